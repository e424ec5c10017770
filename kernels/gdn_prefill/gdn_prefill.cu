// Gated DeltaNet chunked prefill (NVRTC, sm_80+; tuned for sm_90): two kernels.
//
// gdn_chunk_prep: one 256-thread block per (chunk of 64 tokens, 1 to 4 value heads of one q/k head),
//   all chunks at once.
//   From raw q, k, a, b it computes the gates G (in-chunk cumsum of g), beta, the l2-norm factors
//   rk, rq (q scale folded in), and the two 64x64 chunk matrices that do not depend on the state:
//     L = tril(beta_i rk_i rk_j e^{G_i-G_j} K K^T, -1)     T = (I + L)^-1   (fp32/tf32, then 16-bit)
//     P = tril(rq_i rk_j e^{G_i-G_j} Q K^T)
//   and writes T, P (16-bit) and the four per-token vectors (fp32), ~17 KB per (chunk, head).
// gdn_chunk_prefill_fwd: one 256-thread block per (sequence, value head, DVS state columns) walks
//   its chunks in order with the fp32 state in mma accumulator registers:
//     rhs = beta (v - e^G rk (K S));  u = T rhs;  o = rq e^G (Q S) + P u
//     S  <- e^{G_end} S + K^T (rk e^{G_end - G} u)
//   The state columns are independent, so slicing Dv is an exact split that fills the machine when
//   B * Hv is small; for long sequences the blocks of a head rather split the sequence (segments with a
//   gate-chosen warm-up, see below) and each walks all 128 columns. K, Q, V, T, P of the next chunks
//   stream in with cp.async while one computes.
// On sm_90a the 128-column walk runs its products as warpgroup mma (walk_chunks_wg, wgmma.cuh); the
// mma.sync walk (walk_chunks) serves the narrower column slices and every other architecture.
// The chunk-local work is thus done once per (chunk, head) at full occupancy instead of on the
// sequential path of every Dv slice (that fused variant was ~3x slower per chunk step).
// rhs and the scaled u enter their mma as hi + lo 16-bit pairs: a single bf16 rounding of them
// alone would put the final state's error near 3e-3; split, it is ~1e-6 (strong decay) to ~7e-4. (The wgmma
// walk takes the scaled u as one fp16 value instead, with K^T in fp16: 11 bits, see walk_chunks_wg.)
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
#define NTHR 256    // main kernel: 8 warps
#define PTHR 256    // prep kernel: 8 warps, two groups of 4 (K K^T -> L -> T; Q K^T -> P)
#ifndef PREP_MINB
#define PREP_MINB 4  // prep blocks per SM the registers are sized for (64 per thread)
#endif
#define KST (DK + 8)    // smem row stride (elements) of K, Q tiles: 272 B, ldmatrix conflict-free
#define FST 68          // fp32 row stride of L and T (prep kernel): 64 rows fill exactly a K or Q tile
#define BST 72          // 16-bit row stride of P and T

#ifdef PROFILE  // cycles between block-wide barriers, summed over chunks, left in ht[0..4] of block 0
#define MARK(i) do { __syncthreads(); if (tid == 0) { const long long now_ = clock64(); prof[i] += now_ - tprev; tprev = now_; } } while (0)
#else
#define MARK(i) __syncthreads()
#endif

static_assert(DVS == 32 || DVS == 64 || DVS == 128, "DVS must be 32, 64 or 128");

// ---------------------------------------------------------------- shared memory layouts (bytes)
// prep kernel: L and T (fp32) take the place of K and Q once the products are in registers
#define PSM_K 0
#define PSM_Q (PSM_K + CH * KST * 2)
#define PSM_L PSM_K
#define PSM_T PSM_Q
#define PSM_TB (PSM_Q + CH * KST * 2)
#define PSM_X (PSM_TB + CH * BST * 2)    // 4 warps x 16x16 fp32 scratch for the inverse
#define PSM_VEC (PSM_X + 4 * 16 * 20 * 4)  // rk, rq; then G, beta of each of up to PREP_MAX_HEADS heads
#define PREP_MAX_HEADS 4
#define PSM_TOTAL (PSM_VEC + (2 + 2 * PREP_MAX_HEADS) * CH * 4)  // 51 KB: 4 blocks per SM
static_assert(CH * FST * 4 <= CH * KST * 2, "L / T rows must fit in the K / Q tiles they replace");

#include "seq.cuh"
#include "gdn_chunk.cuh"
#include "tma.cuh"

// One group's products in the prep kernel: warp w's blocks (tri_blocks) of K K^T (group 0) or Q K^T (group 1),
// and the squared l2 norms of the rows of K (Q) from the diagonal of its diagonal block of K K^T (of Q Q^T:
// two more mma per k step, whose B fragments are the A fragments of Q already loaded, as K K^T's are for its
// diagonal block). Leaves the norm factors in Rn (q scale folded in for Q); the caller syncs.
template <bool IS_Q>
__device__ __forceinline__ void prep_products(const elem* Ks, const elem* Qs, int w, float acc[3][2][4], float* Rn,
                                              int lane) {
    const elem* X = IS_Q ? Qs : Ks;
    int bi[3], bj[3];
    tri_blocks(w, bi, bj);
    const int nq = tri_nblocks(w);
    float dg[2][4] = {};  // the diagonal block of Q Q^T (group 1)
#pragma unroll
    for (int q = 0; q < 3; ++q)
#pragma unroll
        for (int nj = 0; nj < 2; ++nj)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[q][nj][e] = 0.f;
#pragma unroll 1
    for (int kk = 0; kk < DK / 16; ++kk) {
#pragma unroll
        for (int q = 0; q < 3; ++q) {
            if (q >= nq) break;  // warp-uniform
            u32 ax[4], bf[4];
            ldsm4(ax, a_addr(X, KST, 16 * bi[q], 16 * kk, lane));
            if (q == 0 && !IS_Q) {  // rows bj = bi of K itself: B (two n-tiles) = {a0, a2}, {a1, a3}
                bf[0] = ax[0]; bf[1] = ax[2]; bf[2] = ax[1]; bf[3] = ax[3];
            } else {
                ldsm4(bf, bn_addr(Ks, KST, 16 * bj[q], 16 * kk, lane));
            }
            if (q == 0 && IS_Q) {
                mma16816(dg[0], ax, ax[0], ax[2]);
                mma16816(dg[1], ax, ax[1], ax[3]);
            }
            mma16816(acc[q][0], ax, bf[0], bf[1]);
            mma16816(acc[q][1], ax, bf[2], bf[3]);
        }
    }
    const int g = lane >> 2, t = lane & 3;
    if (t == g >> 1) {  // this lane holds diagonal entries (g, g) and (g + 8, g + 8) of the diagonal block
        const bool odd = g & 1;  // column 2t + 1 (selects, not a register index: that would go to local memory)
        const float(*d)[4] = IS_Q ? dg : acc[0];
        const float sc = IS_Q ? 0.08838834764831845f : 1.f;  // 128 ** -0.5
        Rn[16 * w + g] = rsqrtf((odd ? d[0][1] : d[0][0]) + 1e-6f) * sc;
        Rn[16 * w + g + 8] = rsqrtf((odd ? d[1][3] : d[1][2]) + 1e-6f) * sc;
    }
}

