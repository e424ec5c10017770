"""PyTorch references of rms_norm.cu: the exact roundings of the model code they replace."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: x / rms(x) * (1 + w), computed in fp32, returned in x.dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm: (x / rms(x)) * w * silu(gate); the normalised x is rounded to x.dtype before
    the weight (as in transformers' Qwen3.5 gated norm)."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(gate.float())).to(x.dtype)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The attention's rotary on the first cos.shape[-1] features of x [B, T, H, hd] (half-split), each
    product and the sum in x.dtype. cos, sin: [T, rotary_dim]."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([xr * cos + rot * sin, xp], dim=-1)


def rms_norm_rope_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor:
    """q or k of an attention layer: the zero-centred RMSNorm, rounded to x.dtype, then the rotary.
    x: [B, T, H, hd]; weight: [hd]; cos, sin: [T, rotary_dim] in x.dtype."""
    return rope_ref(rms_norm_ref(x, weight, eps), cos, sin)


def add_rms_norm_ref(res: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's add and the norm after it: (s, rms_norm(s)), s = res + x in x.dtype."""
    s = (res + x).to(x.dtype)
    return s, rms_norm_ref(s, weight, eps)
