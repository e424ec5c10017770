"""PyTorch references of positions.cu, rotary.cu, layer_norm.cu and attention.cu: the vision tower's own
expressions, so the reference backend computes exactly what the tower computed before the kernels."""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=32)
def grid_taps(h: int, w: int, m: int, side: int) -> tuple[np.ndarray, ...]:
    """For one frame of an h x w patch grid, its patches listed in merge-block order (block row, block column,
    row in block, column in block): their rows and columns, and the four taps of the learned side x side
    position grid each interpolates (bilinear, corners aligned: patch 0 -> grid 0, the last -> grid side - 1;
    fp32 as torch computes it): indices [h w, 4] and weights [h w, 4]. Kept per size (read-only)."""
    shape = (h // m, w // m, m, m)
    br, bc, ir, ic = np.ix_(np.arange(h // m), np.arange(w // m), np.arange(m), np.arange(m))
    row, col = np.broadcast_to(br * m + ir, shape).reshape(-1), np.broadcast_to(bc * m + ic, shape).reshape(-1)

    def taps(index, size):
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        lo = np.floor(src)
        return lo.astype(np.int64), np.minimum(lo.astype(np.int64) + 1, side - 1), src - lo

    one = np.float32(1)
    (r0, r1, fr), (c0, c1, fc) = taps(row, h), taps(col, w)
    index = np.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], axis=1)
    weight = np.stack([(one - fr) * (one - fc), (one - fr) * fc, fr * (one - fc), fr * fc], axis=1)
    out = (row, col, index, weight)
    for a in out:
        a.flags.writeable = False
    return out


def vision_positions_ref(x: torch.Tensor, pos_embed: torch.Tensor, grids: list[int], inv_freq: torch.Tensor,
                         merge: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The patches' positions from their grids: (x + the learned position grid interpolated to each frame,
    cos, sin of the 2-D rotary's angles).

    x: [N, D] patch embeddings, patches in merge-block order per frame (merge x merge blocks); pos_embed:
    [side * side, D]; grids: t, h, w of each image / video in turn (flat, in patches; a video's t frames take
    its first frame's positions); inv_freq: fp32 [hd / 4], each quarter of the head's angles is (row, column,
    row, column) x inv_freq. Returns x + pos in x.dtype (pos rounded to x.dtype first) and cos, sin fp32
    [N, hd]."""
    side = math.isqrt(pos_embed.shape[0])
    shapes = [tuple(grids[i:i + 3]) for i in range(0, len(grids), 3)]
    row, col, index, weight = (np.concatenate(a) for a in zip(*(grid_taps(h, w, merge, side) for _, h, w in shapes)))
    dev = x.device
    pos = (pos_embed[torch.from_numpy(index).to(dev)].float()
           * torch.from_numpy(weight).to(dev)[..., None]).sum(1).to(x.dtype)
    rowcol = np.stack([row, col, row, col], axis=1).astype(np.float32)  # exact: far below 2^24 patches
    if any(t > 1 for t, _, _ in shapes):  # a video's frames repeat its first frame's rows
        firsts = np.cumsum([0] + [h * w for _, h, w in shapes[:-1]])
        expand = np.concatenate([np.tile(f + np.arange(h * w), t) for f, (t, h, w) in zip(firsts, shapes)])
        pos, rowcol = pos.index_select(0, torch.from_numpy(expand).to(dev)), rowcol[expand]
    emb = (torch.from_numpy(rowcol).to(dev)[:, :, None] * inv_freq).view(len(rowcol), -1)
    return x + pos, emb.cos(), emb.sin()


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
    s = (x + y).to(x.dtype)
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
