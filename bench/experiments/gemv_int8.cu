// EXPERIMENT (bench only): the first form of kernels/gemv/gemv.cu's Q8 product, y = (Q x) * s for one token with
// 8-bit weights (runtime/quant.py: Q [N, K] int8 row-major, one scale a row s [N], x [K] and y [N] in the element
// type), each weight turned to fp32 by the int-to-float conversion (a quarter-rate instruction on sm_90) where the
// kernel now places the byte under a float's exponent. Measured against the dequantize-then-cuBLAS path it
// replaced (7-15x faster on the 9B's shapes) and against the kernel: bench/gemv_int8_ab.py,
// results/gemv-int8-ab-h200.json. A warp takes ROWS rows at a time, each lane UNROLL 16-byte pieces (16
// weights) of each row in flight with streaming loads, x staged in shared memory once a block; products and sums
// in fp32, a shuffle reduction per row, times the row's scale, rounded once. K a multiple of 16.
#include "common.cuh"

#ifndef IN_T
#define IN_T QF_BF16
#endif
typedef qf_type<IN_T>::t elem;

#define THREADS 256
#define WARPS (THREADS / 32)
#define ROWS 2
#define UNROLL 4

union X8 {
    uint4 u;
    elem e[8];
};

union Q16 {
    uint4 u;
    signed char c[16];
};

__device__ __forceinline__ float dot16(const Q16& w, const X8& lo, const X8& hi, float acc) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc = fmaf(static_cast<float>(w.c[e]), to_f(lo.e[e]), acc);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc = fmaf(static_cast<float>(w.c[8 + e]), to_f(hi.e[e]), acc);
    return acc;
}

extern "C" __global__ void __launch_bounds__(THREADS) gemv_int8(const signed char* __restrict__ Q,
                                                                const elem* __restrict__ s,
                                                                const elem* __restrict__ x,
                                                                elem* __restrict__ y, int N, int K) {
    extern __shared__ uint4 xs[];  // x as K / 8 pieces of 8
    const int nx = K / 8, nq = K / 16;
    for (int i = threadIdx.x; i < nx; i += THREADS) xs[i] = __ldcg(reinterpret_cast<const uint4*>(x) + i);
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int step = gridDim.x * WARPS * ROWS;
    for (int r0 = (blockIdx.x * WARPS + warp) * ROWS; r0 < N; r0 += step) {
        const uint4* row[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)  // a row past N reads row N - 1 again and is not stored
            row[r] = reinterpret_cast<const uint4*>(Q + (long long)min(r0 + r, N - 1) * K);
        float acc[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
        for (int v0 = lane; v0 < nq; v0 += 32 * UNROLL) {
            Q16 w[ROWS][UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int v = v0 + 32 * u;
#pragma unroll
                for (int r = 0; r < ROWS; ++r) w[r][u].u = v < nq ? __ldcs(row[r] + v) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int v = v0 + 32 * u;
                if (v < nq) {
                    X8 lo, hi;
                    lo.u = xs[2 * v];
                    hi.u = xs[2 * v + 1];
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) acc[r] = dot16(w[r][u], lo, hi, acc[r]);
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
                if (r0 + r < N) y[r0 + r] = from_f<elem>(acc[r] * to_f(s[r0 + r]));
        }
    }
}
