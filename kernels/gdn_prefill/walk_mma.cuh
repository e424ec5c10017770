// The mma.sync walk of a column slice (Hopper path, gdn_prefill.cu). Included after the including file has
// defined elem, u32, the tile macros (CH, DK, KST, BST, NTHR) and Walk.
#pragma once
#include "mma_tiles.cuh"

// acc[j] (16 rows r0.. x W columns) = X[r0:r0+16, :] S, X raw K or Q rows, S the 16-bit state in smem
// (row stride LD). With TWO, also acc2 = X2[r0:r0+16, :] S (the S fragments are shared).
template <bool TWO, int W, int LD = W + 8>
__device__ __forceinline__ void rows_times_state(const elem* X, const elem* X2, int r0, const elem* Sb,
                                                 float acc[W / 8][4], float acc2[W / 8][4], int lane) {
    constexpr int NJ_ = W / 8, VST_ = LD;
#pragma unroll
    for (int j = 0; j < NJ_; ++j) {
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
        if (TWO) acc2[j][0] = acc2[j][1] = acc2[j][2] = acc2[j][3] = 0.f;
    }
#pragma unroll 1
    for (int kk = 0; kk < DK / 16; ++kk) {
        u32 af[4], af2[4];
        ldsm4(af, a_addr(X, KST, r0, 16 * kk, lane));
        if (TWO) ldsm4(af2, a_addr(X2, KST, r0, 16 * kk, lane));
#pragma unroll
        for (int jp = 0; jp < NJ_ / 2; ++jp) {
            u32 bf[4];
            ldsm4t(bf, bk_addr(Sb, VST_, 16 * kk, 16 * jp, lane));
            mma16816(acc[2 * jp], af, bf[0], bf[1]);
            mma16816(acc[2 * jp + 1], af, bf[2], bf[3]);
            if (TWO) {
                mma16816(acc2[2 * jp], af2, bf[0], bf[1]);
                mma16816(acc2[2 * jp + 1], af2, bf[2], bf[3]);
            }
        }
    }
}

// acc[j] (state rows r0..r0+16 x W columns) += K^T (rows r0.., all CH tokens of the chunk in Kc) times the
// scaled u given as hi + lo 16-bit halves (Uh, Ul: [CH][W], row stride LD).
template <int W, int LD>
__device__ __forceinline__ void state_update_hilo(float acc[W / 8][4], const elem* Kc, const elem* Uh, const elem* Ul,
                                                  int r0, int lane) {
#pragma unroll 1
    for (int kk = 0; kk < CH / 16; ++kk) {
        u32 af[4];
        ldsm4t(af, at_addr(Kc, KST, r0, 16 * kk, lane));
#pragma unroll
        for (int jp = 0; jp < W / 16; ++jp) {
            u32 bh[4], bl[4];
            ldsm4t(bh, bk_addr(Uh, LD, 16 * kk, 16 * jp, lane));
            ldsm4t(bl, bk_addr(Ul, LD, 16 * kk, 16 * jp, lane));
            mma16816(acc[2 * jp], af, bh[0], bh[1]);
            mma16816(acc[2 * jp + 1], af, bh[2], bh[3]);
            mma16816(acc[2 * jp], af, bl[0], bl[1]);
            mma16816(acc[2 * jp + 1], af, bl[2], bl[3]);
        }
    }
}

// rhs = beta (v - e^G rk (K S)) for rows r0..r0+16 as hi (over v in place) + lo (Rs) 16-bit halves;
// W columns, row stride LD.
template <int W, int LD = W + 8>
__device__ __forceinline__ void store_rhs(const float acc[W / 8][4], int r0, elem* Vc, elem* Rs, const float* Gc,
                                          const float* Bt, const float* Rk, int lane) {
    constexpr int NJ_ = W / 8, VST_ = LD;
    const int g = lane >> 2, t = lane & 3;
    const int ra0 = r0 + g, ra1 = ra0 + 8;
    const float f0 = Rk[ra0] * __expf(Gc[ra0]), f1 = Rk[ra1] * __expf(Gc[ra1]);
    const float b0 = Bt[ra0], b1 = Bt[ra1];
#pragma unroll
    for (int j = 0; j < NJ_; ++j) {
        const int cc = 8 * j + 2 * t;
        const float2 x0 = unpack2(*reinterpret_cast<const u32*>(Vc + ra0 * VST_ + cc));
        const float2 x1 = unpack2(*reinterpret_cast<const u32*>(Vc + ra1 * VST_ + cc));
        store_split(Vc + ra0 * VST_ + cc, Rs + ra0 * VST_ + cc,
                    b0 * (x0.x - f0 * acc[j][0]), b0 * (x0.y - f0 * acc[j][1]));
        store_split(Vc + ra1 * VST_ + cc, Rs + ra1 * VST_ + cc,
                    b1 * (x1.x - f1 * acc[j][2]), b1 * (x1.y - f1 * acc[j][3]));
    }
}

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


// The mma.sync walk of a W-column slice (W = 32 or 64: a head's column split when its sequence is too
// short, or its gates too weak, for the sequence split). Warp w holds state rows [16 w, 16 w + 16) x all
// W columns; in phase 2 warps 0-3 form K S (-> rhs) and warps 4-7 Q S (-> o) for 16 rows each.
template <int W>
__device__ __forceinline__ void walk_chunks(unsigned char* smem, const Walk& wk,
                                            const elem* __restrict__ Tg, const elem* __restrict__ Pg,
                                            const float* __restrict__ Fg, const float* __restrict__ h0,
                                            float* __restrict__ ht)
{
    typedef Geo<W> GW;
    constexpr int NJ_ = W / 8, VST_ = GW::VST, NST_ = GW::NST;
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
    auto srow = [&](int) { return 16 * warp + g; };
    auto scol = [&](int jj) { return 8 * jj + 2 * t; };

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
    auto store_state = [&](float* hp) {  // the slice's columns of the state [128][128] fp32 at hp
#pragma unroll
        for (int j = 0; j < NJ_; ++j) {
            *reinterpret_cast<float2*>(hp + v0 + srow(j) * DK + scol(j)) = make_float2(s[j][0], s[j][1]);
            *reinterpret_cast<float2*>(hp + v0 + (srow(j) + 8) * DK + scol(j)) = make_float2(s[j][2], s[j][3]);
        }
    };
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
    float oacc[NJ_][4];

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
        keep_state(wk.keep, c, wk.cbeg, [&](int e) { store_state(wk.hkeep + ((long long)e * Hv + h) * DK * DK); });
        cp_async_wait<NST_ - 2>();
        __syncthreads();
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
        __syncthreads();

        if (warp < 4 || out) {
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
        __syncthreads();

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
        __syncthreads();

        // ---- phase 4: o = rq e^G Q S + P u (warps 4-7); S <- e^{G_end} S + K^T (scaled u) (all warps)
        if (warp >= 4 && out) {
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
                state_update_hilo<W, VST_>(s, Kc, Uh, Ul, 16 * warp, lane);
        }
    }
    cp_async_wait<0>();

    if (wk.write_ht) store_state(ht + ((long long)wk.n * Hv + h) * DK * DK);
}
