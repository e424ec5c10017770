"""8-bit weights: the text model's matrices kept as int8 with one scale per row, computed in the model's dtype.

A row w of a weight matrix is stored as q = round(w / s) with s = max|w| / 127 (s in the model's dtype, q in
-127..127): one byte a number and one scale a row, half the memory of bf16. The model computes with q * s:
a matmul multiplies its input by that dequantized matrix (made a few thousand rows at a time where the matrix
is large, so no more than DEQUANT_BYTES of it exists at once) and the embedding takes q * s of the rows it looks
up. An int8 model therefore computes exactly what a model with weights q * s computes (on the CPU, a few rows at
a time take another route, below); the one difference from the checkpoint is that rounding (tests/test_int8.py
states it).

Each row is quantized on its own, so the rows of a fused matrix (q/k/v, gate/up) can be filled part by part
as the checkpoint's tensors come, and the result does not depend on which tensors share a matrix.

On the CPU an elementwise pass over a matrix costs many times the matmul that reads it (2 cores, a 6144 x 2048
matrix and one row: dequantized and multiplied 56 ms, the fp32 product with full weights 4.2 ms), so a decode step
that dequantized every matrix would run ~10x slower than full weights. There, inputs of up to PACKED_ROWS rows take
torch's weight-only int8 matmul (torch._weight_int8pack_mm: the int8 rows read as they are, the input in bf16, fp32
sums, a bf16 result; 2.9 ms for that row, 25 ms for 16 rows against 42 for full weights and 87 dequantized), whose
products are then scaled in fp32; from ~100 rows on (a prompt) dequantizing is as fast (256 rows: 231 ms, against
340 packed and 178 full). Its vectorized forms load aligned 16-number runs, so it is
given fresh bf16 copies of the inputs and only matrices whose width is a multiple of 64 (every Qwen3.5 matrix).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

WEIGHTS = ("auto", "full", "int8")  # how load_model keeps the text model's matrices (auto: loader.pick_int8)
QMAX = 127
DEQUANT_BYTES = 384 << 20  # the most of one matrix dequantized at once (the 27B's gate/up, 356 MB, in one go)
FILL_BYTES = 64 << 20  # fp32 rows a fill quantizes at once
PACKED_ROWS = 64  # on the CPU, inputs of up to this many rows take torch's int8 matmul (above)
_packed = [hasattr(torch, "_weight_int8pack_mm")]  # False once this torch refused it


class Int8Weight(nn.Module):
    """A [rows, cols] weight matrix as int8 `q` [rows, cols] and `scale` [rows] in the compute dtype: the
    matrix is q * scale[:, None]."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device):
        super().__init__()
        self.q = nn.Parameter(torch.empty(rows, cols, dtype=torch.int8, device=device), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(rows, dtype=dtype, device=device), requires_grad=False)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the matrix is computed in."""
        return self.scale.dtype

    @property
    def is_meta(self) -> bool:
        return self.q.is_meta

    def numel(self) -> int:
        return self.q.numel()

    def rows(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Rows lo .. hi-1 of the matrix in the compute dtype (one elementwise op: one rounding a number)."""
        return self.q[lo:hi] * self.scale[lo:hi, None]

    def rows_per_piece(self) -> int:
        """How many rows linear dequantizes at once (all of them unless that would exceed DEQUANT_BYTES)."""
        return max(1, min(self.shape[0], DEQUANT_BYTES // (self.shape[1] * self.scale.element_size())))


def matrix(rows: int, cols: int, dtype: torch.dtype, device, int8: bool):
    """A model weight matrix to be filled: an nn.Parameter in `dtype`, or an Int8Weight computed in it."""
    if int8:
        return Int8Weight(rows, cols, dtype, device)
    return nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device), requires_grad=False)


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x @ w^T for a weight w that is a tensor or an Int8Weight (dequantized piece by piece, or on the CPU for a
    few rows torch's int8 matmul)."""
    if not isinstance(w, Int8Weight):
        return F.linear(x, w)
    if x.device.type == "cpu" and x.numel() <= PACKED_ROWS * x.shape[-1] and x.shape[-1] % 64 == 0 and _packed[0]:
        y = _packed_linear(x, w)
        if y is not None:
            return y
    step, n = w.rows_per_piece(), w.shape[0]
    if step >= n:
        return F.linear(x, w.rows())
    return torch.cat([F.linear(x, w.rows(lo, lo + step)) for lo in range(0, n, step)], dim=-1)


def _packed_linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor | None:
    """linear on the CPU through torch._weight_int8pack_mm; None where this torch does not take it."""
    a = x.reshape(-1, x.shape[-1]).to(torch.bfloat16, copy=True)  # contiguous and aligned, as its loads want
    try:
        y = torch._weight_int8pack_mm(a, w.q, torch.ones(w.shape[0], dtype=torch.bfloat16))
    except (RuntimeError, NotImplementedError) as e:
        log.warning("Qwen3.5: this PyTorch has no int8 matmul on the CPU (%s); int8 weights are dequantized for "
                    "each matmul, which decodes slower", e)
        _packed[0] = False
        return None
    return (y.float() * w.scale.float()).to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def embedding(ids: torch.Tensor, w) -> torch.Tensor:
    """The rows of w (a tensor or an Int8Weight) for token ids."""
    if not isinstance(w, Int8Weight):
        return F.embedding(ids, w)
    return F.embedding(ids, w.q) * F.embedding(ids, w.scale[:, None])


def quantize_rows(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [rows, cols], scale [rows] in dtype) for a matrix w: s = max|w| / 127 per row, rounded to dtype,
    q = w / s rounded to the nearest integer and held to -127..127 (a row of zeros: s = 0, q = 0)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / QMAX).to(dtype)
    s = scale.float()
    q = w / torch.where(s > 0, s, 1)[:, None]  # a row whose scale is 0 is zeros (or rounds to them)
    return q.round_().clamp_(-QMAX, QMAX).to(torch.int8), scale


def fill_rows(w: Int8Weight, row: int, t: torch.Tensor) -> None:
    """Quantizes the rows of t [n, cols] (any float dtype, any device) into rows row .. row+n-1 of w, a slice of
    rows at a time (at most FILL_BYTES of them in fp32), on w's device."""
    step = max(1, FILL_BYTES // (4 * t.shape[1]))
    with torch.no_grad():
        for lo in range(0, t.shape[0], step):
            q, s = quantize_rows(t[lo:lo + step].to(w.device), w.dtype)
            w.q[row + lo:row + lo + q.shape[0]].copy_(q)
            w.scale[row + lo:row + lo + q.shape[0]].copy_(s)


def dequant_bytes(model) -> int:
    """The most a run of `model` holds of a dequantized matrix at once (0 for full weights)."""
    pieces = [m.rows_per_piece() * m.shape[1] * m.scale.element_size()
              for m in model.modules() if isinstance(m, Int8Weight)]
    return max(pieces, default=0)


__all__ = ["WEIGHTS", "Int8Weight", "matrix", "linear", "embedding", "quantize_rows", "fill_rows", "dequant_bytes"]
