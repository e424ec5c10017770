"""PyTorch references of rotary.cu, layer_norm.cu and attention.cu: the vision tower's own expressions, so the
reference backend computes exactly what the tower computed before the kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def vision_rotary_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary over the whole head of q and k, in fp32, rounded once to qkv.dtype.

    qkv: [N, 3, H, hd] (q, k, v per token); cos, sin: fp32 [N, hd]. Returns [2, N, H, hd] (q, k).
    """
    half = qkv.shape[-1] // 2
    qk = qkv[:, :2].transpose(0, 1).to(torch.float32, copy=True, memory_format=torch.contiguous_format)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin).to(qkv.dtype)


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension. x: [..., D]; weight, bias: [D]."""
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def add_layer_norm_ref(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the LayerNorm after it: (s, LayerNorm(s)) with s = x + y in x.dtype.
    x, y: [..., D]; weight, bias: [D]."""
    s = x + y
    return s, F.layer_norm(s, s.shape[-1:], weight, bias, eps)


def vision_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Attention within each segment [cu_seqlens[i], cu_seqlens[i + 1]) of the packed tokens, no mask, scale
    1 / sqrt(head dim): SDPA per segment. q, k, v: [N, H, hd]; cu_seqlens int32 [segments + 1]. Returns
    [N, H, hd] (contiguous) in q.dtype."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            out[a:b] = F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v))).transpose(0, 1)
    return out
