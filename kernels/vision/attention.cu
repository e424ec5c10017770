// The vision tower's attention on Hopper (sm_90a: warpgroup mma, TMA): each token of a packed batch attends
// to every token of its own segment (cu_seqlens: one image, or one 2-frame slice of a video) and to no
// other, no causal mask, softmax scale 1 / sqrt(HEAD_DIM). Head dims 64 and 72 (every Qwen3.5 tower) without
// padding a head to 128 columns, as cuDNN does for 72.
//   q, k, v: [N, HEADS, HEAD_DIM] bf16, read through tensor maps (dims HEAD_DIM, HEADS, N; boxes of 64 columns
//   x a block's BM tokens (Q) or a tile's BN (K, V) of one head, 128-byte swizzle, zeros outside the tensor: they
//   pad a Q / K row to 80 columns, a V row to 128, and fill the rows past token N; v64_map / v8_map / v1_map: V's
//   in boxes of 64, 8 and 1 tokens, for a segment's last tile); cu_seqlens int32 [segments + 1];
//   out [N, HEADS, HEAD_DIM] contiguous.
// The work: blocks of BM = 192 query rows of one (segment, head), ordered by segment, head, row block; each
// walks its segment's 128-key tiles. A persistent grid of G blocks (one per SM) shares it out so that every
// SM ends with about the same cost (the tail of a wave-by-wave grid leaves SMs idle: one image is 352 blocks,
// 2.67 waves of 132 SMs): first D whole rounds (block c + i G on CTA c), then the last G .. 2G blocks cut
// into G runs of equal cost (stream-K). A block costs its tiles and ITEM_COST more, its start and end: the
// CTA whose run holds a small image's short blocks (beside a large one's) takes that many fewer tiles.
// A run starts and ends inside a block at most once each (runs are at least the longest block's tiles
// long), never inside the cost of its start: the block at its end is begun first and its partial state
// (O unnormalised, the running max and sum per row) handed to CTA c + 1 through global memory and a flag;
// the block at its start is finished last, after the partial of CTA c - 1 has arrived, then merged. A CTA
// only waits on a lower one, which the hardware started no later.
// A CTA: three consumer warpgroups of 64 rows and one producer warpgroup, one thread of which copies each
// block's Q and each 128-key tile of K and V (two stages each) with TMA; full barriers count the bytes in,
// empty barriers one arrival per consumer warpgroup when its products have read a stage (Q: its block's last
// S).
// Shared memory: Q [QK_CB][BM][64], K [2][QK_CB][BN][64], V [2][V_CB][BN][64] (128-byte rows, 1024-byte
// aligned), the barriers: 181,328 bytes at head dim 72, 91,216 at 64 (launch.py: attention_smem).
// bench/experiments/vision_attention_ws.cu keeps the variants measured against this one
// (kernels/vision/NOTES.md).
#include "common.cuh"
#include "mma_ptx.cuh"    // smem_u32, pack_bf16, u32
#include "wgmma_ptx.cuh"  // fences, swizzled layout, descriptors, m64n128k16 / m64n72k16 / m64n64k16
#include "tma_ptx.cuh"    // TmaDesc, mbarriers, tensor copies

#ifndef HEAD_DIM
#define HEAD_DIM 72
#endif
#ifndef HEADS
#define HEADS 16
#endif

typedef __nv_bfloat16 elem;

#define CONSUMERS 3                      // consumer warpgroups
#define BM (64 * CONSUMERS)              // query rows a block
#define BN 128                           // keys a tile
#define STAGES 2                         // of K and of V
#define THREADS (128 * (CONSUMERS + 1))
#define NS (BN / 2)                      // S accumulators a thread
#define QK_STEPS ((HEAD_DIM + 15) / 16)  // k-steps of S = Q K^T
#define QK_CB ((2 * QK_STEPS + 7) / 8)   // 64-column blocks of a Q / K tile (the zero pad included)
#define V_CB ((HEAD_DIM / 8 + 7) / 8)    // of a V tile
#define NO (HEAD_DIM / 2)                // output accumulators a thread
#define Q_ELEMS (QK_CB * BM * 64)
#define K_ELEMS (QK_CB * BN * 64)
#define V_ELEMS (V_CB * BN * 64)
#define NEG_INF (-__int_as_float(0x7f800000))
#define CT (128 * CONSUMERS)             // consumer threads
#define PART (NO + 4)                    // a consumer thread's partial state: O, the running max and sum of its two rows
#define CU_KEPT 1024                     // segment starts kept in shared memory (the plan's walks read them)
#define ITEM_COST 2                      // a block's start and end, in the plan's tiles (kernels/vision/NOTES.md)

