// Gated DeltaNet chunked prefill, single fused kernel (NVRTC, sm_80+; tuned for sm_90): the variant
// for short prompts and large batches, where one launch and no intermediates beat the two-kernel
// path of gdn_prefill.cu (which takes the chunk-local work off the sequential path).
//
// One thread block owns one (sequence, value head, slice of DVS state columns). The state columns
// are independent in the delta rule (u = T (beta v - beta e^G K S) needs only S's own columns), so
// slicing Dv fills the machine when B * Hv is small, with only the chunk-local work (K K^T, Q K^T
// and the 64x64 triangular inverse) repeated per slice. The block walks its sequence in chunks of
// 64 tokens; the fp32 state stays in mma accumulator registers across chunks, and nothing but the
// inputs, o and the final state touches device memory.
//
// Per chunk (G = in-chunk cumsum of the log gates, rk/rq = l2-norm factors, K/Q raw rows):
//   L = tril(beta_i rk_i rk_j e^{G_i-G_j} K K^T, -1)     T = (I + L)^-1   (fp32/tf32, then bf16)
//   P = tril(rq_i rk_j e^{G_i-G_j} Q K^T)
//   rhs = beta (v - e^G rk (K S));  u = T rhs;  o = rq e^G (Q S) + P u
//   S  <- e^{G_end} S + K^T (rk e^{G_end - G} u)
// rhs and the scaled u enter their mma as hi + lo 16-bit pairs: a single bf16 rounding of them
// alone would put the final state's error near 3e-3; split, it is ~1e-6 (strong decay) to ~7e-4.
#include "common.cuh"

#ifndef DVS
#define DVS 64  // state columns per block: 32, 64 or 128
#endif
#ifndef IN_T
#define IN_T QF_BF16  // q, k, v, o element type: QF_BF16 or QF_HALF
#endif
#ifndef AB_T
#define AB_T QF_FLOAT  // a, b element type
#endif

typedef qf_type<IN_T>::t elem;
typedef qf_type<AB_T>::t abt;
typedef unsigned int u32;

#define CH 64       // chunk length
#define DK 128      // key / value head dim
#define NTHR 256    // 8 warps: group A = warps 0-3, group B = warps 4-7
#define NST (DVS <= 64 ? 3 : 2)  // K, Q, V pipeline stages (prefetch distance NST - 1 chunks)
#define KST (DK + 8)    // smem row stride (elements) of K, Q tiles: 272 B, ldmatrix conflict-free
#define VST (DVS + 8)   // smem row stride of the DVS-wide tiles
#define FST 72          // fp32 row stride of L and T
#define BST 72          // 16-bit row stride of P and T
#define NJ (DVS / 8)    // n-tiles of 8 columns per block slice

#ifdef PROFILE  // cycles between block-wide barriers, summed over chunks, left in ht[0..4] of block 0
#define MARK(i) do { __syncthreads(); if (tid == 0) { const long long now_ = clock64(); prof[i] += now_ - tprev; tprev = now_; } } while (0)
#else
#define MARK(i) __syncthreads()
#endif

static_assert(DVS == 32 || DVS == 64 || DVS == 128, "DVS must be 32, 64 or 128");

// ---------------------------------------------------------------- shared memory layout (bytes)
#define SM_K 0
#define SM_Q (SM_K + NST * CH * KST * 2)
#define SM_V (SM_Q + NST * CH * KST * 2)
#define SM_S (SM_V + NST * CH * VST * 2)  // 16-bit state; reused for u once K S, Q S are done
#define SM_RHS (SM_S + DK * VST * 2) // low half of rhs (the high half overwrites this chunk's v)
#define SM_L (SM_RHS + CH * VST * 2)   // fp32 L; reused for the scaled u (high) once T is built
#define SM_T (SM_L + CH * FST * 4)     // fp32 T; reused for the scaled u (low)
#define SM_TB (SM_T + CH * FST * 4)
#define SM_P (SM_TB + CH * BST * 2)
#define SM_X (SM_P + CH * BST * 2)     // 4 warps x 16x16 fp32 scratch for the inverse
#define SM_VEC (SM_X + 4 * 16 * 20 * 4)
#define SM_TOTAL (SM_VEC + 4 * CH * 4)

#include "gdn_chunk.cuh"
#include "seq.cuh"

