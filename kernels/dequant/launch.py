"""Launcher of dequant.cu: an int8 matrix with a scale a row, in the compute dtype, for a prompt's matmul."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..cuda_build import get_function, launch
from .reference import dequant_rows_ref

SRC = Path(__file__).with_name("dequant.cu")
THREADS = 256  # as in dequant.cu
_CODE = {torch.float16: 1, torch.bfloat16: 2}


def takes(q: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether the kernel takes q [R, C] int8 with scale [R] of a 16-bit type, both on one CUDA device: C a
    multiple of 16 and every row 16-byte aligned, the scales contiguous."""
    return (q.dtype == torch.int8 and q.is_cuda and q.dim() == 2 and scale.dtype in _CODE
            and scale.device == q.device and tuple(scale.shape) == (q.shape[0],) and scale.is_contiguous()
            and q.shape[1] % 16 == 0 and q.stride(1) == 1 and q.stride(0) % 16 == 0 and q.data_ptr() % 16 == 0)


def dequant_rows_cuda(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Same contract as reference.dequant_rows_ref, bit for bit; what the kernel does not take (see takes) runs the
    reference."""
    if not takes(q, scale):
        return dequant_rows_ref(q, scale)
    rows, cols = q.shape
    out = torch.empty(rows, cols, dtype=scale.dtype, device=q.device)
    total = rows * (cols // 16)
    if total == 0:
        return out
    fn = get_function(SRC, "dequant_rows", q.device, {"OUT_T": _CODE[scale.dtype]})
    launch(fn, ((total + THREADS - 1) // THREADS, 1, 1), (THREADS, 1, 1),
           (q, scale, out, np.int64(rows), np.int32(cols), np.int64(q.stride(0))))
    return out