static_assert(HEAD_DIM == 64 || HEAD_DIM == 72, "HEAD_DIM must be 64 or 72 (the P V instruction's width)");

// s (64 x 128) (+)= Q K^T's 16-column step (both K-major in shared memory).
__device__ __forceinline__ void s_step(float (&d)[NS], unsigned long long da, unsigned long long db, int acc) {
    wg_ss_m64n128_bf16(d, da, db, acc);
}

// o (64 x HEAD_DIM) += A (64 x 16, registers) B (16 x HEAD_DIM, N contiguous).
__device__ __forceinline__ void pv_step(float (&o)[NO], const u32 (&a)[4], unsigned long long desc) {
#if HEAD_DIM == 72
    wg_rs_m64n72_bf16(o, a, desc, 1);
#else
    wg_rs_m64n64_bf16(o, a, desc, 1);
#endif
}

// rows [row, row + rows) of head h, columns [0, 64 cbs): one box per 64 columns (the map's box: all the rows)
__device__ __forceinline__ void tma_rows(elem* dst, const TmaDesc* map, int cbs, int rows, int h, int row,
                                         unsigned long long* bar) {
    for (int cb = 0; cb < cbs; ++cb) tma_load_3d(dst + cb * rows * 64, map, 64 * cb, h, row, bar);
}

// A segment's last, partial V tile: rows [0, keys) from the segment's rows [row, row + keys), the rest zeros. The
// rows after the segment are the next one's, which P weighs with exact zeros, but 0 * inf is NaN (a segment whose
// values overflow would reach the one before it). Boxes of 64, 8 and 1 rows (v64_map, v8_map, v1_map) read the
// segment's rows and zero the rest from far past the tensor (TMA's zero fill), never crossing `keys`; the bytes
// are a whole tile's, as full_v expects.
#define PAST_ROWS (1 << 30)  // a token row past every tensor: a box read there is zeros
__device__ __forceinline__ void tma_v_tail(elem* dst, const TmaDesc* v64_map, const TmaDesc* v8_map,
                                           const TmaDesc* v1_map, int h, int row, int keys, unsigned long long* bar) {
    for (int cb = 0; cb < V_CB; ++cb)
        for (int r = 0; r < BN;) {
            const int left = keys - r;  // the segment's rows from r on (none: 0 or less)
            const bool whole = left >= 64 || left <= 0, eighth = left >= 8 || left <= 0;
            const TmaDesc* map = r % 64 == 0 && whole ? v64_map : r % 8 == 0 && eighth ? v8_map : v1_map;
            tma_load_3d(dst + (cb * BN + r) * 64, map, 64 * cb, h, left > 0 ? row + r : PAST_ROWS, bar);
            r += map == v64_map ? 64 : map == v8_map ? 8 : 1;
        }
}

// One block of the work: (segment, head, row block) and its key tiles; u0: where its cost starts in the
// work's order (ITEM_COST, then one step a tile).
struct Blk { int s0, len, h, rb, nt, idx; long long u0; };

// The block of index i (by_step 0) or the block holding cost step u (by_step 1).
__device__ Blk find_block(const int* cu, int segments, int i, long long u, int by_step) {
    Blk b = {0, 0, 0, 0, 1, 0, 0};
    int bi = 0;
    long long bu = 0;
    for (int sg = 0; sg < segments; ++sg) {
        const int s0 = cu[sg], len = cu[sg + 1] - s0;
        const int nb = (len + BM - 1) / BM, nt = (len + BN - 1) / BN;
        const long long cost = (long long)nb * HEADS * (nt + ITEM_COST);
        if (by_step ? u < bu + cost : i < bi + nb * HEADS) {
            const int r = by_step ? (int)((u - bu) / (nt + ITEM_COST)) : i - bi;
            b.s0 = s0; b.len = len; b.h = r / nb; b.rb = r % nb; b.nt = nt; b.idx = bi + r;
            b.u0 = bu + (long long)r * (nt + ITEM_COST);
            return b;
        }
        bi += nb * HEADS;
        bu += cost;
    }
    return b;
}

