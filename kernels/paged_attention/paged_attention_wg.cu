// Paged attention for prefills on Hopper (sm_90a): the same contract as paged_attention_fwd
// (paged_attention.cu documents the layout, the causal rule, the K/V append and the SPLIT shares), with
// the two products on warpgroup mma instead of mma.sync.
//
// A block of WARPGROUPS warpgroups (two for prefills; one for up to 64 rows, e.g. 16 new tokens over a long
// cache, where a second one would only multiply zero rows) takes BM = 64 * WARPGROUPS rows of one (sequence,
// kv head), a row being one (new token, q head of the group); warpgroup w owns rows 64 w .. 64 w + 63 and
// keeps their output (64 x HEAD_DIM, fp32: 128 registers a thread at HEAD_DIM 256) in its accumulators. Q,
// three stages of 64-key K tiles and VSTAGES of V sit in shared memory in the 128-byte swizzled layout wgmma
// reads, as [HEAD_DIM / 64] column blocks of [rows][64]; the tiles are gathered through the block table with
// cp.async (four threads copy one key row, its pool slot looked up once). Per tile j: S(j + 1) = Q K^T (both
// operands from shared memory, 16 instructions of m64n64k16) is issued first and runs while tile j's mask
// and online softmax (exp2 domain, on S(j)'s accumulators) run beside it; the probabilities are then,
// pairwise, the register A operand of O += P V (V's rows read with the transpose bit). K(j + AHEAD + 1) and
// V(j + AHEAD) are copied during tile j: one block barrier per tile.
// Shared memory: (BM + (3 + VSTAGES) * 64) * HEAD_DIM * 2 bytes + 1 KB of alignment: 225 KB at HEAD_DIM 256
// either way (one block per SM; Hopper allows 227 KB).
#include "common.cuh"
#include "mma_ptx.cuh"    // smem_u32, pack_bf16, cp_async*, ex2_ftz
#include "wgmma_ptx.cuh"  // fences, swizzled layout, descriptors, m64n64k16

typedef __nv_bfloat16 elem;

#include "paged_common.cuh"  // the shared defines' defaults; tile_work, slot_of, append_kv, empty_share, finish_row

#ifndef WARPGROUPS
#define WARPGROUPS 2
#endif
#define BM (64 * WARPGROUPS)
#define BN 64
#define THREADS (128 * WARPGROUPS)
#define KROWS (THREADS / 4)  // key rows one pass of the block's copies covers
// Tiles copied ahead: V(j + AHEAD) and K(j + AHEAD + 1) are issued at the start of tile j, into the stages
// that tiles j - 1 (V) and j (K) have finished with. One warpgroup has the shared memory for three V stages
// (two tiles ahead); two warpgroups' Q leaves room for two (one ahead).
#define AHEAD (WARPGROUPS == 1 ? 2 : 1)
#define VSTAGES (AHEAD + 1)
#define CB (HEAD_DIM / 64)     // 64-column blocks of a row
#define PIECES (HEAD_DIM / 8)  // 16-byte pieces of a row

static_assert(HEAD_DIM % 64 == 0, "HEAD_DIM must be a multiple of 64");
static_assert(PIECES % 4 == 0, "four threads copy one key row");
static_assert(WARPGROUPS == 1 || WARPGROUPS == 2, "one or two warpgroups");
static_assert(KROWS % 8 == 0, "a thread's key rows share their swizzle");

// Offset (elements) of 16-byte piece pc of row r in a [rows][HEAD_DIM] tile stored as column blocks.
__device__ __forceinline__ int tile_off(int rows, int r, int pc) { return (pc >> 3) * rows * 64 + sw64(r, (pc & 7) * 8); }

