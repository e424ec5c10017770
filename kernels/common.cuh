// Element types chosen at compile time by -D defines (0 = float, 1 = half, 2 = bfloat16), and the
// conversions every kernel needs. Included by the kernels under kernels/*/ (NVRTC gets -I kernels/).
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

// torch.nn.functional.softplus (beta 1, threshold 20) and silu, in fp32.
__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float silu_f(float x) { return x / (1.f + expf(-x)); }
