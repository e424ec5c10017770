"""Launchers of paged_attention.cu (prefill and decode over the paged K/V pool of runtime/kv_pool.py).

Planning is host-only arithmetic on shapes (`plan`): the warps per block, the row tiles and the number
of key splits follow from (max new tokens per sequence, N, Hkv, GQA group, the block table's capacity)
and never from device values, so a decode step launched with the same shapes is the same launch every
time and can be captured in a CUDA graph (cache_lens and cu_q live on the device and may change
between replays).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..cuda_build import card_of, get_function, launch

SRC = Path(__file__).with_name("paged_attention.cu")
SRC_COMBINE = Path(__file__).with_name("paged_combine.cu")
SRC_WG = Path(__file__).with_name("paged_attention_wg.cu")
SRC_DEC = Path(__file__).with_name("paged_decode.cu")
BN = 32  # keys per tile, as in paged_attention.cu
BN_WG = 64  # paged_attention_wg.cu: keys per tile; 64 rows and 128 threads a warpgroup, one or two a block
THREADS_DEC = 128  # paged_decode.cu: four warps on one 16-row tile
# Up to 64 rows, the decode kernel's 16-row blocks (each reading every key) beat the mma.sync kernel's one
# block of 32 / 64 rows while (row tiles x keys) stays within this (H200, graph us, 5 / 8 / 12 / 16 new tokens
# at GQA 4: 1,024 keys 11.1 / 11.4 / 12.7 / 14.5 against 15.6 / 16.1 / 16.3 / 16.8; 4,096 keys 16.7 / 16.9 against
# 17.0 / 17.6, but 20.2 / 25.3 against 18.4 / 19.2; bench/results/paged-decode-tiles-h200.log)
DEC_KEY_ROWS = 8192
MAX_SPLITS = 128  # paged_combine.cu's COMBINE_MAX_SPLITS
MIN_KEYS_PER_SPLIT = 128  # mma.sync kernel: below that the combine costs more than the split saves


def smem_bytes(warps_m: int, head_dim: int) -> int:
    """Dynamic shared memory of one paged_attention_fwd block: Q tile plus two stages of K and V tiles, padded
    rows."""
    return (16 * warps_m + 4 * BN) * (head_dim + 8) * 2


def smem_bytes_wg(head_dim: int, warpgroups: int = 2) -> int:
    """Dynamic shared memory of one paged_attention_wg block: Q (64 rows a warpgroup), three stages of K and
    VSTAGES of V (three with one warpgroup, two with two), swizzled and unpadded, 1 KB to align them."""
    v_stages = 3 if warpgroups == 1 else 2
    return (64 * warpgroups + (3 + v_stages) * BN_WG) * head_dim * 2 + 1024


def smem_bytes_decode(head_dim: int) -> int:
    """Dynamic shared memory of one paged_attention_decode block (paged_decode.cu SMEM_BYTES): Q (later the
    four warps' partial S, 8 KB) and two stages of K and V tiles, padded rows."""
    return max(16 * (head_dim + 8) * 2, 4 * (BN // 8) * 32 * 16) + 4 * BN * (head_dim + 8) * 2


def combine_shape(head_dim: int, splits: int) -> tuple[int, int, int]:
    """(columns, groups a row, rows) of one paged_attention_combine block: COMBINE_COLS columns, a group of
    columns / 4 threads per run of 8 shares, and as many rows as make 128 threads (a decode step's 4 to 16
    rows of 66 shares: one row of 9 groups a block; 4,096 rows of 4 shares: 8 rows of one group). At most
    256 threads and 128 weights (rows x splits) a block, as the kernel's shared arrays hold."""
    cols = 64 if head_dim % 64 == 0 else 32
    groups = math.ceil(splits / 8)
    return cols, groups, max(1, 128 // (groups * cols // 4))


def decode_blocks_per_sm(head_dim: int, smem_per_sm: int) -> int:
    """Decode blocks one wave counts per SM: two where two fit (H100 / H200, A100), else one (RTX 30 / 40 / 50,
    100 KB). Three fit an H200 SM, but two per SM fill the wave best (bench/paged_decode_sweep.py: 66 shares
    instead of 99 at 16K keys 31.4 against 33.0 us, at 64K 89.5 against 90.3; the fewer shares, the less the
    combine reads)."""
    return max(1, min(2, smem_per_sm // (smem_bytes_decode(head_dim) + 1024)))


@dataclass(frozen=True)
class Plan:
    warps_m: int  # warps per block, each owning 16 (token, q head) rows
    row_tiles: int  # blocks along the rows of the longest sequence
    splits: int  # blocks sharing one row tile's keys (1: no combine pass)
    kernel: str = "mma"  # "mma": paged_attention_fwd; "dec": paged_attention_decode (every card); "wg":
    #                      paged_attention_wg (sm_90a)


def plan(max_q: int, num_seqs: int, num_kv_heads: int, group: int, kv_capacity: int, sm_count: int,
         splits: Optional[int] = None, wgmma: bool = False, kernel: Optional[str] = None,
         head_dim: int = 256, smem_per_sm: int = 233_472) -> Plan:
    """The launch shape for sequences of at most `max_q` new tokens over at most `kv_capacity` keys.
    Decode steps (at most 16 rows) take the four-warp decode kernel, and so do up to 64 rows (16 tokens at
    4 q heads per kv head) over short contexts (DEC_KEY_ROWS); the rest the warpgroup-mma kernel where the
    card has it (`wgmma`: sm_90a; one warpgroup a block up to 64 rows, two above), else the mma.sync one
    (`kernel` forces one). Splits the keys (decode, and short prefills on long contexts)
    until the blocks fill one wave (the blocks an SM of `smem_per_sm` bytes holds: on an H100 / H200 two
    decode blocks (decode_blocks_per_sm), three one-warp or two wider mma.sync blocks, one warpgroup-mma
    block; on an RTX card's 100 KB one of each), but never into a second, partly filled wave: a block of s
    splits reads 1/s of the keys, so the split with the fewest waves per split wins, the smaller on a tie
    (each split costs a partial write and its share of the combine). 256 new tokens over 65,536 keys on
    the mma.sync kernel: 4 splits, not 5 (1.2 waves). A decode share may be one 32-key tile, an mma.sync
    share is at least MIN_KEYS_PER_SPLIT keys."""
    rows = max(1, max_q) * group
    if kernel is None:
        dec = head_dim % 64 == 0 and (rows <= 16 or rows <= 64 and math.ceil(rows / 16) * kv_capacity <= DEC_KEY_ROWS)
        kernel = "dec" if dec else "wg" if wgmma and rows > 16 else "mma"
    if kernel not in ("mma", "dec", "wg"):
        raise ValueError(f"paged_attention: kernel must be 'mma', 'dec' or 'wg', got {kernel!r}")
    min_keys = MIN_KEYS_PER_SPLIT
    if kernel == "wg":  # one warpgroup (64 rows) where the rows fit in it, else two
        warps_m = 4 if rows <= 64 else 8
        row_tiles, bn, per_sm = math.ceil(rows / (16 * warps_m)), BN_WG, 1
    elif kernel == "dec":  # 16 rows a block, shared by its four warps; a share may be one 32-key tile
        warps_m, row_tiles, bn, per_sm = 1, math.ceil(rows / 16), BN, decode_blocks_per_sm(head_dim, smem_per_sm)
        min_keys = BN  # 1 x 1,024 keys: 32 shares 10.8 us, 8 shares (128 keys each) 13.6 (paged_decode_sweep)
    else:
        warps_m = 1 if rows <= 16 else 2 if rows <= 32 else 4
        row_tiles, bn = math.ceil(rows / (16 * warps_m)), BN
        per_sm = max(1, min(3 if warps_m == 1 else 2, smem_per_sm // (smem_bytes(warps_m, head_dim) + 1024)))
    if splits is None:
        base = row_tiles * num_seqs * num_kv_heads
        max_splits = max(1, min(MAX_SPLITS, math.ceil(kv_capacity / bn) // (min_keys // bn)))
        slots = per_sm * sm_count
        most = max(1, min(max_splits, math.ceil(slots / base)))
        splits = min(range(1, most + 1), key=lambda s: (math.ceil(base * s / slots) / s, s))
    return Plan(warps_m, row_tiles, splits, kernel)


def _check_rows(t: torch.Tensor, name: str, shape: tuple) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"paged_attention: {name} has shape {tuple(t.shape)}, expected {shape}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"paged_attention: {name} must be bfloat16, got {t.dtype}")
    if t.stride(-1) != 1 or t.stride(0) % 8 or t.stride(1) % 8 or t.data_ptr() % 16:
        raise ValueError(f"paged_attention: {name} needs a unit last stride, token and head strides that are "
                         f"multiples of 8 and a 16-byte aligned start (strides {t.stride()}); pass .contiguous()")


def paged_attention_cuda(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor,
                         v_pool: torch.Tensor, block_table: torch.Tensor, cache_lens: torch.Tensor,
                         cu_q: torch.Tensor, gate: Optional[torch.Tensor], max_q: int, scale: Optional[float] = None,
                         write_kv: bool = True, out: Optional[torch.Tensor] = None,
                         splits: Optional[int] = None, kernel: Optional[str] = None) -> torch.Tensor:
    """Attention of the new tokens over the paged pool, the new K/V stored in the pool in the same launch.

    q, gate: [T, H, D] bf16 (gate optional: out *= sigmoid(gate)); k_new, v_new: [T, Hkv, D] bf16;
    k_pool, v_pool: [num_blocks, block_size, Hkv, D] bf16 contiguous (updated in place when write_kv);
    block_table: int32 [N, max_blocks]; cache_lens: int32 [N]; cu_q: int32 [N + 1], cu_q[N] = T;
    max_q: at least the largest cu_q[n + 1] - cu_q[n] (a host int: the launch never reads the device).
    splits and kernel ("mma" / "dec" / "wg") override the plan (tests, benchmarks).
    Returns out [T, H, D] bf16 (written into `out` when given). cache_lens[n] + new tokens of sequence n
    must fit in its max_blocks * block_size slots; nothing checks that on the host (it would need a sync).
    """
    T, H, D = q.shape
    num_blocks, bs, Hkv, Dk = k_pool.shape
    N, max_blocks = block_table.shape
    if Dk != D or v_pool.shape != k_pool.shape or not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError(f"paged_attention: pools must be contiguous [num_blocks, block_size, Hkv, {D}], got "
                         f"k {tuple(k_pool.shape)}, v {tuple(v_pool.shape)}")
    if k_pool.dtype != torch.bfloat16 or v_pool.dtype != torch.bfloat16:
        raise TypeError(f"paged_attention: pools must be bfloat16, got {k_pool.dtype}, {v_pool.dtype}")
    for t, name in ((k_pool, "k_pool"), (v_pool, "v_pool")):  # (read and written in 16-byte pieces)
        if t.device != q.device or t.data_ptr() % 16:
            raise ValueError(f"paged_attention: {name} must be on {q.device} and start on a 16-byte boundary, got "
                             f"{t.device}, byte {t.data_ptr() % 16} of one (a view at an offset: pass a pool of its own)")
    if H % Hkv:
        raise ValueError(f"paged_attention: {H} query heads is not a multiple of {Hkv} kv heads")
    if D % 32 or bs & (bs - 1):
        raise ValueError(f"paged_attention: needs head_dim % 32 == 0 (every Qwen3.5 size has 256) and a power-of-two "
                         f"block size, got head_dim {D}, block size {bs}")
    _check_rows(q, "q", (T, H, D))
    _check_rows(k_new, "k_new", (T, Hkv, D))
    _check_rows(v_new, "v_new", (T, Hkv, D))
    if gate is not None:
        _check_rows(gate, "gate", (T, H, D))
    for t, name, shape in ((block_table, "block_table", (N, max_blocks)), (cache_lens, "cache_lens", (N,)),
                           (cu_q, "cu_q", (N + 1,))):
        if t.dtype != torch.int32 or tuple(t.shape) != shape or not t.is_contiguous() or t.device != q.device:
            raise ValueError(f"paged_attention: {name} must be a contiguous int32 {shape} tensor on {q.device}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    if out is None:
        out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    elif (tuple(out.shape) != (T, H, D) or out.dtype != q.dtype or not out.is_contiguous() or out.device != q.device
          or out.data_ptr() % 16):
        raise ValueError(f"paged_attention: out must be a contiguous {q.dtype} {(T, H, D)} tensor on {q.device} "
                         f"starting on a 16-byte boundary, got {out.dtype} {tuple(out.shape)} on {out.device} at byte "
                         f"{out.data_ptr() % 16} of one")
    if T == 0 or N == 0:
        return out
    if N * Hkv > 65535:  # the grid's y dimension: a CTA row per (sequence, kv head)
        raise ValueError(f"paged_attention: {N:,} sequences x {Hkv} kv heads make {N * Hkv:,} grid rows, more than "
                         f"the 65,535 a launch takes; pass at most {65535 // Hkv:,} sequences a call")
    group = H // Hkv
    card = card_of(q.device)
    sms, wgmma = card.sms, card.wgmma
    if kernel == "wg" and not (wgmma and D % 64 == 0):
        raise ValueError(f"paged_attention: the warpgroup-mma kernel needs an sm_90a card and head_dim % 64 == 0 "
                         f"(head_dim {D}); leave kernel unset")
    if kernel == "dec" and D % 64:
        raise ValueError(f"paged_attention: the decode kernel needs head_dim % 64 == 0 (head_dim {D}); leave "
                         f"kernel unset")
    p = plan(max_q, N, Hkv, group, max_blocks * bs, sms, splits, wgmma and D % 64 == 0, kernel, D, card.smem_per_sm)
    if not 1 <= p.splits <= MAX_SPLITS:
        raise ValueError(f"paged_attention: splits must be in 1 .. {MAX_SPLITS} (paged_combine.cu's "
                         f"COMBINE_MAX_SPLITS), got {p.splits}")
    defines = {"HEAD_DIM": D, "GROUP": group, "BLOCK_SIZE": bs, "SPLIT": int(p.splits > 1),
               "GATE": int(gate is not None)}
    if p.kernel == "wg":
        wgs = p.warps_m // 4
        fn = get_function(SRC_WG, "paged_attention_wg", q.device, {**defines, "WARPGROUPS": wgs})
        threads, smem = 128 * wgs, smem_bytes_wg(D, wgs)
    elif p.kernel == "dec":
        fn = get_function(SRC_DEC, "paged_attention_decode", q.device, defines)
        threads, smem = THREADS_DEC, smem_bytes_decode(D)
    else:
        fn = get_function(SRC, "paged_attention_fwd", q.device, {**defines, "WARPS_M": p.warps_m})
        threads, smem = 32 * p.warps_m, smem_bytes(p.warps_m, D)
    g = gate if gate is not None else q
    scale = D ** -0.5 if scale is None else scale
    i64 = np.int64
    o_part = lse_part = None
    if p.splits > 1:
        o_part = torch.empty(p.splits, T, H, D, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(p.splits, T, H, dtype=torch.float32, device=q.device)
    launch(fn, (p.row_tiles, N * Hkv, p.splits), (threads, 1, 1),
           (q, i64(q.stride(0)), i64(q.stride(1)), g, i64(g.stride(0)), i64(g.stride(1)),
            k_new, i64(k_new.stride(0)), i64(k_new.stride(1)), v_new, i64(v_new.stride(0)), i64(v_new.stride(1)),
            k_pool, v_pool, block_table, np.int32(max_blocks), cache_lens, cu_q, out, o_part, lse_part,
            np.int32(Hkv), np.int32(T), np.float32(scale * math.log2(math.e)), np.int32(bool(write_kv))),
           shared_mem=smem)
    if p.splits > 1:
        comb = get_function(SRC_COMBINE, "paged_attention_combine", q.device, {"HEAD_DIM": D, "GATE": int(gate is not None)})
        cols, groups, rows = combine_shape(D, p.splits)
        launch(comb, (math.ceil(T * H / rows), D // cols, 1), (groups * cols // 4, rows, 1),
               (o_part, lse_part, g, i64(g.stride(0)), i64(g.stride(1)), out, np.int32(T), np.int32(H),
                np.int32(p.splits)), programmatic=True)
    return out
