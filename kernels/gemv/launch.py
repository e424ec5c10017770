"""Launcher of gemv.cu: y = W x for one row x, the decode step's projections; with the residual add and
RMSNorm before it (gemv_add_rms_norm_cuda) or the MLP's gate (gemv_silu_mul_cuda) formed as x is staged. Each
takes `scale` for an int8 W with one scale a row (y = (W x) * scale, gemv.cu Q8)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..cuda_build import card_of, get_function, launch
from ..rms_norm.launch import _tpr as norm_threads_per_row
from ..rms_norm.launch import add_rms_norm_cuda, rms_norm_cuda
from ..silu_mul.launch import silu_mul_cuda
from .reference import gemv_ref

SRC = Path(__file__).with_name("gemv.cu")
THREADS, ROWS = 256, 2  # as in gemv.cu
WARPS = THREADS // 32
BLOCKS_PER_SM = 4  # gemv.cu's __launch_bounds__ minimum
_CODE = {torch.float16: 1, torch.bfloat16: 2}
MAX_K = 24576  # 48 KB of x in shared memory (every Qwen3.5 projection: K <= 17,408)


SPLITS = (4, 2, 1)  # warps a row group may take (gemv.cu SPLIT)
# weights of a row a warp's run keeps at least: a 16-bit row's two rounds of its lanes' UNROLL 16-byte loads, an
# int8 row's one round (split_of)
MIN_RUN = 32 * 4 * 2 * 8


def per_sm_of(smem: int, smem_per_sm: int) -> int:
    """Blocks of `smem` bytes of dynamic shared memory (x's K values, and a split's partial sums) one SM holds at
    once: BLOCKS_PER_SM, fewer where those and the 1 KB the runtime reserves a block pass the SM's: the 27B's
    down projection (K = 17,408: 34 KB of x) fits two on the 100 KB SM of an RTX 30 / 40 / 50 card, four on an
    A100 or H100."""
    return max(1, min(BLOCKS_PER_SM, smem_per_sm // (smem + 1024)))


def split_of(n_rows: int, k: int, sms: int, per_sm: int = BLOCKS_PER_SM) -> int:
    """Warps per row group of a plain product: the most of SPLITS whose warps still fit one full grid
    (per_sm blocks an SM: per_sm_of) and leave each warp at least MIN_RUN weights of a row; 1 where the row groups
    alone fill the grid. (The fused products keep 1: every block forms the whole x, a norm or the MLP's gate,
    so twice the blocks for the same rows cost more staging than the shared rows save: 9B-shaped graph decode
    206.4 tok/s with them split against 207.7, results/gemv-split-ab-h200.json; where a product splits, its
    norm or gate runs as a launch of its own instead: `fuses`.) int8 rows are judged as 16-bit ones, their runs
    counted in weights, not 16-byte pieces: int8 graph decode with the 9B and 4B out_proj and o_proj and the 2B
    down split in two, 0.4 / 1.9 / 3.2% faster at 9B / 4B / 2B than with runs of 256 pieces that kept them whole;
    runs of 96 pieces, which split the 0.8B down too, lost its gate's fusion (0.7% slower;
    results/gemv-int8-split-ab-h100-*.json)."""
    groups = -(-n_rows // ROWS)
    for s in SPLITS:
        if groups * s <= sms * per_sm * WARPS and k // s >= MIN_RUN:
            return s
    return 1


def fuses(pro: int, n_rows: int, k: int, sms: int, per_sm: int = BLOCKS_PER_SM) -> bool:
    """Whether a product's fused launch (PRO 1: the residual add and RMSNorm staged as x; PRO 2: the MLP's
    gate) beats the two launches it replaces; else those run (the norm or the gate, then the plain product).
    Graph decode of each dense size at 4K context (results/decode-mixed-*-ab-h200.json, tok/s fused / with the
    gates apart / the norms apart / both apart):
    - where the plain product splits its row groups (split_of > 1) the fused one, which keeps one warp a group,
      loses to the gate's launch and the split product: 9B 207.8 / 210.0, 2B 612.0 / 617.7 (down: 2 warps a
      group); 0.8B, whose down does not split, 899.0 / 884.3;
    - a norm whose row rms_norm.cu forms with one warp (ten 16-byte vectors a lane) holds every block's weights
      back that long: the 4B (K = 2,560) when its rows were one warp's, 294.0 / 300.9 / 300.7 / 307.5; on two
      warps (five vectors a lane, results/decode-mixed-4b-tpr64-ab-h200.json) 315.7 / 323.1 / 307.0 / 313.6,
      the norms fused winning as at the other sizes (9B 207.8 against 203.2 apart). No Qwen3.5 hidden size
      is one warp's row now; the guard stays for any other."""
    if split_of(n_rows, k, sms, per_sm) > 1:
        return False
    tpr = norm_threads_per_row(k)  # gemv.cu's PRO 1 forms the row with these threads (its launcher passes them)
    return pro != 1 or tpr > 32 or tpr == k // 8  # more than one warp a row, or one vector a thread


