// Gated DeltaNet chunked prefill, single fused kernel (NVRTC, sm_80+; tuned for sm_90): the variant
// for short prompts and large batches, where one launch and no intermediates beat the two-kernel
// path of gdn_prefill.cu (which takes the chunk-local work off the sequential path).
//
// One thread block owns one (sequence, value head, slice of DVS state columns). The state columns
// are independent in the delta rule (u = T (beta v - beta e^G K S) needs only S's own columns), so
// slicing Dv fills the machine when B * Hv is small, with only the chunk-local work (K K^T, Q K^T
// and the 64x64 triangular inverse) repeated per slice. The block walks its sequence in chunks of
// 64 tokens; the fp32 state stays in mma accumulator registers across chunks, and nothing but the
// inputs, o and the final state touches device memory.
//
// Per chunk (G = in-chunk cumsum of the log gates, rk/rq = l2-norm factors, K/Q raw rows):
//   L = tril(beta_i rk_i rk_j e^{G_i-G_j} K K^T, -1)     T = (I + L)^-1   (fp32/tf32, then bf16)
//   P = tril(rq_i rk_j e^{G_i-G_j} Q K^T)
//   rhs = beta (v - e^G rk (K S));  u = T rhs;  o = rq e^G (Q S) + P u
//   S  <- e^{G_end} S + K^T (rk e^{G_end - G} u)
// rhs and the scaled u enter their mma as hi + lo 16-bit pairs: a single bf16 rounding of them
// alone would put the final state's error near 3e-3; split, it is ~1e-6 (strong decay) to ~7e-4.
#include "common.cuh"

#ifndef DVS
#define DVS 64  // state columns per block: 32, 64 or 128
#endif
#ifndef IN_T
#define IN_T QF_BF16  // q, k, v, o element type: QF_BF16 or QF_HALF
#endif
#ifndef AB_T
#define AB_T QF_FLOAT  // a, b element type
#endif

typedef qf_type<IN_T>::t elem;
typedef qf_type<AB_T>::t abt;
typedef unsigned int u32;

#define CH 64       // chunk length
#define DK 128      // key / value head dim
#define NTHR 256    // 8 warps: group A = warps 0-3, group B = warps 4-7
#define NST (DVS <= 64 ? 3 : 2)  // K, Q, V pipeline stages (prefetch distance NST - 1 chunks)
#define KST (DK + 8)    // smem row stride (elements) of K, Q tiles: 272 B, ldmatrix conflict-free
#define VST (DVS + 8)   // smem row stride of the DVS-wide tiles
#define FST 72          // fp32 row stride of L and T
#define BST 72          // 16-bit row stride of P and T
#define NJ (DVS / 8)    // n-tiles of 8 columns per block slice

#ifdef PROFILE  // cycles between block-wide barriers, summed over chunks, left in ht[0..4] of block 0
#define MARK(i) do { __syncthreads(); if (tid == 0) { const long long now_ = clock64(); prof[i] += now_ - tprev; tprev = now_; } } while (0)
#else
#define MARK(i) __syncthreads()
#endif

static_assert(DVS == 32 || DVS == 64 || DVS == 128, "DVS must be 32, 64 or 128");

// ---------------------------------------------------------------- shared memory layout (bytes)
#define SM_K 0
#define SM_Q (SM_K + NST * CH * KST * 2)
#define SM_V (SM_Q + NST * CH * KST * 2)
#define SM_S (SM_V + NST * CH * VST * 2)  // 16-bit state; reused for u once K S, Q S are done
#define SM_RHS (SM_S + DK * VST * 2) // low half of rhs (the high half overwrites this chunk's v)
#define SM_L (SM_RHS + CH * VST * 2)   // fp32 L; reused for the scaled u (high) once T is built
#define SM_T (SM_L + CH * FST * 4)     // fp32 T; reused for the scaled u (low)
#define SM_TB (SM_T + CH * FST * 4)
#define SM_P (SM_TB + CH * BST * 2)
#define SM_X (SM_P + CH * BST * 2)     // 4 warps x 16x16 fp32 scratch for the inverse
#define SM_VEC (SM_X + 4 * 16 * 20 * 4)
#define SM_TOTAL (SM_VEC + 4 * CH * 4)

