"""Launchers of positions.cu, rotary.cu, layer_norm.cu and attention.cu (the vision tower's patch positions,
rotary, LayerNorm, residual add + LayerNorm, and attention within each image or video slice).

The kernels take bf16 / fp16 activations: positions with rows that are multiples of 8 and the position grid in
the activation's dtype; rotary with head dims that are multiples of 8 and fp32 cos / sin;
LayerNorm with rows that are multiples of 8 up to MAX_D and weight and bias in the activation's dtype;
attention bf16 with head dims 64 or 72 on sm_90a cards (H100 / H200: wgmma and TMA; the tower takes SDPA
elsewhere). Anything else runs the reference."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..cuda_build import aligned16, card_of, get_function, keep_map, launch, stream_flags, tensor_map
from .reference import add_layer_norm_ref, layer_norm_ref, vision_attention_ref, vision_positions_ref, vision_rotary_ref

POSITIONS_SRC = Path(__file__).with_name("positions.cu")
ROTARY_SRC = Path(__file__).with_name("rotary.cu")
NORM_SRC = Path(__file__).with_name("layer_norm.cu")
ATTN_SRC = Path(__file__).with_name("attention.cu")
_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
POSITIONS_THREADS = 128  # THREADS of positions.cu
ROTARY_THREADS = 256  # THREADS of rotary.cu
ROTARY_HG = 2  # HG of rotary.cu: q / k heads a thread rotates with one read of its cos / sin (divides 2 x any
#                head count; 4 and 8 hold too many loads a thread: kernels/vision/NOTES.md)
NORM_THREADS = 256  # WARPS * 32 of layer_norm.cu
MAX_D = 10240  # layer_norm.cu holds a row in registers, at most 5 vectors of 8 per thread over up to 256 threads
ATTN_ROWS, ATTN_KEYS, ATTN_THREADS, ATTN_CONSUMER_THREADS = 192, 128, 512, 384  # BM, BN, THREADS, CT of attention.cu
ATTN_HEAD_DIMS = (64, 72)


def positions_takes(x: torch.Tensor, pos_embed: torch.Tensor, table: torch.Tensor, grids: list[int],
                    inv_freq: torch.Tensor) -> bool:
    """Whether positions.cu runs this call: bf16 / fp16 rows of a multiple of 8, the position grid square and
    in x's dtype, the grids' table int32 [G, 4] beside them, fp32 frequencies."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16) or x.shape[1] % 8:
        return False
    side = math.isqrt(pos_embed.shape[0]) if pos_embed.dim() == 2 else 0
    return (pos_embed.dtype == x.dtype and pos_embed.shape == (side * side, x.shape[1]) and side > 0
            and table.dtype == torch.int32 and table.shape == (len(grids) // 3, 4) and table.is_contiguous()
            and table.device == x.device and inv_freq.dtype == torch.float32 and inv_freq.dim() == 1
            and inv_freq.is_contiguous() and inv_freq.numel() > 0 and pos_embed.device == inv_freq.device == x.device)


def vision_positions_cuda(x: torch.Tensor, pos_embed: torch.Tensor, table: torch.Tensor, grids: list[int],
                          inv_freq: torch.Tensor, merge: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as reference.vision_positions_ref; table: the grids on x's device as positions.cu reads
    them, int32 [G, 4] (t, h, w, first patch of each)."""
    if not positions_takes(x, pos_embed, table, grids, inv_freq):
        return vision_positions_ref(x, pos_embed, grids, inv_freq, merge)
    n, d = x.shape
    hd = 4 * inv_freq.numel()
    out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    cos, sin = (torch.empty(n, hd, dtype=torch.float32, device=x.device) for _ in range(2))
    if n == 0:
        return out, cos, sin
    defines = {"DIM": d, "HEAD_DIM": hd, "SIDE": math.isqrt(pos_embed.shape[0]), "MERGE": merge,
               "IN_T": _CODE[x.dtype]}
    launch(get_function(POSITIONS_SRC, "vision_positions", x.device, defines), (n, 1, 1), (POSITIONS_THREADS, 1, 1),
           (aligned16(x), aligned16(pos_embed), table, np.int32(table.shape[0]), inv_freq, out, cos, sin))
    return out, cos, sin


def rotary_takes(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if qkv.dim() != 4 or qkv.shape[1] != 3 or qkv.dtype not in (torch.bfloat16, torch.float16):
        return False
    n, _, _, hd = qkv.shape
    return hd % 8 == 0 and all(t.dtype == torch.float32 and t.shape == (n, hd) and t.device == qkv.device
                               for t in (cos, sin))


def vision_rotary_cuda(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Same contract as reference.vision_rotary_ref: qkv [N, 3, H, hd] -> q, k as one [2, N, H, hd]."""
    if not rotary_takes(qkv, cos, sin):
        return vision_rotary_ref(qkv, cos, sin)
    n, _, h, hd = qkv.shape
    out = torch.empty(2, n, h, hd, dtype=qkv.dtype, device=qkv.device)
    total = n * (2 * h // ROTARY_HG) * (hd // 8)  # threads: one per 8 output features of ROTARY_HG heads
    if total == 0:
        return out
    fn = get_function(ROTARY_SRC, "vision_rotary", qkv.device,
                      {"HEAD_DIM": hd, "HEADS": h, "IN_T": _CODE[qkv.dtype], "HG": ROTARY_HG})
    launch(fn, ((total + ROTARY_THREADS - 1) // ROTARY_THREADS, 1, 1), (ROTARY_THREADS, 1, 1),
           (aligned16(qkv), aligned16(cos), aligned16(sin), out, np.int64(n)))
    return out


def norm_takes(x: torch.Tensor, y: Optional[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor) -> bool:
    D = x.shape[-1] if x.dim() else 0
    ok = (x.dtype in (torch.bfloat16, torch.float16) and D % 8 == 0 and 0 < D <= MAX_D
          and weight.dtype == x.dtype and bias.dtype == x.dtype
          and weight.shape == (D,) and bias.shape == (D,) and weight.device == bias.device == x.device)
    return ok and (y is None or (y.shape == x.shape and y.dtype == x.dtype and y.device == x.device))


def _layer_norm(x: torch.Tensor, y: Optional[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor,
                eps: float) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    D = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty_like(out) if y is not None else None
    rows = out.numel() // D
    if rows == 0:
        return s, out
    nv = D // 8
    tpr = 32 if nv <= 160 else 64 if nv <= 320 else 128 if nv <= 640 else 256  # TPR of layer_norm.cu
    per_block = NORM_THREADS // tpr
    defines = {"DIM": D, "IN_T": _CODE[x.dtype], "HAS_Y": int(y is not None)}
    launch(get_function(NORM_SRC, "layer_norm_fwd", x.device, defines), ((rows + per_block - 1) // per_block, 1, 1),
           (NORM_THREADS, 1, 1),
           (aligned16(x), None if y is None else aligned16(y), aligned16(weight), aligned16(bias), s, out, np.int64(rows),
            np.float32(eps)))
    return s, out


def layer_norm_cuda(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as reference.layer_norm_ref."""
    if not norm_takes(x, None, weight, bias):
        return layer_norm_ref(x, weight, bias, eps).contiguous()  # (as the kernel's, and the op's fake)
    return _layer_norm(x, None, weight, bias, eps)[1]


def add_layer_norm_cuda(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as reference.add_layer_norm_ref: (x + y, LayerNorm(x + y))."""
    if not norm_takes(x, y, weight, bias):
        return tuple(t.contiguous() for t in add_layer_norm_ref(x, y, weight, bias, eps))
    return _layer_norm(x, y, weight, bias, eps)


def attention_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> bool:
    """Whether attention.cu runs this call (from shapes, strides and the card; the launcher also wants 16-byte
    aligned data): bf16 q, k, v of one shape [N, H, hd], hd 64 or 72, each token's heads packed ([.., H, hd]
    contiguous; rows any multiple of 16 bytes apart, as the copy engine reads them), on an sm_90a card."""
    if not (q.is_cuda and q.dim() == 3 and q.dtype == torch.bfloat16 and q.shape[-1] in ATTN_HEAD_DIMS):
        return False
    shape, index, hd = q.shape, q.get_device(), q.shape[2]
    for x in (q, k, v):
        s = x.stride()
        if (x.shape != shape or x.dtype != torch.bfloat16 or x.get_device() != index or s[2] != 1 or s[1] != hd
                or s[0] % 8):  # (rows 16 bytes apart: 8 bf16 elements)
            return False
    return cu_seqlens.dtype == torch.int32 and cu_seqlens.get_device() == index and card_of(q.device).wgmma


def attention_smem(head_dim: int) -> int:
    """Dynamic shared memory of attention.cu: Q, two stages of K and V (64-column blocks of 128-byte rows),
    1 KB of alignment, ten barriers."""
    qk_cb = (2 * ((head_dim + 15) // 16) + 7) // 8  # QK_CB: Q / K rows padded to the k-steps of 16
    v_cb = (head_dim + 63) // 64  # V_CB
    return (qk_cb * ATTN_ROWS + 2 * qk_cb * ATTN_KEYS + 2 * v_cb * ATTN_KEYS) * 64 * 2 + 1024 + 10 * 8


def attention_map(x: torch.Tensor, rows: int = 64):
    """x [N, H, hd] as the kernel's TMA boxes: 64 columns x `rows` tokens of one head; zeros outside."""
    n, h, hd = x.shape
    return tensor_map(x, (hd, h, n), (hd * x.element_size(), x.stride(0) * x.element_size()), (64, 1, rows))


_qkv_maps: dict = {}  # (addresses, shape, row strides) of q, k, v -> the kernel's six maps (256 kept)


def _attention_maps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """The kernel's maps, found with one lookup (the tower's layers come back to the same few addresses): q's in
    boxes of a block's rows, k's of a tile's keys, v's of a tile's keys and of 64, 8 and 1 (a segment's last
    tile reads its rows and zeros in them)."""
    key = (q.data_ptr(), k.data_ptr(), v.data_ptr(), q.shape, q.stride(0), k.stride(0), v.stride(0))
    maps = _qkv_maps.get(key)
    if maps is None:
        maps = keep_map(_qkv_maps, key, (attention_map(q, ATTN_ROWS), attention_map(k, ATTN_KEYS),
                                         *(attention_map(v, rows) for rows in (ATTN_KEYS, 64, 8, 1))))
    return maps


def vision_attention_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                          max_len: int, ctas: Optional[int] = None) -> torch.Tensor:
    """Same contract as reference.vision_attention_ref; max_len: at least the longest segment (a host int).
    ctas: the persistent grid (default one CTA per SM; tests take fewer to split small inputs)."""
    if not attention_takes(q, k, v, cu_seqlens) or any(x.data_ptr() % 16 for x in (q, k, v)):
        return vision_attention_ref(q, k, v, cu_seqlens)
    n, h, hd = q.shape
    out = torch.empty(n, h, hd, dtype=q.dtype, device=q.device)
    segments = cu_seqlens.numel() - 1
    if n == 0 or segments <= 0 or max_len <= 0:
        return out
    blocks = (max_len + ATTN_ROWS - 1) // ATTN_ROWS * segments * h  # at least the work's blocks
    grid = max(1, min(ctas or card_of(q.device).sms, blocks))
    if blocks > grid:  # more than a wave: CTAs hand partial blocks on
        partials = torch.empty(grid * (hd // 2 + 4) * ATTN_CONSUMER_THREADS, dtype=torch.float32, device=q.device)
        flags = stream_flags(q.device, grid)
    else:  # a block a CTA: neither is read
        partials, flags = None, None
    fn = get_function(ATTN_SRC, "vision_attention", q.device, {"HEAD_DIM": hd, "HEADS": h})
    launch(fn, (grid, 1, 1), (ATTN_THREADS, 1, 1),
           (*_attention_maps(q, k, v), cu_seqlens.contiguous(),
            np.int32(segments), out,
            partials, flags, np.float32(hd ** -0.5 * math.log2(math.e))),
           shared_mem=attention_smem(hd))
    return out
