"""PyTorch reference of silu_mul.cu: the MLP's gate as the model code computes it."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for gu = [..., 2 I] (g the first half, u the second), in gu.dtype."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u
