// Tensor-core building blocks for the GDN prefill kernels: ldmatrix / mma.sync fragments, 16-bit
// packing, fragment addresses in padded shared-memory tiles, cp.async. The PTX primitives themselves
// (smem_u32, ldsm4 / ldsm4t, mma16816_bf16 / mma16816_f16, pack_bf16 / pack_f16, cp_async*) live in
// kernels/mma_ptx.cuh, shared with paged_attention.cu; here they are typed by IN_T. Included after the
// including file has defined elem (the 16-bit element type) and IN_T.
#pragma once
#include "mma_ptx.cuh"

// ---------------------------------------------------------------- tensor core helpers
// c += a b on the input type's operands (bf16 or fp16).
__device__ __forceinline__ void mma16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
#if IN_T == QF_BF16
    mma16816_bf16(c, a, b0, b1);
#else
    mma16816_f16(c, a, b0, b1);
#endif
}
// mma16816_f16 (mma_ptx.cuh): the same product on fp16 operands whatever the input type (the state
// updates: the scaled u and K^T in fp16).

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
    return pack_bf16(x, y);
#else
    return pack_f16(x, y);
#endif
}
__device__ __forceinline__ float2 unpack2(u32 u) {
#if IN_T == QF_BF16
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u));
#else
    return __half22float2(*reinterpret_cast<__half2*>(&u));
#endif
}
// x ~= hi + lo in two 16-bit values each: keeps ~16 mantissa bits through a 16-bit mma operand.
// Two fp32 -> fp16 pair (x in the low half), rounded to nearest, clamped to the finite range.
__device__ __forceinline__ u32 pack_f16_sat(float x, float y) {
    u32 r;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(y), "f"(x));
    return r;
}
// A 16-bit input pair (bf16 or fp16) as an fp16 pair.
__device__ __forceinline__ u32 to_f16_pair(u32 x) {
#if IN_T == QF_BF16
    const float2 f = unpack2(x);
    return pack_f16_sat(f.x, f.y);
#else
    return x;
#endif
}

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

// Barrier among the 128 threads of one warp group (id 1: group A, id 2: group B).
__device__ __forceinline__ void group_sync(int id) { asm volatile("bar.sync %0, 128;\n" :: "r"(id) : "memory"); }
