"""PyTorch reference of paged_attention.cu: gather each sequence's cached K/V through its block table,
append the new tokens, and run attention with the lower-right causal mask in fp32. The ground truth
the kernels are tested against.

Shapes (the pool layout is documented in runtime/kv_pool.py):
    q, gate:        [T, H, D]      the new tokens of all sequences, back to back (cu_q says where)
    k_new, v_new:   [T, Hkv, D]
    k_pool, v_pool: [num_blocks, block_size, Hkv, D]
    block_table:    int32 [N, max_blocks]
    cache_lens:     int32 [N]      tokens already in the pool per sequence
    cu_q:           int32 [N + 1]  new tokens of sequence n are rows cu_q[n]:cu_q[n + 1]
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def slots(block_table_row: torch.Tensor, start: int, end: int, block_size: int) -> torch.Tensor:
    """Pool slots (rows of the pool seen as [num_blocks * block_size, Hkv, D]) of positions start..end-1."""
    pos = torch.arange(start, end, device=block_table_row.device)
    return block_table_row.long()[pos // block_size] * block_size + pos % block_size


def gather_kv(pool: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of one sequence as a contiguous [length, Hkv, D] tensor."""
    nb, bs = pool.shape[:2]
    return pool.reshape(nb * bs, *pool.shape[2:])[slots(block_table_row, 0, length, bs)]


def write_kv_ref(k_pool, v_pool, k_new, v_new, block_table, cache_lens, cu_q) -> None:
    """Store the new tokens' K/V in their pool slots (positions cache_lens[n] + i), in place."""
    nb, bs = k_pool.shape[:2]
    kf, vf = k_pool.view(nb * bs, *k_pool.shape[2:]), v_pool.view(nb * bs, *v_pool.shape[2:])
    for n in range(block_table.shape[0]):
        a, b, L = int(cu_q[n]), int(cu_q[n + 1]), int(cache_lens[n])
        s = slots(block_table[n], L, L + b - a, bs)
        kf[s] = k_new[a:b].to(k_pool.dtype)
        vf[s] = v_new[a:b].to(v_pool.dtype)


def paged_attention_ref(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor,
                        v_pool: torch.Tensor, block_table: torch.Tensor, cache_lens: torch.Tensor,
                        cu_q: torch.Tensor, gate: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                        write_kv: bool = True) -> torch.Tensor:
    """out[t, h] = softmax(q K^T * scale) V over the sequence's visible keys (the whole prefix and the
    new tokens up to t), times sigmoid(gate[t, h]) when a gate is given; computed in fp32, rounded once to
    q.dtype. With write_kv the new K/V are stored in the pool first (in place), as the kernel does."""
    T, H, D = q.shape
    Hkv = k_new.shape[1]
    scale = D ** -0.5 if scale is None else scale
    cache_lens, cu_q = cache_lens.tolist(), cu_q.tolist()
    out = torch.empty(T, H, D, dtype=torch.float32, device=q.device)
    for n in range(block_table.shape[0]):
        a, b, L = cu_q[n], cu_q[n + 1], cache_lens[n]
        if b == a:
            continue
        k = torch.cat([gather_kv(k_pool, block_table[n], L).float(), k_new[a:b].float()])  # [L + nq, Hkv, D]
        v = torch.cat([gather_kv(v_pool, block_table[n], L).float(), v_new[a:b].float()])
        nq = b - a
        visible = torch.arange(L + nq, device=q.device)[None, :] <= L + torch.arange(nq, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(q[a:b].float().transpose(0, 1), k.transpose(0, 1).repeat_interleave(H // Hkv, 0),
                                           v.transpose(0, 1).repeat_interleave(H // Hkv, 0), attn_mask=visible,
                                           scale=scale)
        out[a:b] = o.transpose(0, 1)
    if gate is not None:
        out = out * torch.sigmoid(gate.float())
    if write_kv:
        write_kv_ref(k_pool, v_pool, k_new, v_new, torch.as_tensor(block_table), cache_lens, cu_q)
    return out.to(q.dtype)