// ---------------------------------------------------------------- tensor core helpers
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

#ifndef NO_LDSM_CLOBBER
#define LDSM_CLOBBER : "memory"
#else
#define LDSM_CLOBBER
#endif
__device__ __forceinline__ void ldsm4(u32 r[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)) LDSM_CLOBBER);
}
__device__ __forceinline__ void ldsm4t(u32 r[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)) LDSM_CLOBBER);
}

__device__ __forceinline__ void mma16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
#if IN_T == QF_BF16
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ u32 tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ void mma1688tf32(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 pack2(float x, float y) {
#if IN_T == QF_BF16
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
#else
    __half2 h = __floats2half2_rn(x, y);
#endif
    return *reinterpret_cast<u32*>(&h);
}
__device__ __forceinline__ float2 unpack2(u32 u) {
#if IN_T == QF_BF16
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u));
#else
    return __half22float2(*reinterpret_cast<__half2*>(&u));
#endif
}
// x ~= hi + lo in two 16-bit values each: keeps ~16 mantissa bits through a 16-bit mma operand.
__device__ __forceinline__ void store_split(elem* hi, elem* lo, float x, float y) {
    const u32 h = pack2(x, y);
    const float2 hf = unpack2(h);
    *reinterpret_cast<u32*>(hi) = h;
    *reinterpret_cast<u32*>(lo) = pack2(x - hf.x, y - hf.y);
}

// Fragment addresses (lane-dependent) for ldmatrix.x4, 16-bit row-major tiles with row stride ld.
// A operand 16x16 at (r0, c0) of a row-major [m][k] tile.
__device__ __forceinline__ const elem* a_addr(const elem* base, int ld, int r0, int c0, int lane) {
    return base + (r0 + (lane & 15)) * ld + c0 + (lane >> 4) * 8;
}
// A operand 16x16 taken as the transpose of a row-major [k][m] tile: A rows m0.., cols k0.. (use .trans).
__device__ __forceinline__ const elem* at_addr(const elem* base, int ld, int m0, int k0, int lane) {
    return base + (k0 + (lane & 7) + ((lane >> 4) << 3)) * ld + m0 + ((lane >> 3) & 1) * 8;
}
// B operand, two n-tiles (n0, n0+8) x k16 at k0, from a row-major [n][k] tile (no .trans).
__device__ __forceinline__ const elem* bn_addr(const elem* base, int ld, int n0, int k0, int lane) {
    return base + (n0 + (lane & 7) + ((lane >> 4) << 3)) * ld + k0 + ((lane >> 3) & 1) * 8;
}
// B operand, two n-tiles (n0, n0+8) x k16 at k0, from a row-major [k][n] tile (use .trans).
__device__ __forceinline__ const elem* bk_addr(const elem* base, int ld, int k0, int n0, int lane) {
    return base + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int n> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(n) : "memory");
}
// Barrier among the 128 threads of one warp group (id 1: group A, id 2: group B).
__device__ __forceinline__ void group_sync(int id) { asm volatile("bar.sync %0, 128;\n" :: "r"(id) : "memory"); }

