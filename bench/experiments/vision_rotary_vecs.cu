// EXPERIMENT (bench only): kernels/vision/rotary.cu with VECS 16-byte vectors a thread, THREADS vectors apart,
// every load of them issued before any arithmetic. bench/vision_elementwise.py sweeps VECS against the shipped
// kernel (one vector a thread); none was faster (results/vision-rotary-vecs-h200.json: one image 18.6 / 19.9 /
// 21.2 / 26.1 us at VECS 1 / 2 / 4 / 8, 32 frames of video 144 / 151 / 149 / 204 us): the registers the loads
// hold (44 / 69 / 118 / 214 a thread) cut the threads an SM keeps by as much as each thread adds in flight.
// The same arithmetic as the shipped kernel (bit for bit the reference).
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
#ifndef VECS
#define VECS 4
#endif
static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM > 0, "HEAD_DIM must be a multiple of 8");
static_assert(HEADS > 0, "HEADS must be positive");
static_assert(VECS > 0, "VECS must be positive");

union Vec8 {
    uint4 u;
    elem e[8];
};
union Vec4 {
    uint2 u;
    elem e[4];
};

extern "C" __global__ void __launch_bounds__(THREADS)
vision_rotary_vecs(const elem* __restrict__ qkv, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                   elem* __restrict__ out, long long n_tokens)
{
    const long long total = n_tokens * VPT;
    const long long first = (long long)blockIdx.x * (THREADS * VECS) + threadIdx.x;
    Vec8 x[VECS];
    Vec4 p[VECS][2];
    float4 cs[VECS][2], sn[VECS][2];
#pragma unroll
    for (int u = 0; u < VECS; ++u) {
        const long long i = first + u * THREADS;
        if (i >= total) break;
        const long long n = i / VPT;
        const int r = (int)(i - n * VPT);
        const int j = (r % VPH) * 8;
        const elem* row = qkv + n * (3LL * HEADS * HEAD_DIM) + (long long)(r / VPH) * HEAD_DIM;
        x[u].u = *reinterpret_cast<const uint4*>(row + j);
#pragma unroll
        for (int g = 0; g < 2; ++g) {
            const int jj = j + 4 * g;
            p[u][g].u = *reinterpret_cast<const uint2*>(row + (jj < HALF ? jj + HALF : jj - HALF));
            cs[u][g] = *reinterpret_cast<const float4*>(cos_t + n * HEAD_DIM + j + 4 * g);
            sn[u][g] = *reinterpret_cast<const float4*>(sin_t + n * HEAD_DIM + j + 4 * g);
        }
    }
#pragma unroll
    for (int u = 0; u < VECS; ++u) {
        const long long i = first + u * THREADS;
        if (i >= total) break;
        const long long n = i / VPT;
        const int r = (int)(i - n * VPT);
        const int th = r / VPH;
        const int j = (r - th * VPH) * 8;
        const float c[8] = {cs[u][0].x, cs[u][0].y, cs[u][0].z, cs[u][0].w, cs[u][1].x, cs[u][1].y, cs[u][1].z, cs[u][1].w};
        const float s[8] = {sn[u][0].x, sn[u][0].y, sn[u][0].z, sn[u][0].w, sn[u][1].x, sn[u][1].y, sn[u][1].z, sn[u][1].w};
        Vec8 o;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float pf = to_f(p[u][e / 4].e[e % 4]);
            const float rot = (j + e) < HALF ? -pf : pf;
            o.e[e] = from_f<elem>(__fadd_rn(__fmul_rn(to_f(x[u].e[e]), c[e]), __fmul_rn(rot, s[e])));
        }
        const int t = th / HEADS;
        elem* dst = out + ((long long)t * n_tokens + n) * (HEADS * HEAD_DIM) + (long long)(th - t * HEADS) * HEAD_DIM + j;
        *reinterpret_cast<uint4*>(dst) = o.u;
    }
}