// Grid: (Hv / hpb, slots) with slots = B * ceil(T / 64), or ceil(T / 64) + N for packed sequences. A
// block takes hpb <= PREP_MAX_HEADS value heads of one q/k head (hpb divides Hv / Hk): it reads K, Q
// (warp j computes head j's gates meanwhile); group 0 (warps 0-3) forms the raw K K^T once and per value
// head applies that head's gates, inverts (I + L) and stores T; group 1 (warps 4-7) forms Q K^T once and
// per head stores P, alongside (8 warps of 64 registers: 4 blocks per SM hide each other's latency). hpb = 1
// gives the most blocks (short prompts: one wave, latency counts); hpb = Hv / Hk the least work.
// Outputs per (slot, head): Tg, Pg [64][64] 16-bit (the lower 16 x 16 blocks only; the upper ones, zero, are
// not written: readers zero them where they load them), Fg [4][64] fp32
// (G, beta, rk, rq). Strides in elements.
extern "C" __global__ void __launch_bounds__(PTHR, PREP_MINB)
gdn_chunk_prep(const elem* __restrict__ q, const elem* __restrict__ k,
               const abt* __restrict__ a, const abt* __restrict__ b,
               const float* __restrict__ A_log, const float* __restrict__ dt_bias,
               const int* __restrict__ cu_seqlens,
               elem* __restrict__ Tg, elem* __restrict__ Pg, float* __restrict__ Fg,
               int T, int Hk, int Hv, int N, int hpb,
               long long q_sb, long long q_st, long long q_sh,
               long long k_sb, long long k_st, long long k_sh,
               long long a_sb, long long a_st, long long a_sh,
               long long b_sb, long long b_st, long long b_sh)
{
    extern __shared__ __align__(128) unsigned char smem[];
    elem* Ks = reinterpret_cast<elem*>(smem + PSM_K);
    elem* Qs = reinterpret_cast<elem*>(smem + PSM_Q);
    float* Lf = reinterpret_cast<float*>(smem + PSM_L);
    float* Tf = reinterpret_cast<float*>(smem + PSM_T);
    elem* Tb = reinterpret_cast<elem*>(smem + PSM_TB);
    float* Xs = reinterpret_cast<float*>(smem + PSM_X);
    float* Rk = reinterpret_cast<float*>(smem + PSM_VEC);
    float* Rq = Rk + CH;
    float* Gv = Rq + CH;  // [hpb][G (64), beta (64)]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int hfirst = blockIdx.x * hpb, slot = blockIdx.y;
#ifdef PROFILE  // block (0, 0) leaves the cycles of its phases in its own Fg row (development only)
    long long prof[3] = {}, tprev = clock64();
#endif
    const int hk = hfirst / (Hv / Hk);
    int n, c;
    const SeqSpan sp = slot_sequence(cu_seqlens, slot, N, T, n, c);
    const long long bos = sp.bos;
    const int len = sp.len, batch = sp.batch;
    if (c * CH >= len) return;  // a gap between packed sequences
    const int tok0 = c * CH;
    const elem* qb = q + batch * q_sb + (bos + tok0) * q_st + hk * q_sh;
    const elem* kb = k + batch * k_sb + (bos + tok0) * k_st + hk * k_sh;
#pragma unroll
    for (int i = 0; i < CH * DK / 8 / PTHR; ++i) {
        const int idx = tid + i * PTHR, row = idx >> 4, col = (idx & 15) * 8;
        const bool ok = tok0 + row < len;
        const long long tt = ok ? row : 0;
        cp_async16(Ks + row * KST + col, kb + tt * k_st + col, ok);
        cp_async16(Qs + row * KST + col, qb + tt * q_st + col, ok);
    }
    cp_async_commit();
    if (warp < hpb) {  // warp j: gates of tokens 2 lane, 2 lane + 1 of head hfirst + j, their in-chunk cumsum
        const int h = hfirst + warp;
        float* Gc = Gv + warp * 2 * CH;
        float* Bt = Gc + CH;
        const abt* ab = a + batch * a_sb + (bos + tok0) * a_st + h * a_sh;
        const abt* bb = b + batch * b_sb + (bos + tok0) * b_st + h * b_sh;
        const float neg_A = -__expf(A_log[h]), dtb = dt_bias[h];
        float gv[2], bv[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int i = 2 * lane + e;
            const bool ok = tok0 + i < len;
            const float x = ok ? to_f(ab[i * a_st]) + dtb : 0.f;
            const float y = ok ? to_f(bb[i * b_st]) : 0.f;
            gv[e] = ok ? neg_A * (x > 20.f ? x : log1pf(__expf(x))) : 0.f;
            bv[e] = ok ? 1.f / (1.f + __expf(-y)) : 0.f;
        }
        float incl = gv[0] + gv[1];
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const float y = __shfl_up_sync(0xffffffffu, incl, off);
            if (lane >= off) incl += y;
        }
        *reinterpret_cast<float2*>(Gc + 2 * lane) = make_float2(incl - gv[1], incl);
        *reinterpret_cast<float2*>(Bt + 2 * lane) = make_float2(bv[0], bv[1]);
    }
    cp_async_wait<0>();
    MARK(0);
    const int grp = warp >> 2, w = warp & 3;
    float acc[3][2][4];  // raw K K^T (group 0) or Q K^T (group 1) blocks: shared by the value heads
    if (grp == 0) prep_products<false>(Ks, Qs, w, acc, Rk, lane);
    else prep_products<true>(Ks, Qs, w, acc, Rq, lane);
    MARK(1);  // K and Q are dead: L and T take their place
    for (int j = 0; j < hpb; ++j) {
        const int h = hfirst + j;
        const float* Gc = Gv + j * 2 * CH;
        const float* Bt = Gc + CH;
        const long long ob = ((long long)slot * Hv + h) * CH * CH;
        if (grp == 1) {  // P straight to memory
#ifdef PREP_NO_PSTORE  // development only (timing): P not stored (a test the compiler cannot fold)
            if (len == -12345)
#endif
            tri_store(true, acc, w, Gc, Bt, Rk, Rq, nullptr, Pg + ob, CH, lane);
            continue;
        }
        // group 0; no block barrier between heads: head j + 1 writes L after head j's inverse read it, and T
        // after head j's stores read it, each behind a group barrier
        tri_store(false, acc, w, Gc, Bt, Rk, Rq, Lf, nullptr, 0, lane);
        group_sync(1);
        invert_tril64(Lf, Tf, Tb, Xs, tid);
        group_sync(1);
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // 64 rows x 8 pieces of 16 B; the upper blocks (zero) are left out
            const int idx = tid + i * 128, row = idx >> 3, col = (idx & 7) * 8;
#ifdef PREP_NO_TSTORE  // development only (timing): T not stored
            if (len == -12345)
#endif
            if ((col >> 4) <= (row >> 4))
                *reinterpret_cast<uint4*>(Tg + ob + row * CH + col) = *reinterpret_cast<const uint4*>(Tb + row * BST + col);
        }
        if (tid < CH) {  // [G, beta, rk, rq] of head h: 64 pieces of 16 B
            const float* src = tid < CH / 2 ? Gc + 4 * tid : Rk + 4 * (tid - CH / 2);  // Gc, Bt and Rk, Rq adjoin
            *reinterpret_cast<float4*>(Fg + ((long long)slot * Hv + h) * 4 * CH + 4 * tid) =
                *reinterpret_cast<const float4*>(src);
        }
    }