def grid_blocks(n_rows: int, sms: int, split: int = 1, per_sm: int = BLOCKS_PER_SM) -> int:
    """Blocks for n_rows rows, `split` warps a row group: at most per_sm a multiprocessor, and as few as
    give every warp the same number of row groups (ROWS rows each) as the fullest one (no wave of a few warps
    at the end)."""
    groups, per_block = -(-n_rows // ROWS), WARPS // split
    rounds = -(-groups // (sms * per_sm * per_block))  # row groups per warp
    return max(1, -(-groups // (rounds * per_block)))


def _fuses_on(pro: int, n_rows: int, k: int, device) -> bool:
    card = card_of(device)
    return fuses(pro, n_rows, k, card.sms, per_sm_of(2 * k, card.smem_per_sm))  # (x: a 16-bit type)


def takes(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
    """Whether the kernel takes x @ weight^T: one row of a 16-bit type on a CUDA device, weight [N, K] of the
    same type (with `scale`: int8, and scale [N] contiguous in x's type) with unit column stride, K a multiple
    of a 16-byte piece's weights (8; int8 16) up to MAX_K (x fits the block's shared memory without an opt-in)
    and every row 16-byte aligned."""
    if x.dtype not in _CODE or not (x.is_cuda and weight.is_cuda) or weight.dim() != 2:
        return False
    if scale is None:
        if weight.dtype != x.dtype:
            return False
    elif not (weight.dtype == torch.int8 and scale.dtype == x.dtype and scale.device == weight.device
              and tuple(scale.shape) == (weight.shape[0],) and scale.is_contiguous()):
        return False
    K, piece = weight.shape[1], 16 // weight.element_size()
    return (x.shape[-1] == K and x.numel() == K and K % piece == 0 and 0 < K <= MAX_K and weight.shape[0] > 0
            and weight.stride(1) == 1 and weight.stride(0) % piece == 0 and weight.data_ptr() % 16 == 0)


def _aligned_row(t: torch.Tensor, n: int) -> torch.Tensor:
    """t's n elements as a contiguous, 16-byte aligned row (a copy where t is not one)."""
    v = t.reshape(n)
    return v if v.is_contiguous() and v.data_ptr() % 16 == 0 else v.clone(memory_format=torch.contiguous_format)


def _launch(weight: torch.Tensor, x, y: torch.Tensor, K: int, defines: dict, res=None, norm_w=None, s=None,
            eps: float = 0.0, split: int = 1, scale=None) -> None:
    N = weight.shape[0]
    defines = {"IN_T": _CODE[y.dtype], "SPLIT": split, **defines, **({"Q8": 1} if scale is not None else {})}
    fn = get_function(SRC, "gemv", y.device, defines)
    card, smem = card_of(y.device), K * y.element_size() + (WARPS * ROWS * 4 if split > 1 else 0)
    launch(fn, (grid_blocks(N, card.sms, split, per_sm_of(smem, card.smem_per_sm)), 1, 1), (THREADS, 1, 1),
           (weight, x, y, np.int32(N), np.int32(K), np.int64(weight.stride(0)), res, norm_w, s, np.float32(eps),
            scale),
           shared_mem=smem, programmatic=True)


def gemv_cuda(x: torch.Tensor, weight: torch.Tensor, split: int | None = None,
              scale: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as reference.gemv_ref; what the kernel does not take (see takes) runs the reference.
    split: warps a row group (default split_of; 1 sums each row as the fused products do, bit for bit)."""
    if not takes(x, weight, scale):
        return gemv_ref(x, weight, scale)
    N, K = weight.shape
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    if split is None:
        card = card_of(x.device)
        split = split_of(N, K, card.sms, per_sm_of(K * x.element_size(), card.smem_per_sm))
    _launch(weight, _aligned_row(x, K), y, K, {}, split=split, scale=scale)
    return y


def gemv_add_rms_norm_cuda(res: torch.Tensor, x: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                           weight: torch.Tensor, fuse: bool | None = None,
                           scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as reference.gemv_add_rms_norm_ref: add_rms_norm (rms_norm without x) then gemv_cuda, bit
    for bit, in one launch (PRO 1) where `fuses` says it is faster (fuse: True / False to ask for it or not).
    The fused launch sums each row as gemv_cuda(..., split=1) does; what it does not take (see takes; the hidden
    size a multiple of 256, the norm weight [K] of a 16-bit or fp32 type) runs as the two launches."""
    K = res.shape[-1]
    ok = (takes(res, weight, scale) and K % 256 == 0 and norm_w.shape == (K,)
          and norm_w.dtype in (*_CODE, torch.float32) and norm_w.is_cuda
          and (x is None or (x.shape == res.shape and x.dtype == res.dtype))
          and (fuse if fuse is not None else _fuses_on(1, weight.shape[0], K, res.device)))
    if not ok:
        s, n = add_rms_norm_cuda(res, x, norm_w, eps) if x is not None else (res, rms_norm_cuda(res, norm_w, eps))
        return s, gemv_cuda(n, weight, scale=scale)
    s = res if x is None else torch.empty_like(res, memory_format=torch.contiguous_format)
    y = torch.empty(*res.shape[:-1], weight.shape[0], dtype=res.dtype, device=res.device)
    # the row formed with the threads of rms_norm.cu's one-row launch: the same sums, bit for bit
    defines = {"PRO": 1, "DIM": K, "W_T": _CODE.get(norm_w.dtype, 0), "TPR": norm_threads_per_row(K)}  # W_T 0: fp32
    _launch(weight, None if x is None else _aligned_row(x, K), y, K, defines, _aligned_row(res, K), _aligned_row(norm_w, K),
            None if x is None else s, eps, scale=scale)
    return s, y


def gemv_silu_mul_cuda(gu: torch.Tensor, weight: torch.Tensor, fuse: bool | None = None,
                       scale: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as reference.gemv_silu_mul_ref: silu_mul then gemv_cuda, bit for bit, in one launch (PRO 2)
    where `fuses` says it is faster (fuse: True / False to ask for it or not; the fused launch sums each row as
    gemv_cuda(..., split=1) does); what it does not take runs as the two launches."""
    K = weight.shape[-1]
    ok = (gu.shape[-1] == 2 * K and takes(gu[..., :K], weight, scale)
          and (fuse if fuse is not None else _fuses_on(2, weight.shape[0], K, gu.device)))
    if not ok:
        return gemv_cuda(silu_mul_cuda(gu), weight, scale=scale)
    y = torch.empty(*gu.shape[:-1], weight.shape[0], dtype=gu.dtype, device=gu.device)
    _launch(weight, _aligned_row(gu, 2 * K), y, K, {"PRO": 2}, scale=scale)
    return y
