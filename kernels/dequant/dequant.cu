// An int8 matrix with one scale a row, in the compute dtype: out[r, c] = q[r, c] * scale[r], the fp32 product
// rounded once (what torch.mul(q, scale[:, None]) gives in bf16 / fp16: q and the scale are exact in fp32).
// What a prompt's product with int8 weights multiplies by (runtime/quant.py): each byte read once, streamed,
// and the result written for the matmul after it. One thread per 16 weights (a 16-byte load, two 16-byte stores).
#include "common.cuh"

#ifndef OUT_T
#define OUT_T QF_BF16
#endif

typedef qf_type<OUT_T>::t elem;

#define THREADS 256

// q: rows of stride q_row bytes (a multiple of 16), cols a multiple of 16; out [rows, cols] contiguous.
extern "C" __global__ void __launch_bounds__(THREADS)
dequant_rows(const signed char* __restrict__ q, const elem* __restrict__ scale, elem* __restrict__ out,
             long long rows, int cols, long long q_row)
{
    const long long i = (long long)blockIdx.x * THREADS + threadIdx.x;
    const int ppr = cols / 16;  // 16-byte pieces a row
    if (i >= rows * ppr) return;
    const long long r = i / ppr;
    const int c = (int)(i - r * ppr) * 16;
    union {
        int4 v;
        signed char b[16];
    } in;
    in.v = __ldcs(reinterpret_cast<const int4*>(q + r * q_row + c));
    const float s = to_f(scale[r]);
    Vec8<elem> lo, hi;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        lo.e[e] = from_f<elem>(__fmul_rn((float)in.b[e], s));
        hi.e[e] = from_f<elem>(__fmul_rn((float)in.b[8 + e], s));
    }
    uint4* dst = reinterpret_cast<uint4*>(out + r * (long long)cols + c);
    dst[0] = lo.u;
    dst[1] = hi.u;
}
