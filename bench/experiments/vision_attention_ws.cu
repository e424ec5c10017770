// EXPERIMENT (bench only): the variants measured on the way to kernels/vision/attention.cu, the shipped kernel
// (C 3, BN 128, KS = VS = 2, ORDER 1, PINGPONG 1, POLY 0). One producer warp copies Q, K and V with TMA into
// stages guarded by shared-memory barriers; C consumer warpgroups (64 query rows each) never copy. Switches:
// C consumers, BN keys a tile, KS / VS stages, ORDER (0: S(j + 1) beside tile j's exponentials, then P V(j);
// 1: FlashAttention-3's order), PINGPONG (the consumers take turns issuing products), POLY (every POLY-th
// group of 8 columns takes its exponentials on the FMA pipe). bench/vision_attention_variants.py times them
// against cuDNN and the shipped kernel (kernels/vision/NOTES.md has the table).
//
// Each token of a packed batch attends to every token of its own segment (cu_seqlens: one image, or one
// 2-frame slice of a video) and to no other, no causal mask, softmax scale 1 / sqrt(HEAD_DIM).
//   q, k, v: [N, HEADS, HEAD_DIM] bf16 read through tensor maps (dims HEAD_DIM, HEADS, N; boxes of 64 columns x
//   64 tokens of one head, 128-byte swizzle, zeros past the tensor: the pad of a Q / K row to 80 columns and
//   the rows past token N); cu_seqlens int32 [segments + 1]; out [N, HEADS, HEAD_DIM] contiguous.
// Block: BM = 64 C rows of one (segment, head); warpgroup C is the producer. Per tile of BN keys a consumer
// warpgroup forms S = Q K^T (both in shared memory), the online softmax in the exp2 domain, O += P V with P
// from registers and V read with the transpose bit (one m64nHEAD_DIMk16 per 16 keys).
// Shared memory: Q [QK_CB][BM][64], K [KS][QK_CB][BN][64], V [VS][V_CB][BN][64] (128-byte rows), barriers.
#include "common.cuh"
#include "mma_ptx.cuh"    // smem_u32, pack_bf16
#include "wgmma_ptx.cuh"  // fences, swizzled layout, descriptors, the m64n64 / m64n128 / m64n72 shapes
#include "tma_ptx.cuh"    // TmaDesc, mbarriers, tensor copies

#ifndef HEAD_DIM
#define HEAD_DIM 72
#endif
#ifndef HEADS
#define HEADS 16
#endif
#ifndef C
#define C 2  // consumer warpgroups
#endif
#ifndef BN
#define BN 128
#endif
#ifndef KS
#define KS 2  // K stages
#endif
#ifndef VS
#define VS 2  // V stages
#endif
#ifndef ORDER
#define ORDER 1  // 0: S(j + 1) beside tile j's exponentials, then P V(j); 1: FlashAttention-3's order
#endif
#ifndef POLY
#define POLY 0  // every POLY-th group of 8 key columns takes its exponentials on the FMA pipe (0: none)
#endif
#ifndef PINGPONG
#define PINGPONG 0  // 1: the consumer warpgroups take turns issuing their products (ORDER 1)
#endif

typedef __nv_bfloat16 elem;

#define BM (64 * C)
#define THREADS (128 * (C + 1))
#define NS (BN / 2)                      // S accumulators a thread
#define QK_STEPS ((HEAD_DIM + 15) / 16)  // k-steps of S = Q K^T
#define QK_CB ((2 * QK_STEPS + 7) / 8)   // 64-column blocks of a Q / K tile (the zero pad included)
#define V_CB ((HEAD_DIM / 8 + 7) / 8)    // of a V tile
#define NO (HEAD_DIM / 2)                // output accumulators a thread
#define NEG_INF (-__int_as_float(0x7f800000))
#define Q_ELEMS (QK_CB * BM * 64)
#define K_ELEMS (QK_CB * BN * 64)
#define V_ELEMS (V_CB * BN * 64)
#define REG_PRODUCER 24
#define REG_CONSUMER (C == 2 ? 240 : 160)

static_assert(HEAD_DIM == 64 || HEAD_DIM == 72, "HEAD_DIM must be 64 or 72 (the PV instruction's width)");

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

