// One sampled token from fp32 logits [VOCAB] in one launch: the repetition and presence penalties, top_k's k
// candidates, then the temperature's softmax over them, min_p, top_p and the draw (reference.py sample_ref is
// the same pick in torch ops).
//
// The penalties read marks (uint8 [VOCAB], or none): bit 0 an id of the prompt or the answer so far, bit 1 an
// id of the answer. A marked logit l becomes l / rep where positive, l * rep where not (bit 0), then l - presence
// (bit 1), in that order (reference.py penalise_ref). The launch marks the id it draws with both bits.
//
// Candidates are ordered by the 64-bit key (logit, then the lower id first): the high word is the float's
// bits mapped to an unsigned order (negatives flipped, positives with the sign bit set; a positive NaN above
// +inf, as torch.topk ranks it, a negative one below -inf), the low word 0xFFFFFFFF - id. Keys are unique,
// so "the k largest keys" is exactly k
// candidates whatever the logits tie on; key 0 is no candidate (an empty slot).
//
// Two stages in the one launch. Each of the BLOCKS blocks holds its CHUNK of the vocabulary in registers (PER
// keys a thread) and selects its k largest keys by radix select: 8-bit digits from the top, a shared
// histogram per digit (warp-aggregated atomics: logits share their top bits), the digit where the count from
// the top reaches k, until the bin holding the k-th key holds exactly the keys still needed (early exit; at
// worst all 8 digits). The block writes them to part[block][0..k). The last block to finish (a ticket:
// atomics after a fence) selects the k largest of the BLOCKS * k keys the same way, ranks them (k <= K_MAX),
// and one thread walks them in order: w_i = exp(l_i / T - l_0 / T), p_i = w_i / sum w, min_p drops p_i <
// min_p * p_0, top_p keeps p_i while the mass before it is below top_p, and the draw takes the first
// candidate whose running kept mass (in double) exceeds u * the kept total. It writes the id to out (int64),
// the kept weights and the ids to weights / ids, marks the id, and sets the ticket back to zero for the next
// launch on the stream. (Every block has read its marks before the last one starts: the mark cannot reach a
// read of this launch.)
#include "common.cuh"

#define THREADS 512
#define WARPS (THREADS / 32)
#define BLOCKS 64
#define K_MAX 64
#ifndef VOCAB
#error "VOCAB (the logits' length) is required"
#endif
#define CHUNK ((VOCAB + BLOCKS - 1) / BLOCKS)
#define PER ((CHUNK + THREADS - 1) / THREADS)
#define MERGE_PER (BLOCKS * K_MAX / THREADS)

typedef unsigned long long u64;

__device__ __forceinline__ u64 make_key(float logit, unsigned id) {
    const unsigned b = __float_as_uint(logit);
    const unsigned t = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)t << 32) | (0xFFFFFFFFu - id);
}
__device__ __forceinline__ float key_logit(u64 key) {
    const unsigned t = (unsigned)(key >> 32);
    return __uint_as_float((t & 0x80000000u) ? (t & 0x7FFFFFFFu) : ~t);
}
__device__ __forceinline__ unsigned key_id(u64 key) { return 0xFFFFFFFFu - (unsigned)key; }

struct Select {
    unsigned hist[256];
    u64 prefix, mask;  // the digits fixed so far (prefix) and the bits they cover (mask)
    int need;          // keys still to take from the bin of the prefix
    int done, count;
    u64 sel[K_MAX];
};

// The k largest nonzero keys of the block's keys (N a thread) into s.sel[0..k), in no order. The block must
// hold at least k nonzero keys; every thread calls it.
template <int N>
__device__ void select_top(const u64 (&keys)[N], int k, Select& s) {
    const int lane = threadIdx.x & 31;
    if (threadIdx.x == 0) { s.prefix = 0; s.mask = 0; s.need = k; s.done = 0; s.count = 0; }
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += THREADS) s.hist[i] = 0;
        __syncthreads();
        const u64 prefix = s.prefix, mask = s.mask;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            const bool in = keys[j] != 0 && (keys[j] & mask) == prefix;
            const unsigned digit = in ? (unsigned)(keys[j] >> shift) & 255u : 256u;
            const unsigned same = __match_any_sync(0xffffffffu, digit);
            if (in && lane == __ffs(same) - 1) atomicAdd(&s.hist[digit], __popc(same));
        }
        __syncthreads();
        if (threadIdx.x < 32) {  // lane l: bins 255 - 8 l down to 248 - 8 l; the count above each from the top
            unsigned c[8], total = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) { c[j] = s.hist[255 - 8 * lane - j]; total += c[j]; }
            unsigned before = total;  // exclusive scan over the lanes, lane 0 first
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned v = __shfl_up_sync(0xffffffffu, before, o);
                if (lane >= o) before += v;
            }
            before -= total;
            const unsigned need = (unsigned)s.need;
            __syncwarp();  // every lane has read need before the one that finds the bin writes it
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (before < need && need <= before + c[j]) {  // one bin in the warp
                    const unsigned digit = 255 - 8 * lane - j;
                    s.prefix = prefix | ((u64)digit << shift);
                    s.mask = mask | ((u64)255 << shift);
                    s.need = (int)(need - before);
                    s.done = c[j] == need - before;
                }
                before += c[j];
            }
        }
        __syncthreads();
        if (s.done) break;
    }
    const u64 prefix = s.prefix, mask = s.mask;  // the k largest: every key whose fixed digits reach the prefix
