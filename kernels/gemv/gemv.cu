// One token's projection, y = W x (W [N, K] row-major, x [K], y [N]): the decode step's linear layers,
// where every weight byte is read once per token and the step is bound by how fast the weights stream.
// A warp takes ROWS rows at a time; each lane reads 16-byte pieces (8 elements) of them, UNROLL pieces of
// each row before it uses any (ROWS * UNROLL loads in flight a lane), with a streaming load (the weights
// are not read again this step). x is staged in shared memory once a block. Products and sums in fp32, a
// shuffle reduction per row, rounded once to the element type. The grid (launch.py) gives every warp the
// same number of row groups. K a multiple of 8, rows 16-byte aligned (the launcher checks).
// SPLIT warps may share a row group, each taking one of SPLIT consecutive runs of K (launch.py: where the rows
// alone leave warps of a full grid idle, e.g. the 4,096 rows of a 9B out_proj); their row sums meet in
// shared memory, added in run order.
// Q8: W holds int8 weights with one scale a row (wscale [N], the element type; runtime/quant.py), y = (W x) *
// wscale rounded once: a 16-byte piece is 16 weights, so each weight byte is read once, half the bytes of a
// 16-bit matrix (the decode step of an int8 model; dequantizing for cuBLAS instead read, wrote and read again
// twice that, 7-15x this product's time on the 9B's shapes, bench/results/gemv-int8-ab-h200.json). A weight
// becomes fp32 through its byte placed under the exponent of 2^23 (prmt) minus 2^23 + 128: exact, two
// instructions of the full-rate pipes instead of the quarter-rate int-to-float conversion (measured within 10%
// of the conversion's form either way, NOTES.md).
//
// What stands before the projection in the decoder layer can be formed while x is staged (PRO), so that
// it costs no launch of its own:
//   PRO 0: x as given.
//   PRO 1: x = RMSNorm(res + x) with weight nw (x null: RMSNorm(res)): the residual stream's add and the
//          norm after it, as rms_norm.cu's add_rms_norm computes them (DIM = K; the same threads per row,
//          the same order of the sum of squares and the same roundings: bit for bit its output); block 0
//          stores res + x to `sum`.
//   PRO 2: x = silu(g) * u, g and u the halves of x [2 K] (the MLP's gate), as silu_mul.cu rounds them.
#include "common.cuh"

#ifndef IN_T
#define IN_T QF_BF16
#endif

#ifndef PRO
#define PRO 0
#endif
#ifndef W_T
#define W_T IN_T  // PRO 1: the norm's weight
#endif

typedef qf_type<IN_T>::t elem;
typedef qf_type<W_T>::t wtype;

#ifndef Q8
#define Q8 0
#endif
#if Q8
typedef signed char welem;  // a weight
#define WPP 16              // weights a 16-byte piece
#else
typedef elem welem;
#define WPP 8
#endif

#ifndef SPLIT
#define SPLIT 1
#endif

#define THREADS 256
#define WARPS (THREADS / 32)
#define ROWS 2
#define UNROLL 4
#define GROUPS (WARPS / SPLIT)  // row groups a block works on at once
// pieces of a warp's first row group loaded before x is staged (programmatic launch: before the wait); one
// with PRO 1, whose norm holds its row in registers meanwhile (more spill at hidden sizes 2,560 to 5,120)
#ifndef PRE
#define PRE (PRO == 1 ? 1 : UNROLL)
#endif
static_assert(SPLIT == 1 || SPLIT == 2 || SPLIT == 4, "SPLIT: 1, 2 or 4 warps a row group");

__device__ __forceinline__ float dot8(const Vec8<elem>& w, const Vec8<elem>& x, float acc) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc = fmaf(to_f(w.e[e]), to_f(x.e[e]), acc);
    return acc;
}

