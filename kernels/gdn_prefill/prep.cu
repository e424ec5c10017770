// Gated DeltaNet chunked prefill, the chunk-local step shared by both paths (NVRTC, sm_80+).
//
// gdn_chunk_prep: one 256-thread block per (chunk of 64 tokens, 1 to 4 value heads of one q/k head),
// all chunks at once. From raw q, k, a, b it computes the gates G (in-chunk cumsum of g), beta, the
// l2-norm factors rk, rq (q scale folded in), and the two 64x64 chunk matrices that do not depend on
// the state:
//     L = tril(beta_i rk_i rk_j e^{G_i-G_j} K K^T, -1)     T = (I + L)^-1   (fp32/tf32, then 16-bit)
//     P = tril(rq_i rk_j e^{G_i-G_j} Q K^T)
// and writes T, P (16-bit) and the four per-token vectors (fp32), ~17 KB per (chunk, head). The walks
// (gdn_prefill.cu on Hopper, portable.cu elsewhere) read them: the chunk-local work is done once per
// (chunk, head) at full occupancy instead of on the sequential path of every column slice.
#include "layout.cuh"  // elem (IN_T), u32, CH, DK, KST, BST

#ifndef AB_T
#define AB_T QF_FLOAT  // a, b element type
#endif

typedef qf_type<AB_T>::t abt;

#define PTHR 256    // 8 warps, two groups of 4 (K K^T -> L -> T; Q K^T -> P)
#define PREP_MINB 4 // blocks per SM the registers are sized for (64 per thread)
#define FST 68          // fp32 row stride of L and T: 64 rows fill exactly a K or Q tile

// Shared memory (bytes): L and T (fp32) take the place of K and Q once the products are in registers.
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
#ifdef PREP_SMEM  // the launcher's size (plan.py), checked against the layout here
static_assert(PREP_SMEM == PSM_TOTAL, "plan.py's prep_smem() disagrees with PSM_TOTAL in prep.cu");
#endif

#include "seq.cuh"
#include "prep_math.cuh"


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
    __syncthreads();
    const int grp = warp >> 2, w = warp & 3;
    float acc[3][2][4];  // raw K K^T (group 0) or Q K^T (group 1) blocks: shared by the value heads
    if (grp == 0) prep_products<false>(Ks, Qs, w, acc, Rk, lane);
    else prep_products<true>(Ks, Qs, w, acc, Rq, lane);
    __syncthreads();  // K and Q are dead: L and T take their place
    for (int j = 0; j < hpb; ++j) {
        const int h = hfirst + j;
        const float* Gc = Gv + j * 2 * CH;
        const float* Bt = Gc + CH;
        const long long ob = ((long long)slot * Hv + h) * CH * CH;
        if (grp == 1) {  // P straight to memory
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
            if ((col >> 4) <= (row >> 4))
                *reinterpret_cast<uint4*>(Tg + ob + row * CH + col) = *reinterpret_cast<const uint4*>(Tb + row * BST + col);
        }
        if (tid < CH) {  // [G, beta, rk, rq] of head h: 64 pieces of 16 B
            const float* src = tid < CH / 2 ? Gc + 4 * tid : Rk + 4 * (tid - CH / 2);  // Gc, Bt and Rk, Rq adjoin
            *reinterpret_cast<float4*>(Fg + ((long long)slot * Hv + h) * 4 * CH + 4 * tid) =
                *reinterpret_cast<const float4*>(src);
        }
    }
}