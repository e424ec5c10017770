// Paged attention for decode steps: at most 16 rows ((new token, q head of the group) pairs: one to four new
// tokens at GQA 4) of one (sequence, kv head) against its cached context, one key share per block (SPLIT).
// Layout, causal rule, K/V append and shares as in paged_attention.cu; paged_combine.cu merges the shares.
//
// Why a kernel of its own: paged_attention.cu gives these rows one warp per block (16 rows are one mma
// tile), three such blocks per H200 SM (one per RTX SM). A warp alone on its scheduler waits out the latency
// of every instruction of a 32-key tile (~300 of them: ldmatrix, mma, exponentials, copies): ~4.5 us per tile
// whatever the share size, 58-63% of the copy bandwidth at 65,536 keys and far less on short contexts.
// Here four warps share each tile: warp w forms S over head dims [w DW, (w + 1) DW) (DW = HEAD_DIM / 4,
// its Q fragments held in registers for the whole share), the four partial S meet through shared memory
// (summed in warp order, so every warp holds the same S and the same softmax), and warp w accumulates
// output columns [w DW, (w + 1) DW) of O += P V. A warp's part of a tile is a quarter of the one-warp
// kernel's, and three blocks (12 warps) share an H200 SM: 76,032 bytes of shared memory a block at head dim
// 256 (Q's space holds the partial S once Q is in registers).
#include "common.cuh"
#include "mma_ptx.cuh"  // smem_u32, ldsm4 / ldsm4t, mma16816_bf16, pack_bf16, cp_async*

typedef __nv_bfloat16 elem;

#include "paged_common.cuh"  // the shared defines' defaults; tile_work, slot_of, append_kv, empty_share, finish_row

#define BM 16               // rows of the block: one mma tile
#define BN 32               // keys per tile
#define NW 4                // warps
#define THREADS (32 * NW)
#define DW (HEAD_DIM / NW)  // head dims (of S's sum, of the output) per warp
#define LDS (HEAD_DIM + 8)  // padded row: the 8 rows one ldmatrix reads fall in distinct banks

static_assert(HEAD_DIM % (16 * NW) == 0, "HEAD_DIM must be a multiple of 64");
static_assert(BN == 32, "one lane per key row of a tile");
#define SP_BYTES (NW * (BN / 8) * 32 * 16)  // the four warps' partial S, fragment order
#define Q_BYTES (BM * LDS * 2 > SP_BYTES ? BM * LDS * 2 : SP_BYTES)  // Q, then the partial S
#define SMEM_BYTES (Q_BYTES + 4 * BN * LDS * 2)  // + two stages of K and V: launch.smem_bytes_decode