#ifdef PROFILE
    MARK(2);
    if (tid == 0 && blockIdx.x == 0 && slot == 0)
        for (int i = 0; i < 3; ++i) Fg[i] = (float)prof[i];
#endif
}

// ---------------------------------------------------------------- the sequential kernel
// Shared memory of one block walking W state columns: NST stages of K, Q, V, T, P, vectors; then the
// 16-bit state (reused for u), rhs (lo), and the scaled u (hi, lo). Byte offsets.
template <int W> struct Geo {
    static constexpr int NST = W <= 32 ? 3 : 2;  // pipeline stages (prefetch distance NST - 1 chunks)
    static constexpr int VST = W + 8;            // row stride of the W-wide tiles
    static constexpr int SO_Q = CH * KST * 2, SO_V = 2 * CH * KST * 2;
    static constexpr int SO_T = SO_V + CH * VST * 2, SO_P = SO_T + CH * BST * 2, SO_F = SO_P + CH * BST * 2;
    static constexpr int STAGE = SO_F + 4 * CH * 4;
    static constexpr int S = NST * STAGE, RHS = S + DK * VST * 2, UH = RHS + CH * VST * 2, UL = UH + CH * VST * 2;
    static constexpr int TOTAL = UL + CH * VST * 2;
};

// One block's walk: state columns [v0, v0 + W) of head h of sequence n over chunks [cw, cend). Chunks
// before cbeg only carry the state (warm-up of a sequence segment); o is written for [cbeg, cend).
struct Walk {
    const elem *qb, *kb, *vb;  // token 0 of the sequence at this block's head (vb, ob: column 0)
    elem* ob;
    long long q_st, k_st, v_st;
    int Hv, h, n, v0, len, slot0;
    int hk, batch, bos;        // tile coordinates of the tensor-map copies: q/k head, batch row, first token
    int cw, cbeg, cend;
    bool from_h0, write_ht;    // start from h0 (else zero); store the final state
};

