"""PyTorch reference of paged_attention.cu: gather each sequence's cached K/V through its block table,
append the new tokens, and run attention with the lower-right causal mask in fp32 (each kv head's product
over all its q heads at once). The ground truth the kernels are tested against, and what the runtime runs
where they do not.

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


def runs(blocks: list[int], length: int, block_size: int) -> list[tuple[int, int]]:
    """Positions 0 .. length - 1 of a sequence whose blocks are `blocks` as stretches that lie in consecutive pool
    slots: (first slot, count) each, in position order."""
    out: list[list[int]] = []
    for i in range(-(-length // block_size)):
        n = min(block_size, length - i * block_size)
        if out and blocks[i] == blocks[i - 1] + 1:
            out[-1][1] += n
        else:
            out.append([blocks[i] * block_size, n])
    return [(a, n) for a, n in out]


MAX_RUNS = 8  # more stretches than this: one gathered copy instead of a product per stretch
# The most fp32 scores (and as many probabilities) a call holds at a time: many new tokens over a long cache
# (a 4,096-token follow-up over 32K cached tokens, 16 heads: 9.7 GB of scores at once) run in row chunks.
SCORE_BYTES = 256 << 20


def rows_per_chunk(heads: int, keys: int) -> int:
    """New tokens whose scores over `keys` keys (all `heads` q heads, fp32) fit SCORE_BYTES; at least one."""
    return max(1, SCORE_BYTES // (4 * heads * max(1, keys)))


def paged_attention_ref(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor,
                        v_pool: torch.Tensor, block_table: torch.Tensor, cache_lens: torch.Tensor,
                        cu_q: torch.Tensor, gate: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                        write_kv: bool = True) -> torch.Tensor:
    """out[t, h] = softmax(q K^T * scale) V over the sequence's visible keys (the whole prefix and the
    new tokens up to t), times sigmoid(gate[t, h]) when a gate is given; computed in fp32, rounded once to
    q.dtype. With write_kv the new K/V are stored in the pool first (in place), as the kernel does, and the
    keys are read where they lie: each stretch of consecutive pool slots as a view (a sequence's blocks mostly
    come in order), no copy of the cache per call; else (or past MAX_RUNS stretches) gathered. Off the CPU
    (paged_attention_on_device) nothing is read back to the host."""
    if q.device.type != "cpu":
        return paged_attention_on_device(q, k_new, v_new, k_pool, v_pool, block_table, cache_lens, cu_q, gate,
                                         scale, write_kv)
    T, H, D = q.shape
    Hkv = k_new.shape[1]
    G, bs = H // Hkv, k_pool.shape[1]
    scale = D ** -0.5 if scale is None else scale
    cache_lens, cu_q = cache_lens.tolist(), cu_q.tolist()
    in_place = write_kv and k_new.dtype == k_pool.dtype and v_new.dtype == v_pool.dtype
    if in_place:  # the new K/V as the pool holds them: the same values
        write_kv_ref(k_pool, v_pool, k_new, v_new, torch.as_tensor(block_table), cache_lens, cu_q)
    kf, vf = (p.view(-1, Hkv, D) for p in (k_pool, v_pool))
    out = torch.empty(T, H, D, dtype=torch.float32, device=q.device)
    for n in range(block_table.shape[0]):
        a, b, L = cu_q[n], cu_q[n + 1], cache_lens[n]
        if b == a:
            continue
        nq = b - a
        parts = runs(block_table[n, :-(-(L + nq) // bs)].tolist(), L + nq, bs) if in_place else []
        if in_place and len(parts) <= MAX_RUNS:
            keys = [(kf[s:s + c], vf[s:s + c]) for s, c in parts]
        elif in_place:
            keys = [(gather_kv(k_pool, block_table[n], L + nq), gather_kv(v_pool, block_table[n], L + nq))]
        else:
            keys = [(torch.cat([gather_kv(k_pool, block_table[n], L), k_new[a:b]]),
                     torch.cat([gather_kv(v_pool, block_table[n], L), v_new[a:b]]))]  # [L + nq, Hkv, D]
        step = rows_per_chunk(H, L + nq)
        for r0 in range(0, nq, step):  # new tokens r0 .. r1 - 1 see keys 0 .. L + r1 - 1 at most
            r1 = min(nq, r0 + step)
            c, seen = r1 - r0, [(k[:m], v[:m]) for (k, v), m in zip(keys, _upto(keys, L + r1)) if m > 0]
            # each kv head with its G q heads' rows (g, t) as one product, no copy of K / V per q head
            qh = q[a + r0:a + r1].float().view(c, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * c, D) * scale
            s = torch.cat([qh @ k.float().permute(1, 2, 0) for k, _ in seen], -1)  # [Hkv, G * c, L + r1]
            if c > 1:  # the prefix and, causally, each other (lower right); a lone row sees every key kept
                hidden = (torch.arange(L + r1, device=q.device)[None, :]
                          > L + torch.arange(r0, r1, device=q.device)[:, None])
                s.view(Hkv, G, c, L + r1).masked_fill_(hidden, -torch.inf)
            p, o, at = torch.softmax(s, -1), 0, 0
            for k, v in seen:
                o = o + p[..., at:at + k.shape[0]] @ v.float().transpose(0, 1)  # [Hkv, G * c, D]
                at += k.shape[0]
            out[a + r0:a + r1] = o.view(Hkv, G, c, D).permute(2, 0, 1, 3).reshape(c, H, D)
    if gate is not None:
        out = out * torch.sigmoid(gate.float())
    if write_kv and not in_place:
        write_kv_ref(k_pool, v_pool, k_new, v_new, torch.as_tensor(block_table), cache_lens, cu_q)
    return out.to(q.dtype)


def _upto(keys: list, limit: int) -> list[int]:
    """How many rows of each of the stretches `keys` (in position order) lie before position `limit`."""
    out, at = [], 0
    for k, _ in keys:
        out.append(max(0, min(k.shape[0], limit - at)))
        at += k.shape[0]
    return out


def paged_attention_on_device(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor,
                              v_pool: torch.Tensor, block_table: torch.Tensor, cache_lens: torch.Tensor,
                              cu_q: torch.Tensor, gate: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                              write_kv: bool = True) -> torch.Tensor:
    """paged_attention_ref with nothing read back to the host (a GPU's queue never waits on it, and a CUDA graph
    can capture it): the keys of sequence n are every slot its block-table row names (PAD entries and all), those
    past its tokens masked, and their values zeroed so that whatever they hold (NaN) reaches no output; the new
    tokens' K/V are set into the gathered copy. One pass of the whole batch of tokens per sequence (the table's
    rows, a shape), each token's result taken from its own sequence's pass."""
    T, H, D = q.shape
    Hkv = k_new.shape[1]
    G = H // Hkv
    nb, bs = k_pool.shape[:2]
    N, width = block_table.shape
    C = width * bs
    scale = D ** -0.5 if scale is None else scale
    dev = q.device
    cu, lens = cu_q.long(), cache_lens.long()
    t = torch.arange(T, device=dev)
    seq = torch.searchsorted(cu[1:], t, right=True)  # the sequence of each new token
    pos = lens[seq] + t - cu[seq]  # its position in that sequence
    table = block_table.long().clamp(0, nb - 1)
    kf, vf = (p.view(nb * bs, Hkv, D) for p in (k_pool, v_pool))
    if write_kv:
        slot = table[seq, pos // bs] * bs + pos % bs
        kf.index_copy_(0, slot, k_new.to(kf.dtype))
        vf.index_copy_(0, slot, v_new.to(vf.dtype))
    slots = (table[:, :, None] * bs + torch.arange(bs, device=dev)).view(N, C)
    k, v = kf[slots].float(), vf[slots].float()  # [N, C, Hkv, D]
    k[seq, pos] = k_new.float()
    v[seq, pos] = v_new.float()
    j = torch.arange(C, device=dev)
    held = j[None, :] < (lens + cu[1:] - cu[:-1])[:, None]  # [N, C]: the slots that hold a token of the sequence
    v = torch.where(held[:, :, None, None], v, 0.0)
    seen = j[None, :] <= pos[:, None]  # [T, C]: causal within the sequence (the cached prefix all seen)
    qh = q.float().view(T, Hkv, G, D) * scale
    out = torch.zeros(T, Hkv, G, D, dtype=torch.float32, device=dev)
    step = rows_per_chunk(H, C)
    for r0 in range(0, T, step):  # (T is the tensor's shape: the chunks read nothing back)
        r1 = min(T, r0 + step)
        for n in range(N):
            s = torch.einsum("thgd,chd->hgtc", qh[r0:r1], k[n])
            s.masked_fill_(~seen[r0:r1], -torch.inf)
            o = torch.einsum("hgtc,chd->thgd", torch.softmax(s, -1), v[n])
            # (other sequences' rows: all masked, NaN)
            out[r0:r1] = torch.where((seq[r0:r1] == n)[:, None, None, None], o, out[r0:r1])
    out = out.reshape(T, H, D)
    if gate is not None:
        out = out * torch.sigmoid(gate.float())
    return out.to(q.dtype)
