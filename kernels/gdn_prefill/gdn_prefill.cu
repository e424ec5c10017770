// Gated DeltaNet chunked prefill, the Hopper path (NVRTC, sm_90a only: warpgroup mma and TMA copies).
// After gdn_chunk_prep (prep.cu) has formed T, P and the per-token vectors of every (chunk, head):
//
// gdn_chunk_prefill_fwd: one 256-thread block per (sequence, value head, DVS state columns) walks
//   its chunks in order with the fp32 state in mma accumulator registers:
//     rhs = beta (v - e^G rk (K S));  u = T rhs;  o = rq e^G (Q S) + P u
//     S  <- e^{G_end} S + K^T (rk e^{G_end - G} u)
//   The state columns are independent, so slicing Dv is an exact split that fills the machine when
//   B * Hv is small; for long sequences the 128 / DVS blocks of a head rather split the sequence
//   (segments.cuh) and each walks all 128 columns on wgmma (walk_wgmma.cuh: the 128-column walk does
//   ~1.6x the work per cycle of a 32-column one). A column slice walks on mma.sync (walk_mma.cuh).
// rhs and the scaled u enter their mma as hi + lo 16-bit pairs: a single bf16 rounding of them
// alone would put the final state's error near 3e-3; split, it is ~1e-6 (strong decay) to ~7e-4. (The wgmma
// walk takes the scaled u as one fp16 value instead, with K^T in fp16: 11 bits, see walk_wgmma.cuh.)
#include "layout.cuh"  // elem (IN_T), u32, CH, DK, KST, BST

#ifndef __CUDA_ARCH_FEAT_SM90_ALL
#error "gdn_prefill.cu is the Hopper path (sm_90a); other cards take portable.cu"
#endif
#ifndef DVS
#define DVS 64  // state columns per block: 32, 64 or 128
#endif

#define NTHR 256    // 8 warps

static_assert(DVS == 32 || DVS == 64 || DVS == 128, "DVS must be 32, 64 or 128");

#include "seq.cuh"
#include "mma_tiles.cuh"
#include "segments.cuh"
#include "tma_ptx.cuh"

// One block's walk: state columns [v0, v0 + W) of head h of sequence n over chunks [cw, cend). Chunks
// before cbeg only carry the state (warm-up of a sequence segment); o is written for [cbeg, cend).
struct Walk {
    const elem *qb, *kb, *vb;  // token 0 of the sequence at this block's head (vb, ob: column 0)
    elem* ob;
    long long q_st, k_st, v_st;
    int Hv, h, n, v0, len, slot0;
    int hk, batch, bos;        // tile coordinates of the tensor-map copies: q/k head, batch row, first token
    int cw, cbeg, cend;
    bool from_h0, write_ht;    // start from h0 (else zero); store the final state
    KeepAt keep;               // states kept on the way (seq.cuh), into hkeep
    float* hkeep;
};

#include "walk_mma.cuh"
#include "walk_wgmma.cuh"

#ifdef WALK_SMEM  // the launcher's sizes (plan.py), checked against the layouts here
static_assert(WALK_SMEM == (DVS == 128 ? GeoWG::TOTAL : Geo<DVS>::TOTAL),
              "plan.py's hopper_walk_smem() disagrees with the layout in walk_mma.cuh / walk_wgmma.cuh");
static_assert(WALK128_SMEM == GeoWG::TOTAL, "plan.py's hopper_walk_smem(128) disagrees with GeoWG::TOTAL");
#endif

// Grid: (128 / DVS, Hv, N). Strides in elements; o is contiguous [B, T, Hv, 128]. keep, hkeep: states kept on the
// way (seq.cuh; one sequence).
// Dynamic shared memory: Geo<DVS>::TOTAL (DVS 128: GeoWG::TOTAL), the larger of the two when seg is set.
// seg: with DVS < 128, a sequence of at least SEG_MIN_CHUNKS chunks is split into 128 / DVS segments, one
// per block of its head; a head whose gates refuse the split keeps the column split.
extern "C" __global__ void __launch_bounds__(NTHR, 1)
gdn_chunk_prefill_fwd(const elem* __restrict__ q, const elem* __restrict__ k, const elem* __restrict__ v,
                      const elem* __restrict__ Tg, const elem* __restrict__ Pg, const float* __restrict__ Fg,
                      const float* __restrict__ h0, const int* __restrict__ cu_seqlens,
                      elem* __restrict__ o, float* __restrict__ ht, KEEP_PARAMS, float* __restrict__ hkeep,
                      int T, int Hk, int Hv,
                      long long q_sb, long long q_st, long long q_sh,
                      long long k_sb, long long k_st, long long k_sh,
                      long long v_sb, long long v_st, long long v_sh, int seg,
                      const __grid_constant__ TmaDesc tm_k, const __grid_constant__ TmaDesc tm_q,
                      const __grid_constant__ TmaDesc tm_v, const __grid_constant__ TmaDesc tm_t,
                      const __grid_constant__ TmaDesc tm_p, const __grid_constant__ TmaDesc tm_o)
{
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ unsigned long long tma_bar[2];  // the wgmma walk's copy barriers, one per stage
    const int h = blockIdx.y, n = blockIdx.z;
    const int hk = h / (Hv / Hk);

    const SeqSpan sp = seq_span(cu_seqlens, n, T);
    const long long bos = sp.bos, batch_tok = sp.batch_tok;
    const int len = sp.len, batch = sp.batch;
    const int nchunks = (len + CH - 1) / CH;
    Walk wk;
    wk.qb = q + batch * q_sb + bos * q_st + hk * q_sh;
    wk.kb = k + batch * k_sb + bos * k_st + hk * k_sh;
    wk.vb = v + batch * v_sb + bos * v_st + h * v_sh;
    wk.ob = o + (batch_tok * Hv + h) * DK;
    wk.q_st = q_st; wk.k_st = k_st; wk.v_st = v_st;
    wk.Hv = Hv; wk.h = h; wk.n = n; wk.len = len;
    wk.hk = hk; wk.batch = batch; wk.bos = (int)bos;
    wk.slot0 = first_slot(cu_seqlens, n, T);
    wk.v0 = blockIdx.x * DVS;
    wk.cw = wk.cbeg = 0;
    wk.cend = nchunks;
    wk.from_h0 = wk.write_ht = true;
    wk.keep = KEEP_AT;
    wk.hkeep = hkeep;
    if (DVS < 128 && seg && seg_count(DK / DVS, nchunks) > 1) {
        __shared__ int warm[SEG_MAX];
        SegWalk sw;
        if (seg_plan(Fg, wk.slot0, Hv, h, nchunks, DK / DVS, blockIdx.x, warm, sw)) {
            if (sw.cbeg == sw.cend) return;  // an empty tail segment (nchunks > 0: another block writes ht)
            wk.cw = sw.cw; wk.cbeg = sw.cbeg; wk.cend = sw.cend;
            wk.v0 = 0;
            wk.from_h0 = wk.cw == 0;
            wk.write_ht = wk.cend == nchunks;
            walk_chunks_wg(smem, wk, Fg, h0, ht, &tm_k, &tm_q, &tm_v, &tm_t, &tm_p, &tm_o, tma_bar);
            return;
        }
    }
#if DVS == 128
    walk_chunks_wg(smem, wk, Fg, h0, ht, &tm_k, &tm_q, &tm_v, &tm_t, &tm_p, &tm_o, tma_bar);
#else
    walk_chunks<DVS>(smem, wk, Tg, Pg, Fg, h0, ht);
#endif
}
