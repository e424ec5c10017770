// Gated DeltaNet chunked prefill, the portable path (NVRTC, sm_80 and later: every block fits the
// 99 KB of shared memory the RTX 30/40/50 cards give one block). Two or three launches:
//   1. gdn_chunk_prep (prep.cu): per (chunk, head) T = (I+L)^-1, P, G, beta, rk, rq.
//   2. gdn_chunk_state (here): one 256-thread block per (DVS state columns, segment, value head, sequence)
//      walks its chunks with the fp32 state in registers:
//        rhs = beta (v - e^G rk (K S));  u = T rhs;  S <- e^{G_end} S + K^T (rk e^{G_end - G} u)
//      Column slices are an exact split; a long sequence is also cut into segments that start a few chunks
//      early from a zero state where the gates have decayed the earlier state away (segments.cuh).
//      Built with OUT_IN_WALK (the plan's choice) it also forms o = rq e^G (Q S) + P u of its columns: Q S
//      beside K S on the same B fragments of the 16-bit state, P u (P's A fragments loaded to registers
//      during the state update) at the next step's start, where u is in shared memory for every warp.
//      Otherwise it writes the 16-bit state entering each chunk (Hs) and u (Ug) to device memory, and
//   3. gdn_chunk_out (here): all (chunk, head) at once: o = rq e^G (Q Hs) + P Ug.
// The state block holds two stages of K and the vectors, one of v (then rhs hi) and T (each reloaded once
// the step's T rhs has read it), Q (OUT_IN_WALK: reloaded once K S / Q S have read it), the 16-bit state
// (then the scaled u) and rhs lo: 74 / 82 / 98 KB at 16 / 32 / 64 columns with Q, 57 / 65 / 81 KB without.
// The roundings are those of the Hopper path's wgmma walk: Q S with the 16-bit state, P u with 16-bit u,
// rhs as a hi + lo 16-bit pair, the state update on fp16 (scaled u and K^T); o is bit for bit the same
// either way (the same products in the same order).
#include "layout.cuh"  // elem (IN_T), u32, CH, DK, KST, BST

#ifndef DVS
#define DVS 32  // state columns per block of gdn_chunk_state: 16, 32 or 64
#endif
#ifndef OUT_IN_WALK
#define OUT_IN_WALK 0  // 1: gdn_chunk_state forms o itself (no Hs / Ug, no gdn_chunk_out)
#endif

#define NTHR 256    // state kernel: 8 warps
#define OTHR 256    // output kernel: 8 warps
#define VST (DVS + 8)   // smem row stride of the DVS-wide tiles
#define NJ (DVS / 8)    // n-tiles of 8 columns per state slice
#define NH (NJ / 2)     // n-tiles per warp in the K S and T rhs phases (column halves)
#define OST (DK + 8)    // output kernel: row stride of the state and u tiles

static_assert(DVS == 16 || DVS == 32 || DVS == 64, "DVS must be 16, 32 or 64");

// ---------------------------------------------------------------- shared memory layouts (bytes)
// state kernel: 2 stages of K and the vectors; v (then rhs hi); T; Q (OUT_IN_WALK); the 16-bit state, whose
// space holds the scaled u (fp16) once K S has read it; rhs lo (then u)
#define SO_F (CH * KST * 2)
#define STAGE_BYTES (SO_F + 4 * CH * 4)
#define SM_V (2 * STAGE_BYTES)
#define SM_T (SM_V + CH * VST * 2)
#define SM_Q (SM_T + CH * BST * 2)
#define SM_S (SM_Q + (OUT_IN_WALK ? CH * KST * 2 : 0))
#define SM_UH SM_S
#define SM_RHS (SM_S + DK * VST * 2)
#define SM_TOTAL (SM_RHS + CH * VST * 2)
// output kernel: Q, P and the vectors for the whole block; the B operands (the 16-bit state's rows, then u's
// rows) stream through a ring of two 32-row slices
#define OSL 32      // rows per slice
#define ONS 6       // slices: state rows 0-127 (Q S), then u rows 0-63 (P u)
#define OSM_Q 0
#define OSM_P (OSM_Q + CH * KST * 2)
#define OSM_F (OSM_P + CH * BST * 2)
#define OSM_R (OSM_F + 4 * CH * 4)
#define OSLICE (OSL * OST * 2)
#define OSM_TOTAL (OSM_R + 2 * OSLICE)  // 44 KB: two blocks per SM on the RTX cards, four on an H200
#ifdef STATE_SMEM  // the launcher's sizes (plan.py), checked against the layouts here
static_assert(STATE_SMEM == SM_TOTAL, "plan.py's portable_state_smem() disagrees with SM_TOTAL in portable.cu");
static_assert(OUT_SMEM == OSM_TOTAL, "plan.py's PORTABLE_OUT_SMEM disagrees with OSM_TOTAL in portable.cu");
#endif
static_assert(SM_TOTAL <= 101376 && OSM_TOTAL <= 101376, "a block must fit the 99 KB of the RTX cards");

