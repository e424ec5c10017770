// The smallest kernel that proves NVRTC, the CUDA headers, the driver and CuPy work together on a
// device (kernels/cuda_impl.py:cuda_status): y = x * s for bf16 x.
#include <cuda_bf16.h>

extern "C" __global__ void probe_scale(const __nv_bfloat16* x, float* y, int n, float s)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __bfloat162float(x[i]) * s;
}
