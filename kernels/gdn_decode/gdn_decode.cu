// One gated-delta-rule token for N sequences (see reference.py for the math):
//   g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), q, k l2-normalised, q *= D^-1/2
//   S' = e^g S;  u = beta (v - S'^T k);  S'' = S' + k u^T;  o = S''^T q = e^g S^T q + (q.k) u
// One block per (value-column tile, value head, sequence). Each thread keeps RPT rows x 4 columns
// of the fp32 state in registers: the state is read once (16-byte loads, all issued before any
// arithmetic) and written once, in place. Two block reductions over D: the norms of q and k, then
// S^T k and S^T q together.
//
// Defines: D, DV (head dims), TQ (q, k), TV (v, out), TA (a, b), TP (A_log, dt_bias): 0 float,
// 1 half, 2 bfloat16.
#include "common.cuh"

#ifndef D
#define D 128
#endif
#ifndef DV
#define DV 128
#endif
#ifndef TQ
#define TQ QF_BF16
#endif
#ifndef TV
#define TV QF_BF16
#endif
#ifndef TA
#define TA QF_BF16
#endif
#ifndef TP
#define TP QF_FLOAT
#endif

#ifndef VT
#define VT 32                 // value columns per block
#endif
#ifndef THREADS
#define THREADS 128
#endif
#define VG (VT / 4)           // threads across the columns of a tile (4 columns each)
#define DG (THREADS / VG)     // threads across the rows
#define RPT (D / DG)          // state rows per thread
#define WARPS (THREADS / 32)
#define L2_EPS 1e-6f

static_assert(VG <= 32 && 32 % VG == 0 && THREADS % 32 == 0, "a warp must span whole rows of the tile");
static_assert(D % DG == 0, "D must be a multiple of THREADS / (VT / 4)");
static_assert(DV % VT == 0, "DV must be a multiple of VT");

typedef qf_type<TQ>::t tq;
typedef qf_type<TV>::t tv;
typedef qf_type<TA>::t ta;
typedef qf_type<TP>::t tp;

// q, k: [N, Hk, D] rows of D contiguous, sequence stride q_sn / k_sn; v: [N, Hv, DV] likewise;
// a, b: [N, Hv] with sequence stride a_sn / b_sn; state: [N, Hv, D, DV] contiguous fp32;
// out: [N, Hv, DV] contiguous.
extern "C" __global__ void __launch_bounds__(THREADS)
gdn_decode_step(const tq* __restrict__ q, const tq* __restrict__ k, const tv* __restrict__ v,
                const ta* __restrict__ a, const ta* __restrict__ b,
                const tp* __restrict__ A_log, const tp* __restrict__ dt_bias,
                float* __restrict__ state, tv* __restrict__ out,
                int Hk, int Hv, long long q_sn, long long k_sn, long long v_sn, long long a_sn, long long b_sn)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int vg = tid % VG, dg = tid / VG;
    const int h = blockIdx.y, n = blockIdx.z;
    const int col = blockIdx.x * VT + vg * 4;
    const int hk = h / (Hv / Hk);

    float* S = state + ((size_t)n * Hv + h) * (size_t)(D * DV);
    float4 s[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i)
        s[i] = *reinterpret_cast<const float4*>(S + (size_t)(dg + i * DG) * DV + col);

    // while the state is in flight: q, k, their norms, the gates and this thread's v
    __shared__ float qs[D], ks[D];
    __shared__ float red1[WARPS][3];
    __shared__ float red2[WARPS][VG][8];
    const tq* qn = q + n * q_sn + (size_t)hk * D;
    const tq* kn = k + n * k_sn + (size_t)hk * D;
    float qq = 0.f, kk = 0.f, qk = 0.f;
    for (int d = tid; d < D; d += THREADS) {
        float x = to_f(qn[d]), y = to_f(kn[d]);
        qs[d] = x; ks[d] = y;
        qq += x * x; kk += y * y; qk += x * y;
    }
    const tv* vn = v + n * v_sn + (size_t)h * DV + col;
    float vv[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) vv[c] = to_f(vn[c]);
    const float g = -expf(to_f(A_log[h])) * softplus_f(to_f(a[n * a_sn + h]) + to_f(dt_bias[h]));
    const float decay = expf(g);
    const float beta = 1.f / (1.f + expf(-to_f(b[n * b_sn + h])));

#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        qq += __shfl_xor_sync(0xffffffffu, qq, o);
        kk += __shfl_xor_sync(0xffffffffu, kk, o);
        qk += __shfl_xor_sync(0xffffffffu, qk, o);
    }
    if (lane == 0) { red1[warp][0] = qq; red1[warp][1] = kk; red1[warp][2] = qk; }
    __syncthreads();
    qq = kk = qk = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) { qq += red1[w][0]; kk += red1[w][1]; qk += red1[w][2]; }
    const float rq = rsqrtf(qq + L2_EPS) * rsqrtf((float)D), rk = rsqrtf(kk + L2_EPS);
    qk *= rq * rk;  // (normalised, scaled q) . (normalised k)

    float kr[RPT], qr[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) { kr[i] = ks[dg + i * DG] * rk; qr[i] = qs[dg + i * DG] * rq; }

    // partial S^T k and S^T q over this thread's rows, then over the warp's rows (lanes 8 and 16 apart)
    float p[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) p[c] = 0.f;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        p[0] += kr[i] * s[i].x; p[1] += kr[i] * s[i].y; p[2] += kr[i] * s[i].z; p[3] += kr[i] * s[i].w;
        p[4] += qr[i] * s[i].x; p[5] += qr[i] * s[i].y; p[6] += qr[i] * s[i].z; p[7] += qr[i] * s[i].w;
    }
#pragma unroll
    for (int o = VG; o < 32; o <<= 1)
#pragma unroll
        for (int c = 0; c < 8; ++c) p[c] += __shfl_xor_sync(0xffffffffu, p[c], o);
    if (lane < VG) {
#pragma unroll
        for (int c = 0; c < 8; ++c) red2[warp][lane][c] = p[c];
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < 8; ++c) {
        float t = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) t += red2[w][vg][c];
        p[c] = t * decay;  // now (S'^T k, S'^T q) for this thread's 4 columns
    }
    float u[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) u[c] = beta * (vv[c] - p[c]);

#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const float4 t = make_float4(fmaf(decay, s[i].x, kr[i] * u[0]), fmaf(decay, s[i].y, kr[i] * u[1]),
                                     fmaf(decay, s[i].z, kr[i] * u[2]), fmaf(decay, s[i].w, kr[i] * u[3]));
        __stwb(reinterpret_cast<float4*>(S + (size_t)(dg + i * DG) * DV + col), t);
    }
    if (dg == 0) {
        tv* on = out + ((size_t)n * Hv + h) * DV + col;
#pragma unroll
        for (int c = 0; c < 4; ++c) on[c] = from_f<tv>(fmaf(qk, u[c], p[4 + c]));
    }
}
