// What the paged-attention kernels share (paged_attention.cu on mma.sync, paged_decode.cu, paged_attention_wg.cu on
// wgmma): their arguments, which rows and key tiles a block takes, the block-table lookup, the append of the new
// tokens' K/V, the mma.sync kernels' copies of Q and of a K/V tile, the rows of an empty key share, the mma.sync
// kernels' online softmax step and P V product, the quad sums of a row's running sum, and the end of a row
// (normalise, gate, store; or the share's partial output and log2-sum-exp). Uses the defines HEAD_DIM, GROUP,
// BLOCK_SIZE, SPLIT, GATE (their defaults below; a launch passes every one) and the including kernel's `elem`
// (bf16): included right after it.
#pragma once

#ifndef HEAD_DIM
#define HEAD_DIM 256
#endif
#ifndef GROUP
#define GROUP 4  // q heads per kv head
#endif
#ifndef BLOCK_SIZE
#define BLOCK_SIZE 16
#endif
#ifndef SPLIT
#define SPLIT 0
#endif
#ifndef GATE
#define GATE 1
#endif

#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + __expf(-x)); }

// With SPLIT, the merge of the shares (paged_combine.cu) is launched with programmatic serialization: each
// kernel lets it start as its first act, so the merge's blocks are resident in the slots this grid leaves free
// (a split launch is planned to one wave) and waiting in grid_wait() when the last share ends, instead of
// being launched then. Nothing else follows a split launch before the merge.
__device__ __forceinline__ void let_the_merge_start() {
#if SPLIT
    grid_launch_dependents();
#endif
}