#include "seq.cuh"
#include "segments.cuh"
#include "mma_tiles.cuh"

static_assert(SEG_MAX * 4 <= CH * VST * 2, "the segment plan's scratch sits in the rhs space");

__device__ __forceinline__ void ldsm2t(u32 r[2], const void* p) {  // lanes 0-15 give the addresses
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(p)) : "memory");
}

// acc[j] += A (fragment af) * B[k0:k0+16, n0 + 8j : n0 + 8j + 8] for j < NT, B a row-major [k][n] tile; with
// TWO, acc2[j] += A2 (fragment af2) * B as well, on the same B fragments (loaded once).
template <int NT, bool TWO>
__device__ __forceinline__ void mma_rows(float acc[][4], const u32 af[4], float acc2[][4], const u32 af2[4],
                                         const elem* B, int ld, int k0, int n0, int lane) {
    if (NT == 1) {
        u32 bf[2];
        ldsm2t(bf, bk_addr(B, ld, k0, n0, lane));
        mma16816(acc[0], af, bf[0], bf[1]);
        if (TWO) mma16816(acc2[0], af2, bf[0], bf[1]);
    } else {
#pragma unroll
        for (int jp = 0; jp < NT / 2; ++jp) {
            u32 bf[4];
            ldsm4t(bf, bk_addr(B, ld, k0, n0 + 16 * jp, lane));
            mma16816(acc[2 * jp], af, bf[0], bf[1]);
            mma16816(acc[2 * jp + 1], af, bf[2], bf[3]);
            if (TWO) {
                mma16816(acc2[2 * jp], af2, bf[0], bf[1]);
                mma16816(acc2[2 * jp + 1], af2, bf[2], bf[3]);
            }
        }
    }
}
template <int NT>
__device__ __forceinline__ void mma_row(float acc[][4], const u32 af[4], const elem* B, int ld, int k0, int n0,
                                        int lane) {
    mma_rows<NT, false>(acc, af, acc, af, B, ld, k0, n0, lane);
}

// ROWS rows of a DVS-wide 16-bit tile in shared memory (row stride VST) -> device memory (row stride DK),
// 16-byte pieces over the block's NTHR threads.
template <int ROWS>
__device__ __forceinline__ void store_rows(elem* dst, const elem* src, int tid) {
    constexpr int PIECES = ROWS * DVS / 8;
#pragma unroll
    for (int i = 0; i < (PIECES + NTHR - 1) / NTHR; ++i) {
        const int idx = tid + i * NTHR, row = idx / (DVS / 8), col = (idx % (DVS / 8)) * 8;
        if (PIECES % NTHR == 0 || idx < PIECES)
            *reinterpret_cast<uint4*>(dst + row * DK + col) = *reinterpret_cast<const uint4*>(src + row * VST + col);
    }
}