#pragma unroll
    for (int j = 0; j < N; ++j) {
        if (keys[j] != 0 && (keys[j] & mask) >= prefix) {
            const int slot = atomicAdd(&s.count, 1);
            if (slot < K_MAX) s.sel[slot] = keys[j];
        }
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(THREADS)
sample_top_k(const float* __restrict__ logits, unsigned char* __restrict__ marks, float rep, float presence,
             int k, float temperature, float min_p, float top_p, double u,
             u64* __restrict__ part, unsigned* __restrict__ ticket, long long* __restrict__ out,
             float* __restrict__ weights, long long* __restrict__ ids) {
    __shared__ Select s;
    __shared__ u64 ranked[K_MAX];
    __shared__ int last;
    const int start = blockIdx.x * CHUNK;
    const int n = min(CHUNK, VOCAB - start);  // this block's logits (<= 0 past the vocabulary)
    u64 keys[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = j * THREADS + threadIdx.x;
        if (i < n) {
            float l = __ldg(logits + start + i);
            if (marks != nullptr) {
                const unsigned m = marks[start + i];
                if (m & 1u) l = l > 0.f ? l / rep : l * rep;
                if (m & 2u) l -= presence;
            }
            keys[j] = make_key(l, (unsigned)(start + i));
        } else {
            keys[j] = 0;
        }
    }
    u64* mine = part + (size_t)blockIdx.x * K_MAX;
    if (n > k) {
        select_top(keys, k, s);
        if (threadIdx.x < k) mine[threadIdx.x] = s.sel[threadIdx.x];
    } else {  // all of them, and empty slots
#pragma unroll
        for (int j = 0; j < PER; ++j) {  // PER * THREADS >= THREADS > K_MAX slots
            const int i = j * THREADS + threadIdx.x;
            if (i < k) mine[i] = keys[j];
        }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == BLOCKS - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();

    u64 cand[MERGE_PER];  // every block's k keys; the stores above came through L2
#pragma unroll
    for (int j = 0; j < MERGE_PER; ++j) {
        const int e = j * THREADS + threadIdx.x;
        cand[j] = e < BLOCKS * k ? __ldcg(part + (size_t)(e / k) * K_MAX + e % k) : 0;
    }
    select_top(cand, k, s);
    if (threadIdx.x < k) {  // rank by key, largest first
        const u64 key = s.sel[threadIdx.x];
        int r = 0;
        for (int j = 0; j < k; ++j) r += s.sel[j] > key;
        ranked[r] = key;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const float x0 = key_logit(ranked[0]) / temperature;
        float w[K_MAX], sum = 0.f;
        for (int i = 0; i < k; ++i) {
            w[i] = expf(key_logit(ranked[i]) / temperature - x0);
            sum += w[i];
        }
        const float floor_p = min_p * (w[0] / sum);  // min_p times the largest probability
        float mass = 0.f;  // the probability before candidate i, after min_p
        double kept = 0.0;
        for (int i = 0; i < k; ++i) {
            float p = w[i] / sum;
            if (p < floor_p) p = 0.f;
            w[i] = mass < top_p ? p : 0.f;
            mass += p;
            kept += w[i];
        }
        const double target = u * kept;
        double run = 0.0;
        int pick = 0;
        for (int i = 0; i < k; ++i) {
            if (w[i] > 0.f) pick = i;
            run += w[i];
            if (run > target && w[i] > 0.f) break;
        }
        out[0] = key_id(ranked[pick]);
        if (marks != nullptr) marks[key_id(ranked[pick])] = 3;
        for (int i = 0; i < k; ++i) {
            weights[i] = w[i];
            ids[i] = key_id(ranked[i]);
        }
        *ticket = 0u;
    }
}
