// Hopper warpgroup matrix multiply (wgmma, sm_90a only) for the GDN prefill walk: A from registers
// (the mma.m16n8k16 A fragment of each warp's 16 rows, loaded with ldmatrix as before), B from shared
// memory through a matrix descriptor, fp32 accumulators in registers. Included after mma_tiles.cuh.
//
// B tiles live in the canonical "no swizzle" layout with N contiguous (MN-major; the instruction's
// transpose-B bit): core matrices of 8 K-rows x 8 N-elements (16 B per row, 128 B each), 16 of them
// side by side along N (one 8-row group of a 128-wide tile, 2 KB), the 8-row groups one after the other.
// Element (r, c) of such a [K][128] tile is at cb_off(r, c). A thread writing its accumulator pairs
// (row g, columns 2t, 2t + 1) into it hits 32 different banks.
// Accumulators of an m64nN instruction: warp w of the warpgroup holds rows 16 w + g and 16 w + g + 8;
// d[4 j + 0, 1] are (row g, columns 8 j + 2 t, +1), d[4 j + 2, 3] the same columns 8 rows below.
#pragma once
#include "wgmma_ptx.cuh"  // fences, waits, the swizzled layout and its descriptors

#if IN_T == QF_BF16
#define WG_AB "bf16"
#else
#define WG_AB "f16"
#endif
#ifndef WG_LBO
#define WG_LBO 2048  // bytes between core matrices along K (one 8-row group of a 128-wide tile)
#endif
#ifndef WG_SBO
#define WG_SBO 128   // bytes between core matrices along N
#endif

// Offset in elements of (r, c) in a canonical [rows][128] 16-bit tile.
__device__ __forceinline__ int cb_off(int r, int c) {
    return (r >> 3) * 1024 + (c >> 3) * 64 + (r & 7) * 8 + (c & 7);
}
// Descriptor of a B operand starting at p (16-byte aligned) in the canonical layout above.
__device__ __forceinline__ unsigned long long wg_desc(const void* p, int lbo = WG_LBO, int sbo = WG_SBO) {
    return (unsigned long long)((smem_u32(p) & 0x3FFFF) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32);
}
// d (64 x N) (+)= A (64 x 16, this warp's 16 rows in a) x B (16 x N at desc_b); accumulate = 0 overwrites d.
// TY: the 16-bit type of A and B ("bf16" or "f16").
#define WG_M64N128(TY)                                                                                                  \
    asm volatile(                                                                                                       \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                                   \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY "\n"                                                   \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
        "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "  \
        "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},\n"                    \
        "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                                                    \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),                 \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),           \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),         \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),         \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),         \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),         \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),         \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])          \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))
__device__ __forceinline__ void wg_m64n128(float d[64], const u32 a[4], unsigned long long desc_b, int accumulate) {
    WG_M64N128(WG_AB);
}
// The same with fp16 A and B whatever the input type (the walk's state update, see walk_chunks_wg).
__device__ __forceinline__ void wg_m64n128_f16(float d[64], const u32 a[4], unsigned long long desc_b, int accumulate) {
    WG_M64N128("f16");
}
__device__ __forceinline__ void wg_m64n64(float d[32], const u32 a[4], unsigned long long desc_b, int accumulate) {
    WG_RS_M64N64_T(WG_AB);
}

// ldmatrix / stmatrix on a canonical tile: the 16 x 16 block at (r0, c0) (multiples of 8 and 16) as four
// 8 x 8 matrices (rows r0 / r0 + 8 x columns c0, then the same at c0 + 8), each 128 contiguous bytes.
// Register q of the x4 holds, for thread (g, t), the pair at row g (+ 8 for odd q), columns 2 t, 2 t + 1
// of its matrix: accumulators d[4 j], d[4 j + 1] -> q = 0, d[4 j + 2, 3] -> 1, tile j + 1 -> 2, 3.
__device__ __forceinline__ const elem* cb_mat(const elem* base, int r0, int c0, int lane) {
    const int q = lane >> 3;
    return base + cb_off(r0 + 8 * (q & 1) + (lane & 7), c0 + 8 * (q >> 1));
}
__device__ __forceinline__ void stsm4(elem* p, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(smem_u32(p)), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
