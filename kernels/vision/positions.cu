// The vision tower's positions, made from the patch grids alone, one CTA per patch:
//   out[n] = x[n] + round( sum_k w_k * pos[tap_k] )     the learned SIDE x SIDE position grid, bilinearly
//            interpolated to the patch's frame size (corners aligned: patch 0 -> grid 0, the last -> SIDE - 1)
//   cos[n, j], sin[n, j] = cos / sin( rc * inv_freq[j % Q] )     the 2-D rotary's angles, Q = HEAD_DIM / 4,
//            rc the patch's row in the quarters 0 and 2 of the head, its column in 1 and 3
// grids int32 [G, 4]: t, h, w (in patches) and the first patch of each image / video, in patch order.
// A frame's patches are listed in merge-block order (block row, block column, row in block, column in
// block); every frame of a video takes the rows and columns of its first.
// fp32 as reference.py computes it, each product and sum rounded separately (__fmul_rn / __fadd_rn: no FMA
// contraction): the tap coordinates index * (SIDE - 1) / (size - 1), the weights (1 - f) products, the four
// weighted taps summed in order, rounded once to the element type, then added to x (torch's bf16 / fp16 add).
// cosf / sinf are the precise ones (NVRTC without fast math), as torch's cos / sin kernels.
// Threads: 16-byte vectors (8 features) of the row in turn; the first HEAD_DIM write the angles.
#include "common.cuh"

#ifndef DIM
#define DIM 1152
#endif
#ifndef HEAD_DIM
#define HEAD_DIM 72
#endif
#ifndef SIDE
#define SIDE 48
#endif
#ifndef MERGE
#define MERGE 2
#endif
#ifndef IN_T
#define IN_T QF_BF16
#endif

typedef qf_type<IN_T>::t elem;

#define THREADS 128
#define NV (DIM / 8)
#define Q (HEAD_DIM / 4)
static_assert(DIM % 8 == 0 && DIM > 0, "DIM must be a multiple of 8");
static_assert(HEAD_DIM % 4 == 0 && HEAD_DIM > 0, "HEAD_DIM must be a multiple of 4");
static_assert(SIDE > 0 && MERGE > 0, "SIDE and MERGE must be positive");

// grid coordinate of patch index i of `size` along one side: the lower tap, the upper one and the fraction
__device__ __forceinline__ void tap(int i, int size, int& lo, int& hi, float& frac) {
    const float src = __fdiv_rn(__fmul_rn((float)i, (float)(SIDE - 1)), (float)max(size - 1, 1));
    const float f = floorf(src);
    lo = (int)f;
    hi = min(lo + 1, SIDE - 1);
    frac = __fsub_rn(src, f);
}

extern "C" __global__ void __launch_bounds__(THREADS)
vision_positions(const elem* __restrict__ x, const elem* __restrict__ pos, const int* __restrict__ grids,
                 int n_grids, const float* __restrict__ inv_freq, elem* __restrict__ out,
                 float* __restrict__ cos_t, float* __restrict__ sin_t)
{
    const long long n = blockIdx.x;
    int g = 0, last = n_grids - 1;  // the last grid that starts at or before n
    while (g < last) {
        const int mid = (g + last + 1) >> 1;
        if (grids[4 * mid + 3] <= n) g = mid; else last = mid - 1;
    }
    const int h = grids[4 * g + 1], w = grids[4 * g + 2];
    const int f = (int)((n - grids[4 * g + 3]) % (long long)(h * w));  // patch in its frame
    const int blk = f / (MERGE * MERGE), in = f - blk * (MERGE * MERGE);
    const int row = blk / (w / MERGE) * MERGE + in / MERGE, col = blk % (w / MERGE) * MERGE + in % MERGE;

    int r0, r1, c0, c1;
    float fr, fc;
    tap(row, h, r0, r1, fr);
    tap(col, w, c0, c1, fc);
    const float gr = __fsub_rn(1.f, fr), gc = __fsub_rn(1.f, fc);
    const float wt[4] = {__fmul_rn(gr, gc), __fmul_rn(gr, fc), __fmul_rn(fr, gc), __fmul_rn(fr, fc)};
    const elem* tp[4] = {pos + (long long)(r0 * SIDE + c0) * DIM, pos + (long long)(r0 * SIDE + c1) * DIM,
                         pos + (long long)(r1 * SIDE + c0) * DIM, pos + (long long)(r1 * SIDE + c1) * DIM};

    for (int v = threadIdx.x; v < NV; v += THREADS) {
        Vec8<elem> t[4], a, o;
#pragma unroll
        for (int k = 0; k < 4; ++k) t[k].u = *reinterpret_cast<const uint4*>(tp[k] + 8 * v);
        a.u = *reinterpret_cast<const uint4*>(x + n * DIM + 8 * v);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float s = __fmul_rn(to_f(t[0].e[e]), wt[0]);
#pragma unroll
            for (int k = 1; k < 4; ++k) s = __fadd_rn(s, __fmul_rn(to_f(t[k].e[e]), wt[k]));
            o.e[e] = from_f<elem>(__fadd_rn(to_f(a.e[e]), to_f(from_f<elem>(s))));
        }
        *reinterpret_cast<uint4*>(out + n * DIM + 8 * v) = o.u;
    }
    for (int j = threadIdx.x; j < HEAD_DIM; j += THREADS) {
        const float angle = __fmul_rn((float)((j / Q) & 1 ? col : row), inv_freq[j % Q]);
        cos_t[n * HEAD_DIM + j] = cosf(angle);
        sin_t[n * HEAD_DIM + j] = sinf(angle);
    }
}
