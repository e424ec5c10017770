// The prefix cache's content hash (runtime/prefix.py content_hash) in one pass over a tensor's 64-bit words:
//   out[s] += sum_i mix(w_i ^ mix(i + seed_s))   (s = 0, 1; wrapping 64-bit sums)
// with mix(x) = two rounds of x = (x ^ (x >>a 29)) * M, then x ^ (x >>a 32): arithmetic shifts and wrapping
// multiplies, bit for bit the int64 torch expression of reference.py (the sums commute, so the order of the
// additions does not change them). Each thread sums a grid-strided share of the words, the block reduces
// its threads' sums through shuffles and shared memory, and one atomic add a lane and block adds them to
// out (zeroed by the caller).
#include "common.cuh"

#define THREADS 256

__device__ __forceinline__ long long mix(long long x) {
    x = (long long)((unsigned long long)(x ^ (x >> 29)) * 0x3C79AC492BA7B653ull);
    x = (long long)((unsigned long long)(x ^ (x >> 29)) * 0x1C69B3F74AC4AE35ull);
    return x ^ (x >> 32);
}

extern "C" __global__ void __launch_bounds__(THREADS)
content_hash(const long long* __restrict__ words, long long n, long long seed0, long long seed1,
             unsigned long long* __restrict__ out) {
    __shared__ unsigned long long part[2][THREADS / 32];
    unsigned long long a = 0, b = 0;
    for (long long i = (long long)blockIdx.x * THREADS + threadIdx.x; i < n; i += (long long)gridDim.x * THREADS) {
        const long long w = __ldg(words + i);
        a += (unsigned long long)mix(w ^ mix((long long)((unsigned long long)i + (unsigned long long)seed0)));
        b += (unsigned long long)mix(w ^ mix((long long)((unsigned long long)i + (unsigned long long)seed1)));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
        part[0][warp] = a;
        part[1][warp] = b;
    }
    __syncthreads();
    if (threadIdx.x < 2) {
        unsigned long long s = 0;
#pragma unroll
        for (int w = 0; w < THREADS / 32; ++w) s += part[threadIdx.x][w];
        atomicAdd(out + threadIdx.x, s);
    }
}
