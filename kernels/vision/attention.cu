// The vision tower's attention on Hopper (sm_90a: warpgroup mma, TMA): each token of a packed batch attends
// to every token of its own segment (cu_seqlens: one image, or one 2-frame slice of a video) and to no
// other, no causal mask, softmax scale 1 / sqrt(HEAD_DIM). Head dims 64 and 72 (every Qwen3.5 tower) without
// padding a head to 128 columns, as cuDNN does for 72.
//   q, k, v: [N, HEADS, HEAD_DIM] bf16, read through tensor maps (dims HEAD_DIM, HEADS, N; boxes of 64 columns
//   x 64 tokens of one head, 128-byte swizzle, zeros outside the tensor: they pad a Q / K row to 80 columns,
//   a V row to 128, and fill the rows past token N); cu_seqlens int32 [segments + 1];
//   out [N, HEADS, HEAD_DIM] contiguous.
// Grid: (row blocks of the longest segment, segments x HEADS). A block: BM = 192 rows (tokens) of one
// (segment, head), three consumer warpgroups of 64 rows and one producer warpgroup, one thread of which
// copies Q once and each 128-key tile of K and V (two stages each) with TMA; full barriers count the bytes
// in, empty barriers one arrival per consumer warpgroup when its products have read a stage.
// A consumer warpgroup per tile j (FlashAttention-3's order): issue S(j) = Q K(j)^T (both operands in shared
// memory, five k-steps: the head padded to 80 by the map's zeros) and O += P(j - 1) V(j - 1) (P from
// registers, V read with the transpose bit: one m64nHEAD_DIMk16 per 16 keys, spanning V's two 64-column
// blocks through the descriptor's leading offset); wait for S(j) only, then tile j's online softmax (exp2
// domain, the scale folded into one fma) runs while the tensor cores finish P(j - 1) V(j - 1); then O is
// rescaled and P(j) packed to bf16. The warpgroups take turns issuing their products (named barriers
// 1 .. 3, each handing the turn to the next), so one warpgroup's exponentials run while another's products
// do. Rows past the segment are computed on the next segment's tokens (or zeros) and never stored; keys
// past it get -inf before the softmax, so their V rows (finite, or zeros) weigh nothing.
// Shared memory: Q [QK_CB][BM][64], K [2][QK_CB][BN][64], V [2][V_CB][BN][64] (128-byte rows, 1024-byte
// aligned), the barriers: 181,320 bytes at head dim 72, 91,208 at 64 (launch.py: attention_smem).
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

