// Depthwise causal conv1d + SiLU in front of each GDN layer (see reference.py):
//   y[t, c] = silu(bias[c] + sum_j weight[c, j] * x[t - (W-1) + j, c]),  inputs before a sequence's
//   start come from its initial state [C, W-1] (oldest first) or are zero.
// Prefill: each thread owns VEC adjacent channels (16 bytes of x) over a chunk of tokens and slides
// a window of the last W-1 inputs through registers, so x is read once (plus W-1 tokens of halo per
// chunk) and y written once. The thread that handles a sequence's last token writes its final state.
// Update: one token per sequence, one thread per (sequence, channel), state shifted in place.
// States: the conv state at given points of a prompt, gathered from its inputs and initial state.
//
// Defines: W (kernel width), VEC (channels per thread), TX (x, y, prefill states), TS (update state),
// TW (weight), TB (bias): 0 float, 1 half, 2 bfloat16; HAS_BIAS, HAS_INIT, VARLEN: 0 or 1.
#include "common.cuh"

#ifndef W
#define W 4
#endif
#ifndef VEC
#define VEC 8
#endif
#ifndef TX
#define TX QF_BF16
#endif
#ifndef TS
#define TS TX
#endif
#ifndef TW
#define TW TX
#endif
#ifndef TB
#define TB TW
#endif
#ifndef HAS_BIAS
#define HAS_BIAS 0
#endif
#ifndef HAS_INIT
#define HAS_INIT 0
#endif
#ifndef VARLEN
#define VARLEN 0
#endif

#define THREADS 128
#ifndef UNROLL
#define UNROLL 8   // tokens whose loads are issued together (kept packed in registers until used)
#endif

static_assert(W >= 2 && W <= 8, "kernel width W must be in 2..8");

typedef qf_type<TX>::t tx;
typedef qf_type<TS>::t ts;
typedef qf_type<TW>::t tw;
typedef qf_type<TB>::t tb;

// VEC elements of T as they sit in memory: one 16- or 8-byte word when they fill it, else VEC elements.
template <int bytes> struct word_of { typedef void t; };
template <> struct word_of<16> { typedef uint4 t; };
template <> struct word_of<8> { typedef uint2 t; };
template <typename T, typename Wd = typename word_of<VEC * sizeof(T)>::t> struct packed { Wd w; };
template <typename T> struct packed<T, void> { T e[VEC]; };
template <typename T> __host__ __device__ constexpr bool is_wide() { return VEC * sizeof(T) == 16 || VEC * sizeof(T) == 8; }

template <typename T>
__device__ __forceinline__ void load_packed(const T* p, packed<T>& r)
{
    if constexpr (is_wide<T>()) r.w = *reinterpret_cast<const decltype(r.w)*>(p);
    else {
#pragma unroll
        for (int v = 0; v < VEC; ++v) r.e[v] = p[v];
    }
}

template <typename T>
__device__ __forceinline__ float unpack(const packed<T>& r, int v)
{
    if constexpr (is_wide<T>()) return to_f(reinterpret_cast<const T*>(&r.w)[v]);
    else return to_f(r.e[v]);
}

template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float* f)
{
    packed<T> r;
    load_packed(p, r);
#pragma unroll
    for (int v = 0; v < VEC; ++v) f[v] = unpack(r, v);
}

template <typename T>
__device__ __forceinline__ void store_vec(T* p, const float* f)
{
    if constexpr (is_wide<T>()) {
        packed<T> r;
        T* e = reinterpret_cast<T*>(&r.w);
#pragma unroll
        for (int v = 0; v < VEC; ++v) e[v] = from_f<T>(f[v]);
        *reinterpret_cast<decltype(r.w)*>(p) = r.w;
    } else {
#pragma unroll
        for (int v = 0; v < VEC; ++v) p[v] = from_f<T>(f[v]);
    }
}

// silu with the fast exp and divide (x / inf gives -0 for very negative x, as it should)
__device__ __forceinline__ float silu_fast(float x) { return __fdividef(x, 1.f + __expf(-x)); }