// ---------------------------------------------------------------- the 64x64 inverse, 16x16 blocks in fp32
// acc (16x16 as two m16n8 tiles) += A (16x16 fp32, row stride lda) * B (16x16 fp32, row stride ldb), tf32 mma.
__device__ __forceinline__ void mm16_tf32(float acc[2][4], const float* A, int lda, const float* B, int ldb, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
        const float* Ab = A + 8 * ks;
        const u32 af[4] = {tf32(Ab[g * lda + t]), tf32(Ab[(g + 8) * lda + t]),
                           tf32(Ab[g * lda + t + 4]), tf32(Ab[(g + 8) * lda + t + 4])};
#pragma unroll
        for (int nj = 0; nj < 2; ++nj) {
            const float* Bb = B + 8 * ks * ldb + 8 * nj;
            mma1688tf32(acc[nj], af, tf32(Bb[t * ldb + g]), tf32(Bb[(t + 4) * ldb + g]));
        }
    }
}
// Store sign * acc into a 16x16 fp32 block (row stride ld) and, if Tb, into its 16-bit copy.
__device__ __forceinline__ void put16(const float acc[2][4], float sign, float* F, int ld, elem* Tb, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nj = 0; nj < 2; ++nj) {
        const int c = 8 * nj + 2 * t;
        if (F) {
            *reinterpret_cast<float2*>(F + g * ld + c) = make_float2(sign * acc[nj][0], sign * acc[nj][1]);
            *reinterpret_cast<float2*>(F + (g + 8) * ld + c) = make_float2(sign * acc[nj][2], sign * acc[nj][3]);
        }
        if (Tb) {
            *reinterpret_cast<u32*>(Tb + g * BST + c) = pack2(sign * acc[nj][0], sign * acc[nj][1]);
            *reinterpret_cast<u32*>(Tb + (g + 8) * BST + c) = pack2(sign * acc[nj][2], sign * acc[nj][3]);
        }
    }
}

// T = (I + L)^-1 for the strictly lower 64x64 L (fp32, Lf), by the 128 threads of group A.
// Diagonal 16x16 blocks by substitution; then T10, T32 (= -Tii Lij Tjj); then the lower-left 32x32
// block as -T_D (L_C T_A). Writes Tb (16-bit, lower part incl. diagonal) and uses Tf (fp32) and Xs.
__device__ __forceinline__ void invert_tril64(const float* Lf, float* Tf, elem* Tb, float* Xs, int ta) {
    const int lane = ta & 31, wa = ta >> 5;
    if (ta < CH) {  // one thread per column of the 4 diagonal blocks, right-looking substitution
        const int d0 = 16 * (ta >> 4), cc = ta & 15;
        float x[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) x[i] = (i == cc) ? 1.f : 0.f;
#pragma unroll
        for (int kk = 0; kk < 15; ++kk)
#pragma unroll
            for (int i = kk + 1; i < 16; ++i) x[i] -= Lf[(d0 + i) * FST + d0 + kk] * x[kk];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            Tf[(d0 + i) * FST + d0 + cc] = x[i];
            Tb[(d0 + i) * BST + d0 + cc] = from_f<elem>(x[i]);
        }
    }
    group_sync(1);
    float* X = Xs + wa * 320;
    if (wa < 2) {  // T10 (warp 0), T32 (warp 1)
        const int bi = 1 + 2 * wa, bj = 2 * wa;
        float acc[2][4] = {};
        mm16_tf32(acc, Lf + 16 * bi * FST + 16 * bj, FST, Tf + 16 * bj * FST + 16 * bj, FST, lane);
        put16(acc, 1.f, X, 20, nullptr, lane);
        __syncwarp();
        float y[2][4] = {};
        mm16_tf32(y, Tf + 16 * bi * FST + 16 * bi, FST, X, 20, lane);
        put16(y, -1.f, Tf + 16 * bi * FST + 16 * bj, FST, Tb + 16 * bi * BST + 16 * bj, lane);
    }
    group_sync(1);
    const int bi = 2 + (wa >> 1), bj = wa & 1;
    {  // X(bi, bj) = sum_{kb = bj..1} L[bi][kb] T[kb][bj]  (= L_C T_A)
        float acc[2][4] = {};
        for (int kb = bj; kb < 2; ++kb)
            mm16_tf32(acc, Lf + 16 * bi * FST + 16 * kb, FST, Tf + 16 * kb * FST + 16 * bj, FST, lane);
        put16(acc, 1.f, X, 20, nullptr, lane);
    }
    group_sync(1);
    {  // T(bi, bj) = -sum_{kb = 2..bi} T[bi][kb] X(kb, bj)
        float acc[2][4] = {};
        for (int kb = 2; kb <= bi; ++kb)
            mm16_tf32(acc, Tf + 16 * bi * FST + 16 * kb, FST, Xs + ((kb - 2) * 2 + bj) * 320, 20, lane);
        put16(acc, -1.f, nullptr, 0, Tb + 16 * bi * BST + 16 * bj, lane);
    }
}