// Grid: (128 / DVS * nseg, Hv, N): block x takes columns (x % (128 / DVS)) * DVS.. of segment x / (128 / DVS).
// OUT_IN_WALK: o (contiguous [B, T, Hv, 128]) for rows < the sequence's length; Hs, Ug unused. Else
// Hs: [slots, Hv, 128, 128] 16-bit, state entering each chunk; Ug: [slots, Hv, 64, 128] 16-bit u of each
// chunk (all 64 rows; rows past a sequence's end are not used); q, Pg, o unused. Strides in elements. keep, hkeep:
// states kept on the way (seq.cuh; one sequence).
extern "C" __global__ void __launch_bounds__(NTHR, 2)
gdn_chunk_state(const elem* __restrict__ k, const elem* __restrict__ v,
                const elem* __restrict__ Tg, const float* __restrict__ Fg,
                const float* __restrict__ h0, const int* __restrict__ cu_seqlens,
                elem* __restrict__ Hs, elem* __restrict__ Ug, float* __restrict__ ht,
                KEEP_PARAMS, float* __restrict__ hkeep,
                const elem* __restrict__ q, const elem* __restrict__ Pg, elem* __restrict__ o,
                int T, int Hk, int Hv, int nseg,
                long long k_sb, long long k_st, long long k_sh,
                long long v_sb, long long v_st, long long v_sh,
                long long q_sb, long long q_st, long long q_sh)
{
    extern __shared__ __align__(128) unsigned char smem[];
    elem* Sb = reinterpret_cast<elem*>(smem + SM_S);
    elem* Rs = reinterpret_cast<elem*>(smem + SM_RHS);
    elem* Vc = reinterpret_cast<elem*>(smem + SM_V);  // v, then the high half of rhs
    elem* Tb = reinterpret_cast<elem*>(smem + SM_T);
    elem* Qs = reinterpret_cast<elem*>(smem + SM_Q);  // OUT_IN_WALK only
    u32* Uh = reinterpret_cast<u32*>(smem + SM_UH);  // rk e^{G_end-G} u in fp16 pairs, where S was

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    constexpr int NSL = DK / DVS;
    const int v0 = (blockIdx.x % NSL) * DVS, sg = blockIdx.x / NSL, h = blockIdx.y, n = blockIdx.z;
    const int hk = h / (Hv / Hk);

    const SeqSpan sp = seq_span(cu_seqlens, n, T);
    const long long bos = sp.bos;
    const int len = sp.len, batch = sp.batch;
    const int slot0 = first_slot(cu_seqlens, n, T);
    const elem* kb = k + batch * k_sb + bos * k_st + hk * k_sh;
    const elem* vb = v + batch * v_sb + bos * v_st + h * v_sh + v0;
    const elem* qb = q + batch * q_sb + bos * q_st + hk * q_sh;
    const int nchunks = (len + CH - 1) / CH;

    // chunks [cw, cend) walked, o (or Hs and Ug) written for [cbeg, cend); unsplit: segment 0 takes them all
    SegWalk sw{0, 0, nchunks};
    if (seg_count(nseg, nchunks) > 1) {
        if (!seg_plan(Fg, slot0, Hv, h, nchunks, nseg, sg, reinterpret_cast<int*>(Rs), sw)) sw = SegWalk{0, 0, nchunks};
    }
    if (sg > 0 && (sw.cbeg == 0 || sw.cbeg == sw.cend)) return;  // not split (no segment here), or an empty tail
    const bool from_h0 = sw.cw == 0, write_ht = sw.cend == nchunks;
    const KeepAt keep = KEEP_AT;

    // 64 rows of 128 columns of x (K or Q: zero past the end) for chunk c -> dst (row stride KST)
    auto load_rows128 = [&](elem* dst, const elem* xb, long long x_st, int c) {
#pragma unroll
        for (int i = 0; i < CH * DK / 8 / NTHR; ++i) {
            const int idx = tid + i * NTHR, row = idx >> 4, col = (idx & 15) * 8;
            const int tok = c * CH + row;
            const bool ok = tok < len;
            const long long tt = ok ? tok : 0;
            cp_async16(dst + row * KST + col, xb + tt * x_st + col, ok);
        }
    };
    auto load_kf = [&](int c, int buf) {  // K rows and the vectors, into stage buf
        unsigned char* st = smem + buf * STAGE_BYTES;
        load_rows128(reinterpret_cast<elem*>(st), kb, k_st, c);
        if (tid < CH)
            cp_async16(reinterpret_cast<float*>(st + SO_F) + 4 * tid,
                       Fg + ((long long)(slot0 + c) * Hv + h) * 4 * CH + 4 * tid, true);
    };
    auto load_vt = [&](int c) {  // this block's V columns (zero past the end) and T (lower blocks only)
#pragma unroll
        for (int i = 0; i < (8 * DVS + NTHR - 1) / NTHR; ++i) {  // 64 rows x DVS / 8 pieces
            const int idx = tid + i * NTHR, row = idx / (DVS / 8), col = (idx % (DVS / 8)) * 8;
            if (idx < 8 * DVS) {
                const int tok = c * CH + row;
                const bool ok = tok < len;
                const long long tt = ok ? tok : 0;
                cp_async16(Vc + row * VST + col, vb + tt * v_st + col, ok);
            }
        }
        const long long sb = ((long long)(slot0 + c) * Hv + h) * CH * CH;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int idx = tid + i * NTHR, row = idx >> 3, col = (idx & 7) * 8;
            cp_async16(Tb + row * BST + col, Tg + sb + row * CH + col, (col >> 4) <= (row >> 4));
        }
    };

    // The state slice rows [16 warp, 16 warp + 16) x DVS columns, as mma accumulators.
    float s[NJ][4];
    auto store_state = [&](float* st) {  // the slice's part of the state [128][128] fp32 at st
        float* hp = st + 16 * warp * DK + v0;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            *reinterpret_cast<float2*>(hp + g * DK + 8 * j + 2 * t) = make_float2(s[j][0], s[j][1]);
            *reinterpret_cast<float2*>(hp + (g + 8) * DK + 8 * j + 2 * t) = make_float2(s[j][2], s[j][3]);
        }
    };
    if (from_h0 && h0) {
        const float* hp = h0 + (((long long)n * Hv + h) * DK + 16 * warp) * DK + v0;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const float2 x0 = *reinterpret_cast<const float2*>(hp + g * DK + 8 * j + 2 * t);
            const float2 x1 = *reinterpret_cast<const float2*>(hp + (g + 8) * DK + 8 * j + 2 * t);
            s[j][0] = x0.x; s[j][1] = x0.y; s[j][2] = x1.x; s[j][3] = x1.y;
        }
    } else {
#pragma unroll
        for (int j = 0; j < NJ; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    }

    if (sw.cw < sw.cend) {
        load_kf(sw.cw, 0);
        load_vt(sw.cw);
        if (OUT_IN_WALK && sw.cw >= sw.cbeg) load_rows128(Qs, qb, q_st, sw.cw);
    }
    cp_async_commit();

    const int mt = warp & 3, jh = (warp >> 2) * NH;  // phases 2, 3: row tile, first n-tile of the column half
    const int ra0 = 16 * mt + g, ra1 = ra0 + 8;
    elem* ob = o + (sp.batch_tok * Hv + h) * DK + v0;  // OUT_IN_WALK
    float acc_o[NH][4];  // OUT_IN_WALK: o of the chunk walked last (rows 16 mt, column half), Q S scaled, then + P u
    u32 pf[4][4];        // OUT_IN_WALK: its P's A fragments (16-token blocks 0..mt of rows 16 mt)
    // OUT_IN_WALK: o of chunk c += P u (u, 16-bit, in the rhs space), then stored
    auto finish_o = [&](int c) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            if (kk > mt) break;  // warp-uniform
            mma_row<NH>(acc_o, pf[kk], Rs, VST, 16 * kk, 8 * jh, lane);
        }
        const long long tok0 = (long long)c * CH;
