// Element types chosen at compile time by -D defines (0 = float, 1 = half, 2 = bfloat16), the conversions
// every kernel needs, and the norm kernels' row reduction (block_row_sum). Included by the kernels under
// kernels/*/ (NVRTC gets -I kernels/); the tensor-core PTX primitives are in mma_ptx.cuh beside it.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define QF_FLOAT 0
#define QF_HALF 1
#define QF_BF16 2

template <int code> struct qf_type;
template <> struct qf_type<QF_FLOAT> { typedef float t; };
template <> struct qf_type<QF_HALF> { typedef __half t; };
template <> struct qf_type<QF_BF16> { typedef __nv_bfloat16 t; };

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Eight / four elements of a 16-bit type as one 16-byte / 8-byte vector: the elementwise kernels' loads and
// stores (v.u from memory, v.e[i] the elements; w[] the 16-byte vector's 32-bit words, as shuffles move them).
template <typename T> union Vec8 {
    uint4 u;
    unsigned int w[4];
    T e[8];
};
template <typename T> union Vec4 {
    uint2 u;
    T e[4];
};

// Programmatic dependent launch (compute capability 9.0 and newer; nothing on older targets). A kernel the
// launcher starts with programmatic serialization (cuda_build.launch(..., programmatic=True)) may begin while
// the grid before it in the stream is still running: before grid_wait() it may only read what no earlier
// kernel writes (weights) and must write nothing; grid_wait() returns once that grid has completed and its
// writes are visible. Such a kernel calls grid_wait() on every path, so that a kernel after it, waiting for it
// to complete, waits for the one before it too; and it reads what earlier kernels wrote with coherent loads
// (__ldcg), not the read-only path (__ldg, or a plain load through a const __restrict__ pointer, which the
// compiler makes one): that data changed while the grid was already resident. grid_launch_dependents() lets the
// next grid (if launched so) start early; without it, the next starts as this one's blocks exit.
__device__ __forceinline__ void grid_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// torch.nn.functional.softplus (beta 1, threshold 20) and silu, in fp32.
__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float silu_f(float x) { return x / (1.f + expf(-x)); }

// Eight consecutive weights w[0..7] as fp32 from 16-byte loads (w 16-byte aligned): an fp32 weight in two, one
// of a 16-bit type in one. The norms' weights (rms_norm.cu, gemv.cu's fused norm): element by element they were
// eight loads a vector, each warp's spread over eight cache lines (kernels/rms_norm/NOTES.md).
__device__ __forceinline__ void load8_f32(const float* __restrict__ w, float* f) {
    const float4 a = *reinterpret_cast<const float4*>(w), b = *reinterpret_cast<const float4*>(w + 4);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
template <typename T> __device__ __forceinline__ void load8_f32(const T* __restrict__ w, float* f) {
    Vec8<T> v;
    v.u = *reinterpret_cast<const uint4*>(w);
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = to_f(v.e[e]);
}

// Sum of v over the `tpr` consecutive threads of the block that hold one row (tpr a power of two up to 32,
// or a multiple of 32): a butterfly over the row's lanes, then, for tpr > 32, the warps' partial sums
// through part (one float per warp of the block), added in warp order. Every lane ends with the same
// total. With tpr > 32 every thread of the block must call it (a __syncthreads), and a second reduction
// right after needs its own part. Used by rms_norm.cu and vision/layer_norm.cu.
template <int tpr>
__device__ __forceinline__ float block_row_sum(float v, float* part) {
#pragma unroll
    for (int off = (tpr < 32 ? tpr : 32) / 2; off >= 1; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if constexpr (tpr > 32) {
        if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
        __syncthreads();
        const int w0 = (threadIdx.x / tpr) * (tpr / 32);  // the row's first warp
        v = 0.f;
#pragma unroll
        for (int i = 0; i < tpr / 32; ++i) v += part[w0 + i];
    }
    return v;
}