// ---------------------------------------------------------------- chunk-local products
__device__ __forceinline__ void tri_block(int id, int& bi, int& bj) {  // 0..9 -> lower blocks (bi >= bj)
    bi = id < 1 ? 0 : id < 3 ? 1 : id < 6 ? 2 : 3;
    bj = id - bi * (bi + 1) / 2;
}

// The lower 16x16 blocks {w, w+4, w+8} (< 10; warps 2, 3 redo block w as their third) of X K^T
// (X = raw K rows, or Q rows if is_q), scaled and masked, in one code path for both groups:
// K K^T -> L (fp32, strictly lower, beta_i rk_i rk_j e^{G_i-G_j});  Q K^T -> P (16-bit, rq_i rk_j e^{..}).
__device__ __forceinline__ void tri_products(bool is_q, const elem* X, const elem* Kc, int w, const float* Gc,
                                             const float* Bt, const float* Rk, const float* Rq, float* Lf,
                                             elem* Pb, int lane) {
    const int g = lane >> 2, t = lane & 3;
    int bi[3], bj[3];
#pragma unroll
    for (int q = 0; q < 3; ++q) tri_block(w + 4 * q < 10 ? w + 4 * q : w, bi[q], bj[q]);
    float acc[3][2][4] = {};
#pragma unroll 1
    for (int kk = 0; kk < DK / 16; ++kk) {
#pragma unroll
        for (int q = 0; q < 3; ++q) {
            u32 af[4], bf[4];
            ldsm4(af, a_addr(X, KST, 16 * bi[q], 16 * kk, lane));
            ldsm4(bf, bn_addr(Kc, KST, 16 * bj[q], 16 * kk, lane));
            mma16816(acc[q][0], af, bf[0], bf[1]);
            mma16816(acc[q][1], af, bf[2], bf[3]);
        }
    }
    const int lim = is_q ? 0 : 1;  // P keeps the diagonal, L does not
#pragma unroll
    for (int q = 0; q < 3; ++q) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int r = 16 * bi[q] + g + 8 * hr;
            const float gr = Gc[r], fr = is_q ? Rq[r] : Bt[r] * Rk[r];
#pragma unroll
            for (int nj = 0; nj < 2; ++nj) {
                const int c = 16 * bj[q] + 8 * nj + 2 * t;
                const float2 gc = *reinterpret_cast<const float2*>(Gc + c);
                const float2 kc = *reinterpret_cast<const float2*>(Rk + c);
                const float m0 = (r - c >= lim) ? fr : 0.f, m1 = (r - c - 1 >= lim) ? fr : 0.f;
                const float v0 = m0 * kc.x * acc[q][nj][2 * hr] * __expf(fminf(gr - gc.x, 0.f));
                const float v1 = m1 * kc.y * acc[q][nj][2 * hr + 1] * __expf(fminf(gr - gc.y, 0.f));
                if (is_q) *reinterpret_cast<u32*>(Pb + r * BST + c) = pack2(v0, v1);
                else *reinterpret_cast<float2*>(Lf + r * FST + c) = make_float2(v0, v1);
            }
        }
    }
}

// acc[j] (16 rows r0.. x DVS) = X[r0:r0+16, :] S, X raw K or Q rows, S the 16-bit state in smem.
// With TWO, also acc2 = X2[r0:r0+16, :] S (the S fragments are shared).
template <bool TWO>
__device__ __forceinline__ void rows_times_state(const elem* X, const elem* X2, int r0, const elem* Sb,
                                                 float acc[NJ][4], float acc2[NJ][4], int lane) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
        if (TWO) acc2[j][0] = acc2[j][1] = acc2[j][2] = acc2[j][3] = 0.f;
    }