#pragma unroll
        for (int j = 0; j < NH; ++j) {
            const int cc = 8 * (jh + j) + 2 * t;
            if (tok0 + ra0 < len)
                *reinterpret_cast<u32*>(ob + (tok0 + ra0) * Hv * DK + cc) = pack2(acc_o[j][0], acc_o[j][1]);
            if (tok0 + ra1 < len)
                *reinterpret_cast<u32*>(ob + (tok0 + ra1) * Hv * DK + cc) = pack2(acc_o[j][2], acc_o[j][3]);
        }
    };
    // u of chunk c (16-bit, in the rhs space) -> Ug
    auto store_ug = [&](int c) { store_rows<CH>(Ug + ((long long)(slot0 + c) * Hv + h) * CH * DK + v0, Rs, tid); };

    for (int c = sw.cw, i = 0; c < sw.cend; ++c, ++i) {
        unsigned char* st = smem + (i & 1) * STAGE_BYTES;
        const elem* Kc = reinterpret_cast<const elem*>(st);
        const float* Gc = reinterpret_cast<const float*>(st + SO_F);
        const float* Bt = Gc + CH;
        const float* Rk = Bt + CH;
        const float* Rq = Rk + CH;
        const bool out = c >= sw.cbeg;  // else a warm-up chunk: state only
        keep_state(keep, c, sw.cbeg, [&](int e) { store_state(hkeep + ((long long)e * Hv + h) * DK * DK); });
        cp_async_wait<0>();
        __syncthreads();  // also: the last step's update has read the scaled u that phase 1 overwrites
        if (c + 1 < sw.cend) load_kf(c + 1, (i + 1) & 1);
        cp_async_commit();
        if (c - 1 >= sw.cbeg) {  // the last chunk's u, in the rhs space until phase 2 below
            if (OUT_IN_WALK) finish_o(c - 1);
            else store_ug(c - 1);
        }

        // ---- phase 1: state -> 16-bit smem
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const int r = 16 * warp + g, cc = 8 * j + 2 * t;
            *reinterpret_cast<u32*>(Sb + r * VST + cc) = pack2(s[j][0], s[j][1]);
            *reinterpret_cast<u32*>(Sb + (r + 8) * VST + cc) = pack2(s[j][2], s[j][3]);
        }
        __syncthreads();

        // ---- the 16-bit state entering chunk c -> Hs (16-byte stores; read by gdn_chunk_out)
        if (!OUT_IN_WALK && out) store_rows<DK>(Hs + ((long long)(slot0 + c) * Hv + h) * DK * DK + v0, Sb, tid);

        // ---- phase 2: rhs = beta (v - e^G rk (K S)) for rows 16 mt, n-tiles jh .. jh + NH; with o, Q S beside
        {
            float acc[NH][4];
#pragma unroll
            for (int j = 0; j < NH; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
            if (OUT_IN_WALK && out) {
#pragma unroll
                for (int j = 0; j < NH; ++j) acc_o[j][0] = acc_o[j][1] = acc_o[j][2] = acc_o[j][3] = 0.f;
#pragma unroll 2
                for (int kk = 0; kk < DK / 16; ++kk) {
                    u32 af[4], aq[4];
                    ldsm4(af, a_addr(Kc, KST, 16 * mt, 16 * kk, lane));
                    ldsm4(aq, a_addr(Qs, KST, 16 * mt, 16 * kk, lane));
                    mma_rows<NH, true>(acc, af, acc_o, aq, Sb, VST, 16 * kk, 8 * jh, lane);
                }
                const float f0 = Rq[ra0] * __expf(Gc[ra0]), f1 = Rq[ra1] * __expf(Gc[ra1]);
#pragma unroll
                for (int j = 0; j < NH; ++j) {
                    acc_o[j][0] *= f0; acc_o[j][1] *= f0; acc_o[j][2] *= f1; acc_o[j][3] *= f1;
                }
            } else {
#pragma unroll 2
                for (int kk = 0; kk < DK / 16; ++kk) {
                    u32 af[4];
                    ldsm4(af, a_addr(Kc, KST, 16 * mt, 16 * kk, lane));
                    mma_row<NH>(acc, af, Sb, VST, 16 * kk, 8 * jh, lane);
                }
            }
            const float f0 = Rk[ra0] * __expf(Gc[ra0]), f1 = Rk[ra1] * __expf(Gc[ra1]);
            const float b0 = Bt[ra0], b1 = Bt[ra1];
#pragma unroll
            for (int j = 0; j < NH; ++j) {
                const int cc = 8 * (jh + j) + 2 * t;
                const float2 x0 = unpack2(*reinterpret_cast<const u32*>(Vc + ra0 * VST + cc));
                const float2 x1 = unpack2(*reinterpret_cast<const u32*>(Vc + ra1 * VST + cc));
                store_split(Vc + ra0 * VST + cc, Rs + ra0 * VST + cc,
                            b0 * (x0.x - f0 * acc[j][0]), b0 * (x0.y - f0 * acc[j][1]));
                store_split(Vc + ra1 * VST + cc, Rs + ra1 * VST + cc,
                            b1 * (x1.x - f1 * acc[j][2]), b1 * (x1.y - f1 * acc[j][3]));
            }
        }
        __syncthreads();  // rhs complete; S (and the Hs copy) and Q read: S's space takes the scaled u
        if (OUT_IN_WALK && c + 1 < sw.cend && c + 1 >= sw.cbeg) load_rows128(Qs, qb, q_st, c + 1);
        cp_async_commit();

        // ---- phase 3: u = T rhs (rows 16 mt, same column half) -> the scaled u (fp16) where S was, and
        //      after the barrier u itself (16-bit) into the rhs space, read at the next step's start
        u32 upk[NH][2];
        {
            float acc[NH][4];
#pragma unroll
            for (int j = 0; j < NH; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
            for (int kk = 0; kk <= mt; ++kk) {
                u32 af[4];
                ldsm4(af, a_addr(Tb, BST, 16 * mt, 16 * kk, lane));
                mma_row<NH>(acc, af, Vc, VST, 16 * kk, 8 * jh, lane);
                mma_row<NH>(acc, af, Rs, VST, 16 * kk, 8 * jh, lane);
            }
            const float gend = Gc[CH - 1];
            const float f0 = Rk[ra0] * __expf(gend - Gc[ra0]), f1 = Rk[ra1] * __expf(gend - Gc[ra1]);
#pragma unroll
            for (int j = 0; j < NH; ++j) {
                const int cc = 8 * (jh + j) + 2 * t;
                upk[j][0] = pack2(acc[j][0], acc[j][1]);
                upk[j][1] = pack2(acc[j][2], acc[j][3]);
                Uh[(ra0 * VST + cc) / 2] = pack_f16_sat(f0 * acc[j][0], f0 * acc[j][1]);
                Uh[(ra1 * VST + cc) / 2] = pack_f16_sat(f1 * acc[j][2], f1 * acc[j][3]);
            }
        }
        __syncthreads();  // every warp is done with rhs and T: u takes the rhs space, the next v and T load
        if (c + 1 < sw.cend) load_vt(c + 1);
        cp_async_commit();
        if (out) {
#pragma unroll
            for (int j = 0; j < NH; ++j) {
                const int cc = 8 * (jh + j) + 2 * t;
                *reinterpret_cast<u32*>(Rs + ra0 * VST + cc) = upk[j][0];
                *reinterpret_cast<u32*>(Rs + ra1 * VST + cc) = upk[j][1];
            }
            if (OUT_IN_WALK) {  // P's A fragments (the mma's layout: rows g, g + 8; columns 2t, 2t + 8)
                const elem* pb = Pg + ((long long)(slot0 + c) * Hv + h) * CH * CH + (16 * mt + g) * CH + 2 * t;
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) {
                    if (kk > mt) break;  // warp-uniform
                    const elem* pk = pb + 16 * kk;
                    pf[kk][0] = *reinterpret_cast<const u32*>(pk);
                    pf[kk][1] = *reinterpret_cast<const u32*>(pk + 8 * CH);
                    pf[kk][2] = *reinterpret_cast<const u32*>(pk + 8);
                    pf[kk][3] = *reinterpret_cast<const u32*>(pk + 8 * CH + 8);
                }
            }
        }

        // ---- phase 4: S <- e^{G_end} S + K^T (scaled u), rows 16 warp of the state, all DVS columns, in fp16
        //      (11 bits, as the Hopper walk's update: half the tensor work of a bf16 hi + lo pair)
        {
            const float decay = __expf(Gc[CH - 1]);
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                s[j][0] *= decay; s[j][1] *= decay; s[j][2] *= decay; s[j][3] *= decay;
            }
#pragma unroll 1
            for (int kk = 0; kk < CH / 16; ++kk) {
                u32 af[4];
                ldsm4t(af, at_addr(Kc, KST, 16 * warp, 16 * kk, lane));
#pragma unroll
                for (int e = 0; e < 4; ++e) af[e] = to_f16_pair(af[e]);
#pragma unroll
                for (int jp = 0; jp < NJ / 2; ++jp) {
                    u32 bf[4];
                    ldsm4t(bf, bk_addr(reinterpret_cast<const elem*>(Uh), VST, 16 * kk, 16 * jp, lane));
                    mma16816_f16(s[2 * jp], af, bf[0], bf[1]);
                    mma16816_f16(s[2 * jp + 1], af, bf[2], bf[3]);
                }
            }
        }
    }
    cp_async_wait<0>();
    if (sw.cend - 1 >= sw.cbeg && sw.cw < sw.cend) {  // the last chunk's u
        __syncthreads();
        if (OUT_IN_WALK) finish_o(sw.cend - 1);
        else store_ug(sw.cend - 1);
    }

    if (write_ht) store_state(ht + ((long long)n * Hv + h) * DK * DK);
}

