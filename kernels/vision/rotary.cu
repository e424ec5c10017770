// The vision tower's 2-D rotary, q and k together, straight from the qkv projection's output:
//   qkv [N, 3, HEADS, HEAD_DIM] (q, k, v per token, contiguous)  ->  out [2, N, HEADS, HEAD_DIM] (q, k)
//   out[j] = x[j] * cos[j] + r[j] * sin[j],  r = cat(-x[half:], x[:half])  (rotate-half over the whole head)
// in fp32 with every product and the sum rounded separately (__fmul_rn / __fadd_rn: no FMA contraction),
// as the PyTorch expression in reference.py does, then rounded once to the element type: bit for bit the
// reference. cos, sin: fp32 [N, HEAD_DIM].
// One thread per (token, 8 features, HG of the token's 2 x HEADS q and k heads): the thread reads the 8
// features' cos / sin (64 bytes) once for its HG heads. Its heads are G = 2 HEADS / HG apart, so at each of
// its HG steps the threads of one token cover G adjacent heads (one contiguous run of the row). Each head's
// 8 features are one 16-byte load and store; the partner features j +- half come as two 8-byte loads: half
// is a multiple of 4, not always of 8 (head dim 72: half 36), and each 4-feature group lies inside one half
// of the head. The partner row is the one just loaded, so it comes from L1. All HG heads' loads are issued
// before the arithmetic.
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
#ifndef HG
#define HG 2
#endif

typedef qf_type<IN_T>::t elem;

#define HALF (HEAD_DIM / 2)
#define VPH (HEAD_DIM / 8)        // 16-byte vectors per head
#define G (2 * HEADS / HG)        // head groups: a thread's heads are G apart
#define THREADS 256
static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM > 0, "HEAD_DIM must be a multiple of 8");
static_assert(HEADS > 0, "HEADS must be positive");
static_assert(HG > 0 && (2 * HEADS) % HG == 0, "HG must divide 2 x HEADS");

extern "C" __global__ void __launch_bounds__(THREADS)
vision_rotary(const elem* __restrict__ qkv, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
              elem* __restrict__ out, long long n_tokens)
{
    const long long i = (long long)blockIdx.x * THREADS + threadIdx.x;
    if (i >= n_tokens * (G * VPH)) return;
    const long long n = i / (G * VPH);
    const int r = (int)(i - n * (G * VPH));
    const int g = r / VPH;            // the thread's first head (q heads 0 .. HEADS - 1, then k)
    const int j = (r - g * VPH) * 8;  // first feature of the vector
    const elem* row = qkv + n * (3LL * HEADS * HEAD_DIM) + j;
    const int p0 = (j < HALF ? HALF : -HALF), p1 = (j + 4 < HALF ? HALF : -HALF);  // partners of the two halves

    Vec8<elem> x[HG];
    Vec4<elem> p[HG][2];
#pragma unroll
    for (int k = 0; k < HG; ++k) {
        const elem* head = row + (g + k * G) * HEAD_DIM;
        x[k].u = *reinterpret_cast<const uint4*>(head);
        p[k][0].u = *reinterpret_cast<const uint2*>(head + p0);
        p[k][1].u = *reinterpret_cast<const uint2*>(head + 4 + p1);
    }
    const float4* cs = reinterpret_cast<const float4*>(cos_t + n * HEAD_DIM + j);
    const float4* sn = reinterpret_cast<const float4*>(sin_t + n * HEAD_DIM + j);
    const float4 c0 = cs[0], c1 = cs[1], s0 = sn[0], s1 = sn[1];
    const float c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
    const float s[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
    for (int k = 0; k < HG; ++k) {
        Vec8<elem> o;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float pf = to_f(p[k][e / 4].e[e % 4]);
            const float rot = (j + e) < HALF ? -pf : pf;
            o.e[e] = from_f<elem>(__fadd_rn(__fmul_rn(to_f(x[k].e[e]), c[e]), __fmul_rn(rot, s[e])));
        }
        const int th = g + k * G, t = th / HEADS;  // t = 0: q, 1: k
        elem* dst = out + ((long long)t * n_tokens + n) * (HEADS * HEAD_DIM) + (long long)(th - t * HEADS) * HEAD_DIM + j;
        *reinterpret_cast<uint4*>(dst) = o.u;
    }
}
