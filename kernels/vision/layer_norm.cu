// LayerNorm over rows of DIM (weight and bias), optionally fused with the residual add before it:
//   HAS_Y 1:  s = x + y (rounded to the element type, as torch's bf16 / fp16 add), written to `sum`;
//             out = LayerNorm(s)
//   HAS_Y 0:  out = LayerNorm(x)
// LayerNorm: mean and biased variance in fp32 (two passes over the row held in registers),
// out = w * (rstd * (v - mean)) + b as one fma, rounded once: torch's CUDA kernel's expression.
// TPR threads hold one row in 16-byte vectors (8 elements), at most 5 per thread (registers: 72 at 5):
// one warp up to DIM 1,280, 2 / 4 / 8 warps (partial sums through shared memory) up to 2,560 / 5,120 /
// 10,240. DIM / 8 need not be a multiple of TPR: the last slot of some lanes stays empty (1,152: 144
// vectors over 32 lanes).
#include "common.cuh"

#ifndef DIM
#define DIM 1152
#endif
#ifndef IN_T
#define IN_T QF_BF16  // x, y, sum, out, weight, bias
#endif
#ifndef HAS_Y
#define HAS_Y 1
#endif

typedef qf_type<IN_T>::t elem;

#define NV (DIM / 8)                          // 16-byte vectors per row
#define TPR (NV <= 160 ? 32 : NV <= 320 ? 64 : NV <= 640 ? 128 : 256)  // threads per row
#define VPL ((NV + TPR - 1) / TPR)            // vector slots per thread
#define WARPS 8
#define RPB (WARPS * 32 / TPR)                // rows per block
static_assert(DIM % 8 == 0 && DIM > 0 && NV <= 1280, "DIM must be a multiple of 8, at most 10,240");

extern "C" __global__ void __launch_bounds__(WARPS * 32)
layer_norm_fwd(const elem* __restrict__ x, const elem* __restrict__ y, const elem* __restrict__ w,
               const elem* __restrict__ b, elem* __restrict__ sum, elem* __restrict__ out, long long rows,
               float eps)
{
    __shared__ float part[2][WARPS];  // one set per reduction: no barrier between them
    const int li = threadIdx.x % TPR;
    const long long row = (long long)blockIdx.x * RPB + threadIdx.x / TPR;
    const bool ok = row < rows;
    const long long off = (ok ? row : 0) * DIM;

    Vec8<elem> v[VPL];
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < VPL; ++k) {
        const int c = k * TPR + li;  // vector index in the row
        const bool in = ok && c < NV;
        v[k].u = in ? *reinterpret_cast<const uint4*>(x + off + c * 8) : make_uint4(0, 0, 0, 0);
#if HAS_Y
        Vec8<elem> yv;
        yv.u = in ? *reinterpret_cast<const uint4*>(y + off + c * 8) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[k].e[e] = from_f<elem>(to_f(v[k].e[e]) + to_f(yv.e[e]));
        if (in) *reinterpret_cast<uint4*>(sum + off + c * 8) = v[k].u;
#endif
#pragma unroll
        for (int e = 0; e < 8; ++e) acc += to_f(v[k].e[e]);
    }
    const float mean = block_row_sum<TPR>(acc, part[0]) / DIM;
    acc = 0.f;
#pragma unroll
    for (int k = 0; k < VPL; ++k) {
        if (k * TPR + li < NV) {  // empty slots hold zeros, which are not part of the row
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float d = to_f(v[k].e[e]) - mean;
                acc = fmaf(d, d, acc);
            }
        }
    }
    const float rstd = rsqrtf(block_row_sum<TPR>(acc, part[1]) / DIM + eps);
    if (!ok) return;
#pragma unroll
    for (int k = 0; k < VPL; ++k) {
        const int c = k * TPR + li;
        if (c < NV) {
            float wf[8], bf[8];
            load8_f32(w + c * 8, wf);
            load8_f32(b + c * 8, bf);
            Vec8<elem> o;
#pragma unroll
            for (int e = 0; e < 8; ++e) o.e[e] = from_f<elem>(fmaf(wf[e], rstd * (to_f(v[k].e[e]) - mean), bf[e]));
            *reinterpret_cast<uint4*>(out + off + c * 8) = o.u;
        }
    }
}
