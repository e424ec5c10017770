// The vision tower's 2-D rotary, q and k together, straight from the qkv projection's output:
//   qkv [N, 3, HEADS, HEAD_DIM] (q, k, v per token, contiguous)  ->  out [2, N, HEADS, HEAD_DIM] (q, k)
//   out[j] = x[j] * cos[j] + r[j] * sin[j],  r = cat(-x[half:], x[:half])  (rotate-half over the whole head)
// in fp32 with every product and the sum rounded separately (__fmul_rn / __fadd_rn: no FMA contraction),
// as the PyTorch expression in reference.py does, then rounded once to the element type: bit for bit the
// reference. cos, sin: fp32 [N, HEAD_DIM].
// One thread per 8 output features (one 16-byte load and store). The partner features j +- half come as
// two 8-byte loads: half is a multiple of 4, not always of 8 (head dim 72: half 36), and each 4-feature
// group lies inside one half of the head. The partner row is the one just loaded, so it comes from L1.
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 72
#endif
#ifndef HEADS
#define HEADS 16
#endif
#ifndef IN_T
#define IN_T QF_BF16
#endif

typedef qf_type<IN_T>::t elem;

#define HALF (HEAD_DIM / 2)
#define VPH (HEAD_DIM / 8)        // 16-byte vectors per head
#define VPT (2 * HEADS * VPH)     // vectors of q and k per token
#define THREADS 256
static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM > 0, "HEAD_DIM must be a multiple of 8");
static_assert(HEADS > 0, "HEADS must be positive");

union Vec8 {
    uint4 u;
    elem e[8];
};
union Vec4 {
    uint2 u;
    elem e[4];
};

extern "C" __global__ void __launch_bounds__(THREADS)
vision_rotary(const elem* __restrict__ qkv, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
              elem* __restrict__ out, long long n_tokens)
{
    const long long i = (long long)blockIdx.x * THREADS + threadIdx.x;
    if (i >= n_tokens * VPT) return;
    const long long n = i / VPT;
    const int r = (int)(i - n * VPT);  // vector among the token's q and k heads
    const int th = r / VPH;            // t * HEADS + head (t = 0: q, 1: k)
    const int j = (r - th * VPH) * 8;  // first feature of the vector
    const elem* row = qkv + n * (3LL * HEADS * HEAD_DIM) + (long long)th * HEAD_DIM;

    Vec8 x;
    x.u = *reinterpret_cast<const uint4*>(row + j);
    Vec4 p[2];
#pragma unroll
    for (int g = 0; g < 2; ++g) {
        const int jj = j + 4 * g;
        p[g].u = *reinterpret_cast<const uint2*>(row + (jj < HALF ? jj + HALF : jj - HALF));
    }
    const float4* cs = reinterpret_cast<const float4*>(cos_t + n * HEAD_DIM + j);
    const float4* sn = reinterpret_cast<const float4*>(sin_t + n * HEAD_DIM + j);
    const float4 c0 = cs[0], c1 = cs[1], s0 = sn[0], s1 = sn[1];
    const float c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
    const float s[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};

    Vec8 o;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float pf = to_f(p[e / 4].e[e % 4]);
        const float rot = (j + e) < HALF ? -pf : pf;
        o.e[e] = from_f<elem>(__fadd_rn(__fmul_rn(to_f(x.e[e]), c[e]), __fmul_rn(rot, s[e])));
    }
    const int t = th / HEADS;
    elem* dst = out + ((long long)t * n_tokens + n) * (HEADS * HEAD_DIM) + (long long)(th - t * HEADS) * HEAD_DIM + j;
    *reinterpret_cast<uint4*>(dst) = o.u;
}
