"""PyTorch references of gemv.cu: one row times a weight's transpose, as F.linear computes it; with the
residual add and norm, or the MLP's gate, formed before it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..rms_norm.reference import add_rms_norm_ref, rms_norm_ref
from ..silu_mul.reference import silu_mul_ref


def gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] (one row in all) @ weight [N, K]^T -> [..., N] in x.dtype."""
    return F.linear(x, weight)


def gemv_add_rms_norm_ref(res: torch.Tensor, x: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                          weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add, the norm after it and the projection that takes it: (s, RMSNorm(s) @ weight^T) with
    s = res + x (x None: s = res), as add_rms_norm_ref and gemv_ref round them."""
    s, n = add_rms_norm_ref(res, x, norm_w, eps) if x is not None else (res, rms_norm_ref(res, norm_w, eps))
    return s, gemv_ref(n, weight)


def gemv_silu_mul_ref(gu: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The MLP's down projection of silu(g) * u, gu = [..., 2 K] (g its first half): silu_mul_ref, then
    gemv_ref."""
    return gemv_ref(silu_mul_ref(gu), weight)