// 16 int8 weights w (one piece) times x pieces a, b, in column order: byte e + 128 under the exponent of 2^23
// is the float 2^23 + 128 + q_e.
__device__ __forceinline__ float dot16_q8(const uint4& w, const Vec8<elem>& a, const Vec8<elem>& b, float acc) {
    const unsigned u[4] = {w.x ^ 0x80808080u, w.y ^ 0x80808080u, w.z ^ 0x80808080u, w.w ^ 0x80808080u};
#pragma unroll
    for (int e = 0; e < 16; ++e) {
        const float q = __int_as_float(__byte_perm(u[e >> 2], 0x4B000000u, 0x7440u | (e & 3))) - 8388736.f;
        acc = fmaf(q, to_f(e < 8 ? a.e[e] : b.e[e - 8]), acc);
    }
    return acc;
}

#if PRO == 1
#define NV (DIM / 8)
// threads per row (from the launcher: rms_norm.cu's for a one-row launch) and vectors per thread
#ifndef TPR
#error "TPR (threads per row) is set by the launcher: rms_norm/launch.py _tpr"
#endif
#define VPL (NV / TPR)
static_assert(NV % TPR == 0 && TPR <= THREADS, "DIM: a multiple of 256 (every Qwen3.5 hidden size)");

// xs = RMSNorm(res + x) * (1 + nw) as 16-byte pieces; block 0 stores res + x to sum. Every group of TPR threads
// forms the whole row (the same values; the first group stores them).
__device__ __forceinline__ void stage_norm(uint4* xs, const elem* __restrict__ x, const elem* __restrict__ res,
                                           const wtype* __restrict__ nw, elem* __restrict__ sum, float eps) {
    __shared__ float part[WARPS];
    const int li = threadIdx.x % TPR;
    const bool first = threadIdx.x < TPR;
    Vec8<elem> v[VPL];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < VPL; ++k) {
        const int col = (k * TPR + li) * 8;
        v[k].u = __ldcg(reinterpret_cast<const uint4*>(res + col));
        if (x != nullptr) {
            Vec8<elem> xv;
            xv.u = __ldcg(reinterpret_cast<const uint4*>(x + col));
#pragma unroll
            for (int e = 0; e < 8; ++e) v[k].e[e] = from_f<elem>(to_f(v[k].e[e]) + to_f(xv.e[e]));
            if (blockIdx.x == 0 && first) *reinterpret_cast<uint4*>(sum + col) = v[k].u;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float f = to_f(v[k].e[e]);
            ss = fmaf(f, f, ss);
        }
    }
    ss = block_row_sum<TPR>(ss, part);
    const float rr = rsqrtf(ss * (1.f / DIM) + eps);
#pragma unroll
    for (int k = 0; k < VPL; ++k) {
        const int col = (k * TPR + li) * 8;
        Vec8<elem> out;
        float wk[8];
        load8_f32(nw + col, wk);
#pragma unroll
        for (int e = 0; e < 8; ++e) out.e[e] = from_f<elem>(to_f(v[k].e[e]) * rr * (1.f + wk[e]));
        if (first) xs[k * TPR + li] = out.u;
    }
}
#endif