// This CTA's items (blocks, or parts of one, in the order it runs them): D whole blocks c + i G, then the run
// of cost steps [a, b): the block at its end begun (kind 1: the partial state handed on), the whole blocks
// inside, the block at its start finished (kind 2: merged with CTA c - 1's partial). Work of one wave at
// most: block c alone.
struct Plan { int d, nfull, head, tail, head_idx, head_t1, tail_idx, tail_t0, first_full, items; };
struct Item { Blk b; int t0, t1, kind; };

__device__ Item plan_item(const Plan& p, const int* cu, int segments, int k) {
    int idx, t0 = 0, t1 = -1, kind = 0;
    if (k < p.d) {
        idx = blockIdx.x + k * gridDim.x;
    } else {
        k -= p.d;
        if (p.head && k == 0) {
            idx = p.head_idx; t1 = p.head_t1; kind = 1;
        } else {
            k -= p.head;
            if (k < p.nfull) idx = p.first_full + k;
            else { idx = p.tail_idx; t0 = p.tail_t0; kind = 2; }
        }
    }
    Item it;
    it.b = find_block(cu, segments, idx, 0, 0);
    it.t0 = t0;
    it.t1 = t1 < 0 ? it.b.nt : t1;
    it.kind = kind;
    return it;
}

// Where run x of the g_sk runs of the stream-K part [u_dp, u_dp + rest) starts: the equal share's step, or
// the start of its block where that falls inside the block's ITEM_COST (no run takes a block's start alone).
// Equal shares are at least the longest block's cost and a cut moves back by at most ITEM_COST, so a run is at
// least the longest block's tiles and still never starts and ends inside the same block.
__device__ long long run_cut(const int* cu, int segments, long long u_dp, long long rest, int g_sk, int x) {
    const long long u = u_dp + rest * x / g_sk;
    if (x == 0 || x == g_sk) return u;  // (the part's start is a block's; its end, the work's)
    const Blk b = find_block(cu, segments, 0, u, 1);
    return u - b.u0 <= ITEM_COST ? b.u0 : u;
}