// Slot (row of [num_blocks * BLOCK_SIZE, Hkv, HEAD_DIM]) of key position p through the block table.
__device__ __forceinline__ long long slot_of(const int* bt, int p) {
    return (long long)__ldg(bt + p / BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE;
}

// What one block of either kernel takes: blockIdx.y = (sequence n, kv head), the row tile [r0, r0 + bm) of
// the sequence's (new token, q head of the group) rows, the last tiles first (they have the most keys to
// read), and with SPLIT the key tiles [j0, j1) of share blockIdx.z (j0 >= j1: an empty share). The tiles of
// bn keys run up to the last key visible to the tile's last row. r0 >= rows: nothing to do.
struct TileWork {
    int n, kvh, q0, nq, rows, r0, L, H, j0, j1;
};
template <int bm, int bn>
__device__ __forceinline__ TileWork tile_work(const int* cu_q, const int* cache_lens, int Hkv) {
    TileWork w;
    w.n = blockIdx.y / Hkv;
    w.kvh = blockIdx.y % Hkv;
    w.q0 = cu_q[w.n];
    w.nq = cu_q[w.n + 1] - w.q0;
    w.rows = w.nq * GROUP;
    w.r0 = (gridDim.x - 1 - blockIdx.x) * bm;
    w.L = cache_lens[w.n];
    w.H = Hkv * GROUP;
    const int kv_end = w.L + (min(w.r0 + bm, w.rows) - 1) / GROUP + 1;
    const int ntiles = (kv_end + bn - 1) / bn;
    w.j0 = 0;
    w.j1 = ntiles;
#if SPLIT
    const int per = (ntiles + gridDim.z - 1) / gridDim.z;
    w.j0 = blockIdx.z * per;
    w.j1 = min(ntiles, w.j0 + per);
#endif
    return w;
}

// The arguments of every paged-attention kernel, in the order launch.paged_attention_cuda packs them: q and
// the output gate [T, H, HEAD_DIM] and the new tokens' k / v [T, Hkv, HEAD_DIM] with their token and head
// strides (elements); the pools [num_blocks * BLOCK_SIZE, Hkv, HEAD_DIM]; each sequence's block-table row
// (bt_stride entries), cached length and first new token (cu_q); the output, or with SPLIT the shares'
// partial outputs and log2-sum-exps; the softmax scale with log2(e) folded in; whether to store the new K/V.
#define PAGED_PARAMS                                                                                           \
    const elem *__restrict__ q, long long q_st, long long q_sh, const elem *__restrict__ gate, long long g_st, \
        long long g_sh, const elem *__restrict__ k_new, long long kn_st, long long kn_sh,                      \
        const elem *__restrict__ v_new, long long vn_st, long long vn_sh, elem *__restrict__ k_pool,           \
        elem *__restrict__ v_pool, const int *__restrict__ block_table, int bt_stride,                         \
        const int *__restrict__ cache_lens, const int *__restrict__ cu_q, elem *__restrict__ out,              \
        float *__restrict__ o_part, float *__restrict__ lse_part, int Hkv, int total_q, float scale_log2,      \
        int write_kv


// Stores the K/V of the tokens whose first row lies in rows [r0, r0 + bm) in their pool slots (so each
// token is stored by exactly one block), 16 bytes a thread at a time; kn, vn: this sequence's first new
// token at this kv head.
template <int bm, int threads>
__device__ __forceinline__ void append_kv(elem* k_pool, elem* v_pool, const elem* kn, long long kn_st,
                                          const elem* vn, long long vn_st, const int* bt, int L, int nq, int r0,
                                          int Hkv, int kvh) {
    constexpr int pieces = HEAD_DIM / 8;
    const int t_lo = (r0 + GROUP - 1) / GROUP, t_hi = min(nq, (r0 + bm + GROUP - 1) / GROUP);
    for (int c = threadIdx.x; c < (t_hi - t_lo) * pieces; c += threads) {
        const int tk = t_lo + c / pieces, ch = c % pieces;
        const long long dst = (slot_of(bt, L + tk) * Hkv + kvh) * HEAD_DIM + ch * 8;
        *reinterpret_cast<uint4*>(k_pool + dst) = *reinterpret_cast<const uint4*>(kn + tk * kn_st + ch * 8);
        *reinterpret_cast<uint4*>(v_pool + dst) = *reinterpret_cast<const uint4*>(vn + tk * vn_st + ch * 8);
    }
}

// The mma.sync kernels' copies into shared memory (paged_attention.cu, paged_decode.cu): rows of HEAD_DIM
// elements `lds` apart, in 16-byte cp.async pieces.

// The block's Q rows r0 .. r0 + bm (row r: token r / GROUP at q head kvh GROUP + r % GROUP; rows past the
// sequence: zeros) into qs; not committed (they join the first tile's group).
template <int bm, int threads, int lds>
__device__ __forceinline__ void copy_q_rows(elem* qs, const elem* q, long long q_st, long long q_sh, int q0, int r0,
                                            int rows, int kvh, int tid) {
    constexpr int chunks = HEAD_DIM / 8;
    for (int c = tid; c < bm * chunks; c += threads) {
        const int r = c / chunks, ch = c % chunks, gr = r0 + r;
        const bool ok = gr < rows;
        const int t = ok ? gr / GROUP : 0, h = kvh * GROUP + (ok ? gr % GROUP : 0);
        cp_async16(qs + r * lds + ch * 8, q + (long long)(q0 + t) * q_st + (long long)h * q_sh + ch * 8, ok);
    }
}

// The 32 key rows of tile j (keys 32 j ..) of K into ks and of V into vs, committed as one group. Lane r of
// every warp computes row r's K and V source address (the pool slot through the block table, the new token's
// row in kn / vn, or none: zero fill), tagged valid in bit 0 (rows are 16-byte aligned); the copy loop only
// shuffles the addresses to the copying lanes. (Computing the address per 16-byte piece took ~50 instructions
// for every 2 copies: decode blocks of one warp were bound by issue.)
template <int threads, int lds>
__device__ __forceinline__ void copy_kv_tile(elem* ks, elem* vs, int j, const int* bt, int L, int nq, int Hkv, int kvh,
                                             const elem* k_pool, const elem* v_pool, const elem* kn, long long kn_st,
                                             const elem* vn, long long vn_st, int tid, int lane) {
    constexpr int chunks = HEAD_DIM / 8;
    static_assert((32 * chunks) % threads == 0, "every thread must run the tile-copy loop equally often");
    unsigned long long ka = reinterpret_cast<unsigned long long>(kn);
    unsigned long long va = reinterpret_cast<unsigned long long>(vn);
    const int p = j * 32 + lane;
    if (p < L) {
        const long long off = (slot_of(bt, p) * Hkv + kvh) * HEAD_DIM;
        ka = reinterpret_cast<unsigned long long>(k_pool + off) | 1ull;
        va = reinterpret_cast<unsigned long long>(v_pool + off) | 1ull;
    } else if (p < L + nq) {
        ka = reinterpret_cast<unsigned long long>(kn + (long long)(p - L) * kn_st) | 1ull;
        va = reinterpret_cast<unsigned long long>(vn + (long long)(p - L) * vn_st) | 1ull;
    }  // else: past the sequence, zeros (P = 0 times V stays 0); kn / vn only as harmless addresses
#pragma unroll
    for (int i = 0; i < 32 * chunks / threads; ++i) {
        const int c = tid + i * threads, r = c / chunks, ch = c % chunks;
        const unsigned long long kr = __shfl_sync(0xffffffffu, ka, r);
        const unsigned long long vr = __shfl_sync(0xffffffffu, va, r);
        const bool ok = kr & 1ull;
        cp_async16(ks + r * lds + ch * 8, reinterpret_cast<const elem*>(kr & ~1ull) + ch * 8, ok);
        cp_async16(vs + r * lds + ch * 8, reinterpret_cast<const elem*>(vr & ~1ull) + ch * 8, ok);
    }
    cp_async_commit();
}

// (token, q head) row r of sequence n's rows: its [total_q * H] index.
__device__ __forceinline__ long long row_index(int r, int q0, int kvh, int H) {
    return (long long)(q0 + r / GROUP) * H + kvh * GROUP + r % GROUP;
}

// A share with no key tile to read: lse = -inf for the thread's rows (the combine gives it weight 0).
// t: the thread's column quad index (lane & 3); only t == 0 writes.
__device__ __forceinline__ void empty_share(const int (&r)[2], int rows, int t, int q0, int kvh, int H, int total_q,
                                            float* lse_part) {
    if (t != 0) return;
    for (int half = 0; half < 2; ++half)
        if (r[half] < rows) lse_part[(long long)blockIdx.z * total_q * H + row_index(r[half], q0, kvh, H)] = NEG_INF;
}

// One key tile of a thread's two rows (rows A and B of its mma fragments), S unscaled: keys past the last
// visible position of each row (limA, limB: causal, and past the sequence) masked to -inf, but only in tiles
// that reach lim0, the block's first row's limit (the others are visible to every row of the block: a branch
// all its threads take alike); then the online softmax step in the log2 domain: s becomes
// P = 2^(s scale_log2 - m), the running max m (scaled) and sum l advance, and the thread's NO output fragments o
// are rescaled, only when a row maximum of the warp moved (once the maxima settle, rarely).
// j: the tile's index (keys j bn ..). ex2.approx.ftz: no range fix-up around each exponential.
template <int bn, int NO>
__device__ __forceinline__ void online_softmax(float (&s)[bn / 8][4], float (&o)[NO][4], float (&m)[2], float (&l)[2],
                                               int j, int lane, int limA, int limB, int lim0, float scale_log2) {
    if ((j + 1) * bn - 1 > lim0) {
#pragma unroll
        for (int i = 0; i < bn / 8; ++i) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int p = j * bn + i * 8 + 2 * (lane & 3) + e;
                if (p > limA) s[i][e] = NEG_INF;
                if (p > limB) s[i][2 + e] = NEG_INF;
            }
        }
    }
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int i = 0; i < bn / 8; ++i) {
        mx[0] = fmaxf(mx[0], fmaxf(s[i][0], s[i][1]));
        mx[1] = fmaxf(mx[1], fmaxf(s[i][2], s[i][3]));
    }
    float mu[2], alpha[2], rs[2] = {0.f, 0.f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        const float mh = fmaxf(m[h], mx[h] * scale_log2);  // the scale is positive; -inf stays -inf
        mu[h] = mh == NEG_INF ? 0.f : mh;  // a row with nothing visible yet keeps p = 0
        alpha[h] = ex2_ftz(m[h] - mu[h]);  // 0 while m = -inf
        l[h] *= alpha[h];
        m[h] = mh;
    }
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int d = 0; d < NO; ++d) {
            o[d][0] *= alpha[0];
            o[d][1] *= alpha[0];
            o[d][2] *= alpha[1];
            o[d][3] *= alpha[1];
        }
    }
