// Paged attention for Qwen3.5's full-attention layers: the new tokens of each sequence attend causally
// to themselves and to every token already in the paged K/V pool (prefill), or 1..16 new tokens attend
// to a long cached context split across thread blocks (decode). One kernel does both.
//
// Layout (documented once, in runtime/kv_pool.py; repeated here only as the kernel reads it):
//   k_pool, v_pool   [num_blocks, BLOCK_SIZE, Hkv, HEAD_DIM] bf16, one pair per attention layer
//   block_table      int32 [N, bt_stride]: key position p of sequence n lives in block
//                    block_table[n, p / BLOCK_SIZE], row p % BLOCK_SIZE; entries past the last block
//                    a sequence needs are never read
//   cache_lens       int32 [N]: tokens already in the pool before this call (the prefix)
//   cu_q             int32 [N + 1]: sequence n's new tokens are rows cu_q[n] .. cu_q[n+1] of q, k_new, ...
//   q, gate, out     [T, H, HEAD_DIM] (H = Hkv * GROUP; q head h reads kv head h / GROUP)
//   k_new, v_new     [T, Hkv, HEAD_DIM]: the new tokens' K (rotary applied) and V
// New token i of sequence n sees key positions 0 .. cache_lens[n] + i. With write_kv, its K/V are also
// stored in slot cache_lens[n] + i of the pool (by the blocks of split 0, each (token, kv head) once);
// the attention itself reads the new tokens' K/V from k_new / v_new, so no block waits for another.
//
// Work split: a thread block takes BM = 16 * WARPS_M rows of one (sequence, kv head), a row being one
// (new token, q head of the group): GQA heads share every K/V tile loaded. Each warp owns 16 rows and
// keeps their output (16 x HEAD_DIM, fp32) in registers; K/V tiles of BN = 32 keys are gathered through
// the block table straight into shared memory with cp.async (two stages), S = Q K^T and O += P V run on
// mma.sync m16n8k16 bf16 with fp32 accumulation, online softmax in the exp2 domain.
// With SPLIT, blockIdx.z takes one contiguous share of the row tile's key tiles and writes its
// normalised partial output and log2-sum-exp (fp32) for paged_combine.cu; without, the block
// writes out = softmax(Q K^T) V * sigmoid(gate) directly.
// Shared memory: (BM + 4 * BN) * (HEAD_DIM + 8) * 2 bytes: 101,376 B at WARPS_M = 4 (the RTX 30/40/50
// opt-in maximum, exactly), 76,032 B at WARPS_M = 1.
#include "common.cuh"
#include "mma_ptx.cuh"  // smem_u32, ldsm4 / ldsm4t, mma16816_bf16, pack_bf16, cp_async*

typedef __nv_bfloat16 elem;

#include "paged_common.cuh"  // the shared defines' defaults; tile_work, slot_of, append_kv, empty_share, finish_row

#ifndef WARPS_M
#define WARPS_M 4
#endif

#define BN 32
#define BM (16 * WARPS_M)
#define THREADS (32 * WARPS_M)
#define LDS (HEAD_DIM + 8)  // padded row: the 8 rows one ldmatrix reads fall in distinct banks

static_assert(HEAD_DIM % 32 == 0, "HEAD_DIM must be a multiple of 32");
static_assert(BN == 32, "one lane per key row of a tile");

extern "C" __global__ void __launch_bounds__(THREADS)
paged_attention_fwd(PAGED_PARAMS) {
    let_the_merge_start();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem* Qs = reinterpret_cast<elem*>(smem_raw);  // [BM][LDS]
    elem* Ks = Qs + BM * LDS;                         // [2][BN][LDS]
    elem* Vs = Ks + 2 * BN * LDS;                     // [2][BN][LDS]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const TileWork tw = tile_work<BM, BN>(cu_q, cache_lens, Hkv);
    const int kvh = tw.kvh, q0 = tw.q0, nq = tw.nq, rows = tw.rows, r0 = tw.r0, L = tw.L, H = tw.H;
    if (r0 >= rows) return;
    const int* bt = block_table + (long long)tw.n * bt_stride;
    const elem* kn = k_new + (long long)q0 * kn_st + (long long)kvh * kn_sh;
    const elem* vn = v_new + (long long)q0 * vn_st + (long long)kvh * vn_sh;

    if (write_kv && blockIdx.z == 0) append_kv<BM, THREADS>(k_pool, v_pool, kn, kn_st, vn, vn_st, bt, L, nq, r0, Hkv, kvh);

    int j0 = tw.j0, j1 = tw.j1;  // key tiles of this block's share
    const int rA = r0 + warp * 16 + (lane >> 2), rB = rA + 8;  // the two rows this thread holds
    if (j0 >= j1) {  // nothing to see: an empty share (the combine skips it)
        empty_share({rA, rB}, rows, lane & 3, q0, kvh, H, total_q, lse_part);
        return;
    }

    copy_q_rows<BM, THREADS, LDS>(Qs, q, q_st, q_sh, q0, r0, rows, kvh, tid);

    auto load_kv = [&](int j, int stage) {  // tile j's K and V rows into the stage's buffers
        copy_kv_tile<THREADS, LDS>(Ks + stage * BN * LDS, Vs + stage * BN * LDS, j, bt, L, nq, Hkv, kvh, k_pool,
                                   v_pool, kn, kn_st, vn, vn_st, tid, lane);
    };

    float o[HEAD_DIM / 8][4];
#pragma unroll
    for (int d = 0; d < HEAD_DIM / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    // last visible key position of each row (rows past the tile's end act as its last token)
    const int limA = L + min(rA, rows - 1) / GROUP, limB = L + min(rB, rows - 1) / GROUP;
    const int lim0 = L + r0 / GROUP;  // the block's first row's: every row sees keys 0 .. lim0

    load_kv(j0, 0);  // Q's copies join this first group
    for (int j = j0; j < j1; ++j) {
        const int st = (j - j0) & 1;
        if (j + 1 < j1) {
            load_kv(j + 1, st ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const elem* ks = Ks + st * BN * LDS;
        const elem* vs = Vs + st * BN * LDS;

        float s[BN / 8][4];
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            u32 a[4];
            ldsm4(a, Qs + (warp * 16 + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int nn = 0; nn < BN / 16; ++nn) {
                u32 b[4];
                ldsm4(b, ks + (nn * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDS + kk * 16 + ((lane >> 3) & 1) * 8);
                mma16816_bf16(s[2 * nn], a, b[0], b[1]);
                mma16816_bf16(s[2 * nn + 1], a, b[2], b[3]);
            }
        }

        // mask (causal, and past the sequence) where the tile needs it, online softmax in the log2 domain
        online_softmax<BN, HEAD_DIM / 8>(s, o, m, l, j, lane, limA, limB, lim0, scale_log2);

        pv_product<BN, HEAD_DIM / 8, LDS>(o, s, vs, lane);  // O += P V
        __syncthreads();  // this stage is refilled by the next iteration's copies
    }

    quad_sums(l);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = half ? rB : rA;
        if (r < rows)
            finish_row(r, m[half], l[half], lane & 3, q0, kvh, H, total_q, gate, g_st, g_sh, out, o_part, lse_part,
                       [&](int i, int e) { return o[i][2 * half + e]; });
    }
}