// Grid (1, N * Hkv, splits); THREADS threads; SMEM_BYTES of dynamic shared memory.
// Arguments as paged_attention_fwd's.
extern "C" __global__ void __launch_bounds__(THREADS)
paged_attention_decode(PAGED_PARAMS) {
    let_the_merge_start();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    elem* Qs = reinterpret_cast<elem*>(smem_raw);  // [BM][LDS]; then the partial S
    elem* Ks = reinterpret_cast<elem*>(smem_raw + Q_BYTES);  // [2][BN][LDS]
    elem* Vs = Ks + 2 * BN * LDS;                     // [2][BN][LDS]
    float4* Sp = reinterpret_cast<float4*>(smem_raw);  // [NW][BN / 8][32 lanes]: each warp's S fragments

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const TileWork tw = tile_work<BM, BN>(cu_q, cache_lens, Hkv);
    const int kvh = tw.kvh, q0 = tw.q0, nq = tw.nq, rows = tw.rows, r0 = tw.r0, L = tw.L, H = tw.H;
    if (r0 >= rows) return;
    const int* bt = block_table + (long long)tw.n * bt_stride;
    const elem* kn = k_new + (long long)q0 * kn_st + (long long)kvh * kn_sh;
    const elem* vn = v_new + (long long)q0 * vn_st + (long long)kvh * vn_sh;

    if (write_kv && blockIdx.z == 0) append_kv<BM, THREADS>(k_pool, v_pool, kn, kn_st, vn, vn_st, bt, L, nq, r0, Hkv, kvh);

    const int j0 = tw.j0, j1 = tw.j1;  // key tiles of this block's share
    const int rA = r0 + (lane >> 2), rB = rA + 8;  // the two rows this thread holds (the same in every warp)
    if (j0 >= j1) {  // nothing to see: an empty share (the combine skips it)
        if (warp == 0) empty_share({rA, rB}, rows, lane & 3, q0, kvh, H, total_q, lse_part);
        return;
    }

    copy_q_rows<BM, THREADS, LDS>(Qs, q, q_st, q_sh, q0, r0, rows, kvh, tid);
    cp_async_commit();

    auto load_kv = [&](int j, int stage) {  // tile j's K and V rows into the stage's buffers
        copy_kv_tile<THREADS, LDS>(Ks + stage * BN * LDS, Vs + stage * BN * LDS, j, bt, L, nq, Hkv, kvh, k_pool,
                                   v_pool, kn, kn_st, vn, vn_st, tid, lane);
    };

    load_kv(j0, 0);
    cp_async_wait<1>();  // Q has landed (the first tile may still be in flight)
    __syncthreads();
    u32 qa[DW / 16][4];  // A fragments of Q over this warp's head dims, for the whole share
#pragma unroll
    for (int kk = 0; kk < DW / 16; ++kk)
        ldsm4(qa[kk], Qs + (lane & 15) * LDS + warp * DW + kk * 16 + (lane >> 4) * 8);
    // (the loop's first barrier orders these reads before any warp writes the partial S over them)

    float o[DW / 8][4];
#pragma unroll
    for (int d = 0; d < DW / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    // last visible key position of each row (rows past the tile's end act as its last token)
    const int limA = L + min(rA, rows - 1) / GROUP, limB = L + min(rB, rows - 1) / GROUP;
    const int lim0 = L + r0 / GROUP;  // the block's first row's: every row sees keys 0 .. lim0

    for (int j = j0; j < j1; ++j) {
        const int st = (j - j0) & 1;
        cp_async_wait<0>();
        __syncthreads();  // tile j has landed for every thread; every warp is done with tile j - 1
        if (j + 1 < j1) load_kv(j + 1, st ^ 1);  // into the stage tile j - 1 used
        const elem* ks = Ks + st * BN * LDS;
        const elem* vs = Vs + st * BN * LDS;

        // this warp's part of S = Q K^T: head dims [warp DW, warp DW + DW)
        float s[BN / 8][4];
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < DW / 16; ++kk) {
#pragma unroll
            for (int nn = 0; nn < BN / 16; ++nn) {
                u32 b[4];
                ldsm4(b, ks + (nn * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDS + warp * DW + kk * 16 +
                             ((lane >> 3) & 1) * 8);
                mma16816_bf16(s[2 * nn], qa[kk], b[0], b[1]);
                mma16816_bf16(s[2 * nn + 1], qa[kk], b[2], b[3]);
            }
        }
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) Sp[(warp * (BN / 8) + i) * 32 + lane] = make_float4(s[i][0], s[i][1], s[i][2], s[i][3]);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {  // the four parts in warp order: the same S in every warp
            float4 acc = Sp[i * 32 + lane];
#pragma unroll
            for (int w = 1; w < NW; ++w) {
                const float4 x = Sp[(w * (BN / 8) + i) * 32 + lane];
                acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
            }
            s[i][0] = acc.x; s[i][1] = acc.y; s[i][2] = acc.z; s[i][3] = acc.w;
        }

        // mask (causal, and past the sequence) where the tile needs it, online softmax in the log2 domain
        online_softmax<BN, DW / 8>(s, o, m, l, j, lane, limA, limB, lim0, scale_log2);

        pv_product<BN, DW / 8, LDS>(o, s, vs + warp * DW, lane);  // O[:, warp DW ..] += P V
    }

    quad_sums(l);
    auto val = [&](int half) { return [&, half](int i, int e) { return o[i][2 * half + e]; }; };
    if (rA < rows)
        finish_row<DW / 8>(rA, m[0], l[0], lane & 3, q0, kvh, H, total_q, gate, g_st, g_sh, out, o_part, lse_part,
                           val(0), warp * DW, warp == 0);
    if (rB < rows)
        finish_row<DW / 8>(rB, m[1], l[1], lane & 3, q0, kvh, H, total_q, gate, g_st, g_sh, out, o_part, lse_part,
                           val(1), warp * DW, warp == 0);
}