extern "C" __global__ void __launch_bounds__(THREADS, 1)
paged_attention_wg(PAGED_PARAMS) {
    let_the_merge_start();
    extern __shared__ unsigned char smem_raw[];
    elem* Qs = reinterpret_cast<elem*>((reinterpret_cast<unsigned long long>(smem_raw) + 1023) & ~1023ull);
    elem* Ks = Qs + BM * HEAD_DIM;  // [3][BN x HEAD_DIM]
    elem* Vs = Ks + 3 * BN * HEAD_DIM;  // [VSTAGES][BN x HEAD_DIM]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wq = warp & 3;  // warpgroup, warp within it
    const int g = lane >> 2, t = lane & 3;
    const TileWork tw = tile_work<BM, BN>(cu_q, cache_lens, Hkv);
    const int kvh = tw.kvh, q0 = tw.q0, nq = tw.nq, rows = tw.rows, r0 = tw.r0, L = tw.L, H = tw.H;
    if (r0 >= rows) return;
    const int* bt = block_table + (long long)tw.n * bt_stride;
    const elem* kn = k_new + (long long)q0 * kn_st + (long long)kvh * kn_sh;
    const elem* vn = v_new + (long long)q0 * vn_st + (long long)kvh * vn_sh;

    if (write_kv && blockIdx.z == 0) append_kv<BM, THREADS>(k_pool, v_pool, kn, kn_st, vn, vn_st, bt, L, nq, r0, Hkv, kvh);

    int j0 = tw.j0, j1 = tw.j1;  // key tiles of this block's share
    const int rA = r0 + 64 * wg + 16 * wq + g, rB = rA + 8;  // the two rows this thread holds
    if (j0 >= j1) {  // nothing to see: an empty share (the combine skips it)
        empty_share({rA, rB}, rows, t, q0, kvh, H, total_q, lse_part);
        return;
    }

    {  // Q: thread tid copies half of row tid / 2 (BM = THREADS / 2; rows past the sequence: zeros)
        const int r = tid >> 1, gr = r0 + r;
        const bool ok = gr < rows;
        const elem* src = q + (long long)(q0 + (ok ? gr / GROUP : 0)) * q_st + (long long)(kvh * GROUP + (ok ? gr % GROUP : 0)) * q_sh;
#pragma unroll
        for (int i = 0; i < PIECES / 2; ++i) {
            const int pc = (tid & 1) + 2 * i;
            cp_async16(Qs + tile_off(BM, r, pc), src + pc * 8, ok);
        }
    }
    // Key row r of tile j (thread tid: rows tid / 4 + KROWS i, pieces (tid & 3) + 4 c) of K or V (pool, and nw
    // with token stride nw_st for the new tokens) into d: the pool slot through the block table, the new
    // token's row, or nothing past the sequence (zeros: P = 0 there, and no NaN is read).
    // Piece (tid & 3) + 4 c of a row lies in column block c / 2 at chunk (tid & 3) + 4 (c & 1), swizzled by the
    // row's low three bits (the same for every row the thread copies: KROWS is a multiple of 8): two offsets
    // (bytes, in a [BN][64] block) for the thread's first row; the rest are constants the copies carry.
    const u32 swz0 = (u32)sw64(tid >> 2, (tid & 3) * 8) * 2;
    const u32 swz1 = (u32)sw64(tid >> 2, ((tid & 3) + 4) * 8) * 2;
    auto load_tile = [&](int j, elem* d, const elem* pool, const elem* nw, long long nw_st) {
        const u32 base = smem_u32(d);
#pragma unroll
        for (int i = 0; i < BN / KROWS; ++i) {
            const int p = j * BN + (tid >> 2) + KROWS * i;
            const bool ok = p < L + nq;
            const elem* s = (p < L ? pool + (slot_of(bt, p) * Hkv + kvh) * HEAD_DIM : nw + (ok ? p - L : 0) * nw_st)
                            + (tid & 3) * 8;
            const u32 d0 = base + swz0 + KROWS * i * 128, d1 = base + swz1 + KROWS * i * 128;
#pragma unroll
            for (int c = 0; c < PIECES / 4; ++c)
                cp_async16_s((c & 1 ? d1 : d0) + (c >> 1) * BN * 128, s + 32 * c, ok);
        }
    };
    // K of tile j into stage (j - j0) % 3, V of tile j into stage (j - j0) % VSTAGES
    auto load_k = [&](int j) { load_tile(j, Ks + ((j - j0) % 3) * BN * HEAD_DIM, k_pool, kn, kn_st); };
    auto load_v = [&](int j) { load_tile(j, Vs + ((j - j0) % VSTAGES) * BN * HEAD_DIM, v_pool, vn, vn_st); };

    float o[CB * 32];
#pragma unroll
    for (int i = 0; i < CB * 32; ++i) o[i] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    const int limA = L + min(rA, rows - 1) / GROUP, limB = L + min(rB, rows - 1) / GROUP;
    const int lim0 = L + r0 / GROUP;  // the block's first row's: every row sees at least keys 0 .. lim0
    const elem* Qw = Qs + 64 * wg * 64;  // this warpgroup's 64 rows (8 KB into each column block)

    // descriptors step through shared memory in 16-byte units of their address field (no carry out of it)
    const unsigned long long dq = wg_desc_kmajor_sw128(Qw);
    auto issue_s = [&](float (&s)[32], int j) {  // S = Q K^T of tile j, asynchronous until wg_wait
        const unsigned long long dk = wg_desc_kmajor_sw128(Ks + ((j - j0) % 3) * BN * HEAD_DIM);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            const int cb = kk >> 2, sub = kk & 3;  // column block, 16-column step inside it (32 bytes)
            wg_ss_m64n64_bf16(s, dq + cb * BM * 64 * 2 / 16 + 2 * sub, dk + cb * BN * 64 * 2 / 16 + 2 * sub, kk > 0);
        }
        wg_commit();
        wg_pin(s);
    };

    // One tile: S(j) is in s (complete). S(j + 1) runs on the tensor cores while the softmax of tile j runs on
    // the other units; then O += P V(j). Pipeline: K in three stages, V in VSTAGES; the copies of
    // K(j + AHEAD + 1) and V(j + AHEAD) are issued at the start of tile j, once every warp has finished tile
    // j - 1 (the barrier).
    auto tile = [&](int j, float (&s)[32], float (&s_next)[32]) {
        cp_async_wait<AHEAD - 1>();  // K(j + 1), V(j): issued at the start of tile j - AHEAD (or before the loop)
        fence_proxy_async();  // the copies, seen by the tensor cores' operand reads
        __syncthreads();
        if (j + AHEAD + 1 < j1) load_k(j + AHEAD + 1);
        if (j + AHEAD < j1) load_v(j + AHEAD);
        cp_async_commit();  // one group a tile, empty past the last: the wait above counts groups
        // the row maxima of tile j first, and O rescaled to them, before S(j + 1) is in flight (no accumulator
        // a running wgmma may write is touched by other instructions); the exponentials run beside it. S stays
        // unscaled (the scale is positive: the maxima are the same keys'); m is in the log2 domain. Keys past a
        // row's last visible one are masked only in the tiles that reach the block's first row's limit (the
        // others see every key: a branch the whole block takes alike).
        float mx[2] = {NEG_INF, NEG_INF};
        if ((j + 1) * BN - 1 > lim0) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int p = j * BN + 8 * i + 2 * t + e;
                    if (p > limA) s[4 * i + e] = NEG_INF;
                    if (p > limB) s[4 * i + 2 + e] = NEG_INF;
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            mx[0] = fmaxf(mx[0], fmaxf(s[4 * i], s[4 * i + 1]));
            mx[1] = fmaxf(mx[1], fmaxf(s[4 * i + 2], s[4 * i + 3]));
        }
        float mu[2], alpha[2], rs[2] = {0.f, 0.f};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            const float mh = fmaxf(m[h], mx[h] * scale_log2);  // -inf * scale stays -inf
            mu[h] = mh == NEG_INF ? 0.f : mh;  // a row with nothing visible yet keeps p = 0
            alpha[h] = ex2_ftz(m[h] - mu[h]);  // 0 while m = -inf
            l[h] *= alpha[h];
            m[h] = mh;
        }
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // once the maxima settle, rarely
#pragma unroll
            for (int i = 0; i < CB * 8; ++i) {
                o[4 * i] *= alpha[0];
                o[4 * i + 1] *= alpha[0];
                o[4 * i + 2] *= alpha[1];
                o[4 * i + 3] *= alpha[1];
            }
        }
        issue_s(s_next, j + 1);  // past the last tile: a stale stage, never read (branch-free wgmma)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            s[4 * i + 0] = ex2_ftz(fmaf(s[4 * i + 0], scale_log2, -mu[0]));
            s[4 * i + 1] = ex2_ftz(fmaf(s[4 * i + 1], scale_log2, -mu[0]));
            s[4 * i + 2] = ex2_ftz(fmaf(s[4 * i + 2], scale_log2, -mu[1]));
            s[4 * i + 3] = ex2_ftz(fmaf(s[4 * i + 3], scale_log2, -mu[1]));
            rs[0] += s[4 * i + 0] + s[4 * i + 1];
            rs[1] += s[4 * i + 2] + s[4 * i + 3];
        }
        l[0] += rs[0];
        l[1] += rs[1];

        // O += P V: keys 16 kk .. 16 kk + 15 of P are accumulators 8 kk .. 8 kk + 7 (the m16n8k16 A fragment)
        const unsigned long long dv = wg_desc_sw128(Vs + ((j - j0) % VSTAGES) * BN * HEAD_DIM);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const u32 a[4] = {pack_bf16(s[8 * kk + 0], s[8 * kk + 1]), pack_bf16(s[8 * kk + 2], s[8 * kk + 3]),
                              pack_bf16(s[8 * kk + 4], s[8 * kk + 5]), pack_bf16(s[8 * kk + 6], s[8 * kk + 7])};