__device__ __forceinline__ int seq_start(const int* cu, int n, int T) { return VARLEN ? cu[n] : n * T; }

// Window slots j = 0..W-2 hold the inputs at positions i - (W-1) + j, for the token i about to be
// processed of sequence n, which starts at s; positions before s come from the initial state.
__device__ __forceinline__ void fill_window(float (*win)[VEC], int i, int s, int n, int C, int c0,
                                           const tx* __restrict__ x, long long x_sb, long long x_st, int T,
                                           const tx* __restrict__ init)
{
#pragma unroll
    for (int j = 0; j < W - 1; ++j) {
        const int p = i - (W - 1) + j;
        if (p >= s) {
            const int row = VARLEN ? 0 : p / T, t = VARLEN ? p : p % T;
            load_vec(x + row * x_sb + t * x_st + c0, win[j]);
        } else {
#pragma unroll
            for (int v = 0; v < VEC; ++v)
                win[j][v] = HAS_INIT ? to_f(init[((size_t)n * C + c0 + v) * (W - 1) + (W - 1) + (p - s)]) : 0.f;
        }
    }
}

// x: [B, T, C] with batch / token strides x_sb / x_st (channels contiguous); y: [B, T, C] contiguous;
// weight: [C, W]; bias: [C]; init, final_state: [N, C, W-1] contiguous; cu_seqlens: [N + 1] (VARLEN,
// B == 1); total = B * T tokens; each block.y handles `chunk` consecutive tokens.
extern "C" __global__ void __launch_bounds__(THREADS)
causal_conv1d_prefill(const tx* __restrict__ x, const tw* __restrict__ weight, const tb* __restrict__ bias,
                      const tx* __restrict__ init, const int* __restrict__ cu_seqlens,
                      tx* __restrict__ y, tx* __restrict__ final_state,
                      int C, int T, int N, int total, int chunk, long long x_sb, long long x_st)
{
    const int c0 = (blockIdx.x * THREADS + threadIdx.x) * VEC;
    if (c0 >= C) return;

    float w[W][VEC], bv[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
#pragma unroll
        for (int j = 0; j < W; ++j) w[j][v] = to_f(weight[(size_t)(c0 + v) * W + j]);
        bv[v] = HAS_BIAS ? to_f(bias[c0 + v]) : 0.f;
    }

    if (blockIdx.y == 0) {  // empty sequences: the final state is the initial state
        for (int n = 0; n < N; ++n) {
            if (seq_start(cu_seqlens, n, T) != seq_start(cu_seqlens, n + 1, T)) continue;
#pragma unroll
            for (int v = 0; v < VEC; ++v)
#pragma unroll
                for (int j = 0; j < W - 1; ++j) {
                    const size_t o = ((size_t)n * C + c0 + v) * (W - 1) + j;
                    final_state[o] = HAS_INIT ? init[o] : from_f<tx>(0.f);
                }
        }
    }

    int i = blockIdx.y * chunk;
    const int i1 = min(i + chunk, total);
    if (i >= i1) return;

    // the sequence holding token i: the last n with start(n) <= i (skips empty sequences)
    int n;
    if (VARLEN) {
        int lo = 0, hi = N - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (cu_seqlens[mid] <= i) lo = mid; else hi = mid - 1;
        }
        n = lo;
    } else {
        n = i / T;
    }
    int s = seq_start(cu_seqlens, n, T), e = seq_start(cu_seqlens, n + 1, T);

    float win[W - 1][VEC];
    fill_window(win, i, s, n, C, c0, x, x_sb, x_st, T, init);

    while (i < i1) {
        if (i == e) {  // next non-empty sequence
            do { ++n; s = e; e = seq_start(cu_seqlens, n + 1, T); } while (e == s);
            fill_window(win, i, s, n, C, c0, x, x_sb, x_st, T, init);
        }
        const int seg_end = min(i1, e);
        const int row = VARLEN ? 0 : n;
        const tx* xr = x + row * x_sb + c0;
        tx* yr = y + (size_t)row * T * C + c0;
        for (; i < seg_end; i += UNROLL) {
            packed<tx> xin[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                if (i + u < seg_end) load_packed(xr + (long long)(i + u - row * T) * x_st, xin[u]);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                if (i + u < seg_end) {
                    float out[VEC];
#pragma unroll
                    for (int v = 0; v < VEC; ++v) {
                        const float xv = unpack(xin[u], v);
                        float acc = bv[v];
#pragma unroll
                        for (int j = 0; j < W - 1; ++j) acc = fmaf(w[j][v], win[j][v], acc);
                        acc = fmaf(w[W - 1][v], xv, acc);
                        out[v] = silu_fast(acc);
#pragma unroll
                        for (int j = 0; j < W - 2; ++j) win[j][v] = win[j + 1][v];
                        win[W - 2][v] = xv;
                    }
                    store_vec(yr + (size_t)(i + u - row * T) * C, out);
                }
            }
        }
        i = seg_end;
        if (seg_end == e) {  // this thread handled the sequence's last token
#pragma unroll
            for (int v = 0; v < VEC; ++v)
#pragma unroll
                for (int j = 0; j < W - 1; ++j)
                    final_state[((size_t)n * C + c0 + v) * (W - 1) + j] = from_f<tx>(win[j][v]);
        }
    }
}

