"""Launcher of rms_norm.cu: the model's RMSNorm (and the GDN output's gated norm, and the attention's q / k norm
with the rotary after it) in one pass."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..cuda_build import aligned16, get_function, launch
from .reference import add_rms_norm_ref, gated_rms_norm_ref, rms_norm_ref, rms_norm_rope_ref

SRC = Path(__file__).with_name("rms_norm.cu")
WARPS = 8  # as in rms_norm.cu
_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
MAX_D = 5120  # a row stays in registers: 5,120 (Qwen3.5-27B's hidden size) takes ~200 per thread, 8,192 spills


def supported(D: int) -> bool:
    """Row lengths the kernel takes: D / 8 divides 32 or is a multiple of 32 (64, 128, 256, 1024, 2048,
    2560, 4096, 5120: every Qwen3.5 size), at most MAX_D."""
    nv, rem = divmod(D, 8)
    return rem == 0 and 0 < D <= MAX_D and (32 % nv == 0 if nv < 32 else nv % 32 == 0)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as an [R, H, D] view (H = x.shape[-2], 1 for a vector) with unit last stride and 16-byte aligned
    rows, or a contiguous copy when its strides do not allow that."""
    D = x.shape[-1]
    H = x.shape[-2] if x.dim() >= 2 else 1
    try:
        v = x.view(-1, H, D)
    except RuntimeError:
        v = x.reshape(-1, H, D)
    aligned = (v.stride(2) == 1 and v.data_ptr() % 16 == 0 and v.stride(0) % 8 == 0 and v.stride(1) % 8 == 0)
    return v if aligned else v.contiguous()


FEW_ROWS = 256  # 2 to this many rows of 2,048 or 4,096: a whole block a row (TPR 256)


def _tpr(D: int, rows: Optional[int] = None) -> int:
    """Threads per row (TPR) of rms_norm.cu and of gemv.cu's fused norm; the one place the rule is written.
    Rows of at most 32 vectors (of 8 elements) take one thread a vector; longer ones 128 threads where the
    vectors divide by 128, else 64 where by 64 (2,560: five vectors a thread, not ten; results/norm-rows-2560-
    h200.json), else one warp: long rows keep few vectors a thread (registers: occupancy). A few long rows (a
    short prefill's hidden states) take the whole block, so that more blocks share the work: H200, the 9B add
    + norm (bench/norm_rows.py, graph replay of one launch): 64 rows 9.3 -> 7.8 us, 256 rows 10.2 -> 9.4, 1,294
    rows the same. One row (a decode step) keeps the rule: gemv.cu's fused norm, given rows=None, sums with the
    same threads, and is bit for bit the norm launch it replaces only when that launch does too."""
    nv = D // 8
    if rows is not None and nv % 256 == 0 and 1 < rows <= FEW_ROWS:
        return 256
    return nv if nv <= 32 else 128 if nv % 128 == 0 else 64 if nv % 64 == 0 else 32


def _norm(x: torch.Tensor, gate: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
          rope: Optional[tuple] = None, res: Optional[torch.Tensor] = None) -> torch.Tensor:
    """rms_norm.cu over x: gated by `gate`, with the rotary `rope` = (cos, sin) after it, or of res + x
    (then returns the sum and the norm)."""
    D = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if res is not None else None
    if x.numel() == 0:  # no rows (before _rows: a 2-D [0, D] has no [R, H, D] view with H = 0)
        return y if res is None else (s, y)
    xv = _rows(x)
    gv = _rows(gate) if gate is not None else xv
    w = aligned16(weight)  # read in 16-byte loads
    rows = xv.shape[0] * xv.shape[1]
    cos, sin = rope if rope is not None else (None, None)
    tpr = _tpr(D, rows if rope is None else None)  # (the rotary: the default threads per row)
    defines = {"DIM": D, "IN_T": _CODE[x.dtype], "W_T": _CODE[w.dtype], "GATED": int(gate is not None),
               "ROPE": 0 if cos is None else cos.shape[-1], "RES": int(res is not None), "TPR": tpr}
    per_block = WARPS * 32 // tpr  # RPB of rms_norm.cu
    i64 = np.int64
    launch(get_function(SRC, "rms_norm_fwd", x.device, defines), ((rows + per_block - 1) // per_block, 1, 1),
           (WARPS * 32, 1, 1),
           (xv, gv, w, y, i64(rows), np.int32(xv.shape[1]), i64(xv.stride(0)), i64(xv.stride(1)),
            i64(gv.stride(0)), i64(gv.stride(1)), np.float32(eps), cos, sin, i64(0 if cos is None else cos.shape[0]),
            res, s))
    return y if res is None else (s, y)


def _kernel_takes(x: torch.Tensor, weight: torch.Tensor, gate: Optional[torch.Tensor]) -> bool:
    ok = (x.dim() >= 1 and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype in (x.dtype, torch.float32)
          and supported(x.shape[-1]) and weight.shape == x.shape[-1:])
    return ok and (gate is None or (gate.shape == x.shape and gate.dtype == x.dtype))


def rms_norm_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as reference.rms_norm_ref; shapes or dtypes the kernel does not take run the reference."""
    if not _kernel_takes(x, weight, None):
        return rms_norm_ref(x, weight, eps).contiguous()  # (contiguous as the kernel's, and the op's fake)
    return _norm(x, None, weight, eps)


def gated_rms_norm_cuda(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as reference.gated_rms_norm_ref (same fallback)."""
    if not _kernel_takes(x, weight, gate):
        return gated_rms_norm_ref(x, gate, weight, eps).contiguous()
    return _norm(x, gate, weight, eps)


def rope_supported(D: int, rd: int) -> bool:
    """Rotary widths the fused kernel takes after a norm of D: a multiple of 16 whose sixteenth is a power of
    two, inside the first warp's vectors of a row (Qwen3.5: 64 of 256; the small test models 32 of 128)."""
    return (supported(D) and 0 < rd <= D and rd % 16 == 0 and (rd // 16) & (rd // 16 - 1) == 0
            and rd <= 8 * min(_tpr(D), 32))


def rms_norm_rope_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                       sin: torch.Tensor) -> torch.Tensor:
    """Same contract as reference.rms_norm_rope_ref (x [B, T, H, hd], cos / sin [T, rd]); what the kernel
    does not take runs the reference."""
    ok = (_kernel_takes(x, weight, None) and x.dim() == 4 and cos.dim() == 2 and cos.shape == sin.shape
          and cos.shape[0] == x.shape[1] and cos.dtype == x.dtype and sin.dtype == x.dtype
          and rope_supported(x.shape[-1], cos.shape[1]))
    if not ok:  # x's dtype and a contiguous result whatever the inputs' (the op's fake says so)
        return rms_norm_rope_ref(x, weight, eps, cos, sin).to(x.dtype, memory_format=torch.contiguous_format)
    return _norm(x, None, weight, eps, (aligned16(cos), aligned16(sin)))  # read in 16-byte vectors


def add_rms_norm_cuda(res: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as reference.add_rms_norm_ref: (s, rms_norm(s)) with s = res + x (what the kernel does not
    take runs the reference)."""
    ok = _kernel_takes(x, weight, None) and res.shape == x.shape and res.dtype == x.dtype
    if not ok:
        return tuple(t.contiguous() for t in add_rms_norm_ref(res, x, weight, eps))
    return _norm(x, None, weight, eps, res=aligned16(res))