#pragma unroll
    for (int i = 0; i < bn / 8; ++i) {
        s[i][0] = ex2_ftz(fmaf(s[i][0], scale_log2, -mu[0]));
        s[i][1] = ex2_ftz(fmaf(s[i][1], scale_log2, -mu[0]));
        s[i][2] = ex2_ftz(fmaf(s[i][2], scale_log2, -mu[1]));
        s[i][3] = ex2_ftz(fmaf(s[i][3], scale_log2, -mu[1]));
        rs[0] += s[i][0] + s[i][1];
        rs[1] += s[i][2] + s[i][3];
    }
    l[0] += rs[0];
    l[1] += rs[1];
}

// O += P V over one key tile of bn keys on mma.sync: the S accumulators (P, after online_softmax) are,
// pairwise, the A fragments of P; vs: the tile's V rows (row stride lds) from the first of the NO * 8 output
// columns the thread's o holds.
template <int bn, int NO, int lds>
__device__ __forceinline__ void pv_product(float (&o)[NO][4], const float (&s)[bn / 8][4], const elem* vs, int lane) {
#pragma unroll
    for (int kk = 0; kk < bn / 16; ++kk) {
        const u32 a[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                          pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                          pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int dn = 0; dn < NO / 2; ++dn) {
            u32 b[4];
            ldsm4t(b, vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * lds + dn * 16 + (lane >> 4) * 8);
            mma16816_bf16(o[2 * dn], a, b[0], b[1]);
            mma16816_bf16(o[2 * dn + 1], a, b[2], b[3]);
        }
    }
}

