// One token's projection, y = W x (W [N, K] row-major, x [K], y [N]): the decode step's linear layers,
// where every weight byte is read once per token and the step is bound by how fast the weights stream.
// A warp takes ROWS rows at a time; each lane reads 16-byte pieces (8 elements) of them, UNROLL pieces of
// each row before it uses any (ROWS * UNROLL loads in flight a lane), with a streaming load (the weights
// are not read again this step). x is staged in shared memory once a block. Products and sums in fp32, a
// shuffle reduction per row, rounded once to the element type. The grid (launch.py) gives every warp the
// same number of row groups. K a multiple of 8, rows 16-byte aligned (the launcher checks).
#include "common.cuh"

#ifndef IN_T
#define IN_T QF_BF16
#endif

typedef qf_type<IN_T>::t elem;

#define THREADS 256
#define WARPS (THREADS / 32)
#define ROWS 2
#define UNROLL 4

union Vec8 {
    uint4 u;
    elem e[8];
};

__device__ __forceinline__ float dot8(const Vec8& w, const Vec8& x, float acc) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc = fmaf(to_f(w.e[e]), to_f(x.e[e]), acc);
    return acc;
}

// W: N rows of stride ldw elements; x: K contiguous; y: N contiguous.
extern "C" __global__ void __launch_bounds__(THREADS, 4)
gemv(const elem* __restrict__ W, const elem* __restrict__ x, elem* __restrict__ y, int N, int K, long long ldw)
{
    extern __shared__ uint4 xs[];  // K / 8 pieces of x
    const int nv = K >> 3;
    for (int i = threadIdx.x; i < nv; i += THREADS) xs[i] = __ldg(reinterpret_cast<const uint4*>(x) + i);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int step = gridDim.x * WARPS * ROWS;
    for (int r0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * ROWS; r0 < N; r0 += step) {
        const uint4* row[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)  // a row past N reads row N - 1 again and is not stored
            row[r] = reinterpret_cast<const uint4*>(W + (long long)min(r0 + r, N - 1) * ldw);
        float acc[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
        for (int v0 = lane; v0 < nv; v0 += 32 * UNROLL) {
            Vec8 w[ROWS][UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int v = v0 + 32 * u;
#pragma unroll
                for (int r = 0; r < ROWS; ++r) w[r][u].u = v < nv ? __ldcs(row[r] + v) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int v = v0 + 32 * u;
                if (v < nv) {
                    Vec8 xv;
                    xv.u = xs[v];
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) acc[r] = dot8(w[r][u], xv, acc[r]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
#pragma unroll
            for (int off = 16; off >= 1; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
        }
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                if (r0 + r < N) y[r0 + r] = from_f<elem>(acc[r]);
        }
    }
}
