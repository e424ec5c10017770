"""Launcher of silu_mul.cu: the MLP's silu(g) * u in one pass over the gate_up projection's output."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..cuda_build import get_function, launch
from .reference import silu_mul_ref

SRC = Path(__file__).with_name("silu_mul.cu")
THREADS = 256  # as in silu_mul.cu
_CODE = {torch.float16: 1, torch.bfloat16: 2}


def silu_mul_cuda(gu: torch.Tensor) -> torch.Tensor:
    """Same contract as reference.silu_mul_ref; what the kernel does not take (fp32, I not a multiple of 8,
    rows that are not 16-byte aligned) runs the reference."""
    I2 = gu.shape[-1] if gu.dim() else 0
    I = I2 // 2
    rows2 = gu.reshape(-1, I2) if gu.dim() else gu
    ok = (gu.dtype in _CODE and I2 % 2 == 0 and I % 8 == 0 and I > 0 and rows2.stride(-1) == 1
          and rows2.data_ptr() % 16 == 0 and (rows2.stride(0) % 8 == 0 or rows2.shape[0] <= 1))
    if not ok:
        return silu_mul_ref(gu).contiguous()  # (contiguous as the kernel's, and the op's fake)
    out = torch.empty(*gu.shape[:-1], I, dtype=gu.dtype, device=gu.device)
    rows = rows2.shape[0]
    total = rows * (I // 8)
    if total == 0:
        return out
    fn = get_function(SRC, "silu_mul", gu.device, {"IN_T": _CODE[gu.dtype]})
    launch(fn, ((total + THREADS - 1) // THREADS, 1, 1), (THREADS, 1, 1),
           (rows2, out, np.int64(rows), np.int32(I), np.int64(rows2.stride(0))))
    return out