// ---------------------------------------------------------------- output kernel: all chunks at once
// Grid: (ranks, Hv), 8 warps, warp w: rows 16 (w & 3), columns 64 (w >> 2). Blocks start in linear order
// (x fastest); block i takes value head i % Hv of chunk rank i / Hv. Packed sequences: rank = slot (as the
// prep kernel's). B rows of T tokens: the state walk wrote the last steps of its segments last, and those
// Hs / Ug are still in L2, so they come first: rank r is step per - 1 - r / (N ns) of segment r % ns of
// sequence (r / ns) % N (ns segments of per chunks as the walk cuts them; ranks past a sequence's chunks
// have nothing to do). plan.out_ranks gives the grid.
// o = rq e^G (Q S_c) + P u for the chunk's rows < its sequence's length; o is contiguous [B, T, Hv, 128].
// Q, P and the vectors stay in shared memory; the state's 128 rows and u's 64 rows, the products' B operands,
// pass through two 32-row slices, the next one in flight while the current one is used: 44 KB a block, so
// that two blocks share an RTX SM (the 80 KB layout holding everything at once fitted one) and four an H200 SM.
extern "C" __global__ void __launch_bounds__(OTHR, 4)
gdn_chunk_out(const elem* __restrict__ q, const elem* __restrict__ Pg, const float* __restrict__ Fg,
              const elem* __restrict__ Hs, const elem* __restrict__ Ug, const int* __restrict__ cu_seqlens,
              elem* __restrict__ o, int T, int Hk, int Hv, int N, int nseg,
              long long q_sb, long long q_st, long long q_sh)
{
    extern __shared__ __align__(128) unsigned char smem[];
    elem* Qs = reinterpret_cast<elem*>(smem + OSM_Q);
    elem* Ps = reinterpret_cast<elem*>(smem + OSM_P);
    float* Gc = reinterpret_cast<float*>(smem + OSM_F);
    const float* Rq = Gc + 3 * CH;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int mt = warp & 3, cw = 64 * (warp >> 2);
    const int lin = blockIdx.y * gridDim.x + blockIdx.x, h = lin % Hv, r = lin / Hv;
    const int hk = h / (Hv / Hk);
    int n, c, slot;
    SeqSpan sp;
    if (cu_seqlens) {
        slot = r;
        sp = slot_sequence(cu_seqlens, slot, N, T, n, c);
    } else {
        const int nch = (T + CH - 1) / CH, ns = nseg;  // the plan's count for T (seg_count)
        const int per = (nch + ns - 1) / ns, k = r / (N * ns);
        n = (r / ns) % N;
        c = (r % ns) * per + per - 1 - k;
        if (c >= nch) return;  // past the end of a short last segment
        slot = n * nch + c;
        sp = seq_span(cu_seqlens, n, T);
    }
    const long long bos = sp.bos, batch_tok = sp.batch_tok;
    const int len = sp.len, batch = sp.batch;
    if (c * CH >= len) return;  // a gap between packed sequences
    const int tok0 = c * CH;
    const elem* qb = q + batch * q_sb + (bos + tok0) * q_st + hk * q_sh;
    const long long sh = (long long)slot * Hv + h;
    const elem* hs = Hs + sh * DK * DK;
    const elem* ug = Ug + sh * CH * DK;

    auto load_slice = [&](int s) {  // slice s: state rows 32 s.. (s < 4), else u rows 32 (s - 4)..
        const elem* src = s < 4 ? hs + (long long)s * OSL * DK : ug + (long long)(s - 4) * OSL * DK;
        elem* dst = reinterpret_cast<elem*>(smem + OSM_R + (s & 1) * OSLICE);
#pragma unroll
        for (int i = 0; i < OSL * DK / 8 / OTHR; ++i) {
            const int idx = tid + i * OTHR, row = idx >> 4, col = (idx & 15) * 8;
            cp_async16(dst + row * OST + col, src + row * DK + col, true);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int i = 0; i < CH * DK / 8 / OTHR; ++i) {  // Q: 64 rows (zero past the end)
        const int idx = tid + i * OTHR, row = idx >> 4, col = (idx & 15) * 8;
        const bool ok = tok0 + row < len;
        const long long tt = ok ? row : 0;
        cp_async16(Qs + row * KST + col, qb + tt * q_st + col, ok);
    }
#pragma unroll
    for (int i = 0; i < CH * CH / 8 / OTHR; ++i) {  // P: lower blocks only
        const int idx = tid + i * OTHR, row = idx >> 3, col = (idx & 7) * 8;
        cp_async16(Ps + row * BST + col, Pg + sh * CH * CH + row * CH + col, (col >> 4) <= (row >> 4));
    }
    if (tid < CH) cp_async16(Gc + 4 * tid, Fg + sh * 4 * CH + 4 * tid, true);
    load_slice(0);  // one group with Q, P and the vectors
    load_slice(1);

    float acc[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    const int r0 = 16 * mt + g, r1 = r0 + 8;
#pragma unroll 1
    for (int s = 0; s < ONS; ++s) {
        if (s + 1 < ONS) cp_async_wait<1>();  // slice s landed; s + 1 may still be in flight
        else cp_async_wait<0>();
        __syncthreads();
        const elem* B = reinterpret_cast<const elem*>(smem + OSM_R + (s & 1) * OSLICE);
        if (s < 4) {  // Q S over state rows 32 s..
#pragma unroll
            for (int kl = 0; kl < OSL / 16; ++kl) {
                u32 af[4];
                ldsm4(af, a_addr(Qs, KST, 16 * mt, OSL * s + 16 * kl, lane));
                mma_row<8>(acc, af, B, OST, 16 * kl, cw, lane);
            }
            if (s == 3) {  // Q S done: rows scaled by rq e^G before P u joins
                const float f0 = Rq[r0] * __expf(Gc[r0]), f1 = Rq[r1] * __expf(Gc[r1]);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    acc[j][0] *= f0; acc[j][1] *= f0; acc[j][2] *= f1; acc[j][3] *= f1;
                }
            }
        } else {  // P u over tokens 32 (s - 4).., the 16-token blocks at or left of the diagonal
#pragma unroll
            for (int kl = 0; kl < OSL / 16; ++kl) {
                const int kk = 2 * (s - 4) + kl;
                if (kk > mt) break;  // warp-uniform
                u32 af[4];
                ldsm4(af, a_addr(Ps, BST, 16 * mt, 16 * kk, lane));
                mma_row<8>(acc, af, B, OST, 16 * kl, cw, lane);
            }
        }
        if (s + 2 < ONS) {
            __syncthreads();  // every warp is done with this slice's buffer
            load_slice(s + 2);
        }
    }
    elem* ob = o + (batch_tok * Hv + h) * DK + cw;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int cc = 8 * j + 2 * t;
        if (tok0 + r0 < len)
            *reinterpret_cast<u32*>(ob + (long long)(tok0 + r0) * Hv * DK + cc) = pack2(acc[j][0], acc[j][1]);
        if (tok0 + r1 < len)
            *reinterpret_cast<u32*>(ob + (long long)(tok0 + r1) * Hv * DK + cc) = pack2(acc[j][2], acc[j][3]);
    }
}
