// EXPERIMENT (bench only; not used by the runtime): the vision tower's attention on warpgroup mma, head dims
// 64 / 72 without padding to 128. Correct (the GPU tests of its first version passed: 211 cases against the fp32
// reference, NaN past the segments never read), but slower than cuDNN's padded kernel on the H200: one image
// (4,096 tokens, 16 heads of 72) 0.286 ms (WGS 2, BN 128) against 0.205 ms; bench/vision_attention_variants.py
// times the variants (kernels/vision/NOTES.md). What it lacks is FlashAttention-3's scheduling: the block
// barrier per tile keeps the warpgroups in step, so their exponentials never overlap the other's matrix work.
// Variants: WGS warpgroups a block (64 rows each), BN keys a tile (64 or 128), EXP_FAST (ex2.approx.ftz).
//
// The vision tower's attention on Hopper (sm_90a, warpgroup mma): each token of a packed batch attends to
// every token of its own segment (one image, or one 2-frame slice of a video; cu_seqlens) and to no other,
// without a causal mask, softmax scale 1 / sqrt(HEAD_DIM). For the head dims of the Qwen3.5 towers (64, 72)
// without padding a head to 128 columns, as cuDNN's kernels do for 72.
//   q, k, v: [N, HEADS, HEAD_DIM] bf16 with token strides q_st, k_st, v_st (v read in place from the qkv
//   projection's output); cu_seqlens: int32 [segments + 1]; out: [N, HEADS, HEAD_DIM] contiguous.
// A block of WGS warpgroups takes BM = 64 WGS rows (tokens) of one (segment, head); warpgroup w owns 64 of them
// and keeps their output (64 x HEAD_DIM, fp32: HEAD_DIM / 2 registers a thread) in its accumulators. Per tile
// of BN keys: S = Q K^T (both operands in shared memory, QK_STEPS m64nBNk16 instructions: the head
// padded with zero columns to a multiple of 16), the online softmax on S's accumulators in the exp2 domain
// (scale folded into one fma per element), then O += P V with the probabilities as the register A operand
// and V read with the transpose bit: one m64nHEAD_DIMk16 instruction per 16 keys, spanning V's 64-column
// blocks through the descriptor's leading offset. Q, K and V sit in the 128-byte swizzled layout as
// [column block][rows][64]; only the columns the instructions read are copied. S(j + 1) runs on the tensor
// cores while tile j's exponentials run; K in three stages, V in two, copied with cp.async a tile ahead; one
// block barrier per tile (the pipeline of paged_attention/paged_attention_wg.cu).
// Shared memory: (QK_CB * (BM + 3 BN) + 2 V_CB BN) * 128 bytes + 1 KB of alignment (113 KB at head dim 72 with
// WGS 2, BN 64).
#include "common.cuh"
#include "mma_ptx.cuh"    // smem_u32, pack_bf16, cp_async*
#include "wgmma_ptx.cuh"  // fences, swizzled layout, descriptors, the m64n64 / m64n128 / m64n72 shapes

#ifndef HEAD_DIM
#define HEAD_DIM 72
#endif
#ifndef HEADS
#define HEADS 16
#endif

typedef __nv_bfloat16 elem;

#ifndef WGS
#define WGS 2
#endif
#ifndef BN
#define BN 64
#endif
#ifndef EXP_FAST
#define EXP_FAST 1
#endif
#define BM (64 * WGS)
#define THREADS (128 * WGS)
#define NS (BN / 2)
#define QK_STEPS ((HEAD_DIM + 15) / 16)  // k-steps of S = Q K^T
#define QK_PIECES (2 * QK_STEPS)         // 16-byte pieces of a Q / K row in shared memory, zero pad included
#define PIECES (HEAD_DIM / 8)            // 16-byte pieces of a row in memory
#define QK_CB ((QK_PIECES + 7) / 8)      // 64-column blocks of a Q / K tile
#define V_CB ((PIECES + 7) / 8)          // of a V tile
#define NO (HEAD_DIM / 2)                // output accumulators a thread
#define NEG_INF (-__int_as_float(0x7f800000))

static_assert(HEAD_DIM == 64 || HEAD_DIM == 72, "HEAD_DIM must be 64 or 72 (the PV instruction's width)");

