// The MLP's gate: out = silu(g) * u with g, u the two halves of the gate_up projection's rows [R, 2 I]:
// silu(g) rounded to the element type, then the product rounded (the roundings of the PyTorch expression
// F.silu(g) * u on bf16 / fp16 tensors, silu as x / (1 + exp(-x)) in fp32: bit for bit reference.py).
// One thread per 8 outputs (a 16-byte load of g, of u, a 16-byte store); out is [R, I] contiguous.
#include "common.cuh"

#ifndef IN_T
#define IN_T QF_BF16
#endif

typedef qf_type<IN_T>::t elem;

#define THREADS 256

// gu: rows of stride `row` elements, g at columns [0, I), u at [I, 2 I); I a multiple of 8.
extern "C" __global__ void __launch_bounds__(THREADS)
silu_mul(const elem* __restrict__ gu, elem* __restrict__ out, long long rows, int I, long long row)
{
    const long long i = (long long)blockIdx.x * THREADS + threadIdx.x;
    const int vpr = I / 8;  // vectors per row
    if (i >= rows * vpr) return;
    const long long r = i / vpr;
    const int c = (int)(i - r * vpr) * 8;
    Vec8<elem> g, u, o;
    g.u = *reinterpret_cast<const uint4*>(gu + r * row + c);
    u.u = *reinterpret_cast<const uint4*>(gu + r * row + I + c);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float s = to_f(from_f<elem>(silu_f(to_f(g.e[e]))));
        o.e[e] = from_f<elem>(__fmul_rn(s, to_f(u.e[e])));
    }
    *reinterpret_cast<uint4*>(out + r * (long long)I + c) = o.u;
}