#pragma unroll
            for (int cb = 0; cb < CB; ++cb)
                wg_rs_m64n64_bf16(o + 32 * cb, a, dv + (cb * BN * 64 + kk * 16 * 64) * 2 / 16, 1);
        }
        wg_commit();
        wg_wait<0>();  // S(j + 1) and O
        wg_pin(o);
        wg_pin(s_next);
    };

    // the tile range through a shuffle: ptxas serializes wgmma around branches it cannot prove warp-uniform
    j0 = __shfl_sync(0xffffffffu, j0, 0);
    j1 = __shfl_sync(0xffffffffu, j1, 0);
    float sa[32], sb[32];
    // before the loop: Q and K(j0) (one group), then AHEAD groups of the next K and V; S(j0)
    load_k(j0);
    cp_async_commit();
#pragma unroll
    for (int a = 1; a <= AHEAD; ++a) {  // K(j0 + a) and V(j0 + a - 1), one group each
        if (j0 + a < j1) load_k(j0 + a);
        if (j0 + a - 1 < j1) load_v(j0 + a - 1);
        cp_async_commit();
    }
    cp_async_wait<AHEAD>();
    fence_proxy_async();
    __syncthreads();
    issue_s(sa, j0);
    wg_wait<0>();
    wg_pin(sa);
    for (int j = j0; j < j1; j += 2) {  // two tiles a turn: the S registers trade places
        tile(j, sa, sb);
        if (j + 1 < j1) tile(j + 1, sb, sa);
    }

    quad_sums(l);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = half ? rB : rA;
        if (r < rows)
            finish_row(r, m[half], l[half], t, q0, kvh, H, total_q, gate, g_st, g_sh, out, o_part, lse_part,
                       [&](int i, int e) { return o[4 * i + 2 * half + e]; });
    }
}
