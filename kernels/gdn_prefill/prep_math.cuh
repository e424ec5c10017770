// The prep kernel's math (prep.cu): the 64x64 triangular inverse and the scaled, masked chunk-local
// products. Included after prep.cu has defined elem, u32 and the tile macros (CH, DK, KST, FST, BST).
#pragma once
#include "mma_tiles.cuh"

// ---------------------------------------------------------------- the 64x64 inverse, 16x16 blocks in fp32
// acc (16x16 as two m16n8 tiles) += A (16x16, row stride lda) * B (16x16, row stride ldb), tf32 mma. Both hold
// fp32 values already rounded to tf32 (cvt.rna) where they were stored: rounded once there, not at every use.
__device__ __forceinline__ void mm16_tf32(float acc[2][4], const float* A, int lda, const float* B, int ldb, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
        const float* Ab = A + 8 * ks;
        const u32 af[4] = {__float_as_uint(Ab[g * lda + t]), __float_as_uint(Ab[(g + 8) * lda + t]),
                           __float_as_uint(Ab[g * lda + t + 4]), __float_as_uint(Ab[(g + 8) * lda + t + 4])};
#pragma unroll
        for (int nj = 0; nj < 2; ++nj) {
            const float* Bb = B + 8 * ks * ldb + 8 * nj;
            mma1688tf32(acc[nj], af, __float_as_uint(Bb[t * ldb + g]), __float_as_uint(Bb[(t + 4) * ldb + g]));
        }
    }
}
__device__ __forceinline__ float tf32r(float x) { return __uint_as_float(tf32(x)); }
// Store sign * acc into a 16x16 fp32 block (row stride ld; rounded to tf32: it only feeds mm16_tf32) and, if Tb,
// into its 16-bit copy.
__device__ __forceinline__ void put16(const float acc[2][4], float sign, float* F, int ld, elem* Tb, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nj = 0; nj < 2; ++nj) {
        const int c = 8 * nj + 2 * t;
        if (F) {
            *reinterpret_cast<float2*>(F + g * ld + c) = make_float2(tf32r(sign * acc[nj][0]), tf32r(sign * acc[nj][1]));
            *reinterpret_cast<float2*>(F + (g + 8) * ld + c) = make_float2(tf32r(sign * acc[nj][2]), tf32r(sign * acc[nj][3]));
        }
        if (Tb) {
            *reinterpret_cast<u32*>(Tb + g * BST + c) = pack2(sign * acc[nj][0], sign * acc[nj][1]);
            *reinterpret_cast<u32*>(Tb + (g + 8) * BST + c) = pack2(sign * acc[nj][2], sign * acc[nj][3]);
        }
    }
}

// T = (I + L)^-1 for the strictly lower 64x64 L (fp32, Lf: the diagonal blocks exact, the blocks below them
// rounded to tf32 as tri_store leaves them), by the 128 threads of group A.
// Diagonal 16x16 blocks by substitution; then T10, T32 (= -Tii Lij Tjj); then the lower-left 32x32
// block as -T_D (L_C T_A). Writes Tb (16-bit, lower part incl. diagonal) and uses Tf (tf32) and Xs.
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
            Tf[(d0 + i) * FST + d0 + cc] = tf32r(x[i]);
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
// The lower 16x16 blocks of a 64x64 product that warp w (of 4) owns: first its diagonal block (w, w), then
// #w and, for warps 0 and 1, #(w + 4) of the six below the diagonal, (1,0) (2,0) (3,0) (2,1) (3,1) (3,2).
// 10 blocks, none twice; warps 2 and 3 have two (tri_nblocks).
__device__ __forceinline__ void tri_blocks(int w, int bi[3], int bj[3]) {
    bi[0] = bj[0] = w;
    bi[1] = w == 3 ? 2 : w + 1;
    bj[1] = w == 3 ? 1 : 0;
    bi[2] = 3;
    bj[2] = w + 1;
}
__device__ __forceinline__ int tri_nblocks(int w) { return w < 2 ? 3 : 2; }


// tri_acc's blocks scaled and masked: K K^T -> L (fp32, row stride FST, strictly lower,
// beta_i rk_i rk_j e^{G_i-G_j});  Q K^T (is_q) -> P (16-bit, row stride pst, rq_i rk_j e^{..}).
// Only the diagonal block needs the mask: below it i > j, so G_i <= G_j and e^{G_i-G_j} <= 1. Above the
// diagonal the exponential may overflow; the mask selects 0 there (a select, not a product). L's blocks
// below the diagonal only feed the inverse's tf32 products: stored rounded to tf32; its diagonal blocks stay
// exact fp32 (the substitution).
__device__ __forceinline__ void tri_store(bool is_q, const float acc[3][2][4], int w, const float* Gc,
                                          const float* Bt, const float* Rk, const float* Rq, float* Lf,
                                          elem* Pb, int pst, int lane) {
    constexpr float LOG2E = 1.4426950408889634f;
    const int g = lane >> 2, t = lane & 3;
    int bi[3], bj[3];
    tri_blocks(w, bi, bj);
    const int nq = tri_nblocks(w);
    const int lim = is_q ? 0 : 1;  // P keeps the diagonal, L does not
#pragma unroll
    for (int q = 0; q < 3; ++q) {
        if (q >= nq) break;  // warp-uniform
        float2 gc[2], kc[2];
#pragma unroll
        for (int nj = 0; nj < 2; ++nj) {
            const int c = 16 * bj[q] + 8 * nj + 2 * t;
            gc[nj] = *reinterpret_cast<const float2*>(Gc + c);
            kc[nj] = *reinterpret_cast<const float2*>(Rk + c);
        }
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int r = 16 * bi[q] + g + 8 * hr;
            const float gr = Gc[r] * LOG2E, fr = is_q ? Rq[r] : Bt[r] * Rk[r];
#pragma unroll
            for (int nj = 0; nj < 2; ++nj) {
                const int c = 16 * bj[q] + 8 * nj + 2 * t;
                float v0 = acc[q][nj][2 * hr] * (fr * kc[nj].x) * ex2_ftz(fmaf(gc[nj].x, -LOG2E, gr));
                float v1 = acc[q][nj][2 * hr + 1] * (fr * kc[nj].y) * ex2_ftz(fmaf(gc[nj].y, -LOG2E, gr));
                if (q == 0) {
                    v0 = r - c >= lim ? v0 : 0.f;
                    v1 = r - c - 1 >= lim ? v1 : 0.f;
                }
                if (is_q) *reinterpret_cast<u32*>(Pb + r * pst + c) = pack2(v0, v1);
                else if (q == 0) *reinterpret_cast<float2*>(Lf + r * FST + c) = make_float2(v0, v1);
                else *reinterpret_cast<float2*>(Lf + r * FST + c) = make_float2(tf32r(v0), tf32r(v1));
            }
        }
    }
}