// Two layouts of the state accumulators over the 8 warps. Narrow (W <= 64): warp w holds rows
// [16 w, 16 w + 16) x all W columns. Wide (W = 128): warp w holds rows [32 (w & 3), +32) x columns
// [64 (w >> 2), +64), and in the products with S every warp takes a 64-column half: each S, u
// fragment is read by 4 warps instead of 8 (shared-memory traffic per chunk ~630 -> ~440 KB).
template <int W>
__device__ __forceinline__ void walk_chunks(unsigned char* smem, const Walk& wk,
                                            const elem* __restrict__ Tg, const elem* __restrict__ Pg,
                                            const float* __restrict__ Fg, const float* __restrict__ h0,
                                            float* __restrict__ ht)
{
    typedef Geo<W> GW;
    constexpr int NJ_ = W / 8, VST_ = GW::VST, NST_ = GW::NST;
    constexpr bool WIDE = W == 128;
    constexpr int OJ = WIDE ? 8 : NJ_;  // n-tiles of one warp's o (and rhs) rows
    elem* Sb = reinterpret_cast<elem*>(smem + GW::S);
    elem* Ub = reinterpret_cast<elem*>(smem + GW::S);   // u, once the 16-bit state is dead
    elem* Rs = reinterpret_cast<elem*>(smem + GW::RHS);
    elem* Uh = reinterpret_cast<elem*>(smem + GW::UH);  // rk e^{G_end-G} u (hi)
    elem* Ul = reinterpret_cast<elem*>(smem + GW::UL);  // (lo)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int v0 = wk.v0, h = wk.h, Hv = wk.Hv, len = wk.len;
    const elem* qb = wk.qb;
    const elem* kb = wk.kb;
    const elem* vb = wk.vb + v0;
    elem* ob = wk.ob + v0;
    const long long q_st = wk.q_st, k_st = wk.k_st, v_st = wk.v_st;
    // state accumulator s[jj][0..1] sits at (srow(jj), scol(jj) + 0..1), s[jj][2..3] 8 rows below
    auto srow = [&](int jj) { return WIDE ? 32 * (warp & 3) + 16 * (jj >> 3) + g : 16 * warp + g; };
    auto scol = [&](int jj) { return WIDE ? 64 * (warp >> 2) + 8 * (jj & 7) + 2 * t : 8 * jj + 2 * t; };

    auto load_chunk = [&](int c, int buf) {  // K, Q rows, this block's V columns (zero past the end), T, P, vectors
        unsigned char* st = smem + buf * GW::STAGE;
        elem* Kd = reinterpret_cast<elem*>(st);
        elem* Qd = reinterpret_cast<elem*>(st + GW::SO_Q);
        elem* Vd = reinterpret_cast<elem*>(st + GW::SO_V);
        elem* Td = reinterpret_cast<elem*>(st + GW::SO_T);
        elem* Pd = reinterpret_cast<elem*>(st + GW::SO_P);
        float* Fd = reinterpret_cast<float*>(st + GW::SO_F);
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
        for (int i = 0; i < W / 32; ++i) {
            const int idx = tid + i * NTHR, row = idx / (W / 8), col = (idx % (W / 8)) * 8;
            const int tok = c * CH + row;
            const bool ok = tok < len;
            const long long tt = ok ? tok : 0;
            cp_async16(Vd + row * VST_ + col, vb + tt * v_st + col, ok);
        }
        const long long sb = ((long long)(wk.slot0 + c) * Hv + h) * CH * CH;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int idx = tid + i * NTHR, row = idx >> 3, col = (idx & 7) * 8;
            const bool lower = (col >> 4) <= (row >> 4);  // upper 16 x 16 blocks are zero: not stored, not read
            cp_async16(Td + row * BST + col, Tg + sb + row * CH + col, lower);
            cp_async16(Pd + row * BST + col, Pg + sb + row * CH + col, lower);
        }
        if (tid < CH) cp_async16(Fd + 4 * tid, Fg + ((long long)(wk.slot0 + c) * Hv + h) * 4 * CH + 4 * tid, true);
    };

    // This warp's part of the state slice (srow, scol above), as mma accumulators.
    float s[NJ_][4];
    if (wk.from_h0 && h0) {
        const float* hp = h0 + ((long long)wk.n * Hv + h) * DK * DK + v0;
#pragma unroll
        for (int j = 0; j < NJ_; ++j) {
            const float2 x0 = *reinterpret_cast<const float2*>(hp + srow(j) * DK + scol(j));
            const float2 x1 = *reinterpret_cast<const float2*>(hp + (srow(j) + 8) * DK + scol(j));
            s[j][0] = x0.x; s[j][1] = x0.y; s[j][2] = x1.x; s[j][3] = x1.y;
        }
    } else {
#pragma unroll
        for (int j = 0; j < NJ_; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    }

#pragma unroll
    for (int st = 0; st < NST_ - 1; ++st) {
        if (wk.cw + st < wk.cend) load_chunk(wk.cw + st, st);
        cp_async_commit();
    }
    float oacc[OJ][4];
#ifdef PROFILE
    long long prof[5] = {}, tprev = clock64();
#endif

    for (int c = wk.cw, i = 0; c < wk.cend; ++c, ++i) {
        const int buf = i % NST_;
        const bool out = c >= wk.cbeg;  // else a warm-up chunk: state only
        const bool szero = c == wk.cw && !(wk.from_h0 && h0);  // S = 0 entering this chunk: K S = Q S = 0
        unsigned char* st = smem + buf * GW::STAGE;
        const elem* Kc = reinterpret_cast<const elem*>(st);
        const elem* Qc = reinterpret_cast<const elem*>(st + GW::SO_Q);
        elem* Vc = reinterpret_cast<elem*>(st + GW::SO_V);  // v, then the high half of rhs
        const elem* Tb = reinterpret_cast<const elem*>(st + GW::SO_T);
        const elem* Pb = reinterpret_cast<const elem*>(st + GW::SO_P);
        const float* Gc = reinterpret_cast<const float*>(st + GW::SO_F);
        const float* Bt = Gc + CH;
        const float* Rk = Bt + CH;
        const float* Rq = Rk + CH;
        cp_async_wait<NST_ - 2>();
        MARK(0);
        if (c + NST_ - 1 < wk.cend) load_chunk(c + NST_ - 1, (i + NST_ - 1) % NST_);
        cp_async_commit();

        // ---- phase 1: state -> 16-bit smem
        if (!szero) {
#pragma unroll
            for (int j = 0; j < NJ_; ++j) {
                const int r = srow(j), cc = scol(j);
                *reinterpret_cast<u32*>(Sb + r * VST_ + cc) = pack2(s[j][0], s[j][1]);
                *reinterpret_cast<u32*>(Sb + (r + 8) * VST_ + cc) = pack2(s[j][2], s[j][3]);
            }
        }
        MARK(1);

        // ---- phase 2, wide: rows 16 (warp & 3) of K (-> rhs) and Q (-> o part) times S's column half
        if constexpr (WIDE) {
            const int r0 = 16 * (warp & 3), c0 = 64 * (warp >> 2);
            float kacc[8][4];
            if (szero) {
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) kacc[j][e] = oacc[j][e] = 0.f;
            } else if (out) {
                rows_times_state<true, 64, VST_>(Kc, Qc, r0, Sb + c0, kacc, oacc, lane);
            } else {
                rows_times_state<false, 64, VST_>(Kc, Kc, r0, Sb + c0, kacc, kacc, lane);
            }
            store_rhs<64, VST_>(kacc, r0, Vc + c0, Rs + c0, Gc, Bt, Rk, lane);
            if (out) {
                const int ra0 = r0 + g, ra1 = ra0 + 8;
                const float f0 = Rq[ra0] * __expf(Gc[ra0]), f1 = Rq[ra1] * __expf(Gc[ra1]);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    oacc[j][0] *= f0; oacc[j][1] *= f0; oacc[j][2] *= f1; oacc[j][3] *= f1;
                }
            }
        // ---- phase 2, narrow: rows 16 (warp & 3) of K (warps 0-3: -> rhs) or Q (warps 4-7: -> o part) times S
        } else if (warp < 4 || out) {
            const int r0 = 16 * (warp & 3);
            if (szero) {
#pragma unroll
                for (int j = 0; j < NJ_; ++j) oacc[j][0] = oacc[j][1] = oacc[j][2] = oacc[j][3] = 0.f;
            } else {
                rows_times_state<false, W>(warp < 4 ? Kc : Qc, Qc, r0, Sb, oacc, oacc, lane);
            }
            if (warp < 4) {
                store_rhs<W>(oacc, r0, Vc, Rs, Gc, Bt, Rk, lane);
            } else {
                const int ra0 = r0 + g, ra1 = ra0 + 8;
                const float f0 = Rq[ra0] * __expf(Gc[ra0]), f1 = Rq[ra1] * __expf(Gc[ra1]);
#pragma unroll
                for (int j = 0; j < NJ_; ++j) {
                    oacc[j][0] *= f0; oacc[j][1] *= f0; oacc[j][2] *= f1; oacc[j][3] *= f1;
                }
            }
        }
        MARK(2);

        // ---- phase 3: u = T rhs (rows 16 (warp & 3), column half warp >> 2)
        {
            const int mt = warp & 3, jh = (warp >> 2) * (NJ_ / 2);
            float acc[NJ_ / 2][4];
#pragma unroll
            for (int j = 0; j < NJ_ / 2; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
            for (int kk = 0; kk <= mt; ++kk) {
                u32 af[4];
                ldsm4(af, a_addr(Tb, BST, 16 * mt, 16 * kk, lane));
#pragma unroll
                for (int jp = 0; jp < NJ_ / 4; ++jp) {
                    u32 bh[4], bl[4];
                    ldsm4t(bh, bk_addr(Vc, VST_, 16 * kk, 8 * jh + 16 * jp, lane));
                    ldsm4t(bl, bk_addr(Rs, VST_, 16 * kk, 8 * jh + 16 * jp, lane));
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
            for (int j = 0; j < NJ_ / 2; ++j) {
                const int cc = 8 * (jh + j) + 2 * t;
                *reinterpret_cast<u32*>(Ub + ra0 * VST_ + cc) = pack2(acc[j][0], acc[j][1]);
                *reinterpret_cast<u32*>(Ub + ra1 * VST_ + cc) = pack2(acc[j][2], acc[j][3]);
                store_split(Uh + ra0 * VST_ + cc, Ul + ra0 * VST_ + cc, f0 * acc[j][0], f0 * acc[j][1]);
                store_split(Uh + ra1 * VST_ + cc, Ul + ra1 * VST_ + cc, f1 * acc[j][2], f1 * acc[j][3]);
            }
        }
        MARK(3);

        // ---- phase 4: o = rq e^G Q S + P u (wide: all warps, a column half each; narrow: warps 4-7);
        //      S <- e^{G_end} S + K^T (scaled u) (all warps)
        if constexpr (WIDE) {
          if (out) {
            const int mt = warp & 3, c0 = 64 * (warp >> 2);
            for (int kk = 0; kk <= mt; ++kk) {
                u32 af[4];
                ldsm4(af, a_addr(Pb, BST, 16 * mt, 16 * kk, lane));
#pragma unroll
                for (int jp = 0; jp < 4; ++jp) {
                    u32 bf[4];
                    ldsm4t(bf, bk_addr(Ub, VST_, 16 * kk, c0 + 16 * jp, lane));
                    mma16816(oacc[2 * jp], af, bf[0], bf[1]);
                    mma16816(oacc[2 * jp + 1], af, bf[2], bf[3]);
                }
            }
            const int tok0 = c * CH + 16 * mt + g, tok1 = tok0 + 8;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int cc = c0 + 8 * j + 2 * t;
                if (tok0 < len)
                    *reinterpret_cast<u32*>(ob + (long long)tok0 * Hv * DK + cc) = pack2(oacc[j][0], oacc[j][1]);
                if (tok1 < len)
                    *reinterpret_cast<u32*>(ob + (long long)tok1 * Hv * DK + cc) = pack2(oacc[j][2], oacc[j][3]);
            }
          }
        } else if (warp >= 4 && out) {
            const int mt = warp - 4;
            for (int kk = 0; kk <= mt; ++kk) {
                u32 af[4];
                ldsm4(af, a_addr(Pb, BST, 16 * mt, 16 * kk, lane));
#pragma unroll
                for (int jp = 0; jp < NJ_ / 2; ++jp) {
                    u32 bf[4];
                    ldsm4t(bf, bk_addr(Ub, VST_, 16 * kk, 16 * jp, lane));
                    mma16816(oacc[2 * jp], af, bf[0], bf[1]);
                    mma16816(oacc[2 * jp + 1], af, bf[2], bf[3]);
                }
            }
            const int tok0 = c * CH + 16 * mt + g, tok1 = tok0 + 8;
#pragma unroll
            for (int j = 0; j < NJ_; ++j) {
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
            for (int j = 0; j < NJ_; ++j) {
                s[j][0] *= decay; s[j][1] *= decay; s[j][2] *= decay; s[j][3] *= decay;
            }
            if constexpr (WIDE) {  // rows 32 (warp & 3) + 0 / 16, columns c0 + 0..63
                const int m0 = 32 * (warp & 3), c0 = 64 * (warp >> 2);
#pragma unroll 1
                for (int kk = 0; kk < CH / 16; ++kk) {
                    u32 a0[4], a1[4];
                    ldsm4t(a0, at_addr(Kc, KST, m0, 16 * kk, lane));
                    ldsm4t(a1, at_addr(Kc, KST, m0 + 16, 16 * kk, lane));
#pragma unroll
                    for (int jp = 0; jp < 4; ++jp) {
                        u32 bh[4], bl[4];
                        ldsm4t(bh, bk_addr(Uh, VST_, 16 * kk, c0 + 16 * jp, lane));
                        ldsm4t(bl, bk_addr(Ul, VST_, 16 * kk, c0 + 16 * jp, lane));
                        mma16816(s[2 * jp], a0, bh[0], bh[1]);
                        mma16816(s[2 * jp + 1], a0, bh[2], bh[3]);
                        mma16816(s[8 + 2 * jp], a1, bh[0], bh[1]);
                        mma16816(s[8 + 2 * jp + 1], a1, bh[2], bh[3]);
                        mma16816(s[2 * jp], a0, bl[0], bl[1]);
                        mma16816(s[2 * jp + 1], a0, bl[2], bl[3]);
                        mma16816(s[8 + 2 * jp], a1, bl[0], bl[1]);
                        mma16816(s[8 + 2 * jp + 1], a1, bl[2], bl[3]);
                    }
                }
            } else {
                state_update_hilo<W, VST_>(s, Kc, Uh, Ul, 16 * warp, lane);
            }
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
    if (!wk.write_ht) return;
    float* hp = ht + ((long long)wk.n * Hv + h) * DK * DK + v0;
#pragma unroll
    for (int j = 0; j < NJ_; ++j) {
        *reinterpret_cast<float2*>(hp + srow(j) * DK + scol(j)) = make_float2(s[j][0], s[j][1]);
        *reinterpret_cast<float2*>(hp + (srow(j) + 8) * DK + scol(j)) = make_float2(s[j][2], s[j][3]);
    }
}

// ---------------------------------------------------------------- the 128-column walk on wgmma (sm_90a)
// Same arithmetic as walk_chunks<128>; the products run as warpgroup mma with B from shared memory. One
// rounding differs: the state update takes the scaled u as one fp16 value (11 bits) against K^T converted to
// fp16 in registers, where the mma.sync walk adds a hi and a lo bf16 half (16 bits): half the update's
// tensor work for a final-state error still ~10x below fla's and FlashQLA's (NOTES.md).
// Warpgroup wg (warps 4 wg .. 4 wg + 3) holds state rows [64 wg, +64) x 128 columns.
// Per chunk: S -> 16-bit (canonical layout); then group wg takes the column half [64 wg, +64) of K S,
// Q S, the rhs, u = T rhs and o += P u, and adds K^T (scaled u) to its own state rows.
// K, Q, V, T, P arrive by TMA (tma.cuh: one thread issues 8 tile copies per chunk, counted on an mbarrier)
// in the 128-byte swizzled layout; K, Q, T, P reach the tensor cores through ldmatrix as A fragments, rhs
// (hi, over v) as a swizzled B operand (T's and P's upper blocks, never written, are zeroed in the
// fragments). The 16-bit state, rhs (lo), u and the scaled u sit in the canonical no-swizzle layout
// (wgmma.cuh). o of a full chunk leaves by TMA store too (one per group, staged where rhs was): 4-byte
// stores from registers held up the next chunk's copies (1.5k of 7.4k cycles per chunk).
// kernels/gdn_prefill/NOTES.md has the cycle counts and the variants that were measured and dropped.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && !defined(NO_WGMMA)
#define GDN_WGMMA 1
#include "wgmma.cuh"

struct GeoWG {  // K, Q, V as two 128-byte-swizzled [64][64] halves each, T, P swizzled [64][64] (TMA boxes)
    static constexpr int NST = 2;
    static constexpr int SO_Q = CH * DK * 2, SO_V = 2 * CH * DK * 2;
    static constexpr int SO_T = SO_V + CH * DK * 2, SO_P = SO_T + CH * CH * 2, SO_F = SO_P + CH * CH * 2;
    static constexpr int STAGE = SO_F + 4 * CH * 4;
    static constexpr int BYTES = STAGE;  // what the copies of one chunk deliver
    static constexpr int S = NST * STAGE, RHS = S + DK * DK * 2, UH = RHS + CH * DK * 2;
    static constexpr int TOTAL = UH + CH * DK * 2 + 1024;  // + the alignment of the base to 1 KB
};
static_assert(GeoWG::TOTAL <= Geo<128>::TOTAL, "the launcher sizes shared memory by Geo<128>");
static_assert(GeoWG::STAGE % 1024 == 0 && GeoWG::SO_T % 1024 == 0 && GeoWG::SO_P % 1024 == 0 && GeoWG::S % 1024 == 0,
              "swizzled tiles need 1 KB alignment");

__device__ __forceinline__ void walk_chunks_wg(unsigned char* smem_raw, const Walk& wk,
                                               const float* __restrict__ Fg, const float* __restrict__ h0,
                                               float* __restrict__ ht, const TmaDesc* tmk, const TmaDesc* tmq,
                                               const TmaDesc* tmv, const TmaDesc* tmt, const TmaDesc* tmp,
                                               const TmaDesc* tmo, unsigned long long* bars)
{
    typedef GeoWG GW;
    unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    elem* Sb = reinterpret_cast<elem*>(smem + GW::S);
    elem* Ub = reinterpret_cast<elem*>(smem + GW::S);   // u, once the 16-bit state is dead
    elem* Rs = reinterpret_cast<elem*>(smem + GW::RHS);
    elem* Uh = reinterpret_cast<elem*>(smem + GW::UH);  // rk e^{G_end-G} u in fp16 (whatever the input type)
    elem* Ot = reinterpret_cast<elem*>(smem + GW::RHS);  // o of a full chunk on its way out, once rhs is dead

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // warpgroup index and chunk range through a shuffle: provably warp-uniform for the compiler, which
    // otherwise serializes the wgmma in branches on them
    const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0);
    const int g = lane >> 2, t = lane & 3, wq = warp & 3;
    const int cw = __shfl_sync(0xffffffffu, wk.cw, 0), cbeg = __shfl_sync(0xffffffffu, wk.cbeg, 0);
    const int cend = __shfl_sync(0xffffffffu, wk.cend, 0);
    const int h = wk.h, Hv = wk.Hv, len = wk.len;
    const int srow = 64 * wg + 16 * wq + g;  // state rows srow, srow + 8 (columns 8 j + 2 t, +1)
    const int c0 = 64 * wg;                  // this group's column half in K S, Q S, u, o

    // Thread 0 copies chunk c into stage buf: K, Q, V rows as two 64-column boxes each (zero past the
    // tensor's end; a packed sequence's last chunk reads the next sequence's rows, which only meet beta = 0
    // and a zero scaled u), T, P, the vectors; all counted on bars[buf].
    auto issue_chunk = [&](int c, int buf) {
        unsigned char* st = smem + buf * GW::STAGE;
        unsigned long long* bar = bars + buf;
#ifdef WALK_NO_TP  // development only (timing): no T, P copies
        mbar_expect_tx(bar, GW::BYTES - 2 * CH * CH * 2);
#else
        mbar_expect_tx(bar, GW::BYTES);
#endif
        const int tok = wk.bos + c * CH;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            tma_load_4d(st + half * CH * 64 * 2, tmk, 64 * half, wk.hk, tok, wk.batch, bar);
            tma_load_4d(st + GW::SO_Q + half * CH * 64 * 2, tmq, 64 * half, wk.hk, tok, wk.batch, bar);
            tma_load_4d(st + GW::SO_V + half * CH * 64 * 2, tmv, 64 * half, h, tok, wk.batch, bar);
        }
        const long long sl = (long long)(wk.slot0 + c) * Hv + h;
#ifndef WALK_NO_TP
        tma_load_2d(st + GW::SO_T, tmt, 0, (int)(sl * CH), bar);
        tma_load_2d(st + GW::SO_P, tmp, 0, (int)(sl * CH), bar);
#endif
        bulk_load(st + GW::SO_F, Fg + sl * 4 * CH, 4 * CH * 4, bar);
    };

    float s[64];  // this thread's state entries (accumulator layout of wgmma.cuh)
    if (wk.from_h0 && h0) {
        const float* hp = h0 + ((long long)wk.n * Hv + h) * DK * DK;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const float2 x0 = *reinterpret_cast<const float2*>(hp + srow * DK + 8 * j + 2 * t);
            const float2 x1 = *reinterpret_cast<const float2*>(hp + (srow + 8) * DK + 8 * j + 2 * t);
            s[4 * j] = x0.x; s[4 * j + 1] = x0.y; s[4 * j + 2] = x1.x; s[4 * j + 3] = x1.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 64; ++i) s[i] = 0.f;
    }

    if (tid == 0) {
        mbar_init(bars, 1);
        mbar_init(bars + 1, 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (tid == 0 && cw < cend) issue_chunk(cw, 0);
#ifdef PROFILE
    long long prof[5] = {}, tprev = clock64();
#endif

    // The wgmma sequences below are branch-free (Q S and P u also run in warm-up chunks, whose o is not
    // stored; a zero state is written as zeros): ptxas then tracks the groups and keeps them asynchronous.
    for (int c = cw, i = 0; c < cend; ++c, ++i) {
        const int buf = i & 1;
        const bool out = c >= cbeg;  // else a warm-up chunk: state only
        unsigned char* st = smem + buf * GW::STAGE;
        const elem* Kc = reinterpret_cast<const elem*>(st);
        const elem* Qc = reinterpret_cast<const elem*>(st + GW::SO_Q);
        elem* Vc = reinterpret_cast<elem*>(st + GW::SO_V);  // v, then the high half of rhs
        const elem* Tb = reinterpret_cast<const elem*>(st + GW::SO_T);
        const elem* Pb = reinterpret_cast<const elem*>(st + GW::SO_P);
        const float* Gc = reinterpret_cast<const float*>(st + GW::SO_F);
        const float* Bt = Gc + CH;
        const float* Rk = Bt + CH;
        const float* Rq = Rk + CH;
        mbar_wait(bars + buf, (i >> 1) & 1);
        MARK(0);
        if (tid == 0 && c + 1 < cend) issue_chunk(c + 1, buf ^ 1);  // its stage was last read in chunk c - 1
#ifdef WALK_COPIES_ONLY  // development only (timing): the copies and waits of the walk, no products
        __syncthreads();
        continue;
#endif

        // ---- phase 1: state -> 16-bit smem (rows srow, srow + 8 of 16 tiles: 8 stmatrix.x4)
#pragma unroll
        for (int j = 0; j < 16; j += 2)
            stsm4(const_cast<elem*>(cb_mat(Sb, 64 * wg + 16 * wq, 8 * j, lane)),
                  pack2(s[4 * j], s[4 * j + 1]), pack2(s[4 * j + 2], s[4 * j + 3]),
                  pack2(s[4 * j + 4], s[4 * j + 5]), pack2(s[4 * j + 6], s[4 * j + 7]));
        fence_proxy_async();
        if ((tid & 127) == 0) bulk_wait_read();  // last chunk's o store has read the rhs space phase 2 rewrites
        MARK(1);

        // ---- phase 2: K S and Q S, columns [c0, +64); rhs = beta (v - e^G rk K S) as hi (over v) + lo (Rs)
        const int ra0 = 16 * wq + g, ra1 = ra0 + 8;  // this thread's chunk rows in the 64-row products
        float kacc[32], oacc[32];
        {
            u32 kf[8][4], qf[8][4];
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) ldsm4(kf[kk], Kc + sw128(16 * wq + (lane & 15), 16 * kk + (lane >> 4) * 8));
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) ldsm4(qf[kk], Qc + sw128(16 * wq + (lane & 15), 16 * kk + (lane >> 4) * 8));
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) wg_m64n64(kacc, kf[kk], wg_desc(Sb + cb_off(16 * kk, c0)), kk);
            wg_commit();
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) wg_m64n64(oacc, qf[kk], wg_desc(Sb + cb_off(16 * kk, c0)), kk);
            wg_commit();
            wg_wait<1>();  // K S done; Q S may still run
            wg_pin(kacc);
        }
        {
            const float f0 = Rk[ra0] * __expf(Gc[ra0]), f1 = Rk[ra1] * __expf(Gc[ra1]);
            const float b0 = Bt[ra0], b1 = Bt[ra1];
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
                const int q8 = lane >> 3;  // v and rhs hi: the 128-byte swizzled layout the copy wrote
                elem* vp = Vc + sw128(16 * wq + 8 * (q8 & 1) + (lane & 7), c0 + 8 * j + 8 * (q8 >> 1));
                elem* lp = const_cast<elem*>(cb_mat(Rs, 16 * wq, c0 + 8 * j, lane));
                u32 vr[4], hi[4], lo[4];
                ldsm4(vr, vp);
#pragma unroll
                for (int q = 0; q < 4; ++q) {  // register q: tile j + (q >> 1), row g + 8 (q & 1)
                    const float f = (q & 1) ? f1 : f0, bb = (q & 1) ? b1 : b0;
                    const float* kp = kacc + 4 * (j + (q >> 1)) + 2 * (q & 1);
                    const float2 x = unpack2(vr[q]);
                    const float y0 = bb * (x.x - f * kp[0]), y1 = bb * (x.y - f * kp[1]);
                    hi[q] = pack2(y0, y1);
                    const float2 hf = unpack2(hi[q]);
                    lo[q] = pack2(y0 - hf.x, y1 - hf.y);
                }
                stsm4(vp, hi[0], hi[1], hi[2], hi[3]);
                stsm4(lp, lo[0], lo[1], lo[2], lo[3]);
            }
            fence_proxy_async();
        }
        wg_wait<0>();
        wg_pin(oacc);
        {
            const float f0 = Rq[ra0] * __expf(Gc[ra0]), f1 = Rq[ra1] * __expf(Gc[ra1]);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                oacc[4 * j] *= f0; oacc[4 * j + 1] *= f0; oacc[4 * j + 2] *= f1; oacc[4 * j + 3] *= f1;
            }
        }
