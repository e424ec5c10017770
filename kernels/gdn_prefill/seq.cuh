// Where a sequence and its chunks sit, shared by the prefill kernels (prep.cu, gdn_prefill.cu, portable.cu).
// Sequences are either B rows of T tokens (cu_seqlens null) or N packed into one row
// (cu_seqlens [N + 1]). Included after the including file has defined CH.
#pragma once

struct SeqSpan {
    long long bos;        // first token of the sequence in its batch row
    long long batch_tok;  // flat token index of that token (the row index into [B * T] outputs)
    int len, batch;
};

__device__ __forceinline__ SeqSpan seq_span(const int* cu_seqlens, int n, int T) {
    SeqSpan s;
    if (cu_seqlens) {
        s.batch = 0;
        s.bos = cu_seqlens[n];
        s.len = cu_seqlens[n + 1] - (int)s.bos;
        s.batch_tok = s.bos;
    } else {
        s.batch = n;
        s.bos = 0;
        s.len = T;
        s.batch_tok = (long long)n * T;
    }
    return s;
}

// Index of the first (chunk, head) slot of sequence n in the prep buffers: n * chunks-per-sequence
// when all have length T, else bos / 64 + n (distinct and increasing for packed sequences; fewer
// than T_total / 64 + N slots in all).
__device__ __forceinline__ int first_slot(const int* cu_seqlens, int n, int T) {
    return cu_seqlens ? cu_seqlens[n] / CH + n : n * ((T + CH - 1) / CH);
}

// The sequence n whose slots hold `slot` (for packed sequences the largest n with first_slot(n) <= slot, a
// binary search) and the chunk c of it; c * CH >= len marks a gap between packed sequences.
__device__ __forceinline__ SeqSpan slot_sequence(const int* cu_seqlens, int slot, int N, int T, int& n, int& c) {
    if (cu_seqlens) {
        int lo = 0, hi = N - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (first_slot(cu_seqlens, mid, T) <= slot) lo = mid; else hi = mid - 1;
        }
        n = lo;
        c = slot - first_slot(cu_seqlens, n, T);
    } else {
        const int nch = (T + CH - 1) / CH;
        n = slot / nch;
        c = slot - n * nch;
    }
    return seq_span(cu_seqlens, n, T);
}

// The states a call of one sequence keeps besides its final one: the state entering chunk c[e] (after its first
// 64 c[e] tokens) goes to hkeep[e] ([kept][Hv][128][128] fp32); -1 keeps none. They come as MAX_KEEP int32
// kernel parameters (KEEP_PARAMS; the launcher passes one value each), gathered in the kernel (KEEP_AT). Each
// walk block stores the chunks it writes o for, so every (state, column) is stored once, by the block whose walk
// is exact there.
#define MAX_KEEP 8
#define KEEP_PARAMS int keep0, int keep1, int keep2, int keep3, int keep4, int keep5, int keep6, int keep7
#define KEEP_AT {{keep0, keep1, keep2, keep3, keep4, keep5, keep6, keep7}}
struct KeepAt {
    int c[MAX_KEEP];
};

// This thread's part of the state entering chunk c into hkeep[e] for every e kept there; store(e) stores it (one
// copy of the stores in the loop, however many are kept). c and cbeg are warp-uniform, so are the branches.
template <class Store>
__device__ __forceinline__ void keep_state(const KeepAt& keep, int c, int cbeg, Store store) {
    if (c < cbeg) return;  // a warm-up chunk: another block's walk writes this state
    unsigned m = 0;
#pragma unroll
    for (int e = 0; e < MAX_KEEP; ++e) m |= (unsigned)(keep.c[e] == c) << e;
    while (m) {
        store(__ffs(m) - 1);
        m &= m - 1;
    }
}