// Grid: (128 / DVS, Hv, N). Strides in elements; o is contiguous [B, T, Hv, 128].
extern "C" __global__ void __launch_bounds__(NTHR, 1)
gdn_chunk_prefill_fwd(const elem* __restrict__ q, const elem* __restrict__ k, const elem* __restrict__ v,
                      const abt* __restrict__ a, const abt* __restrict__ b,
                      const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                      const float* __restrict__ h0, const int* __restrict__ cu_seqlens,
                      elem* __restrict__ o, float* __restrict__ ht,
                      int T, int Hk, int Hv,
                      long long q_sb, long long q_st, long long q_sh,
                      long long k_sb, long long k_st, long long k_sh,
                      long long v_sb, long long v_st, long long v_sh,
                      long long a_sb, long long a_st, long long a_sh,
                      long long b_sb, long long b_st, long long b_sh)
{
    extern __shared__ __align__(128) unsigned char smem[];
    elem* Ks = reinterpret_cast<elem*>(smem + SM_K);
    elem* Qs = reinterpret_cast<elem*>(smem + SM_Q);
    elem* Vs = reinterpret_cast<elem*>(smem + SM_V);
    elem* Sb = reinterpret_cast<elem*>(smem + SM_S);
    elem* Rs = reinterpret_cast<elem*>(smem + SM_RHS);
    float* Lf = reinterpret_cast<float*>(smem + SM_L);
    float* Tf = reinterpret_cast<float*>(smem + SM_T);
    elem* Ub = reinterpret_cast<elem*>(smem + SM_S);   // u, once the 16-bit state is dead
    elem* Uh = reinterpret_cast<elem*>(smem + SM_L);   // rk e^{G_end-G} u (hi), once L is dead
    elem* Ul = reinterpret_cast<elem*>(smem + SM_T);   // (lo), once T (fp32) is dead
    elem* Tb = reinterpret_cast<elem*>(smem + SM_TB);
    elem* Pb = reinterpret_cast<elem*>(smem + SM_P);
    float* Xs = reinterpret_cast<float*>(smem + SM_X);
    float* Gc = reinterpret_cast<float*>(smem + SM_VEC);
    float* Bt = Gc + CH;
    float* Rk = Bt + CH;
    float* Rq = Rk + CH;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int v0 = blockIdx.x * DVS, h = blockIdx.y, n = blockIdx.z;
    const int hk = h / (Hv / Hk);

    const SeqSpan sp = seq_span(cu_seqlens, n, T);
    const long long bos = sp.bos, batch_tok = sp.batch_tok;
    const int len = sp.len, batch = sp.batch;
    const elem* qb = q + batch * q_sb + bos * q_st + hk * q_sh;
    const elem* kb = k + batch * k_sb + bos * k_st + hk * k_sh;
    const elem* vb = v + batch * v_sb + bos * v_st + h * v_sh + v0;
    const abt* ab = a + batch * a_sb + bos * a_st + h * a_sh;
    const abt* bb = b + batch * b_sb + bos * b_st + h * b_sh;
    elem* ob = o + (batch_tok * Hv + h) * DK + v0;
    const int nchunks = (len + CH - 1) / CH;
    const float neg_A = -__expf(A_log[h]);
    const float dtb = dt_bias[h];

    auto load_chunk = [&](int c, int buf) {  // K, Q rows and this block's V columns; zero past the end
        elem* Kd = Ks + buf * CH * KST;
        elem* Qd = Qs + buf * CH * KST;
        elem* Vd = Vs + buf * CH * VST;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int idx = tid + i * NTHR, row = idx >> 4, col = (idx & 15) * 8;
            const int tok = c * CH + row;
            const bool ok = tok < len;
            const long long tt = ok ? tok : 0;
            cp_async16(Kd + row * KST + col, kb + tt * k_st + col, ok);
            cp_async16(Qd + row * KST + col, qb + tt * q_st + col, ok);
        }
#pragma unroll
        for (int i = 0; i < DVS / 32; ++i) {
            const int idx = tid + i * NTHR, row = idx / (DVS / 8), col = (idx % (DVS / 8)) * 8;
            const int tok = c * CH + row;
            const bool ok = tok < len;
            const long long tt = ok ? tok : 0;
            cp_async16(Vd + row * VST + col, vb + tt * v_st + col, ok);
        }
    };

    // The state slice rows [16 warp, 16 warp + 16) x DVS columns, as mma accumulators.
    float s[NJ][4];
    if (h0) {
        const float* hp = h0 + (((long long)n * Hv + h) * DK + 16 * warp) * DK + v0;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const float2 x0 = *reinterpret_cast<const float2*>(hp + g * DK + 8 * j + 2 * t);
            const float2 x1 = *reinterpret_cast<const float2*>(hp + (g + 8) * DK + 8 * j + 2 * t);
            s[j][0] = x0.x; s[j][1] = x0.y; s[j][2] = x1.x; s[j][3] = x1.y;
        }
    } else {
#pragma unroll
        for (int j = 0; j < NJ; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    }

    // Warp 0 keeps the raw a, b of the next chunk's tokens 2 lane, 2 lane + 1 in registers.
    float ra[2] = {0.f, 0.f}, rb[2] = {0.f, 0.f};
    auto load_ab = [&](int c) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int tok = c * CH + 2 * lane + e;
            if (tok < len) {
                ra[e] = to_f(ab[(long long)tok * a_st]);
                rb[e] = to_f(bb[(long long)tok * b_st]);
            }
        }
    };