#ifdef PROFILE
        MARK(2);
#else
        group_sync(1 + wg);  // phase 3 reads only this group's columns of rhs
#endif

        // ---- phase 3: u = T rhs, columns [c0, +64) (hi and lo halves of rhs)
        {
            u32 af[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) ldsm4(af[kk], Tb + sw64(16 * wq + (lane & 15), 16 * kk + (lane >> 4) * 8));
#pragma unroll
            for (int kk = 1; kk < 4; ++kk)  // T's upper blocks (the prep kernel leaves them out) as zeros
#pragma unroll
                for (int e = 0; e < 4; ++e) af[kk][e] = kk > wq ? 0u : af[kk][e];
            float ua[32];
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                wg_m64n64(ua, af[kk], wg_desc_sw128(Vc + wg * CH * 64 + 16 * kk * 64), kk);
                wg_m64n64(ua, af[kk], wg_desc(Rs + cb_off(16 * kk, c0)), 1);
            }
            wg_commit();
            wg_wait<0>();
            wg_pin(ua);
            const float gend = Gc[CH - 1];
            const float f0 = Rk[ra0] * __expf(gend - Gc[ra0]), f1 = Rk[ra1] * __expf(gend - Gc[ra1]);
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
                u32 ur[4], hs[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const float f = (q & 1) ? f1 : f0;
                    const float* up = ua + 4 * (j + (q >> 1)) + 2 * (q & 1);
                    ur[q] = pack2(up[0], up[1]);
                    hs[q] = pack_f16_sat(f * up[0], f * up[1]);
                }
                stsm4(const_cast<elem*>(cb_mat(Ub, 16 * wq, c0 + 8 * j, lane)), ur[0], ur[1], ur[2], ur[3]);
                stsm4(const_cast<elem*>(cb_mat(Uh, 16 * wq, c0 + 8 * j, lane)), hs[0], hs[1], hs[2], hs[3]);
            }
            fence_proxy_async();
        }
        MARK(3);

        // ---- phase 4: o (columns [c0, +64)) += P u; S <- e^{G_end} S + K^T (scaled u), rows [64 wg, +64)
        {
            u32 pf[4][4], kf[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) ldsm4(pf[kk], Pb + sw64(16 * wq + (lane & 15), 16 * kk + (lane >> 4) * 8));
#pragma unroll
            for (int kk = 1; kk < 4; ++kk)  // and P's
#pragma unroll
                for (int e = 0; e < 4; ++e) pf[kk][e] = kk > wq ? 0u : pf[kk][e];
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {  // K^T rows 64 wg + 16 wq .., ldmatrix .trans of K rows 16 kk ..
                ldsm4t(kf[kk], Kc + sw128(16 * kk + (lane & 7) + ((lane >> 4) << 3),
                                          64 * wg + 16 * wq + ((lane >> 3) & 1) * 8));
#pragma unroll
                for (int e = 0; e < 4; ++e) kf[kk][e] = to_f16_pair(kf[kk][e]);  // the state update runs in fp16
            }
            const float decay = __expf(Gc[CH - 1]);
#pragma unroll
            for (int e = 0; e < 64; ++e) s[e] *= decay;
            wg_pin(s);  // the scaling and o's accumulators settle before the fence, not inside the wgmma window
            wg_pin(oacc);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wg_m64n64(oacc, pf[kk], wg_desc(Ub + cb_off(16 * kk, c0)), 1);
            wg_commit();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wg_m64n128_f16(s, kf[kk], wg_desc(Uh + cb_off(16 * kk, 0)), 1);
            wg_commit();
            wg_wait<1>();  // P u done; the state update may still run
            wg_pin(oacc);
            // o of a full chunk leaves as one TMA store per group: stmatrix into the (dead) rhs space in the
            // 128-byte swizzled layout of a 64 x 64 box, then one thread of the group issues the copy, whose
            // shared-memory read is waited for before phase 2 of the next chunk rewrites that space. A
            // partial chunk (a sequence's last) stores from registers, token by token: a box would run into
            // the next packed sequence's rows.
#ifdef WALK_NO_OSTORE  // development only (timing): o not stored (a test the compiler cannot fold)
            if (out && len == -12345) {
#else
            if (out) {
#endif
                if ((c + 1) * CH <= len) {
                    elem* ot = Ot + wg * CH * 64;
#pragma unroll
                    for (int j = 0; j < 8; j += 2) {
                        const int q8 = lane >> 3;
                        u32 r[4];
#pragma unroll
                        for (int q = 0; q < 4; ++q) {  // register q: columns 8 (j + (q >> 1)), row g + 8 (q & 1)
                            const float* op = oacc + 4 * (j + (q >> 1)) + 2 * (q & 1);
                            r[q] = pack2(op[0], op[1]);
                        }
                        stsm4(ot + sw64(16 * wq + 8 * (q8 & 1) + (lane & 7), 8 * j + 8 * (q8 >> 1)), r[0], r[1], r[2], r[3]);
                    }
                    fence_proxy_async();
                    group_sync(1 + wg);
                    if (wq == 0 && lane == 0) {
                        tma_store_4d(tmo, ot, c0, h, wk.bos + c * CH, wk.batch);
                        bulk_commit();
                    }
                } else {
                    const int tok0 = c * CH + ra0, tok1 = tok0 + 8;
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        const int cc = c0 + 8 * j + 2 * t;
                        if (tok0 < len)
                            *reinterpret_cast<u32*>(wk.ob + (long long)tok0 * Hv * DK + cc) = pack2(oacc[4 * j], oacc[4 * j + 1]);
                        if (tok1 < len)
                            *reinterpret_cast<u32*>(wk.ob + (long long)tok1 * Hv * DK + cc) = pack2(oacc[4 * j + 2], oacc[4 * j + 3]);
                    }
                }
            }
            wg_wait<0>();
            wg_pin(s);
        }
