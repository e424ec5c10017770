// Test fixture for wgmma.cuh (tests/test_gdn_prefill_cuda.py::test_wgmma_tiles): one warpgroup forms
// D = A B[:, c0 : c0 + n] with A [64][16 ks] and B [16 ks][128] row-major in global memory, through the
// same ldmatrix fragments, canonical B layout and descriptors as the prefill walk. With trans_a, A is
// read as the transpose of a row-major [16 ks][64] tile (ldmatrix .trans), the way the walk reads K^T.
// Built only for sm_90a (elsewhere the kernel is empty).
#include "common.cuh"
#ifndef IN_T
#define IN_T QF_BF16
#endif
typedef qf_type<IN_T>::t elem;
typedef unsigned int u32;
#include "mma_tiles.cuh"
#include "wgmma.cuh"

#define AST 72  // row stride of the A tile in shared memory (ks <= 4)

extern "C" __global__ void __launch_bounds__(128)
wgmma_check(const elem* __restrict__ A, const elem* __restrict__ B, float* __restrict__ D,
            int ks, int n, int c0, int trans_a, int lbo, int sbo)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __shared__ __align__(128) elem As[64 * AST];
    __shared__ __align__(128) elem Bs[64 * 128];
    const int tid = threadIdx.x, lane = tid & 31, wq = tid >> 5, g = lane >> 2, t = lane & 3;
    const int K = 16 * ks;
    for (int i = tid; i < 64 * K; i += 128) {  // A [64][K], or its transpose [K][64]
        const int r = trans_a ? i / 64 : i / K, c = trans_a ? i % 64 : i % K;
        As[r * AST + c] = A[i];
    }
    for (int i = tid; i < K * 128; i += 128) Bs[cb_off(i / 128, i % 128)] = B[i];
    fence_proxy_async();
    __syncthreads();
    u32 af[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        if (kk >= ks) break;
        if (trans_a) ldsm4t(af[kk], at_addr(As, AST, 16 * wq, 16 * kk, lane));
        else ldsm4(af[kk], a_addr(As, AST, 16 * wq, 16 * kk, lane));
    }
    float d[64];
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        if (kk >= ks) break;
        const unsigned long long desc = wg_desc(Bs + cb_off(16 * kk, c0), lbo, sbo);
        if (n == 128) wg_m64n128(d, af[kk], desc, kk);
        else wg_m64n64(*reinterpret_cast<float(*)[32]>(d), af[kk], desc, kk);
    }
    wg_commit();
    wg_wait<0>();
    wg_pin(d);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        if (j >= n / 8) break;
        const int r = 16 * wq + g, c = 8 * j + 2 * t;
        D[r * n + c] = d[4 * j];
        D[r * n + c + 1] = d[4 * j + 1];
        D[(r + 8) * n + c] = d[4 * j + 2];
        D[(r + 8) * n + c + 1] = d[4 * j + 3];
    }
#endif
}
