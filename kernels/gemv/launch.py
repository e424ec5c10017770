"""Launcher of gemv.cu: y = W x for one row x, the decode step's projections."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..cuda_build import card_of, get_function, launch
from .reference import gemv_ref

SRC = Path(__file__).with_name("gemv.cu")
THREADS, ROWS = 256, 2  # as in gemv.cu
WARPS = THREADS // 32
BLOCKS_PER_SM = 4  # gemv.cu's __launch_bounds__ minimum
_CODE = {torch.float16: 1, torch.bfloat16: 2}
MAX_K = 24576  # 48 KB of x in shared memory (every Qwen3.5 projection: K <= 17,408)


def grid_blocks(n_rows: int, sms: int) -> int:
    """Blocks for n_rows rows: at most BLOCKS_PER_SM a multiprocessor, and as few as give every warp the same
    number of row groups (ROWS rows each) as the fullest one (no wave of a few warps at the end)."""
    groups = -(-n_rows // ROWS)
    rounds = -(-groups // (sms * BLOCKS_PER_SM * WARPS))  # row groups per warp
    return max(1, -(-groups // (rounds * WARPS)))


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes x @ weight^T: one row of a 16-bit type on a CUDA device, weight [N, K] of the
    same type with unit column stride, K a multiple of 8 up to MAX_K (x fits the block's shared memory
    without an opt-in) and every row 16-byte aligned."""
    if x.dtype not in _CODE or weight.dtype != x.dtype or not (x.is_cuda and weight.is_cuda) or weight.dim() != 2:
        return False
    K = weight.shape[1]
    return (x.shape[-1] == K and x.numel() == K and K % 8 == 0 and 0 < K <= MAX_K and weight.shape[0] > 0
            and weight.stride(1) == 1 and weight.stride(0) % 8 == 0 and weight.data_ptr() % 16 == 0)


def gemv_cuda(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same contract as reference.gemv_ref; what the kernel does not take (see takes) runs the reference."""
    if not takes(x, weight):
        return gemv_ref(x, weight)
    N, K = weight.shape
    xv = x.reshape(K)
    if not xv.is_contiguous() or xv.data_ptr() % 16:
        xv = xv.clone(memory_format=torch.contiguous_format)  # a new, aligned copy
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    fn = get_function(SRC, "gemv", x.device, {"IN_T": _CODE[x.dtype]})
    launch(fn, (grid_blocks(N, card_of(x.device).sms), 1, 1), (THREADS, 1, 1),
           (weight, xv, y, np.int32(N), np.int32(K), np.int64(weight.stride(0))), shared_mem=K * x.element_size())
    return y