#ifdef PROFILE
        MARK(4);
#endif
    }

    if ((tid & 127) == 0) bulk_wait();  // the o stores this thread issued

#ifdef PROFILE
    if (tid == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        for (int i = 0; i < 5; ++i) ht[i] = (float)prof[i];
    }
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) return;
#endif
    if (!wk.write_ht) return;
    float* hp = ht + ((long long)wk.n * Hv + h) * DK * DK;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        *reinterpret_cast<float2*>(hp + srow * DK + 8 * j + 2 * t) = make_float2(s[4 * j], s[4 * j + 1]);
        *reinterpret_cast<float2*>(hp + (srow + 8) * DK + 8 * j + 2 * t) = make_float2(s[4 * j + 2], s[4 * j + 3]);
    }
}
#endif

// Sequence split (seg != 0, DVS < 128): when a sequence has at least SEG_MIN_CHUNKS chunks, the
// 128 / DVS blocks of a head take one segment of its chunks each with all 128 state columns, instead
// of one column slice each over all chunks (DVS 128 does ~1.6x the work per cycle of DVS 32). A
// segment starts from a zero state w chunks before its first chunk, where w is the fewest chunks
// whose gates multiply the earlier state by at most 2^-SEG_DROP_BITS (2^-30: below fp32 resolution,
// since every (I - beta k k^T) factor has norm <= 1 with beta in (0, 1) and |k| <= 1), or from the
// initial state at chunk 0 when the walk back reaches it. If some boundary of a head needs more than
// half a segment of warm-up (weak decay), that head keeps the column split: exact in every case,
// never slower than the column split alone.
#ifndef SEG_DROP_BITS
#define SEG_DROP_BITS 30  // (tests lower it to see that the split is taken)
#endif
#define SEG_DECAY (-0.6931471805599453f * SEG_DROP_BITS)
#ifndef SEG_MIN_CHUNKS
#define SEG_MIN_CHUNKS 8
#endif