// Offset (elements) of 16-byte piece pc of row r in a [rows][..] tile stored as 64-column blocks.
__device__ __forceinline__ int tile_off(int rows, int r, int pc) { return (pc >> 3) * rows * 64 + sw64(r, (pc & 7) * 8); }

__device__ __forceinline__ float exp2_(float x) {
#if EXP_FAST
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return exp2f(x);
#endif
}

#if BN == 128
__device__ __forceinline__ void s_step(float (&d)[NS], unsigned long long da, unsigned long long db, int acc) {
    wg_ss_m64n128_bf16(d, da, db, acc);
}
#else
__device__ __forceinline__ void s_step(float (&d)[NS], unsigned long long da, unsigned long long db, int acc) {
    wg_ss_m64n64_bf16(d, da, db, acc);
}
#endif

__device__ __forceinline__ void pv_step(float (&o)[NO], const u32 (&a)[4], unsigned long long desc) {
#if HEAD_DIM == 72
    wg_rs_m64n72_bf16(o, a, desc, 1);
#else
    wg_rs_m64n64_bf16(o, a, desc, 1);
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS, WGS == 1 ? 2 : 1)
vision_attention(const elem* __restrict__ q, long long q_st, const elem* __restrict__ k, long long k_st,
                 const elem* __restrict__ v, long long v_st, const int* __restrict__ cu_seqlens,
                 elem* __restrict__ out, float scale_log2) {
    extern __shared__ unsigned char smem_raw[];
    elem* Qs = reinterpret_cast<elem*>((reinterpret_cast<unsigned long long>(smem_raw) + 1023) & ~1023ull);
    elem* Ks = Qs + QK_CB * BM * 64;      // [3][QK_CB][BN][64]
    elem* Vs = Ks + 3 * QK_CB * BN * 64;  // [2][V_CB][BN][64]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wq = warp & 3;  // warpgroup, warp within it
    const int g = lane >> 2, t = lane & 3;
    const int seg = blockIdx.y / HEADS, h = blockIdx.y % HEADS;
    const int s0 = cu_seqlens[seg], len = cu_seqlens[seg + 1] - s0;
    const int r0 = blockIdx.x * BM;
    if (r0 >= len) return;
    const elem* qh = q + (long long)s0 * q_st + h * HEAD_DIM;
    const elem* kh = k + (long long)s0 * k_st + h * HEAD_DIM;
    const elem* vh = v + (long long)s0 * v_st + h * HEAD_DIM;

    // Q, K, V tiles: 16-byte pieces spread over the threads (rows past the segment, the pad: zeros)
    auto load_rows = [&](elem* d, int rows, const elem* base, long long st, int row0, int npieces, int real) {
        for (int c = tid; c < rows * npieces; c += THREADS) {
            const int r = c / npieces, pc = c - r * npieces;
            const bool ok = row0 + r < len && pc < real;
            cp_async16(d + tile_off(rows, r, pc), ok ? base + (long long)(row0 + r) * st + pc * 8 : base, ok);
        }
    };
    load_rows(Qs, BM, qh, q_st, r0, QK_PIECES, PIECES);
    auto load_k = [&](int j) { load_rows(Ks + (j % 3) * QK_CB * BN * 64, BN, kh, k_st, j * BN, QK_PIECES, PIECES); };
    auto load_v = [&](int j) { load_rows(Vs + (j & 1) * V_CB * BN * 64, BN, vh, v_st, j * BN, PIECES, PIECES); };

    float o[NO];
#pragma unroll
    for (int i = 0; i < NO; ++i) o[i] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};  // running max (unscaled) and sum of the two rows
    const elem* Qw = Qs + 64 * wg * 64;  // this warpgroup's 64 rows (8 KB into each column block)

    auto issue_s = [&](float (&s)[NS], int j) {  // S = Q K^T of tile j, asynchronous until wg_wait
        const elem* ks = Ks + (j % 3) * QK_CB * BN * 64;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < QK_STEPS; ++kk) {
            const int cb = kk >> 2, sub = kk & 3;  // column block, 16-column step inside it (32 bytes)
            s_step(s, wg_desc_kmajor_sw128(Qw + cb * BM * 64) + 2 * sub, wg_desc_kmajor_sw128(ks + cb * BN * 64) + 2 * sub,
                   kk > 0);
        }
        wg_commit();
        wg_pin(s);
    };

    // One tile: S(j) is in s (complete). The row maxima and O's rescale first (no accumulator a running
    // wgmma may write is touched by other instructions), then S(j + 1) is issued and runs beside the
    // exponentials of tile j; then O += P V(j).
    auto tile = [&](int j, float (&s)[NS], float (&s_next)[NS], int ntiles) {
        cp_async_wait<0>();   // K(j + 1), V(j): issued at the start of tile j - 1 (or before the loop)
        fence_proxy_async();  // the copies, seen by the tensor cores' operand reads
        __syncthreads();
        if (j + 2 < ntiles) load_k(j + 2);
        if (j + 1 < ntiles) load_v(j + 1);
        cp_async_commit();
        if (j * BN + BN > len) {  // the segment's last, partial tile: keys past its end weigh nothing
#pragma unroll
            for (int i = 0; i < BN / 8; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (j * BN + 8 * i + 2 * t + e >= len) s[4 * i + e] = s[4 * i + 2 + e] = NEG_INF;
        }
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
            mx[0] = fmaxf(mx[0], fmaxf(s[4 * i], s[4 * i + 1]));
            mx[1] = fmaxf(mx[1], fmaxf(s[4 * i + 2], s[4 * i + 3]));
        }
        float mc[2], rs[2] = {0.f, 0.f};
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {  // every tile holds a key of the segment: mx is finite
            mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
            mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
            mc[hh] = mx[hh] * scale_log2;
            const float alpha = exp2_(m[hh] * scale_log2 - mc[hh]);  // 0 on the first tile (m = -inf)
            l[hh] *= alpha;
#pragma unroll
            for (int i = 0; i < NO / 4; ++i) {
                o[4 * i + 2 * hh] *= alpha;
                o[4 * i + 2 * hh + 1] *= alpha;
            }
            m[hh] = mx[hh];
        }
        issue_s(s_next, j + 1);  // past the last tile: a stale stage, never read (branch-free wgmma)
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
            s[4 * i + 0] = exp2_(fmaf(s[4 * i + 0], scale_log2, -mc[0]));
            s[4 * i + 1] = exp2_(fmaf(s[4 * i + 1], scale_log2, -mc[0]));
            s[4 * i + 2] = exp2_(fmaf(s[4 * i + 2], scale_log2, -mc[1]));
            s[4 * i + 3] = exp2_(fmaf(s[4 * i + 3], scale_log2, -mc[1]));
            rs[0] += s[4 * i + 0] + s[4 * i + 1];
            rs[1] += s[4 * i + 2] + s[4 * i + 3];
        }
        l[0] += rs[0];
        l[1] += rs[1];

        // O += P V: keys 16 kk .. 16 kk + 15 of P are accumulators 8 kk .. 8 kk + 7 (the m16n8k16 A fragment)
        const elem* vs = Vs + (j & 1) * V_CB * BN * 64;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const u32 a[4] = {pack_bf16(s[8 * kk + 0], s[8 * kk + 1]), pack_bf16(s[8 * kk + 2], s[8 * kk + 3]),
                              pack_bf16(s[8 * kk + 4], s[8 * kk + 5]), pack_bf16(s[8 * kk + 6], s[8 * kk + 7])};
            pv_step(o, a, wg_desc_sw128_mn(vs + kk * 16 * 64, BN * 64 * 2));
        }
        wg_commit();
        wg_wait<0>();  // S(j + 1) and O
        wg_pin(o);
        wg_pin(s_next);
    };

    // the tile count through a shuffle: ptxas serializes wgmma around branches it cannot prove warp-uniform
    const int ntiles = __shfl_sync(0xffffffffu, (len + BN - 1) / BN, 0);
    float sa[NS], sb[NS];
    // before the loop: Q and K(0) (one group), then K(1) and V(0); S(0)
    load_k(0);
    cp_async_commit();
    if (1 < ntiles) load_k(1);
    load_v(0);
    cp_async_commit();
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
    issue_s(sa, 0);
    wg_wait<0>();
    wg_pin(sa);
    for (int j = 0; j < ntiles; j += 2) {  // two tiles a turn: the S registers trade places
        tile(j, sa, sb, ntiles);
        if (j + 1 < ntiles) tile(j + 1, sb, sa, ntiles);
    }

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