#pragma unroll 1
    for (int kk = 0; kk < DK / 16; ++kk) {
        u32 af[4], af2[4];
        ldsm4(af, a_addr(X, KST, r0, 16 * kk, lane));
        if (TWO) ldsm4(af2, a_addr(X2, KST, r0, 16 * kk, lane));
#pragma unroll
        for (int jp = 0; jp < NJ / 2; ++jp) {
            u32 bf[4];
            ldsm4t(bf, bk_addr(Sb, VST, 16 * kk, 16 * jp, lane));
            mma16816(acc[2 * jp], af, bf[0], bf[1]);
            mma16816(acc[2 * jp + 1], af, bf[2], bf[3]);
            if (TWO) {
                mma16816(acc2[2 * jp], af2, bf[0], bf[1]);
                mma16816(acc2[2 * jp + 1], af2, bf[2], bf[3]);
            }
        }
    }
}

// rhs = beta (v - e^G rk (K S)) for rows r0..r0+16 as hi (over v in place) + lo (Rs) 16-bit halves.
__device__ __forceinline__ void store_rhs(const float acc[NJ][4], int r0, elem* Vc, elem* Rs, const float* Gc,
                                          const float* Bt, const float* Rk, int lane) {
    const int g = lane >> 2, t = lane & 3;
    const int ra0 = r0 + g, ra1 = ra0 + 8;
    const float f0 = Rk[ra0] * __expf(Gc[ra0]), f1 = Rk[ra1] * __expf(Gc[ra1]);
    const float b0 = Bt[ra0], b1 = Bt[ra1];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        const int cc = 8 * j + 2 * t;
        const float2 x0 = unpack2(*reinterpret_cast<const u32*>(Vc + ra0 * VST + cc));
        const float2 x1 = unpack2(*reinterpret_cast<const u32*>(Vc + ra1 * VST + cc));
        store_split(Vc + ra0 * VST + cc, Rs + ra0 * VST + cc,
                    b0 * (x0.x - f0 * acc[j][0]), b0 * (x0.y - f0 * acc[j][1]));
        store_split(Vc + ra1 * VST + cc, Rs + ra1 * VST + cc,
                    b1 * (x1.x - f1 * acc[j][2]), b1 * (x1.y - f1 * acc[j][3]));
    }
}

