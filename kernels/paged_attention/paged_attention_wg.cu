// Paged attention for prefills on Hopper (sm_90a): the same contract as paged_attention_fwd
// (paged_attention.cu documents the layout, the causal rule, the K/V append and the SPLIT shares), with
// the two products on warpgroup mma instead of mma.sync.
//
// A block of two warpgroups takes BM = 128 rows of one (sequence, kv head), a row being one (new token,
// q head of the group); warpgroup w owns rows 64 w .. 64 w + 63 and keeps their output (64 x HEAD_DIM,
// fp32: 128 registers a thread at HEAD_DIM 256) in its accumulators. Q, three stages of 64-key K tiles and
// two of V sit in shared memory in the 128-byte swizzled layout wgmma reads, as [HEAD_DIM / 64] column
// blocks of [rows][64]; the tiles are gathered through the block table with cp.async (each thread copies
// 8 pieces of one key row: its pool slot looked up once). Per tile j: S(j + 1) = Q K^T (both operands from
// shared memory, 16 instructions of m64n64k16) is issued first and runs while tile j's mask and online
// softmax (exp2 domain, on S(j)'s accumulators) run beside it; the probabilities are then, pairwise, the
// register A operand of O += P V (V's rows read with the transpose bit). K(j + 2) and V(j + 1) are copied
// during tile j: one block barrier per tile.
// Shared memory: (BM + 5 * 64) * HEAD_DIM * 2 bytes + 1 KB of alignment: 225 KB at HEAD_DIM 256 (one block
// per SM; Hopper allows 227 KB).
#include "common.cuh"
#include "mma_ptx.cuh"    // smem_u32, pack_bf16, cp_async*
#include "wgmma_ptx.cuh"  // fences, swizzled layout, descriptors, m64n64k16

typedef __nv_bfloat16 elem;

#include "paged_common.cuh"  // the shared defines' defaults; tile_work, slot_of, append_kv, empty_share, finish_row

#define BM 128
#define BN 64
#define THREADS 256
#define CB (HEAD_DIM / 64)     // 64-column blocks of a row
#define PIECES (HEAD_DIM / 8)  // 16-byte pieces of a row

static_assert(HEAD_DIM % 64 == 0, "HEAD_DIM must be a multiple of 64");
static_assert(PIECES % 4 == 0, "four threads copy one key row");

// Offset (elements) of 16-byte piece pc of row r in a [rows][HEAD_DIM] tile stored as column blocks.
__device__ __forceinline__ int tile_off(int rows, int r, int pc) { return (pc >> 3) * rows * 64 + sw64(r, (pc & 7) * 8); }