__device__ __forceinline__ float exp2_(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// 2^x for x <= 0 on the FMA pipe (FlashAttention-4's trick: some of the exponentials off the MUFU, which
// does 16 a clock per SM): x = j + f, j = round(x) by the 1.5 * 2^23 addition, 2^f by a degree-4 Taylor
// polynomial on [-0.5, 0.5] (relative error <= 4.2e-5, under bf16's 2e-3), 2^j added into the exponent.
__device__ __forceinline__ float exp2_poly(float x) {
    x = fmaxf(x, -126.f);
    const float t = x + 12582912.f, jf = t - 12582912.f, f = x - jf;
    float p = fmaf(0.0096181291f, f, 0.0555041087f);
    p = fmaf(p, f, 0.2402265070f);
    p = fmaf(p, f, 0.6931471806f);
    p = fmaf(p, f, 1.f);
    return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}
__device__ __forceinline__ float exp2_sel(float x, bool poly) { return poly ? exp2_poly(x) : exp2_(x); }

// the rows [row, row + rows) of columns [0, 64 QK_CB) (or V_CB) of head h: boxes of 64 tokens
__device__ __forceinline__ void tma_rows(elem* dst, const TmaDesc* map, int cbs, int rows, int h, int row,
                                         unsigned long long* bar) {
    for (int cb = 0; cb < cbs; ++cb)
        for (int rb = 0; rb < rows / 64; ++rb)
            tma_load_3d(dst + cb * rows * 64 + rb * 64 * 64, map, 64 * cb, h, row + 64 * rb, bar);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
vision_attention_ws(const __grid_constant__ TmaDesc q_map, const __grid_constant__ TmaDesc k_map,
                    const __grid_constant__ TmaDesc v_map, const int* __restrict__ cu_seqlens,
                    elem* __restrict__ out, float scale_log2) {
    extern __shared__ unsigned char smem_raw[];
    elem* Qs = reinterpret_cast<elem*>((reinterpret_cast<unsigned long long>(smem_raw) + 1023) & ~1023ull);
    elem* Ks = Qs + Q_ELEMS;
    elem* Vs = Ks + KS * K_ELEMS;
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(Vs + VS * V_ELEMS);
    unsigned long long* full_q = bars;
    unsigned long long* full_k = bars + 1;
    unsigned long long* empty_k = full_k + KS;
    unsigned long long* full_v = empty_k + KS;
    unsigned long long* empty_v = full_v + VS;

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
        for (int i = 0; i < KS; ++i) { mbar_init(full_k + i, 1); mbar_init(empty_k + i, C); }
        for (int i = 0; i < VS; ++i) { mbar_init(full_v + i, 1); mbar_init(empty_v + i, C); }
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == C) {  // the producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(REG_PRODUCER));
        if (warp == 4 * C && lane == 0) {
            mbar_expect_tx(full_q, Q_ELEMS * 2);
            tma_rows(Qs, &q_map, QK_CB, BM, h, s0 + r0, full_q);
            for (int j = 0; j < ntiles; ++j) {
                const int ks = j % KS, vs = j % VS;
                if (j >= KS) mbar_wait(empty_k + ks, (j / KS - 1) & 1);
                mbar_expect_tx(full_k + ks, K_ELEMS * 2);
                tma_rows(Ks + ks * K_ELEMS, &k_map, QK_CB, BN, h, s0 + j * BN, full_k + ks);
                if (j >= VS) mbar_wait(empty_v + vs, (j / VS - 1) & 1);
                mbar_expect_tx(full_v + vs, V_ELEMS * 2);
                tma_rows(Vs + vs * V_ELEMS, &v_map, V_CB, BN, h, s0 + j * BN, full_v + vs);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(REG_CONSUMER));
    const bool signal = (tid & 127) == 0;  // the thread that releases a stage for its warpgroup

    float o[NO];
#pragma unroll
    for (int i = 0; i < NO; ++i) o[i] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};  // running max (unscaled) and sum of the two rows
    const elem* Qw = Qs + 64 * wg * 64;                  // this warpgroup's 64 rows

    auto issue_s = [&](float (&s)[NS], int j) {  // S = Q K^T of tile j, asynchronous until wg_wait
        const elem* ks = Ks + (j % KS) * K_ELEMS;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < QK_STEPS; ++kk) {
            const int cb = kk >> 2, sub = kk & 3;
            s_step(s, wg_desc_kmajor_sw128(Qw + cb * BM * 64) + 2 * sub, wg_desc_kmajor_sw128(ks + cb * BN * 64) + 2 * sub,
                   kk > 0);
        }
        wg_commit();
        wg_pin(s);
    };

#if ORDER == 0
    auto tile = [&](int j, float (&s)[NS], float (&s_next)[NS]) {
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
        for (int hh = 0; hh < 2; ++hh) {
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
        if (j + 1 < ntiles) mbar_wait(full_k + (j + 1) % KS, ((j + 1) / KS) & 1);
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

        mbar_wait(full_v + j % VS, (j / VS) & 1);
        const elem* vs = Vs + (j % VS) * V_ELEMS;
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
        if (signal) {
            if (j + 1 < ntiles) mbar_arrive(empty_k + (j + 1) % KS);
            mbar_arrive(empty_v + j % VS);
        }
    };

    float sa[NS], sb[NS];
    mbar_wait(full_q, 0);
    mbar_wait(full_k, 0);
    issue_s(sa, 0);
    wg_wait<0>();
    wg_pin(sa);
    if (signal) mbar_arrive(empty_k);
    for (int j = 0; j < ntiles; j += 2) {  // two tiles a turn: the S registers trade places
        tile(j, sa, sb);
        if (j + 1 < ntiles) tile(j + 1, sb, sa);
    }
#else
    // FlashAttention-3's order: S(j) and P(j - 1) V(j - 1) issued together, tile j's softmax beside the
    // latter; P(j - 1) packed to bf16 (the register A operand) only once that product has finished.
    float s[NS];
    u32 pk[BN / 4];
    auto softmax = [&](int j, float (&alpha)[2], float (&rs)[2]) {  // s -> exponentials in place
        if (j * BN + BN > len) {
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
        for (int hh = 0; hh < 2; ++hh) {
            mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
            mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
            mc[hh] = mx[hh] * scale_log2;
            alpha[hh] = exp2_(m[hh] * scale_log2 - mc[hh]);
            m[hh] = mx[hh];
            rs[hh] = 0.f;
        }
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
            const bool poly = POLY > 0 && i % (POLY > 0 ? POLY : 1) == (POLY > 0 ? POLY : 1) - 1;
            s[4 * i + 0] = exp2_sel(fmaf(s[4 * i + 0], scale_log2, -mc[0]), poly);
            s[4 * i + 1] = exp2_sel(fmaf(s[4 * i + 1], scale_log2, -mc[0]), poly);
            s[4 * i + 2] = exp2_sel(fmaf(s[4 * i + 2], scale_log2, -mc[1]), poly);
            s[4 * i + 3] = exp2_sel(fmaf(s[4 * i + 3], scale_log2, -mc[1]), poly);
            rs[0] += s[4 * i + 0] + s[4 * i + 1];
            rs[1] += s[4 * i + 2] + s[4 * i + 3];
        }
    };
    auto pack = [&]() {
#pragma unroll
        for (int i = 0; i < BN / 4; ++i) pk[i] = pack_bf16(s[2 * i], s[2 * i + 1]);
    };
    auto issue_pv = [&](int j) {
        mbar_wait(full_v + j % VS, (j / VS) & 1);
        const elem* vs = Vs + (j % VS) * V_ELEMS;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const u32 a[4] = {pk[4 * kk], pk[4 * kk + 1], pk[4 * kk + 2], pk[4 * kk + 3]};
            pv_step(o, a, wg_desc_sw128_mn(vs + kk * 16 * 64, BN * 64 * 2));
        }
        wg_commit();
    };
    // ping-pong: a warpgroup issues its products only in its turn (named barrier 1 + wg), then hands the
    // turn on, so that one warpgroup's exponentials run while the next one's products do
    auto turn_wait = [&]() {
#if PINGPONG
        asm volatile("bar.sync %0, %1;\n" :: "r"(1 + wg), "n"(256) : "memory");
#endif
    };
    auto turn_pass = [&]() {
#if PINGPONG
        asm volatile("bar.arrive %0, %1;\n" :: "r"(1 + (wg + 1) % C), "n"(256) : "memory");
#endif
    };
#if PINGPONG
    if (wg == C - 1) asm volatile("bar.arrive %0, %1;\n" :: "r"(1), "n"(256) : "memory");
#endif
    float alpha[2], rs[2];
    mbar_wait(full_q, 0);
    mbar_wait(full_k, 0);
    turn_wait();
    issue_s(s, 0);
    turn_pass();
    wg_wait<0>();
    wg_pin(s);
    if (signal) mbar_arrive(empty_k);
    softmax(0, alpha, rs);
    l[0] = rs[0];
    l[1] = rs[1];
    pack();
    for (int j = 1; j < ntiles; ++j) {
        mbar_wait(full_k + j % KS, (j / KS) & 1);
        turn_wait();
        issue_s(s, j);
        issue_pv(j - 1);
        turn_pass();
        wg_wait<1>();  // S(j)
        wg_pin(s);
        if (signal) mbar_arrive(empty_k + j % KS);
        softmax(j, alpha, rs);
        wg_wait<0>();  // P(j - 1) V(j - 1)
        wg_pin(o);
        if (signal) mbar_arrive(empty_v + (j - 1) % VS);
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
#endif

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
