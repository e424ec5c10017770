"""PyTorch reference of dequant.cu: an int8 matrix times its rows' scales, in the scales' dtype."""
from __future__ import annotations

import torch


def dequant_rows_ref(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [R, C] int8 times scale [R] row by row, in scale.dtype: one elementwise op, one rounding a number (the
    product is written straight into the result, where q * scale would first make a copy of q in that dtype on
    the CPU)."""
    return torch.mul(q, scale[:, None], out=torch.empty(q.shape, dtype=scale.dtype, device=q.device))