// Grid: (128 / DVS, Hv, N). Strides in elements; o is contiguous [B, T, Hv, 128].
// Dynamic shared memory: Geo<DVS>::TOTAL, or the larger Geo<128>::TOTAL when seg is set.
extern "C" __global__ void __launch_bounds__(NTHR, 1)
gdn_chunk_prefill_fwd(const elem* __restrict__ q, const elem* __restrict__ k, const elem* __restrict__ v,
                      const elem* __restrict__ Tg, const elem* __restrict__ Pg, const float* __restrict__ Fg,
                      const float* __restrict__ h0, const int* __restrict__ cu_seqlens,
                      elem* __restrict__ o, float* __restrict__ ht,
                      int T, int Hk, int Hv,
                      long long q_sb, long long q_st, long long q_sh,
                      long long k_sb, long long k_st, long long k_sh,
                      long long v_sb, long long v_st, long long v_sh, int seg,
                      const __grid_constant__ TmaDesc tm_k, const __grid_constant__ TmaDesc tm_q,
                      const __grid_constant__ TmaDesc tm_v, const __grid_constant__ TmaDesc tm_t,
                      const __grid_constant__ TmaDesc tm_p, const __grid_constant__ TmaDesc tm_o)
{
    extern __shared__ __align__(128) unsigned char smem[];
#ifdef GDN_WGMMA
    __shared__ unsigned long long tma_bar[2];  // the wgmma walk's copy barriers, one per stage
#endif
    const int h = blockIdx.y, n = blockIdx.z;
    const int hk = h / (Hv / Hk);

    const SeqSpan sp = seq_span(cu_seqlens, n, T);
    const long long bos = sp.bos, batch_tok = sp.batch_tok;
    const int len = sp.len, batch = sp.batch;
    const int nchunks = (len + CH - 1) / CH;
    Walk wk;
    wk.qb = q + batch * q_sb + bos * q_st + hk * q_sh;
    wk.kb = k + batch * k_sb + bos * k_st + hk * k_sh;
    wk.vb = v + batch * v_sb + bos * v_st + h * v_sh;
    wk.ob = o + (batch_tok * Hv + h) * DK;
    wk.q_st = q_st; wk.k_st = k_st; wk.v_st = v_st;
    wk.Hv = Hv; wk.h = h; wk.n = n; wk.len = len;
    wk.hk = hk; wk.batch = batch; wk.bos = (int)bos;
    wk.slot0 = first_slot(cu_seqlens, n, T);
    wk.v0 = blockIdx.x * DVS;
    wk.cw = wk.cbeg = 0;
    wk.cend = nchunks;
    wk.from_h0 = wk.write_ht = true;
#if DVS < 128
    if (seg && nchunks >= SEG_MIN_CHUNKS) {
        constexpr int NSEG = DK / DVS;
        __shared__ int warm[NSEG];  // first chunk of the walk of segment s (-1: more than maxw chunks)
        const int per = (nchunks + NSEG - 1) / NSEG, maxw = max(1, per / 2);
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        if (warp < NSEG - 1 && (warp + 1) * per < nchunks) {  // warp s - 1 walks back from boundary s
            const int cb = (warp + 1) * per, lo = max(0, cb - maxw);
            const float* gend = Fg + ((long long)wk.slot0 * Hv + h) * 4 * CH + (CH - 1);  // G_end of chunk 0
            const long long cstride = (long long)Hv * 4 * CH;
            float run = 0.f;  // sum of G_end over the chunks walked so far
            int found = -1;
            for (int base = cb - 1; base >= lo && found < 0; base -= 32) {
                const int j = base - lane;
                const bool in = j >= lo;
                float x = in ? gend[j * cstride] : 0.f;
#pragma unroll
                for (int off = 1; off < 32; off <<= 1) {
                    const float y = __shfl_up_sync(0xffffffffu, x, off);
                    if (lane >= off) x += y;
                }
                x += run;  // log of the decay from the start of chunk j to the boundary
                const unsigned hit = __ballot_sync(0xffffffffu, in && x <= SEG_DECAY);
                if (hit) found = base - (__ffs(hit) - 1);
                run = __shfl_sync(0xffffffffu, x, 31);
            }
            if (found < 0 && lo == 0) found = 0;  // reached the sequence start: begin there, from h0
            if (lane == 0) warm[warp + 1] = found;
        }
        __syncthreads();
        bool ok = true;
        for (int s = 1; s < NSEG; ++s) ok = ok && (s * per >= nchunks || warm[s] >= 0);
        if (ok) {
            const int sg = blockIdx.x;
            wk.cbeg = min(sg * per, nchunks);
            wk.cend = min(wk.cbeg + per, nchunks);
            if (wk.cbeg == wk.cend) return;  // an empty tail segment (nchunks > 0: another block writes ht)
            wk.cw = sg ? warm[sg] : 0;
            wk.v0 = 0;
            wk.from_h0 = wk.cw == 0;
            wk.write_ht = wk.cend == nchunks;
#ifdef GDN_WGMMA
            walk_chunks_wg(smem, wk, Fg, h0, ht, &tm_k, &tm_q, &tm_v, &tm_t, &tm_p, &tm_o, tma_bar);
#else
            walk_chunks<DK>(smem, wk, Tg, Pg, Fg, h0, ht);
#endif
            return;
        }
    }
#endif
#if defined(GDN_WGMMA) && DVS == 128
    walk_chunks_wg(smem, wk, Fg, h0, ht, &tm_k, &tm_q, &tm_v, &tm_t, &tm_p, &tm_o, tma_bar);
#else
    walk_chunks<DVS>(smem, wk, Tg, Pg, Fg, h0, ht);
#endif
}