// Grid: (128 / DVS, Hv, N). Strides in elements; o is contiguous [B, T, Hv, 128].
extern "C" __global__ void __launch_bounds__(NTHR, 1)
gdn_chunk_prefill_fwd(const elem* __restrict__ q, const elem* __restrict__ k, const elem* __restrict__ v,
                      const abt* __restrict__ a, const abt* __restrict__ b,
                      const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                      const float* __restrict__ h0, const int* __restrict__ cu_seqlens,
                      elem* __restrict__ o, float* __restrict__ ht,
                      int T, int Hk, int Hv,
                      long long q_sb, long long q_st, long long q_sh,
                      long long k_sb, long long k_st, long long k_sh,
                      long long v_sb, long long v_st, long long v_sh,
                      long long a_sb, long long a_st, long long a_sh,
                      long long b_sb, long long b_st, long long b_sh)
{
    extern __shared__ __align__(128) unsigned char smem[];
    elem* Ks = reinterpret_cast<elem*>(smem + SM_K);
    elem* Qs = reinterpret_cast<elem*>(smem + SM_Q);
    elem* Vs = reinterpret_cast<elem*>(smem + SM_V);
    elem* Sb = reinterpret_cast<elem*>(smem + SM_S);
    elem* Rs = reinterpret_cast<elem*>(smem + SM_RHS);
    float* Lf = reinterpret_cast<float*>(smem + SM_L);
    float* Tf = reinterpret_cast<float*>(smem + SM_T);
    elem* Ub = reinterpret_cast<elem*>(smem + SM_S);   // u, once the 16-bit state is dead
    elem* Uh = reinterpret_cast<elem*>(smem + SM_L);   // rk e^{G_end-G} u (hi), once L is dead
    elem* Ul = reinterpret_cast<elem*>(smem + SM_T);   // (lo), once T (fp32) is dead
    elem* Tb = reinterpret_cast<elem*>(smem + SM_TB);
    elem* Pb = reinterpret_cast<elem*>(smem + SM_P);
    float* Xs = reinterpret_cast<float*>(smem + SM_X);
    float* Gc = reinterpret_cast<float*>(smem + SM_VEC);
    float* Bt = Gc + CH;
    float* Rk = Bt + CH;
    float* Rq = Rk + CH;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int v0 = blockIdx.x * DVS, h = blockIdx.y, n = blockIdx.z;
    const int hk = h / (Hv / Hk);

    long long bos, batch_tok;  // first token of the sequence in its batch row; flat token index of it
    int len, batch;
    if (cu_seqlens) {
        batch = 0;
        bos = cu_seqlens[n];
        len = cu_seqlens[n + 1] - (int)bos;
        batch_tok = bos;
    } else {
        batch = n;
        bos = 0;
        len = T;
        batch_tok = (long long)n * T;
    }
    const elem* qb = q + batch * q_sb + bos * q_st + hk * q_sh;
    const elem* kb = k + batch * k_sb + bos * k_st + hk * k_sh;
    const elem* vb = v + batch * v_sb + bos * v_st + h * v_sh + v0;
    const abt* ab = a + batch * a_sb + bos * a_st + h * a_sh;
    const abt* bb = b + batch * b_sb + bos * b_st + h * b_sh;
    elem* ob = o + (batch_tok * Hv + h) * DK + v0;
    const int nchunks = (len + CH - 1) / CH;
    const float neg_A = -__expf(A_log[h]);
    const float dtb = dt_bias[h];

    auto load_chunk = [&](int c, int buf) {  // K, Q rows and this block's V columns; zero past the end
        elem* Kd = Ks + buf * CH * KST;
        elem* Qd = Qs + buf * CH * KST;
        elem* Vd = Vs + buf * CH * VST;
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
        for (int i = 0; i < DVS / 32; ++i) {
            const int idx = tid + i * NTHR, row = idx / (DVS / 8), col = (idx % (DVS / 8)) * 8;
            const int tok = c * CH + row;
            const bool ok = tok < len;
            const long long tt = ok ? tok : 0;
            cp_async16(Vd + row * VST + col, vb + tt * v_st + col, ok);
        }
    };

    // The state slice rows [16 warp, 16 warp + 16) x DVS columns, as mma accumulators.
    float s[NJ][4];
    if (h0) {
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

    // Warp 0 keeps the raw a, b of the next chunk's tokens 2 lane, 2 lane + 1 in registers.
    float ra[2] = {0.f, 0.f}, rb[2] = {0.f, 0.f};
    auto load_ab = [&](int c) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int tok = c * CH + 2 * lane + e;
            if (tok < len) {
                ra[e] = to_f(ab[(long long)tok * a_st]);
                rb[e] = to_f(bb[(long long)tok * b_st]);
            }
        }
    };

#pragma unroll
    for (int st = 0; st < NST - 1; ++st) {
        if (st < nchunks) load_chunk(st, st);
        cp_async_commit();
    }
    if (warp == 0 && nchunks > 0) load_ab(0);
    float oacc[NJ][4];
#ifdef PROFILE
    long long prof[5] = {}, tprev = clock64();