extern "C" __global__ void __launch_bounds__(THREADS, 1)
paged_attention_wg(PAGED_PARAMS) {
    extern __shared__ unsigned char smem_raw[];
    elem* Qs = reinterpret_cast<elem*>((reinterpret_cast<unsigned long long>(smem_raw) + 1023) & ~1023ull);
    elem* Ks = Qs + BM * HEAD_DIM;  // [3][BN x HEAD_DIM]
    elem* Vs = Ks + 3 * BN * HEAD_DIM;  // [2][BN x HEAD_DIM]

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

    {  // Q: thread tid copies half of row tid / 2 (rows past the sequence: zeros)
        const int r = tid >> 1, gr = r0 + r;
        const bool ok = gr < rows;
        const elem* src = q + (long long)(q0 + (ok ? gr / GROUP : 0)) * q_st + (long long)(kvh * GROUP + (ok ? gr % GROUP : 0)) * q_sh;
#pragma unroll
        for (int i = 0; i < PIECES / 2; ++i) {
            const int pc = (tid & 1) + 2 * i;
            cp_async16(Qs + tile_off(BM, r, pc), src + pc * 8, ok);
        }
    }
    // Key row r of tile j (thread tid: row tid / 4, pieces (tid & 3) + 4 i): the pool slot through the block
    // table, the new token's row, or nothing past the sequence (zeros: P = 0 there, and no NaN is read).
    const int kr = tid >> 2;
    auto row_src = [&](int j, const elem*& ks, const elem*& vs) -> bool {
        const int p = j * BN + kr;
        if (p < L) {
            const long long off = (slot_of(bt, p) * Hkv + kvh) * HEAD_DIM;
            ks = k_pool + off;
            vs = v_pool + off;
            return true;
        }
        ks = kn + (long long)(p - L) * kn_st;
        vs = vn + (long long)(p - L) * vn_st;
        return p < L + nq;
    };
    auto load_k = [&](int j) {  // K of tile j into stage (j - j0) % 3
        const elem *ks, *vs;
        const bool ok = row_src(j, ks, vs);
        elem* d = Ks + ((j - j0) % 3) * BN * HEAD_DIM;
#pragma unroll
        for (int i = 0; i < PIECES / 4; ++i) {
            const int pc = (tid & 3) + 4 * i;
            cp_async16(d + tile_off(BN, kr, pc), ok ? ks + pc * 8 : kn, ok);
        }
    };
    auto load_v = [&](int j) {  // V of tile j into stage (j - j0) & 1
        const elem *ks, *vs;
        const bool ok = row_src(j, ks, vs);
        elem* d = Vs + ((j - j0) & 1) * BN * HEAD_DIM;
#pragma unroll
        for (int i = 0; i < PIECES / 4; ++i) {
            const int pc = (tid & 3) + 4 * i;
            cp_async16(d + tile_off(BN, kr, pc), ok ? vs + pc * 8 : vn, ok);
        }
    };

    float o[CB * 32];
#pragma unroll
    for (int i = 0; i < CB * 32; ++i) o[i] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    const int limA = L + min(rA, rows - 1) / GROUP, limB = L + min(rB, rows - 1) / GROUP;
    const elem* Qw = Qs + 64 * wg * 64;  // this warpgroup's 64 rows (8 KB into each column block)

    auto issue_s = [&](float (&s)[32], int j) {  // S = Q K^T of tile j, asynchronous until wg_wait
        const elem* ks = Ks + ((j - j0) % 3) * BN * HEAD_DIM;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            const int cb = kk >> 2, sub = kk & 3;  // column block, 16-column step inside it (32 bytes)
            wg_ss_m64n64_bf16(s, wg_desc_kmajor_sw128(Qw + cb * BM * 64) + 2 * sub,
                              wg_desc_kmajor_sw128(ks + cb * BN * 64) + 2 * sub, kk > 0);
        }
        wg_commit();
        wg_pin(s);
    };

    // One tile: S(j) is in s (complete). S(j + 1) runs on the tensor cores while the softmax of tile j runs on
    // the other units; then O += P V(j). Pipeline: K in three stages, V in two; the copies of K(j + 2) and
    // V(j + 1) are issued at the start of tile j, once every warp has finished tile j - 1 (the barrier).
    auto tile = [&](int j, float (&s)[32], float (&s_next)[32]) {
        cp_async_wait<0>();   // K(j + 1), V(j): issued at the start of tile j - 1 (or before the loop)
        fence_proxy_async();  // the copies, seen by the tensor cores' operand reads
        __syncthreads();
        if (j + 2 < j1) load_k(j + 2);
        if (j + 1 < j1) load_v(j + 1);
        cp_async_commit();
        // the row maxima of tile j first, and O rescaled to them, before S(j + 1) is in flight (no accumulator
        // a running wgmma may write is touched by other instructions); the exponentials run beside it
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int p = j * BN + 8 * i + 2 * t + e;
                s[4 * i + e] = p <= limA ? s[4 * i + e] * scale_log2 : NEG_INF;
                s[4 * i + 2 + e] = p <= limB ? s[4 * i + 2 + e] * scale_log2 : NEG_INF;
                mx[0] = fmaxf(mx[0], s[4 * i + e]);
                mx[1] = fmaxf(mx[1], s[4 * i + 2 + e]);
            }
        }
        float mu[2], rs[2] = {0.f, 0.f};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            mu[h] = mx[h] == NEG_INF ? 0.f : mx[h];  // a row with nothing visible yet keeps p = 0
            const float alpha = exp2f(m[h] - mu[h]);
            l[h] *= alpha;
#pragma unroll
            for (int i = 0; i < CB * 8; ++i) {
                o[4 * i + 2 * h] *= alpha;
                o[4 * i + 2 * h + 1] *= alpha;
            }
            m[h] = mx[h];
        }
        issue_s(s_next, j + 1);  // past the last tile: a stale stage, never read (branch-free wgmma)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            s[4 * i + 0] = exp2f(s[4 * i + 0] - mu[0]);
            s[4 * i + 1] = exp2f(s[4 * i + 1] - mu[0]);
            s[4 * i + 2] = exp2f(s[4 * i + 2] - mu[1]);
            s[4 * i + 3] = exp2f(s[4 * i + 3] - mu[1]);
            rs[0] += s[4 * i + 0] + s[4 * i + 1];
            rs[1] += s[4 * i + 2] + s[4 * i + 3];
        }
        l[0] += rs[0];
        l[1] += rs[1];

        // O += P V: keys 16 kk .. 16 kk + 15 of P are accumulators 8 kk .. 8 kk + 7 (the m16n8k16 A fragment)
        const elem* vs = Vs + ((j - j0) & 1) * BN * HEAD_DIM;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const u32 a[4] = {pack_bf16(s[8 * kk + 0], s[8 * kk + 1]), pack_bf16(s[8 * kk + 2], s[8 * kk + 3]),
                              pack_bf16(s[8 * kk + 4], s[8 * kk + 5]), pack_bf16(s[8 * kk + 6], s[8 * kk + 7])};
#pragma unroll
            for (int cb = 0; cb < CB; ++cb)
                wg_rs_m64n64_bf16(o + 32 * cb, a, wg_desc_sw128(vs + cb * BN * 64 + kk * 16 * 64), 1);
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
    // before the loop: Q and K(j0) (one group), then K(j0 + 1) and V(j0); S(j0)
    load_k(j0);
    cp_async_commit();
    if (j0 + 1 < j1) load_k(j0 + 1);
    load_v(j0);
    cp_async_commit();
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
    issue_s(sa, j0);
    wg_wait<0>();
    wg_pin(sa);
    for (int j = j0; j < j1; j += 2) {  // two tiles a turn: the S registers trade places
        tile(j, sa, sb);
        if (j + 1 < j1) tile(j + 1, sb, sa);
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = half ? rB : rA;
        if (r < rows)
            finish_row(r, m[half], l[half], t, q0, kvh, H, total_q, gate, g_st, g_sh, out, o_part, lse_part,
                       [&](int i, int e) { return o[4 * i + 2 * half + e]; });
    }
}
