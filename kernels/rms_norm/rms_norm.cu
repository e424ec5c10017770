// RMSNorm over the last dimension, one pass: each row is read once into registers (16-byte vectors),
// its sum of squares reduced across the lanes that hold it, and written normalised.
//   plain (GATED 0):  y = x * rsqrt(mean(x^2) + eps) * (1 + w)                 (fp32, rounded once)
//   gated (GATED 1):  y = w * [x * rsqrt(mean(x^2) + eps)] * silu(gate)        ([.] rounded to the
//                     element type first, and w * [.] too when W_T is the element type: the roundings of
//                     the PyTorch expression in reference.py)
// Rows are (i, j) of an [R, H, DIM] view with element strides (s0, s1, 1); x and gate have their own.
// TPR threads hold one row (DIM / 8 vectors of 8 elements, VPL per thread): up to 32 lanes of a warp
// (32 / TPR rows per warp), or 128 threads (4 warps, partial sums through shared memory) where DIM / 8
// is a multiple of 128, so that long rows keep VPL small (registers: occupancy).
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

typedef qf_type<IN_T>::t elem;
typedef qf_type<W_T>::t wtype;

#define NV (DIM / 8)                                        // 16-byte vectors per row
#define TPR (NV <= 32 ? NV : NV % 128 == 0 ? 128 : 32)      // threads per row
#define VPL (NV / TPR)                                      // vectors per thread
#define WARPS 8
#define RPB (WARPS * 32 / TPR)                              // rows per block
static_assert(DIM % 8 == 0 && (NV < 32 ? 32 % NV == 0 : NV % 32 == 0),
              "DIM / 8 must divide 32 or be a multiple of 32");

union Vec8 {
    uint4 u;
    elem e[8];
};

extern "C" __global__ void __launch_bounds__(WARPS * 32)
rms_norm_fwd(const elem* __restrict__ x, const elem* __restrict__ gate, const wtype* __restrict__ w,
             elem* __restrict__ y, long long rows, int H, long long xs0, long long xs1, long long gs0,
             long long gs1, float eps)
{
    const int li = threadIdx.x % TPR;
    const long long row = (long long)blockIdx.x * RPB + threadIdx.x / TPR;
    const bool ok = row < rows;
    const long long r = ok ? row : 0;
    const long long ri = r / H, rj = r % H;
    const elem* xr = x + ri * xs0 + rj * xs1;
    Vec8 v[VPL];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < VPL; ++k) {
        const int col = (k * TPR + li) * 8;
        v[k].u = ok ? *reinterpret_cast<const uint4*>(xr + col) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float f = to_f(v[k].e[e]);
            ss = fmaf(f, f, ss);
        }
    }
    __shared__ float part[WARPS];  // used where TPR > 32 (4 warps a row), else compiled away
    ss = block_row_sum<TPR>(ss, part);
    if (!ok) return;
    const float rr = rsqrtf(ss * (1.f / DIM) + eps);  // the mean as torch forms it: sum times 1 / n
#if GATED
    const elem* gr = gate + ri * gs0 + rj * gs1;
#endif
    elem* yr = y + r * DIM;
#pragma unroll
    for (int k = 0; k < VPL; ++k) {
        const int col = (k * TPR + li) * 8;
#if GATED
        Vec8 gv;
        gv.u = *reinterpret_cast<const uint4*>(gr + col);
#endif
        Vec8 out;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float xf = to_f(v[k].e[e]), wf = to_f(w[col + e]);
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
        *reinterpret_cast<uint4*>(yr + col) = out.u;
    }
}
