// Hopper tensor-memory-accelerator copies (TMA, sm_90) for the GDN prefill walk and the vision attention:
// 2-D / 3-D / 4-D tiles described by tensor maps the launcher encodes (cuda_build.TensorMap: 128-byte
// swizzle) and passes by value, plain bulk copies, and the shared-memory barriers (mbarrier) they complete
// on. After mma_ptx.cuh (smem_u32).
#pragma once
#include "wgmma_ptx.cuh"  // sw64, the 128-byte swizzle

// A CUtensorMap (128 opaque bytes) as a kernel parameter (__grid_constant__: its address is a parameter
// address, which is what the copy instructions take).
struct __align__(64) TmaDesc { unsigned long long opaque[16]; };

__device__ __forceinline__ void mbar_init(unsigned long long* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_u32(bar)), "r"(count) : "memory");
}
// Makes initialised barriers visible to the copy engine (then a block barrier).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// The one arrival of a phase, announcing the bytes the copies of that phase will deliver.
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// One arrival (of the count the barrier was initialised with).
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(smem_u32(bar)) : "memory");
}
// Waits until the phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, int parity) {
    asm volatile("{\n.reg .pred P1;\nWAIT_LOOP:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
                 "@!P1 bra WAIT_LOOP;\n}\n" :: "r"(smem_u32(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma_load_2d(void* dst, const TmaDesc* map, int c0, int c1, unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 :: "r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void tma_load_3d(void* dst, const TmaDesc* map, int c0, int c1, int c2, unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
                 :: "r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void tma_load_4d(void* dst, const TmaDesc* map, int c0, int c1, int c2, int c3,
                                            unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                 :: "r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar)) : "memory");
}
// The other direction: a tile from shared memory (swizzled as the map says) to global memory, in the
// issuing thread's bulk group; the copy engine skips the parts outside the tensor.
__device__ __forceinline__ void tma_store_4d(const TmaDesc* map, const void* src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
                 :: "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(src)) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until this thread's bulk stores have read their shared-memory sources (the writes may still run).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Waits until this thread's bulk stores are complete.
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// bytes (a multiple of 16) from 16-byte aligned global src to 16-byte aligned shared dst
__device__ __forceinline__ void bulk_load(void* dst, const void* src, int bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

// A [64][128] tile as two such [64][64] halves (two TMA boxes), half h at h * 4096 elements.
__device__ __forceinline__ int sw128(int r, int c) { return (c >> 6) * 4096 + sw64(r, c & 63); }
