"""8-bit weights: the text model's matrices kept as int8 with one scale per row, computed in the model's dtype.

A row w of a weight matrix is stored as q = round(w / s) with s = max|w| / 127 (s in the model's dtype, q in
-127..127): one byte a number and one scale a row, half the memory of bf16. The model computes with q * s:
a matmul multiplies its input by that dequantized matrix (made some thousands of rows at a time where the matrix
is large, so no more than DEQUANT_BYTES of it exists at once; on the CUDA backend kernels.dequant_rows makes it,
reading each byte once: 2.5-2.8 TB/s on an H100 and 3.0-3.8 on an H200, where torch.mul of int8 rows by bf16
scales ran at 0.75-0.80, bench/results/int8-dequant-ab-h100.json, -h200.json) and the embedding takes q * s of
the rows it looks up. An int8 model's prompts therefore compute exactly what a model with weights q * s computes
(on the CPU the matmul takes another route, below); the one difference from the checkpoint is that rounding
(tests/test_int8.py states it).

A GPU decode step's one-row products do not dequantize: they take kernels.gemv with the int8 rows and their
scales (Qwen35Model._proj), which reads each weight byte once and scales the row's fp32 sum (q x) * s, rounded
once, within the rounding of the dequantized product, not bit for bit it. Dequantizing there read a byte, wrote
two and read them again for every weight: a 9B-shaped model decoded at 28 tokens/s against 210 with full weights,
and decodes at 308 with the kernel (bench/results/int8-weights-h200.json).

Each row is quantized on its own, so the rows of a fused matrix (q/k/v, gate/up) can be filled part by part
as the checkpoint's tensors come, and the result does not depend on which tensors share a matrix.

On the CPU an elementwise pass over a matrix costs many times the matmul that reads it (2 cores, a 6144 x 2048
matrix and one row: dequantized and multiplied 56 ms, the fp32 product with full weights 4.2 ms), so a decode step
that dequantized every matrix would run ~10x slower than full weights. There the matmul is torch's weight-only
int8 one (torch._weight_int8pack_mm: the int8 rows read as they are, the input in bf16, fp32 sums, a bf16 result,
then scaled in fp32): 2.9 ms for that row, 25 ms for 16 rows against 42 for full weights and 87 dequantized, 340
for 256 rows against 178 full and 231 dequantized. It takes every product, prompts too, although dequantizing
would read a long prompt faster: each output row is then computed the same way whatever the rows beside it, so a
prompt read after a cached prefix, or a follow-up turn, gives what reading it in one go gives (tests/test_int8.py).
Its vectorized forms load aligned 16-number runs: it is given fresh contiguous bf16 copies of the inputs and only
matrices whose width is a multiple of 64 (every Qwen3.5 matrix; others dequantize).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels

log = logging.getLogger(__name__)

WEIGHTS = ("auto", "full", "int8")  # how load_model keeps the text model's matrices (auto: loader.pick_int8)
QMAX = 127
DEQUANT_BYTES = 128 << 20  # the most of one matrix dequantized at once (each CUDA graph's pool keeps that much)
FILL_BYTES = 64 << 20  # fp32 rows a fill quantizes at once
_packed: list = []  # [whether this torch has the CPU int8 matmul], found on first use


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

    def rows(self, lo: int = 0, hi: int | None = None, backend: kernels.Backend | None = None) -> torch.Tensor:
        """Rows lo .. hi-1 of the matrix in the compute dtype, q * scale with one rounding a number
        (kernels.dequant_rows: on the CUDA backend its kernel, which reads each byte once)."""
        return kernels.dequant_rows(self.q[lo:hi], self.scale[lo:hi], backend=backend)

    def rows_per_piece(self) -> int:
        """How many rows linear dequantizes at once (all of them unless that would exceed DEQUANT_BYTES)."""
        return max(1, min(self.shape[0], DEQUANT_BYTES // (self.shape[1] * self.scale.element_size())))


def matrix(rows: int, cols: int, dtype: torch.dtype, device, int8: bool):
    """A model weight matrix to be filled: an nn.Parameter in `dtype`, or an Int8Weight computed in it."""
    if int8:
        return Int8Weight(rows, cols, dtype, device)
    return nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device), requires_grad=False)


def linear(x: torch.Tensor, w, backend: kernels.Backend | None = None, rows: tuple[int, int] | None = None
           ) -> torch.Tensor:
    """x @ w^T for a weight w that is a tensor or an Int8Weight (dequantized piece by piece, on `backend`'s
    kernel; on the CPU torch's int8 matmul); rows (lo, hi): with w's rows lo .. hi-1 alone."""
    lo, hi = rows if rows is not None else (0, w.shape[0])
    if not isinstance(w, Int8Weight):
        return F.linear(x, w if rows is None else w[lo:hi])
    n = hi - lo
    if x.device.type == "cpu" and x.shape[-1] % 64 == 0 and cpu_int8_matmul():
        a = torch.empty(x.numel() // x.shape[-1], x.shape[-1], dtype=torch.bfloat16)
        a.copy_(x.reshape(a.shape))  # contiguous and aligned, as its loads want
        y = torch._weight_int8pack_mm(a, w.q[lo:hi], torch.ones(n, dtype=torch.bfloat16))
        return (y.float() * w.scale[lo:hi].float()).to(x.dtype).reshape(*x.shape[:-1], n)
    step = w.rows_per_piece()
    if step >= n:
        return F.linear(x, w.rows(lo, hi, backend))
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    for a in range(lo, hi, step):  # each piece's product into its columns: one piece and its output at a time
        b = min(hi, a + step)
        y[..., a - lo:b - lo] = F.linear(x, w.rows(a, b, backend))
    return y


def cpu_int8_matmul() -> bool:
    """Whether this torch has the CPU int8 matmul (tried once on a small product, said when it has not)."""
    if not _packed:
        try:
            torch._weight_int8pack_mm(torch.ones(1, 64, dtype=torch.bfloat16), torch.ones(4, 64, dtype=torch.int8),
                                      torch.ones(4, dtype=torch.bfloat16))
            _packed.append(True)
        except (AttributeError, RuntimeError, NotImplementedError) as e:
            log.warning("Qwen3.5: this PyTorch has no int8 matmul on the CPU (%s: %s); int8 weights are "
                        "dequantized for each matmul there, which decodes several times slower", type(e).__name__, e)
            _packed.append(False)
    return _packed[0]


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


__all__ = ["WEIGHTS", "Int8Weight", "matrix", "linear", "cpu_int8_matmul", "embedding", "quantize_rows", "fill_rows",
           "dequant_bytes"]
