"""PyTorch references of gemv.cu: one row times a weight's transpose, as F.linear computes it; with the
residual add and norm, or the MLP's gate, formed before it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..rms_norm.reference import add_rms_norm_ref, rms_norm_ref
from ..silu_mul.reference import silu_mul_ref

ROWS_AT_ONCE_BYTES = 64 << 20  # fp32 rows of an int8 weight the reference converts at once


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (one row in all) @ weight [N, K]^T -> [..., N] in x.dtype. scale [N]: weight is int8 with one
    scale a row; the product in fp32 times the scale, rounded once (as gemv.cu Q8), a few thousand rows at a
    time."""
    if scale is None:
        return F.linear(x, weight)
    N, K = weight.shape
    y, xf = x.new_empty(*x.shape[:-1], N), x.float()
    step = max(1, ROWS_AT_ONCE_BYTES // (4 * max(1, K)))
    for lo in range(0, N, step):
        hi = min(N, lo + step)
        y[..., lo:hi] = F.linear(xf, weight[lo:hi].float()) * scale[lo:hi].float()
    return y


def gemv_add_rms_norm_ref(res: torch.Tensor, x: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                          weight: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add, the norm after it and the projection that takes it: (s, RMSNorm(s) @ weight^T) with
    s = res + x (x None: s = res), as add_rms_norm_ref and gemv_ref round them."""
    s, n = add_rms_norm_ref(res, x, norm_w, eps) if x is not None else (res, rms_norm_ref(res, norm_w, eps))
    return s, gemv_ref(n, weight, scale)


def gemv_silu_mul_ref(gu: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The MLP's down projection of silu(g) * u, gu = [..., 2 K] (g its first half): silu_mul_ref, then
    gemv_ref."""
    return gemv_ref(silu_mul_ref(gu), weight, scale)