__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// rows [row, row + rows) of head h, columns [0, 64 cbs): one box per 64 columns x 64 rows
__device__ __forceinline__ void tma_rows(elem* dst, const TmaDesc* map, int cbs, int rows, int h, int row,
                                         unsigned long long* bar) {
    for (int cb = 0; cb < cbs; ++cb)
        for (int rb = 0; rb < rows / 64; ++rb)
            tma_load_3d(dst + cb * rows * 64 + rb * 64 * 64, map, 64 * cb, h, row + 64 * rb, bar);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
vision_attention(const __grid_constant__ TmaDesc q_map, const __grid_constant__ TmaDesc k_map,
                 const __grid_constant__ TmaDesc v_map, const int* __restrict__ cu_seqlens,
                 elem* __restrict__ out, float scale_log2) {
    extern __shared__ unsigned char smem_raw[];
    elem* Qs = reinterpret_cast<elem*>((reinterpret_cast<unsigned long long>(smem_raw) + 1023) & ~1023ull);
    elem* Ks = Qs + Q_ELEMS;
    elem* Vs = Ks + STAGES * K_ELEMS;
    unsigned long long* full_q = reinterpret_cast<unsigned long long*>(Vs + STAGES * V_ELEMS);
    unsigned long long* full_k = full_q + 1;
    unsigned long long* empty_k = full_k + STAGES;
    unsigned long long* full_v = empty_k + STAGES;
    unsigned long long* empty_v = full_v + STAGES;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wq = warp & 3;
    const int g = lane >> 2, t = lane & 3;
    const int seg = blockIdx.y / HEADS, h = blockIdx.y % HEADS;
    const int s0 = cu_seqlens[seg], len = cu_seqlens[seg + 1] - s0;
    const int r0 = blockIdx.x * BM;
    if (r0 >= len) return;
    // the tile count through a shuffle: ptxas serializes wgmma around branches it cannot prove warp-uniform
    const int ntiles = __shfl_sync(0xffffffffu, (len + BN - 1) / BN, 0);

    if (tid == 0) {
        mbar_init(full_q, 1);
        for (int i = 0; i < STAGES; ++i) {
            mbar_init(full_k + i, 1);
            mbar_init(empty_k + i, CONSUMERS);
            mbar_init(full_v + i, 1);
            mbar_init(empty_v + i, CONSUMERS);
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == CONSUMERS) {  // the producer: 24 registers a thread, the rest to the consumers
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (warp == 4 * CONSUMERS && lane == 0) {
            mbar_expect_tx(full_q, Q_ELEMS * 2);
            tma_rows(Qs, &q_map, QK_CB, BM, h, s0 + r0, full_q);
            for (int j = 0; j < ntiles; ++j) {
                const int st = j % STAGES, reuse = j / STAGES - 1;  // the stage's earlier tile's release
                if (reuse >= 0) mbar_wait(empty_k + st, reuse & 1);
                mbar_expect_tx(full_k + st, K_ELEMS * 2);
                tma_rows(Ks + st * K_ELEMS, &k_map, QK_CB, BN, h, s0 + j * BN, full_k + st);
                if (reuse >= 0) mbar_wait(empty_v + st, reuse & 1);
                mbar_expect_tx(full_v + st, V_ELEMS * 2);
                tma_rows(Vs + st * V_ELEMS, &v_map, V_CB, BN, h, s0 + j * BN, full_v + st);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 160;\n");
    const bool signal = (tid & 127) == 0;  // the thread that releases a stage for its warpgroup

    float o[NO], s[NS];
    u32 pk[BN / 4];  // P of the previous tile, bf16 pairs (the m16n8k16 A fragments of its 16-key steps)
#pragma unroll
    for (int i = 0; i < NO; ++i) o[i] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2];  // running max (unscaled) and sum of the thread's two rows
    const elem* Qw = Qs + 64 * wg * 64;     // this warpgroup's 64 rows

    auto issue_s = [&](int j) {
        const elem* ks = Ks + (j % STAGES) * K_ELEMS;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < QK_STEPS; ++kk) {
            const int cb = kk >> 2, sub = kk & 3;  // column block, 16-column step inside it (32 bytes)
            s_step(s, wg_desc_kmajor_sw128(Qw + cb * BM * 64) + 2 * sub, wg_desc_kmajor_sw128(ks + cb * BN * 64) + 2 * sub,
                   kk > 0);
        }
        wg_commit();
    };
    auto issue_pv = [&](int j) {
        mbar_wait(full_v + j % STAGES, (j / STAGES) & 1);
        const elem* vs = Vs + (j % STAGES) * V_ELEMS;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const u32 a[4] = {pk[4 * kk], pk[4 * kk + 1], pk[4 * kk + 2], pk[4 * kk + 3]};
            pv_step(o, a, wg_desc_sw128_mn(vs + kk * 16 * 64, BN * 64 * 2));
        }
        wg_commit();
    };
    // s -> exponentials in place (against the new running max); alpha rescales what came before
    auto softmax = [&](int j, float (&alpha)[2], float (&rs)[2]) {
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
            alpha[hh] = exp2_approx(m[hh] * scale_log2 - mc[hh]);  // 0 on the first tile (m = -inf)
            m[hh] = mx[hh];
            rs[hh] = 0.f;
        }
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
            s[4 * i + 0] = exp2_approx(fmaf(s[4 * i + 0], scale_log2, -mc[0]));
            s[4 * i + 1] = exp2_approx(fmaf(s[4 * i + 1], scale_log2, -mc[0]));
            s[4 * i + 2] = exp2_approx(fmaf(s[4 * i + 2], scale_log2, -mc[1]));
            s[4 * i + 3] = exp2_approx(fmaf(s[4 * i + 3], scale_log2, -mc[1]));
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

    if (wg == CONSUMERS - 1) asm volatile("bar.arrive 1, 256;\n" ::: "memory");  // the first turn: warpgroup 0's
    float alpha[2], rs[2];
    mbar_wait(full_q, 0);
    mbar_wait(full_k, 0);
    turn_wait();
    issue_s(0);
    turn_pass();
    wg_wait<0>();
    wg_pin(s);
    if (signal) mbar_arrive(empty_k);
    softmax(0, alpha, rs);
    l[0] = rs[0];
    l[1] = rs[1];
    pack();
    for (int j = 1; j < ntiles; ++j) {
        mbar_wait(full_k + j % STAGES, (j / STAGES) & 1);
        turn_wait();
        issue_s(j);
        issue_pv(j - 1);
        turn_pass();
        wg_wait<1>();  // S(j)
        wg_pin(s);
        if (signal) mbar_arrive(empty_k + j % STAGES);
        softmax(j, alpha, rs);
        wg_wait<0>();  // P(j - 1) V(j - 1)
        wg_pin(o);
        if (signal) mbar_arrive(empty_v + (j - 1) % STAGES);
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
    issue_pv(ntiles - 1);
    turn_pass();
    wg_wait<0>();
    wg_pin(o);

#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 1);
        l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 2);
    }
    const int rA = r0 + 64 * wg + 16 * wq + g;  // the thread's two rows: rA and rA + 8
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = rA + 8 * half;
        if (r >= len) continue;
        const float inv = 1.f / l[half];
        elem* dst = out + ((long long)(s0 + r) * HEADS + h) * HEAD_DIM + 2 * t;
#pragma unroll
        for (int i = 0; i < NO / 4; ++i)
            *reinterpret_cast<u32*>(dst + 8 * i) = pack_bf16(o[4 * i + 2 * half] * inv, o[4 * i + 2 * half + 1] * inv);
    }
}