// By the whole warp 0 (lane 0 writes the plan): the work's cost, blocks and longest tile walk first.
__device__ void make_plan(Plan& p, const int* cu, int segments, int lane) {
    long long w = 0;
    int nblocks = 0, ntmax = 1;
    for (int sg = lane; sg < segments; sg += 32) {
        const int len = cu[sg + 1] - cu[sg];
        const int nb = (len + BM - 1) / BM, nt = (len + BN - 1) / BN;
        w += (long long)nb * HEADS * (nt + ITEM_COST);
        nblocks += nb * HEADS;
        if (nb) ntmax = max(ntmax, nt);
    }
    for (int o = 16; o > 0; o >>= 1) {
        w += __shfl_xor_sync(0xffffffffu, w, o);
        nblocks += __shfl_xor_sync(0xffffffffu, nblocks, o);
        ntmax = max(ntmax, __shfl_xor_sync(0xffffffffu, ntmax, o));
    }
    if (lane) return;
    const int G = gridDim.x, c = blockIdx.x;
    p.head = p.tail = p.nfull = 0;
    p.head_idx = p.head_t1 = p.tail_idx = p.tail_t0 = p.first_full = 0;
    if (nblocks <= G) {  // one wave: a block a CTA, nothing handed on (the launcher passes no partials then)
        p.d = c < nblocks;
        p.items = p.d;
        return;
    }
    p.d = nblocks >= 2 * G ? nblocks / G - 1 : 0;
    const long long u_dp = p.d ? find_block(cu, segments, p.d * G, 0, 0).u0 : 0;
    const long long rest = w - u_dp;
    const int g_sk = (int)max(1ll, min((long long)G, rest / (ntmax + ITEM_COST)));
    if (c < g_sk) {
        const long long a = run_cut(cu, segments, u_dp, rest, g_sk, c);
        const long long b = run_cut(cu, segments, u_dp, rest, g_sk, c + 1);
        const Blk A = find_block(cu, segments, 0, a, 1), B = find_block(cu, segments, 0, b - 1, 1);
        p.tail = a > A.u0;
        p.head = b < B.u0 + ITEM_COST + B.nt;
        p.tail_idx = A.idx; p.tail_t0 = (int)(a - A.u0 - ITEM_COST);
        p.head_idx = B.idx; p.head_t1 = (int)(b - B.u0 - ITEM_COST);
        p.first_full = A.idx + p.tail;
        p.nfull = max(0, B.idx + 1 - p.head - p.first_full);
    }
    p.items = p.d + p.head + p.nfull + p.tail;
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release(unsigned* p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;\n" :: "l"(p), "r"(v) : "memory");
}

// partials: [G][PART][CT] fp32; flags: G zeros (CTA c sets flags[c] once its partial is written; CTA c + 1, its
// one reader, returns it to zero at the kernel's end, so launches in stream order share one buffer, zeroed once)
extern "C" __global__ void __launch_bounds__(THREADS, 1)
vision_attention(const __grid_constant__ TmaDesc q_map, const __grid_constant__ TmaDesc k_map,
                 const __grid_constant__ TmaDesc v_map, const __grid_constant__ TmaDesc v64_map,
                 const __grid_constant__ TmaDesc v8_map, const __grid_constant__ TmaDesc v1_map,
                 const int* __restrict__ cu_seqlens, int segments,
                 elem* __restrict__ out, float* __restrict__ partials, unsigned* __restrict__ flags, float scale_log2) {
    extern __shared__ unsigned char smem_raw[];
    __shared__ Plan plan;
    __shared__ int cu_kept[CU_KEPT];
    elem* Qs = reinterpret_cast<elem*>((reinterpret_cast<unsigned long long>(smem_raw) + 1023) & ~1023ull);
    elem* Ks = Qs + Q_ELEMS;
    elem* Vs = Ks + STAGES * K_ELEMS;
    unsigned long long* full_q = reinterpret_cast<unsigned long long*>(Vs + STAGES * V_ELEMS);
    unsigned long long* empty_q = full_q + 1;
    unsigned long long* full_k = empty_q + 1;
    unsigned long long* empty_k = full_k + STAGES;
    unsigned long long* full_v = empty_k + STAGES;
    unsigned long long* empty_v = full_v + STAGES;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wq = warp & 3;
    const int g = lane >> 2, t = lane & 3;

    if (tid == 0) {
        mbar_init(full_q, 1);
        mbar_init(empty_q, CONSUMERS);
        for (int i = 0; i < STAGES; ++i) {
            mbar_init(full_k + i, 1);
            mbar_init(empty_k + i, CONSUMERS);
            mbar_init(full_v + i, 1);
            mbar_init(empty_v + i, CONSUMERS);
        }
        mbar_init_fence();
    }
    const int* cu = cu_seqlens;  // the segment starts: a copy in shared memory where they fit
    if (segments < CU_KEPT) {
        for (int i = tid; i <= segments; i += THREADS) cu_kept[i] = cu_seqlens[i];
        cu = cu_kept;
        __syncthreads();
    }
    if (warp == 0) make_plan(plan, cu, segments, lane);
    __syncthreads();
    const int items = plan.items;
    if (items == 0) return;

    if (wg == CONSUMERS) {  // the producer: 24 registers a thread, the rest to the consumers
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (warp == 4 * CONSUMERS && lane == 0) {
            int step = 0;  // tiles copied so far: the stage and its round
            for (int k = 0; k < items; ++k) {
                const Item it = plan_item(plan, cu, segments, k);
                if (k > 0) mbar_wait(empty_q, (k - 1) & 1);  // the previous block's last S has read Q
                mbar_expect_tx(full_q, Q_ELEMS * 2);
                tma_rows(Qs, &q_map, QK_CB, BM, it.b.h, it.b.s0 + it.b.rb * BM, full_q);
                for (int j = it.t0; j < it.t1; ++j, ++step) {
                    const int st = step % STAGES, reuse = step / STAGES - 1;  // the stage's earlier tile's release
                    if (reuse >= 0) mbar_wait(empty_k + st, reuse & 1);
                    mbar_expect_tx(full_k + st, K_ELEMS * 2);
                    tma_rows(Ks + st * K_ELEMS, &k_map, QK_CB, BN, it.b.h, it.b.s0 + j * BN, full_k + st);
                    if (reuse >= 0) mbar_wait(empty_v + st, reuse & 1);
                    mbar_expect_tx(full_v + st, V_ELEMS * 2);
                    if (it.b.len - j * BN >= BN)  // (the common case kept to the fewest instructions: the
                        tma_rows(Vs + st * V_ELEMS, &v_map, V_CB, BN, it.b.h, it.b.s0 + j * BN, full_v + st);
                    else  // copies wait on this thread, the consumers on the copies)
                        tma_v_tail(Vs + st * V_ELEMS, &v64_map, &v8_map, &v1_map, it.b.h, it.b.s0 + j * BN,
                                   it.b.len - j * BN, full_v + st);
                }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 160;\n");
    const bool signal = (tid & 127) == 0;  // the thread that releases a stage for its warpgroup

    float o[NO], s[NS];
    u32 pk[BN / 4];  // P of the previous tile, bf16 pairs (the m16n8k16 A fragments of its 16-key steps)
    float m[2] = {NEG_INF, NEG_INF}, l[2];  // running max (unscaled) and sum of the thread's two rows
    const elem* Qw = Qs + 64 * wg * 64;     // this warpgroup's 64 rows

    auto issue_s = [&](int step) {
        const elem* ks = Ks + (step % STAGES) * K_ELEMS;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < QK_STEPS; ++kk) {
            const int cb = kk >> 2, sub = kk & 3;  // column block, 16-column step inside it (32 bytes)
            s_step(s, wg_desc_kmajor_sw128(Qw + cb * BM * 64) + 2 * sub, wg_desc_kmajor_sw128(ks + cb * BN * 64) + 2 * sub,
                   kk > 0);
        }
        wg_commit();
    };
    auto issue_pv = [&](int step) {
        mbar_wait(full_v + step % STAGES, (step / STAGES) & 1);
        const elem* vs = Vs + (step % STAGES) * V_ELEMS;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const u32 a[4] = {pk[4 * kk], pk[4 * kk + 1], pk[4 * kk + 2], pk[4 * kk + 3]};
            pv_step(o, a, wg_desc_sw128_mn(vs + kk * 16 * 64, BN * 64 * 2));
        }
        wg_commit();
    };
    // s -> exponentials in place (against the new running max); alpha rescales what came before
    auto softmax = [&](int j, int len, float (&alpha)[2], float (&rs)[2]) {
        if (j * BN + BN > len) {  // the segment's last, partial tile: keys past its end weigh nothing
#pragma unroll
            for (int i = 0; i < BN / 8; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (j * BN + 8 * i + 2 * t + e >= len) s[4 * i + e] = s[4 * i + 2 + e] = NEG_INF;
        }
        float mx[2] = {m[0], m[1]}, mc[2];
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
            mx[0] = fmaxf(mx[0], fmaxf(s[4 * i], s[4 * i + 1]));
            mx[1] = fmaxf(mx[1], fmaxf(s[4 * i + 2], s[4 * i + 3]));
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {  // every tile holds a key of the segment: mx is finite
            mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
            mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
            mc[hh] = mx[hh] * scale_log2;
            alpha[hh] = ex2_ftz(m[hh] * scale_log2 - mc[hh]);  // 0 on the first tile (m = -inf)
            m[hh] = mx[hh];
            rs[hh] = 0.f;
        }
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
            s[4 * i + 0] = ex2_ftz(fmaf(s[4 * i + 0], scale_log2, -mc[0]));
            s[4 * i + 1] = ex2_ftz(fmaf(s[4 * i + 1], scale_log2, -mc[0]));
            s[4 * i + 2] = ex2_ftz(fmaf(s[4 * i + 2], scale_log2, -mc[1]));
            s[4 * i + 3] = ex2_ftz(fmaf(s[4 * i + 3], scale_log2, -mc[1]));
            rs[0] += s[4 * i + 0] + s[4 * i + 1];
            rs[1] += s[4 * i + 2] + s[4 * i + 3];
        }
    };
    auto pack = [&]() {
#pragma unroll
        for (int i = 0; i < BN / 4; ++i) pk[i] = pack_bf16(s[2 * i], s[2 * i + 1]);
    };
    // the turn to issue products: warpgroup w waits on barrier 1 + w, then hands it to the next warpgroup
    auto turn_wait = [&]() { asm volatile("bar.sync %0, 256;\n" :: "r"(1 + wg) : "memory"); };
    auto turn_pass = [&]() { asm volatile("bar.arrive %0, 256;\n" :: "r"(1 + (wg + 1) % CONSUMERS) : "memory"); };
    auto consumers_sync = [&]() { asm volatile("bar.sync 4, %0;\n" :: "n"(CT) : "memory"); };

    if (wg == CONSUMERS - 1) asm volatile("bar.arrive 1, 256;\n" ::: "memory");  // the first turn: warpgroup 0's
    int step = 0;  // tiles consumed so far: the stage and its round
    for (int k = 0; k < items; ++k) {
        const Item it = plan_item(plan, cu, segments, k);
        // loop bounds through a shuffle: ptxas serializes wgmma around branches it cannot prove warp-uniform
        const int t0 = __shfl_sync(0xffffffffu, it.t0, 0), t1 = __shfl_sync(0xffffffffu, it.t1, 0);
        const int len = it.b.len, last = step + t1 - t0 - 1;
        float alpha[2], rs[2];
#pragma unroll
        for (int i = 0; i < NO; ++i) o[i] = 0.f;
        m[0] = m[1] = NEG_INF;
        mbar_wait(full_q, k & 1);
        mbar_wait(full_k + step % STAGES, (step / STAGES) & 1);
        turn_wait();
        issue_s(step);
        turn_pass();
        wg_wait<0>();
        wg_pin(s);
        if (signal) {
            mbar_arrive(empty_k + step % STAGES);
            if (step == last) mbar_arrive(empty_q);
        }
        softmax(t0, len, alpha, rs);
        l[0] = rs[0];
        l[1] = rs[1];
        pack();
        for (int j = t0 + 1; j < t1; ++j) {
            ++step;
            mbar_wait(full_k + step % STAGES, (step / STAGES) & 1);
            turn_wait();
            issue_s(step);
            issue_pv(step - 1);
            turn_pass();
            wg_wait<1>();  // S(j)
            wg_pin(s);
            if (signal) {
                mbar_arrive(empty_k + step % STAGES);
                if (step == last) mbar_arrive(empty_q);
            }
            softmax(j, len, alpha, rs);
            wg_wait<0>();  // P(j - 1) V(j - 1)
            wg_pin(o);
            if (signal) mbar_arrive(empty_v + (step - 1) % STAGES);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                l[hh] = l[hh] * alpha[hh] + rs[hh];
#pragma unroll
                for (int i = 0; i < NO / 4; ++i) {
                    o[4 * i + 2 * hh] *= alpha[hh];
                    o[4 * i + 2 * hh + 1] *= alpha[hh];
                }
            }
            pack();
        }
        turn_wait();
        issue_pv(step);
        turn_pass();
        wg_wait<0>();
        wg_pin(o);
        if (signal) mbar_arrive(empty_v + step % STAGES);
        ++step;

        if (it.kind == 1) {  // the block's first tiles: its partial state to CTA c + 1
            float* w = partials + (long long)blockIdx.x * PART * CT + tid;
#pragma unroll
            for (int i = 0; i < NO; ++i) __stcg(w + i * CT, o[i]);
            __stcg(w + NO * CT, m[0]);
            __stcg(w + (NO + 1) * CT, m[1]);
            __stcg(w + (NO + 2) * CT, l[0]);
            __stcg(w + (NO + 3) * CT, l[1]);
            __threadfence();
            consumers_sync();
            if (tid == 0) st_release(flags + blockIdx.x, 1u);
            continue;
        }
        if (it.kind == 2) {  // the block's last tiles: merged with CTA c - 1's partial state of its first ones
            while (ld_acquire(flags + blockIdx.x - 1) == 0) {}
            const float* w = partials + (long long)(blockIdx.x - 1) * PART * CT + tid;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const float pm = __ldcg(w + (NO + hh) * CT), pl = __ldcg(w + (NO + 2 + hh) * CT);
                const float mn = fmaxf(m[hh], pm);
                const float a0 = ex2_ftz((m[hh] - mn) * scale_log2), a1 = ex2_ftz((pm - mn) * scale_log2);
                l[hh] = l[hh] * a0 + pl * a1;
#pragma unroll
                for (int i = 0; i < NO / 4; ++i)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int x = 4 * i + 2 * hh + e;
                        o[x] = o[x] * a0 + __ldcg(w + x * CT) * a1;
                    }
            }
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 1);
            l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 2);
        }
        const int rA = it.b.rb * BM + 64 * wg + 16 * wq + g;  // the thread's two rows: rA and rA + 8
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = rA + 8 * half;
            if (r >= len) continue;
            const float inv = 1.f / l[half];
            elem* dst = out + ((long long)(it.b.s0 + r) * HEADS + it.b.h) * HEAD_DIM + 2 * t;
#pragma unroll
            for (int i = 0; i < NO / 4; ++i)
                *reinterpret_cast<u32*>(dst + 8 * i) = pack_bf16(o[4 * i + 2 * half] * inv, o[4 * i + 2 * half + 1] * inv);
        }
    }
    // the last item merged CTA c - 1's partial: once every consumer thread has seen its flag (and stored its rows),
    // the flag goes back to zero for the next launch
    if (plan.tail) {
        consumers_sync();
        if (tid == 0) flags[blockIdx.x - 1] = 0u;
    }
}