#pragma unroll
    for (int st = 0; st < NST - 1; ++st) {
        if (st < nchunks) load_chunk(st, st);
        cp_async_commit();
    }
    if (warp == 0 && nchunks > 0) load_ab(0);
    float oacc[NJ][4];
#ifdef PROFILE
    long long prof[5] = {}, tprev = clock64();
#endif

    for (int c = 0; c < nchunks; ++c) {
        const int buf = c % NST;
        const elem* Kc = Ks + buf * CH * KST;
        const elem* Qc = Qs + buf * CH * KST;
        elem* Vc = Vs + buf * CH * VST;  // v, then the high half of rhs
        cp_async_wait<NST - 2>();
        MARK(0);
        if (c + NST - 1 < nchunks) load_chunk(c + NST - 1, (c + NST - 1) % NST);
        cp_async_commit();

        // ---- phase 1: gates (warp 0), l2-norm factors (2 threads a row), state -> 16-bit smem
        if (warp == 0) {
            float gv[2], bv[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const bool ok = c * CH + 2 * lane + e < len;
                const float x = ra[e] + dtb;
                gv[e] = ok ? neg_A * (x > 20.f ? x : __logf(1.f + __expf(x))) : 0.f;
                bv[e] = ok ? __fdividef(1.f, 1.f + __expf(-rb[e])) : 0.f;
            }
            float incl = gv[0] + gv[1];
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const float y = __shfl_up_sync(0xffffffffu, incl, off);
                if (lane >= off) incl += y;
            }
            *reinterpret_cast<float2*>(Gc + 2 * lane) = make_float2(incl - gv[1], incl);
            *reinterpret_cast<float2*>(Bt + 2 * lane) = make_float2(bv[0], bv[1]);
            if (c + 1 < nchunks) load_ab(c + 1);
        }
        {
            const int row = tid >> 1, hf = tid & 1;  // rows 0..63 of K, then 0..63 of Q
            const elem* src = (row < CH ? Kc + row * KST : Qc + (row - CH) * KST) + 64 * hf;
            float ss = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const uint4 raw = *reinterpret_cast<const uint4*>(src + 8 * ((i + 4 * hf) & 7));  // bank-rotated
                const u32 w4[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 f = unpack2(w4[e]);
                    ss = fmaf(f.x, f.x, ss);
                    ss = fmaf(f.y, f.y, ss);
                }
            }
            ss += __shfl_xor_sync(0xffffffffu, ss, 1);
            if (hf == 0) {
                const float r = rsqrtf(ss + 1e-6f);
                if (row < CH) Rk[row] = r;
                else Rq[row - CH] = r * 0.08838834764831845f;  // 128 ** -0.5
            }
        }
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const int r = 16 * warp + g, cc = 8 * j + 2 * t;
            *reinterpret_cast<u32*>(Sb + r * VST + cc) = pack2(s[j][0], s[j][1]);
            *reinterpret_cast<u32*>(Sb + (r + 8) * VST + cc) = pack2(s[j][2], s[j][3]);
        }
        MARK(1);

        // ---- phase 2: group A: L, then T = (I + L)^-1 [, K S -> rhs];  group B: P, Q S -> o part [, K S -> rhs]
        tri_products(warp >= 4, warp >= 4 ? Qc : Kc, Kc, warp & 3, Gc, Bt, Rk, Rq, Lf, Pb, lane);  // one copy of the code
        if (warp < 4) {
            group_sync(1);
            invert_tril64(Lf, Tf, Tb, Xs, tid);
#if DVS > 64
            float kacc[NJ][4];
            rows_times_state<false, DVS>(Kc, Kc, 16 * warp, Sb, kacc, kacc, lane);
            store_rhs<DVS>(kacc, 16 * warp, Vc, Rs, Gc, Bt, Rk, lane);
#endif
        } else {
            const int wb = warp - 4;
#if DVS > 64
            rows_times_state<false, DVS>(Qc, Qc, 16 * wb, Sb, oacc, oacc, lane);
#else
            float kacc[NJ][4];
            rows_times_state<true, DVS>(Qc, Kc, 16 * wb, Sb, oacc, kacc, lane);
            store_rhs<DVS>(kacc, 16 * wb, Vc, Rs, Gc, Bt, Rk, lane);
#endif
            const int ra0 = 16 * wb + g, ra1 = ra0 + 8;
            const float f0 = Rq[ra0] * __expf(Gc[ra0]), f1 = Rq[ra1] * __expf(Gc[ra1]);
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                oacc[j][0] *= f0; oacc[j][1] *= f0; oacc[j][2] *= f1; oacc[j][3] *= f1;
            }
        }
        MARK(2);

        // ---- phase 3: u = T rhs (rows 16 (warp & 3), column half warp >> 2)
        {
            const int mt = warp & 3, jh = (warp >> 2) * (NJ / 2);
            float acc[NJ / 2][4];
#pragma unroll
            for (int j = 0; j < NJ / 2; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
            for (int kk = 0; kk <= mt; ++kk) {
                u32 af[4];
                ldsm4(af, a_addr(Tb, BST, 16 * mt, 16 * kk, lane));
#pragma unroll
                for (int jp = 0; jp < NJ / 4; ++jp) {
                    u32 bh[4], bl[4];
                    ldsm4t(bh, bk_addr(Vc, VST, 16 * kk, 8 * jh + 16 * jp, lane));
                    ldsm4t(bl, bk_addr(Rs, VST, 16 * kk, 8 * jh + 16 * jp, lane));
                    mma16816(acc[2 * jp], af, bh[0], bh[1]);
                    mma16816(acc[2 * jp + 1], af, bh[2], bh[3]);
                    mma16816(acc[2 * jp], af, bl[0], bl[1]);
                    mma16816(acc[2 * jp + 1], af, bl[2], bl[3]);
                }
            }
            const float gend = Gc[CH - 1];
            const int ra0 = 16 * mt + g, ra1 = ra0 + 8;
            const float f0 = Rk[ra0] * __expf(gend - Gc[ra0]), f1 = Rk[ra1] * __expf(gend - Gc[ra1]);
#pragma unroll
            for (int j = 0; j < NJ / 2; ++j) {
                const int cc = 8 * (jh + j) + 2 * t;
                *reinterpret_cast<u32*>(Ub + ra0 * VST + cc) = pack2(acc[j][0], acc[j][1]);
                *reinterpret_cast<u32*>(Ub + ra1 * VST + cc) = pack2(acc[j][2], acc[j][3]);
                store_split(Uh + ra0 * VST + cc, Ul + ra0 * VST + cc, f0 * acc[j][0], f0 * acc[j][1]);
                store_split(Uh + ra1 * VST + cc, Ul + ra1 * VST + cc, f1 * acc[j][2], f1 * acc[j][3]);
            }
        }
        MARK(3);

        // ---- phase 4: o = rq e^G Q S + P u (warps 4-7); S <- e^{G_end} S + K^T (scaled u) (all warps)
        if (warp >= 4) {
            const int mt = warp - 4;
            for (int kk = 0; kk <= mt; ++kk) {
                u32 af[4];
                ldsm4(af, a_addr(Pb, BST, 16 * mt, 16 * kk, lane));
#pragma unroll
                for (int jp = 0; jp < NJ / 2; ++jp) {
                    u32 bf[4];
                    ldsm4t(bf, bk_addr(Ub, VST, 16 * kk, 16 * jp, lane));
                    mma16816(oacc[2 * jp], af, bf[0], bf[1]);
                    mma16816(oacc[2 * jp + 1], af, bf[2], bf[3]);
                }
            }
            const int tok0 = c * CH + 16 * mt + g, tok1 = tok0 + 8;
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const int cc = 8 * j + 2 * t;
                if (tok0 < len)
                    *reinterpret_cast<u32*>(ob + (long long)tok0 * Hv * DK + cc) = pack2(oacc[j][0], oacc[j][1]);
                if (tok1 < len)
                    *reinterpret_cast<u32*>(ob + (long long)tok1 * Hv * DK + cc) = pack2(oacc[j][2], oacc[j][3]);
            }
        }
        {
            const float decay = __expf(Gc[CH - 1]);
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                s[j][0] *= decay; s[j][1] *= decay; s[j][2] *= decay; s[j][3] *= decay;
            }
            state_update_hilo<DVS, VST>(s, Kc, Uh, Ul, 16 * warp, lane);
        }
#ifdef PROFILE
        MARK(4);
#endif
    }
    cp_async_wait<0>();

#ifdef PROFILE
    if (tid == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        for (int i = 0; i < 5; ++i) ht[i] = (float)prof[i];
    }
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) return;
#endif
    float* hp = ht + (((long long)n * Hv + h) * DK + 16 * warp) * DK + v0;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        *reinterpret_cast<float2*>(hp + g * DK + 8 * j + 2 * t) = make_float2(s[j][0], s[j][1]);
        *reinterpret_cast<float2*>(hp + (g + 8) * DK + 8 * j + 2 * t) = make_float2(s[j][2], s[j][3]);
    }
}
