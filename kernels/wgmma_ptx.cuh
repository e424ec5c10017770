// Hopper warpgroup matrix multiply (wgmma, sm_90a only): the primitives every wgmma kernel needs
// (gdn_prefill/wgmma.cuh, paged_attention/paged_attention_wg.cu, vision/attention.cu): the fences and waits of
// the asynchronous window, the 128-byte swizzled shared-memory layout and its matrix descriptors, and the bf16
// shapes the attention kernels issue (m64n64k16; m64n128k16 and m64n72k16 for the vision attention). After
// mma_ptx.cuh (smem_u32, u32).
#pragma once

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int n> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(n) : "memory");
}
// Keeps the compiler from touching accumulators across a wgmma's asynchronous window.
template <int n> __device__ __forceinline__ void wg_pin(float (&d)[n]) {
#pragma unroll
    for (int i = 0; i < n; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
// Makes this thread's generic shared-memory writes (st.shared, cp.async) visible to later wgmma operand
// reads (async proxy); followed by a barrier before the wgmma.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The 128-byte swizzle TMA writes (CU_TENSOR_MAP_SWIZZLE_128B) and wgmma reads (layout type 1): in a
// [rows][64] 16-bit tile (128-byte rows, 1024-byte aligned) the 16-byte piece p of row r sits at p ^ (r & 7).
// Offsets in elements; c a multiple of 8 addresses a whole 16-byte piece.
__device__ __forceinline__ int sw64(int r, int c) { return r * 64 + ((((c >> 3) ^ r) & 7) << 3) + (c & 7); }

// Descriptor of an operand [K][64] with N (or M) contiguous in that swizzled layout (the transpose bit),
// starting at row group p (1024-byte aligned): 8-row groups 1 KB apart; the N extent is one 64-wide block,
// so LBO and SBO are both 1 KB (whichever of the two the hardware takes for the 8-row step).
__device__ __forceinline__ unsigned long long wg_desc_sw128(const void* p) {
    return (unsigned long long)((smem_u32(p) & 0x3FFFF) >> 4) | ((unsigned long long)(1024 >> 4) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
// Descriptor of a K-major operand (rows of 64 K-elements, 128 bytes, in that swizzled layout; the M or N
// rows in 8-row groups 1 KB apart) starting at p: the 16 K-elements of one instruction at p + 32 k bytes.
__device__ __forceinline__ unsigned long long wg_desc_kmajor_sw128(const void* p) {
    return (unsigned long long)((smem_u32(p) & 0x3FFFF) >> 4) | (1ull << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

// Descriptor of an operand [K][N] with N contiguous (the transpose bit) wider than 64: 64-column blocks of that
// swizzled layout, block_bytes apart (the leading offset: the step from one block to the next along N), their
// 8-row groups 1 KB apart (the stride offset).
__device__ __forceinline__ unsigned long long wg_desc_sw128_mn(const void* p, unsigned block_bytes) {
    return (unsigned long long)((smem_u32(p) & 0x3FFFF) >> 4) | ((unsigned long long)(block_bytes >> 4) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

#define WG_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
               "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_D32_OUT(d)                                                                                                  \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),         \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),          \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),         \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// d (64 x 64) (+)= A (64 x 16) B (16 x 64), A and B K-major in shared memory (descriptors), bf16.
// Accumulators: warp w of the warpgroup holds rows 16 w + g and 16 w + g + 8; d[4 j + 0, 1] are (row g,
// columns 8 j + 2 t, +1), d[4 j + 2, 3] the same columns 8 rows below.
__device__ __forceinline__ void wg_ss_m64n64_bf16(float d[32], unsigned long long desc_a, unsigned long long desc_b,
                                                  int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_D32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : WG_D32_OUT(d)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}
// The same with A from registers (this warp's 16 rows as the mma.m16n8k16 A fragment) and B with N
// contiguous (transpose bit): TY the 16-bit type of A and B ("bf16" or "f16").
#define WG_RS_M64N64_T(TY)                                                                                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                          \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " WG_D32 ", {%32, %33, %34, %35}, %36, p, " \
                 "1, 1, 1;\n}\n"                                                                                        \
                 : WG_D32_OUT(d)                                                                                        \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))
__device__ __forceinline__ void wg_rs_m64n64_bf16(float d[32], const u32 a[4], unsigned long long desc_b, int accumulate) {
    WG_RS_M64N64_T("bf16");
}

#define WG_D36 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
               "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35}"
#define WG_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
               "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, " \
               "%43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
// d (64 x 128) (+)= A (64 x 16) B (16 x 128), both K-major in shared memory, bf16 (accumulators as m64n64k16's,
// d[32 ..] the columns 64 ..).
__device__ __forceinline__ void wg_ss_m64n128_bf16(float d[64], unsigned long long desc_a, unsigned long long desc_b,
                                                   int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " WG_D64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : WG_D32_OUT(d), WG_D32_OUT((d + 32))
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}
// d (64 x 72) (+)= A (64 x 16, registers, as wg_rs_m64n64_bf16) B (16 x 72, N contiguous: wg_desc_sw128_mn), bf16.
// d[4 j + 0, 1]: row g, columns 8 j + 2 t, +1 (j < 9); d[4 j + 2, 3]: 8 rows below.
__device__ __forceinline__ void wg_rs_m64n72_bf16(float d[36], const u32 a[4], unsigned long long desc_b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %41, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n72k16.f32.bf16.bf16 " WG_D36 ", {%36, %37, %38, %39}, %40, p, 1, 1, 1;\n}\n"
                 : WG_D32_OUT(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}
