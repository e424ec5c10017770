// The 128-column walk on warpgroup mma and TMA copies (Hopper path, gdn_prefill.cu, sm_90a only).
#pragma once
#include "wgmma.cuh"

// The mma.sync walk's arithmetic (walk_mma.cuh) over all 128 columns; the products run as warpgroup mma with B from shared memory. One
// rounding differs: the state update takes the scaled u as one fp16 value (11 bits) against K^T converted to
// fp16 in registers, where the mma.sync walk adds a hi and a lo bf16 half (16 bits): half the update's
// tensor work for a final-state error still ~10x below fla's and FlashQLA's (NOTES.md).
// Warpgroup wg (warps 4 wg .. 4 wg + 3) holds state rows [64 wg, +64) x 128 columns.
// Per chunk: S -> 16-bit (canonical layout); then group wg takes the column half [64 wg, +64) of K S,
// Q S, the rhs, u = T rhs and o += P u, and adds K^T (scaled u) to its own state rows.
// K, Q, V, T, P arrive by TMA (tma_ptx.cuh: one thread issues 8 tile copies per chunk, counted on an mbarrier)
// in the 128-byte swizzled layout; K, Q, T, P reach the tensor cores through ldmatrix as A fragments, rhs
// (hi, over v) as a swizzled B operand (T's and P's upper blocks, never written, are zeroed in the
// fragments). The 16-bit state, rhs (lo), u and the scaled u sit in the canonical no-swizzle layout
// (wgmma.cuh). o of a full chunk leaves by TMA store too (one per group, staged where rhs was): 4-byte
// stores from registers held up the next chunk's copies (1.5k of 7.4k cycles per chunk).
// kernels/gdn_prefill/NOTES.md has the cycle counts and the variants that were measured and dropped.

struct GeoWG {  // K, Q, V as two 128-byte-swizzled [64][64] halves each, T, P swizzled [64][64] (TMA boxes)
    static constexpr int NST = 2;
    static constexpr int SO_Q = CH * DK * 2, SO_V = 2 * CH * DK * 2;
    static constexpr int SO_T = SO_V + CH * DK * 2, SO_P = SO_T + CH * CH * 2, SO_F = SO_P + CH * CH * 2;
    static constexpr int STAGE = SO_F + 4 * CH * 4;
    static constexpr int BYTES = STAGE;  // what the copies of one chunk deliver
    static constexpr int S = NST * STAGE, RHS = S + DK * DK * 2, UH = RHS + CH * DK * 2;
    static constexpr int TOTAL = UH + CH * DK * 2 + 1024;  // + the alignment of the base to 1 KB
};
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
        mbar_expect_tx(bar, GW::BYTES);
        const int tok = wk.bos + c * CH;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            tma_load_4d(st + half * CH * 64 * 2, tmk, 64 * half, wk.hk, tok, wk.batch, bar);
            tma_load_4d(st + GW::SO_Q + half * CH * 64 * 2, tmq, 64 * half, wk.hk, tok, wk.batch, bar);
            tma_load_4d(st + GW::SO_V + half * CH * 64 * 2, tmv, 64 * half, h, tok, wk.batch, bar);
        }
        const long long sl = (long long)(wk.slot0 + c) * Hv + h;
        tma_load_2d(st + GW::SO_T, tmt, 0, (int)(sl * CH), bar);
        tma_load_2d(st + GW::SO_P, tmp, 0, (int)(sl * CH), bar);
        bulk_load(st + GW::SO_F, Fg + sl * 4 * CH, 4 * CH * 4, bar);
    };

    float s[64];  // this thread's state entries (accumulator layout of wgmma.cuh)
    auto store_state = [&](float* hp) {  // the state [128][128] fp32 at hp
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            *reinterpret_cast<float2*>(hp + srow * DK + 8 * j + 2 * t) = make_float2(s[4 * j], s[4 * j + 1]);
            *reinterpret_cast<float2*>(hp + (srow + 8) * DK + 8 * j + 2 * t) = make_float2(s[4 * j + 2], s[4 * j + 3]);
        }
    };
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
        keep_state(wk.keep, c, cbeg, [&](int e) { store_state(wk.hkeep + ((long long)e * Hv + h) * DK * DK); });
        mbar_wait(bars + buf, (i >> 1) & 1);
        __syncthreads();
        if (tid == 0 && c + 1 < cend) issue_chunk(c + 1, buf ^ 1);  // its stage was last read in chunk c - 1

        // ---- phase 1: state -> 16-bit smem (rows srow, srow + 8 of 16 tiles: 8 stmatrix.x4)
#pragma unroll
        for (int j = 0; j < 16; j += 2)
            stsm4(const_cast<elem*>(cb_mat(Sb, 64 * wg + 16 * wq, 8 * j, lane)),
                  pack2(s[4 * j], s[4 * j + 1]), pack2(s[4 * j + 2], s[4 * j + 3]),
                  pack2(s[4 * j + 4], s[4 * j + 5]), pack2(s[4 * j + 6], s[4 * j + 7]));
        fence_proxy_async();
        if ((tid & 127) == 0) bulk_wait_read();  // last chunk's o store has read the rhs space phase 2 rewrites
        __syncthreads();

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
        group_sync(1 + wg);  // phase 3 reads only this group's columns of rhs

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
        __syncthreads();

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
            if (out) {
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
    }

    if ((tid & 127) == 0) bulk_wait();  // the o stores this thread issued

    if (wk.write_ht) store_state(ht + ((long long)wk.n * Hv + h) * DK * DK);
}