// The merge of a split call's shares (paged_attention.cu, paged_attention_wg.cu and paged_decode.cu with SPLIT
// write them: each share's normalised partial output and log2-sum-exp, fp32), in a source of its own so that
// loading it compiles no attention kernel. Launched by launch.paged_attention_cuda after the split kernel.
#include "common.cuh"
#include "mma_ptx.cuh"  // pack_bf16

typedef __nv_bfloat16 elem;

#include "paged_common.cuh"  // NEG_INF, sigmoid_f

// Merges the SPLIT shares: out[row] = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max), times
// sigmoid(gate). A block takes COMBINE_COLS columns of blockDim.y (token, q head) rows; a row has one group
// of COMBINE_COLS / 4 threads (4 columns a thread) per run of 8 shares (the launcher gives ceil(splits / 8)
// groups, and as many rows a block as make ~128 threads): every share's row is in flight at once, so a merge
// is three dependent rounds of loads (the gate and the log2-sum-exps, then the partial outputs) whatever the
// split count; a row's groups add their sums through shared memory in group order (the sum does not depend
// on timing). Empty shares (lse = -inf) get weight 0 and their o_part is never read.
// Launched with programmatic serialization after the split kernel (paged_common.cuh let_the_merge_start): it
// waits for that grid first (grid_wait) and reads the shares through L2 (__ldcg), not the read-only path,
// since they were written while this grid was already resident.
#define COMBINE_MAX_SPLITS 128
#define COMBINE_COLS (HEAD_DIM % 64 == 0 ? 64 : 32)  // launch.combine_shape
#define COMBINE_THREADS 256  // the most threads of a block (launch.combine_shape)
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
paged_attention_combine(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                        const elem* __restrict__ gate, long long g_st, long long g_sh,
                        elem* __restrict__ out, int total_q, int H, int splits) {
    constexpr int TPG = COMBINE_COLS / 4;  // threads of a group
    __shared__ float w_s[COMBINE_MAX_SPLITS];  // rows a block x splits <= 128 (launch.combine_shape)
    __shared__ float4 part[COMBINE_THREADS];   // the sums of groups 1 .. of each row
    __shared__ float wpart[COMBINE_THREADS / 8];
    const int groups = blockDim.x / TPG, ty = threadIdx.y;
    const long long row = (long long)blockIdx.x * blockDim.y + ty;
    const long long stride = (long long)total_q * H;
    const bool live = row < stride;
    const int grp = threadIdx.x / TPG, tg = threadIdx.x % TPG, c = blockIdx.y * COMBINE_COLS + tg * 4;
    float* w = w_s + ty * splits;  // this row's weights
    grid_wait();
#if GATE
    float2 g01 = make_float2(0.f, 0.f), g23 = g01;
    if (live && grp == 0) {  // the gate's load overlaps the merge
        const long long t = row / H, h = row % H;
        const elem* grow = gate + t * g_st + h * g_sh + c;
        g01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(grow));
        g23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(grow + 2));
    }
#endif
    if (live)
        for (int s = threadIdx.x; s < splits; s += blockDim.x) w[s] = __ldcg(lse_part + s * stride + row);
    __syncthreads();
    float mx = NEG_INF;
    if (live)
        for (int s = 0; s < splits; ++s) mx = fmaxf(mx, w[s]);
    __syncthreads();  // every thread has its row's maximum before the weights replace the lse values
    if (live)
        for (int s = threadIdx.x; s < splits; s += blockDim.x) {
            const float ls = w[s];
            w[s] = ls == NEG_INF ? 0.f : exp2f(ls - mx);
        }
    __syncthreads();
    const float* op = o_part + row * HEAD_DIM + c;
    const int s0 = 8 * grp;  // this group's run: groups * 8 >= splits
    float wi[8];
    float4 v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        wi[i] = live && s0 + i < splits ? w[s0 + i] : 0.f;
        v[i] = wi[i] > 0.f ? __ldcg(reinterpret_cast<const float4*>(op + (s0 + i) * stride * HEAD_DIM))
                           : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float wsum = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        acc.x += wi[i] * v[i].x;
        acc.y += wi[i] * v[i].y;
        acc.z += wi[i] * v[i].z;
        acc.w += wi[i] * v[i].w;
        wsum += wi[i];
    }
    const int pbase = ty * (groups - 1);  // this row's slots of part (TPG each) and wpart
    if (groups > 1) {
        if (grp > 0) {
            part[(pbase + grp - 1) * TPG + tg] = acc;
            if (tg == 0) wpart[pbase + grp - 1] = wsum;
        }
        __syncthreads();
    }
    if (grp > 0 || !live) return;
    for (int k = 0; k < groups - 1; ++k) {  // in group order
        const float4 p = part[(pbase + k) * TPG + tg];
        acc.x += p.x;
        acc.y += p.y;
        acc.z += p.z;
        acc.w += p.w;
        wsum += wpart[pbase + k];
    }
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
#if GATE
    const float gs[4] = {sigmoid_f(g01.x), sigmoid_f(g01.y), sigmoid_f(g23.x), sigmoid_f(g23.y)};
#else
    const float gs[4] = {1.f, 1.f, 1.f, 1.f};
#endif
    uint2 pk;
    pk.x = pack_bf16(acc.x * inv * gs[0], acc.y * inv * gs[1]);
    pk.y = pack_bf16(acc.z * inv * gs[2], acc.w * inv * gs[3]);
    *reinterpret_cast<uint2*>(out + row * HEAD_DIM + c) = pk;
}