// x: [N, C] (sequence stride x_sn); state: [N, C, W-1] with sequence stride s_sn, (C, W-1) contiguous,
// shifted in place; y: [N, C] contiguous.
extern "C" __global__ void __launch_bounds__(THREADS)
causal_conv1d_update(const tx* __restrict__ x, ts* __restrict__ state, const tw* __restrict__ weight,
                     const tb* __restrict__ bias, tx* __restrict__ y, int N, int C, long long x_sn, long long s_sn)
{
    const long long idx = (long long)blockIdx.x * THREADS + threadIdx.x;
    if (idx >= (long long)N * C) return;
    const int n = (int)(idx / C), c = (int)(idx % C);
    ts* st = state + n * s_sn + (size_t)c * (W - 1);
    float xs[W];
#pragma unroll
    for (int j = 0; j < W - 1; ++j) xs[j] = to_f(st[j]);
    const ts xn = from_f<ts>(to_f(x[n * x_sn + c]));  // the reference appends x in the state's dtype
    xs[W - 1] = to_f(xn);
    float acc = HAS_BIAS ? to_f(bias[c]) : 0.f;
#pragma unroll
    for (int j = 0; j < W; ++j) acc = fmaf(to_f(weight[(size_t)c * W + j]), xs[j], acc);
#pragma unroll
    for (int j = 0; j < W - 2; ++j) st[j] = st[j + 1];
    st[W - 2] = xn;
    y[idx] = from_f<tx>(silu_f(acc));
}

// The conv state after ends[s] tokens of a prompt, for each s: the W-1 inputs before that point (oldest
// first), from the initial state where the point lies fewer than W-1 tokens in (zeros without one). What
// the prefill leaves as its final state, for points inside it (a graphed prefill's cut and prompt end).
// x: [T, C] (token stride x_st, channels contiguous); init: [C, W-1] contiguous (HAS_INIT); ends: [S],
// clamped to 0..T; out: [S, C, W-1] contiguous. One thread per (channel, point).
extern "C" __global__ void __launch_bounds__(THREADS)
causal_conv1d_states(const tx* __restrict__ x, const tx* __restrict__ init, const long long* __restrict__ ends,
                     tx* __restrict__ out, int C, int T, long long x_st)
{
    const int c = blockIdx.x * THREADS + threadIdx.x, s = blockIdx.y;
    if (c >= C) return;
    const long long e = min(max(ends[s], 0LL), (long long)T);
    tx* o = out + ((size_t)s * C + c) * (W - 1);
#pragma unroll
    for (int j = 0; j < W - 1; ++j) {
        const long long p = e - (W - 1) + j;
        o[j] = p >= 0 ? x[p * x_st + c] : HAS_INIT ? init[(size_t)c * (W - 1) + (W - 1) + p] : from_f<tx>(0.f);
    }
}
