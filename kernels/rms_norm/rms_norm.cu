// RMSNorm over the last dimension, one pass: each row is read once into registers (16-byte vectors),
// its sum of squares reduced across the lanes that hold it, and written normalised.
//   plain (GATED 0):  y = x * rsqrt(mean(x^2) + eps) * (1 + w)                 (fp32, rounded once)
//   gated (GATED 1):  y = w * [x * rsqrt(mean(x^2) + eps)] * silu(gate)        ([.] rounded to the
//                     element type first, and w * [.] too when W_T is the element type: the roundings of
//                     the PyTorch expression in reference.py)
//   rotary (ROPE > 0): the plain norm, rounded, then the attention's rotary on its first ROPE features:
//                     y[j] = x[j] cos[j] + r[j] sin[j], r = cat(-x[ROPE/2:ROPE], x[:ROPE/2]), each product
//                     and the sum rounded to the element type (the bf16 PyTorch expression of
//                     reference.rms_norm_rope_ref); cos, sin [T, ROPE] in the element type, token = row / H % T.
//                     A lane's partner features (j +- ROPE/2) are in lane ^ ROPE/16: one shuffle per word.
//   residual (RES 1): the plain norm of s = res + x (rounded to the element type, as torch's bf16 / fp16
//                     add), s written to `sum` [rows, DIM]: the residual stream's add and the next norm.
// Rows are (i, j) of an [R, H, DIM] view with element strides (s0, s1, 1); x and gate have their own.
// TPR threads hold one row (DIM / 8 vectors of 8 elements, VPL per thread): up to 32 lanes of a warp
// (32 / TPR rows per warp), or several warps (partial sums through shared memory). TPR, a divisor of DIM / 8
// and at most the block, comes from the launcher (launch.py `_tpr`, the one place its rule is written;
// gemv.cu's fused norm takes the same value, so that both sum a row alike).
#include "common.cuh"

#ifndef DIM
#define DIM 4096
#endif
#ifndef IN_T
#define IN_T QF_BF16  // x, gate, y
#endif
#ifndef W_T
#define W_T QF_FLOAT  // weight
#endif
#ifndef GATED
#define GATED 0
#endif
#ifndef ROPE
#define ROPE 0  // rotary features after the plain norm (q / k of the attention layers); 0: none
#endif
#ifndef RES
#define RES 0  // the residual add before the plain norm
#endif

typedef qf_type<IN_T>::t elem;
typedef qf_type<W_T>::t wtype;

#define NV (DIM / 8)                                        // 16-byte vectors per row
#ifndef TPR
#error "TPR (threads per row) is set by the launcher: rms_norm/launch.py _tpr"
#endif
#define VPL (NV / TPR)                                      // vectors per thread
#define WARPS 8
#define RPB (WARPS * 32 / TPR)                              // rows per block
static_assert(DIM % 8 == 0 && (NV < 32 ? 32 % NV == 0 : NV % 32 == 0),
              "DIM / 8 must divide 32 or be a multiple of 32");
static_assert(NV % TPR == 0 && TPR <= WARPS * 32, "TPR: threads per row, a divisor of DIM / 8, at most a block");
static_assert(!RES || (!GATED && !ROPE), "RES: the plain norm only");
static_assert(ROPE == 0 || (!GATED && ROPE % 16 == 0 && ROPE <= 8 * (TPR < 32 ? TPR : 32) &&
                            ((ROPE / 16) & (ROPE / 16 - 1)) == 0),
              "ROPE: a multiple of 16 whose sixteenth is a power of two, in the first warp's vectors of a row");

extern "C" __global__ void __launch_bounds__(WARPS * 32)
rms_norm_fwd(const elem* __restrict__ x, const elem* __restrict__ gate, const wtype* __restrict__ w,
             elem* __restrict__ y, long long rows, int H, long long xs0, long long xs1, long long gs0,
             long long gs1, float eps, const elem* __restrict__ cos_t, const elem* __restrict__ sin_t, long long T,
             const elem* __restrict__ res, elem* __restrict__ sum)
{
    const int li = threadIdx.x % TPR;
    const long long row = (long long)blockIdx.x * RPB + threadIdx.x / TPR;
    const bool ok = row < rows;
    const long long r = ok ? row : 0;
    const long long ri = r / H, rj = r % H;
    const elem* xr = x + ri * xs0 + rj * xs1;
    Vec8<elem> v[VPL];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < VPL; ++k) {
        const int col = (k * TPR + li) * 8;
        v[k].u = ok ? *reinterpret_cast<const uint4*>(xr + col) : make_uint4(0, 0, 0, 0);
#if RES
        if (ok) {
            Vec8<elem> rv;
            rv.u = *reinterpret_cast<const uint4*>(res + r * DIM + col);
#pragma unroll
            for (int e = 0; e < 8; ++e) v[k].e[e] = from_f<elem>(to_f(rv.e[e]) + to_f(v[k].e[e]));
            *reinterpret_cast<uint4*>(sum + r * DIM + col) = v[k].u;
        }
#endif
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float f = to_f(v[k].e[e]);
            ss = fmaf(f, f, ss);
        }
    }
    __shared__ float part[WARPS];  // used where TPR > 32 (4 warps a row), else compiled away
    ss = block_row_sum<TPR>(ss, part);
    if (!ok && ROPE == 0) return;  // (with ROPE every lane of a warp takes part in the shuffles)
    const float rr = rsqrtf(ss * (1.f / DIM) + eps);  // the mean as torch forms it: sum times 1 / n
#if GATED
    const elem* gr = gate + ri * gs0 + rj * gs1;
#endif
    elem* yr = y + r * DIM;
#pragma unroll
    for (int k = 0; k < VPL; ++k) {
        const int col = (k * TPR + li) * 8;
#if GATED
        Vec8<elem> gv;
        gv.u = *reinterpret_cast<const uint4*>(gr + col);
#endif
        Vec8<elem> out;
        float wk[8];
        load8_f32(w + col, wk);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float xf = to_f(v[k].e[e]), wf = wk[e];
#if GATED
            const float n = to_f(from_f<elem>(xf * rr));
#if W_T == IN_T
            const float p = to_f(from_f<elem>(wf * n));
#else
            const float p = wf * n;
#endif
            out.e[e] = from_f<elem>(p * silu_f(to_f(gv.e[e])));
#else
            out.e[e] = from_f<elem>(xf * rr * (1.f + wf));
#endif
        }
#if ROPE
        if (k == 0) {
            Vec8<elem> pv;  // the normalised features j +- ROPE / 2 of this lane's j
#pragma unroll
            for (int q = 0; q < 4; ++q) pv.w[q] = __shfl_xor_sync(0xffffffffu, out.w[q], ROPE / 16);
            if (col < ROPE) {
                const long long tok = ri % T;
                Vec8<elem> c, s;
                c.u = *reinterpret_cast<const uint4*>(cos_t + tok * ROPE + col);
                s.u = *reinterpret_cast<const uint4*>(sin_t + tok * ROPE + col);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const float p = to_f(pv.e[e]), rot = col < ROPE / 2 ? -p : p;
                    const float a = to_f(from_f<elem>(__fmul_rn(to_f(out.e[e]), to_f(c.e[e]))));
                    const float b = to_f(from_f<elem>(__fmul_rn(rot, to_f(s.e[e]))));
                    out.e[e] = from_f<elem>(__fadd_rn(a, b));
                }
            }
        }
        if (!ok) continue;
#endif
        *reinterpret_cast<uint4*>(yr + col) = out.u;
    }
}