// The running sums of a thread's two rows, each over the four threads of its quad (which hold the row's
// columns): the whole row's sum in each of them.
__device__ __forceinline__ void quad_sums(float (&l)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
}

// The end of row r (< rows) with running max m and sum l: out = o / l * sigmoid(gate), or with SPLIT the
// share's o / l and (with_lse) its log2-sum-exp. The thread holds NI * 2 columns, val(i, e) being column
// c0 + 8 i + 2 t + e (the whole row by default; paged_decode.cu's warps hold a quarter each).
template <int NI = HEAD_DIM / 8, typename F>
__device__ __forceinline__ void finish_row(int r, float m, float l, int t, int q0, int kvh, int H, int total_q,
                                           const elem* gate, long long g_st, long long g_sh, elem* out,
                                           float* o_part, float* lse_part, F val, int c0 = 0,
                                           bool with_lse = true) {
    const long long row = row_index(r, q0, kvh, H);
    const float inv = l > 0.f ? 1.f / l : 0.f;
#if SPLIT
    float* op = o_part + ((long long)blockIdx.z * total_q * H + row) * HEAD_DIM + c0;
#pragma unroll
    for (int i = 0; i < NI; ++i)
        *reinterpret_cast<float2*>(op + 8 * i + 2 * t) = make_float2(val(i, 0) * inv, val(i, 1) * inv);
    if (with_lse && t == 0) lse_part[(long long)blockIdx.z * total_q * H + row] = l > 0.f ? m + log2f(l) : NEG_INF;
#else
    elem* orow = out + row * HEAD_DIM + c0;
#if GATE
    const elem* grow = gate + (long long)(q0 + r / GROUP) * g_st + (long long)(kvh * GROUP + r % GROUP) * g_sh + c0;
#endif
#pragma unroll
    for (int i = 0; i < NI; ++i) {
        const int col = 8 * i + 2 * t;
        float x0 = val(i, 0) * inv, x1 = val(i, 1) * inv;
#if GATE
        const float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(grow + col));
        x0 *= sigmoid_f(g.x);
        x1 *= sigmoid_f(g.y);
#endif
        *reinterpret_cast<u32*>(orow + col) = pack_bf16(x0, x1);
    }
#endif
}