#endif

    for (int c = 0; c < nchunks; ++c) {
        const int buf = c % NST;
        const elem* Kc = Ks + buf * CH * KST;
        const elem* Qc = Qs + buf * CH * KST;
        elem* Vc = Vs + buf * CH * VST;  // v, then the high half of rhs
        cp_async_wait<NST - 2>();
        MARK(0);
        if (c + NST - 1 < nchunks) load_chunk(c + NST - 1, (c + NST - 1) % NST);
        cp_async_commit();

        // ---- phase 1: gates (warp 0), l2-norm factors (2 threads a row), state -> 16-bit smem
        if (warp == 0) {
            float gv[2], bv[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const bool ok = c * CH + 2 * lane + e < len;
                const float x = ra[e] + dtb;
                gv[e] = ok ? neg_A * (x > 20.f ? x : __logf(1.f + __expf(x))) : 0.f;
                bv[e] = ok ? __fdividef(1.f, 1.f + __expf(-rb[e])) : 0.f;
            }
            float incl = gv[0] + gv[1];
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const float y = __shfl_up_sync(0xffffffffu, incl, off);
                if (lane >= off) incl += y;
            }
            *reinterpret_cast<float2*>(Gc + 2 * lane) = make_float2(incl - gv[1], incl);
            *reinterpret_cast<float2*>(Bt + 2 * lane) = make_float2(bv[0], bv[1]);
            if (c + 1 < nchunks) load_ab(c + 1);
        }
        {
            const int row = tid >> 1, hf = tid & 1;  // rows 0..63 of K, then 0..63 of Q
            const elem* src = (row < CH ? Kc + row * KST : Qc + (row - CH) * KST) + 64 * hf;
            float ss = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const uint4 raw = *reinterpret_cast<const uint4*>(src + 8 * ((i + 4 * hf) & 7));  // bank-rotated
                const u32 w4[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 f = unpack2(w4[e]);
                    ss = fmaf(f.x, f.x, ss);
                    ss = fmaf(f.y, f.y, ss);
                }
            }
            ss += __shfl_xor_sync(0xffffffffu, ss, 1);
            if (hf == 0) {
                const float r = rsqrtf(ss + 1e-6f);
                if (row < CH) Rk[row] = r;
                else Rq[row - CH] = r * 0.08838834764831845f;  // 128 ** -0.5
            }
        }
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const int r = 16 * warp + g, cc = 8 * j + 2 * t;
            *reinterpret_cast<u32*>(Sb + r * VST + cc) = pack2(s[j][0], s[j][1]);
            *reinterpret_cast<u32*>(Sb + (r + 8) * VST + cc) = pack2(s[j][2], s[j][3]);
        }
        MARK(1);

        // ---- phase 2: group A: L, then T = (I + L)^-1 [, K S -> rhs];  group B: P, Q S -> o part [, K S -> rhs]
        tri_products(warp >= 4, warp >= 4 ? Qc : Kc, Kc, warp & 3, Gc, Bt, Rk, Rq, Lf, Pb, lane);  // one copy of the code
        if (warp < 4) {
            group_sync(1);
            invert_tril64(Lf, Tf, Tb, Xs, tid);
#if DVS > 64
            float kacc[NJ][4];
            rows_times_state<false>(Kc, Kc, 16 * warp, Sb, kacc, kacc, lane);
            store_rhs(kacc, 16 * warp, Vc, Rs, Gc, Bt, Rk, lane);
#endif
        } else {
            const int wb = warp - 4;
#if DVS > 64
            rows_times_state<false>(Qc, Qc, 16 * wb, Sb, oacc, oacc, lane);
#else
            float kacc[NJ][4];
            rows_times_state<true>(Qc, Kc, 16 * wb, Sb, oacc, kacc, lane);
            store_rhs(kacc, 16 * wb, Vc, Rs, Gc, Bt, Rk, lane);
#endif
            const int ra0 = 16 * wb + g, ra1 = ra0 + 8;
            const float f0 = Rq[ra0] * __expf(Gc[ra0]), f1 = Rq[ra1] * __expf(Gc[ra1]);
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                oacc[j][0] *= f0; oacc[j][1] *= f0; oacc[j][2] *= f1; oacc[j][3] *= f1;
            }
        }
        MARK(2);

        // ---- phase 3: u = T rhs (rows 16 (warp & 3), column half warp >> 2)
        {
            const int mt = warp & 3, jh = (warp >> 2) * (NJ / 2);
            float acc[NJ / 2][4];
#pragma unroll
            for (int j = 0; j < NJ / 2; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
            for (int kk = 0; kk <= mt; ++kk) {
                u32 af[4];
                ldsm4(af, a_addr(Tb, BST, 16 * mt, 16 * kk, lane));
#pragma unroll
                for (int jp = 0; jp < NJ / 4; ++jp) {
                    u32 bh[4], bl[4];
                    ldsm4t(bh, bk_addr(Vc, VST, 16 * kk, 8 * jh + 16 * jp, lane));
                    ldsm4t(bl, bk_addr(Rs, VST, 16 * kk, 8 * jh + 16 * jp, lane));
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
            for (int j = 0; j < NJ / 2; ++j) {
                const int cc = 8 * (jh + j) + 2 * t;
                *reinterpret_cast<u32*>(Ub + ra0 * VST + cc) = pack2(acc[j][0], acc[j][1]);
                *reinterpret_cast<u32*>(Ub + ra1 * VST + cc) = pack2(acc[j][2], acc[j][3]);
                store_split(Uh + ra0 * VST + cc, Ul + ra0 * VST + cc, f0 * acc[j][0], f0 * acc[j][1]);
                store_split(Uh + ra1 * VST + cc, Ul + ra1 * VST + cc, f1 * acc[j][2], f1 * acc[j][3]);
            }
        }
        MARK(3);

        // ---- phase 4: o = rq e^G Q S + P u (warps 4-7); S <- e^{G_end} S + K^T (scaled u) (all warps)
        if (warp >= 4) {
            const int mt = warp - 4;
            for (int kk = 0; kk <= mt; ++kk) {
                u32 af[4];
                ldsm4(af, a_addr(Pb, BST, 16 * mt, 16 * kk, lane));
#pragma unroll
                for (int jp = 0; jp < NJ / 2; ++jp) {
                    u32 bf[4];
                    ldsm4t(bf, bk_addr(Ub, VST, 16 * kk, 16 * jp, lane));
                    mma16816(oacc[2 * jp], af, bf[0], bf[1]);
                    mma16816(oacc[2 * jp + 1], af, bf[2], bf[3]);
                }
            }
            const int tok0 = c * CH + 16 * mt + g, tok1 = tok0 + 8;
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
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
            for (int j = 0; j < NJ; ++j) {
                s[j][0] *= decay; s[j][1] *= decay; s[j][2] *= decay; s[j][3] *= decay;
            }
#pragma unroll 1
            for (int kk = 0; kk < CH / 16; ++kk) {
                u32 af[4];
                ldsm4t(af, at_addr(Kc, KST, 16 * warp, 16 * kk, lane));
#pragma unroll
                for (int jp = 0; jp < NJ / 2; ++jp) {
                    u32 bh[4], bl[4];
                    ldsm4t(bh, bk_addr(Uh, VST, 16 * kk, 16 * jp, lane));
                    ldsm4t(bl, bk_addr(Ul, VST, 16 * kk, 16 * jp, lane));
                    mma16816(s[2 * jp], af, bh[0], bh[1]);
                    mma16816(s[2 * jp + 1], af, bh[2], bh[3]);
                    mma16816(s[2 * jp], af, bl[0], bl[1]);
                    mma16816(s[2 * jp + 1], af, bl[2], bl[3]);
                }
            }
        }
#ifdef PROFILE
        MARK(4);
#endif
    }
    cp_async_wait<0>();

#ifdef PROFILE
    if (tid == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        for (int i = 0; i < 5; ++i) ht[i] = (float)prof[i];
    }
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) return;
#endif
    float* hp = ht + (((long long)n * Hv + h) * DK + 16 * warp) * DK + v0;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        *reinterpret_cast<float2*>(hp + g * DK + 8 * j + 2 * t) = make_float2(s[j][0], s[j][1]);
        *reinterpret_cast<float2*>(hp + (g + 8) * DK + 8 * j + 2 * t) = make_float2(s[j][2], s[j][3]);
    }
}
