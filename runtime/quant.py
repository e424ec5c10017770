"""8-bit weights: the text model's matrices kept as int8 with one scale per row, computed in the model's dtype.

A row w of a weight matrix is stored as q = round(w / s) with s = max|w| / 127 (s in the model's dtype, q in
-127..127): one byte a number and one scale a row, half the memory of bf16. The model computes with q * s:
a matmul multiplies its input by that dequantized matrix (made a few thousand rows at a time where the matrix
is large, so no more than DEQUANT_BYTES of it exists at once) and the embedding takes q * s of the rows it looks
up. An int8 model therefore computes exactly what a model with weights q * s computes; the one difference from
the checkpoint is that rounding (tests/test_int8.py states it).

Each row is quantized on its own, so the rows of a fused matrix (q/k/v, gate/up) can be filled part by part
as the checkpoint's tensors come, and the result does not depend on which tensors share a matrix.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WEIGHTS = ("auto", "full", "int8")  # how load_model keeps the text model's matrices (auto: pick_weights)
QMAX = 127
DEQUANT_BYTES = 384 << 20  # the most of one matrix dequantized at once (the 27B's gate/up, 356 MB, in one go)
FILL_BYTES = 64 << 20  # fp32 rows a fill quantizes at once


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
    """x @ w^T for a weight w that is a tensor or an Int8Weight (dequantized piece by piece)."""
    if not isinstance(w, Int8Weight):
        return F.linear(x, w)
    step, n = w.rows_per_piece(), w.shape[0]
    if step >= n:
        return F.linear(x, w.rows())
    return torch.cat([F.linear(x, w.rows(lo, lo + step)) for lo in range(0, n, step)], dim=-1)


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