// W: N rows of stride ldw weights; x: K contiguous (PRO 2: 2 K); y: N contiguous. PRO 1: res, nw: K
// contiguous, sum: K (written by block 0 when x is given), eps. Q8: wscale [N]. Unused pointers may be null.
extern "C" __global__ void __launch_bounds__(THREADS, 4)
gemv(const welem* __restrict__ W, const elem* __restrict__ x, elem* __restrict__ y, int N, int K, long long ldw,
     const elem* __restrict__ res, const wtype* __restrict__ nw, elem* __restrict__ sum, float eps,
     const elem* __restrict__ wscale)
{
    extern __shared__ uint4 xs[];  // K / 8 pieces of x (SPLIT > 1: then the warps' row sums)
    const int nx = K >> 3, nv = K / WPP;  // pieces of x, of a weight row
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int run = (nv + SPLIT - 1) / SPLIT;                      // pieces of K a warp takes
    const int v_lo = (warp % SPLIT) * run, v_hi = min(nv, v_lo + run);
    const int step = gridDim.x * GROUPS * ROWS;
    const int first = (blockIdx.x * GROUPS + warp / SPLIT) * ROWS;  // the warp's first row group

    // Launched programmatically (launch.py), the block may start while the kernel before it still runs: it
    // lets the next one start too, loads its first row group's first PRE pieces (weights: no kernel writes them),
    // and only then waits for x. What another kernel wrote (x, res) is read through L2 (ld.global.cg), never
    // through the non-coherent read-only path: it changed while this grid was resident.
    grid_launch_dependents();
    Vec8<elem> w[ROWS][UNROLL];
    if (first < N) {
#pragma unroll
        for (int u = 0; u < PRE; ++u) {
            const int v = v_lo + lane + 32 * u;
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                w[r][u].u = v < v_hi ? __ldcs(reinterpret_cast<const uint4*>(W + (long long)min(first + r, N - 1) * ldw) + v)
                                     : make_uint4(0, 0, 0, 0);
        }
    }
    grid_wait();
#if PRO == 1
    stage_norm(xs, x, res, nw, sum, eps);
#elif PRO == 2
    for (int i = threadIdx.x; i < nx; i += THREADS) {
        Vec8<elem> g, u, o;
        g.u = __ldcg(reinterpret_cast<const uint4*>(x) + i);
        u.u = __ldcg(reinterpret_cast<const uint4*>(x) + nx + i);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float sg = to_f(from_f<elem>(silu_f(to_f(g.e[e]))));
            o.e[e] = from_f<elem>(__fmul_rn(sg, to_f(u.e[e])));
        }
        xs[i] = o.u;
    }
#else
    for (int i = threadIdx.x; i < nx; i += THREADS) xs[i] = __ldcg(reinterpret_cast<const uint4*>(x) + i);
#endif
    __syncthreads();
    for (int r0 = first; r0 < N; r0 += step) {
        const uint4* row[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)  // a row past N reads row N - 1 again and is not stored
            row[r] = reinterpret_cast<const uint4*>(W + (long long)min(r0 + r, N - 1) * ldw);
        float acc[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
        for (int v0 = v_lo + lane; v0 < v_hi; v0 += 32 * UNROLL) {
            const bool pre = r0 == first && v0 == v_lo + lane;  // w holds the first PRE pieces of the first group
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int v = v0 + 32 * u;
                if (u >= PRE || !pre)
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) w[r][u].u = v < v_hi ? __ldcs(row[r] + v) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int v = v0 + 32 * u;
                if (v < v_hi) {
#if Q8
                    Vec8<elem> xa, xb;
                    xa.u = xs[2 * v];
                    xb.u = xs[2 * v + 1];
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) acc[r] = dot16_q8(w[r][u].u, xa, xb, acc[r]);
#else
                    Vec8<elem> xv;
                    xv.u = xs[v];
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) acc[r] = dot8(w[r][u], xv, acc[r]);
#endif
                }
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
#pragma unroll
            for (int off = 16; off >= 1; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
        }
#if SPLIT > 1
        // the group's SPLIT warps (the same rows, the same trips through this loop) meet at barrier 1 + group
        float* part = reinterpret_cast<float*>(xs + nx);  // [WARPS][ROWS], after x
        if (lane == 0)
#pragma unroll
            for (int r = 0; r < ROWS; ++r) part[warp * ROWS + r] = acc[r];
        asm volatile("bar.sync %0, %1;\n" :: "r"(1 + warp / SPLIT), "n"(SPLIT * 32) : "memory");
        if (warp % SPLIT == 0) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                acc[r] = part[warp * ROWS + r];
#pragma unroll
                for (int k = 1; k < SPLIT; ++k) acc[r] += part[(warp + k) * ROWS + r];
            }
        }
        asm volatile("bar.sync %0, %1;\n" :: "r"(1 + warp / SPLIT), "n"(SPLIT * 32) : "memory");  // part read
#endif
        if (lane == 0 && warp % SPLIT == 0) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                if (r0 + r < N) y[r0 + r] = from_f<elem>(Q8 ? acc[r] * to_f(wscale[r0 + r]) : acc[r]);
        }
    }
}
