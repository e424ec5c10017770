"""PyTorch reference of gemv.cu: one row times a weight's transpose, as F.linear computes it."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] (one row in all) @ weight [N, K]^T -> [..., N] in x.dtype."""
    return F.linear(x, weight)
