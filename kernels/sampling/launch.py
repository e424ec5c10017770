"""Launcher of sample.cu: one sampled token (the penalties, top_k's candidates, softmax, min_p, top_p, the draw) in one
launch."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..cuda_build import get_function, launch, stream_flags
from .reference import sample_ref

SRC = Path(__file__).with_name("sample.cu")
FLT_MIN = float(np.finfo(np.float32).tiny)  # fp32's smallest normal
THREADS, BLOCKS, K_MAX = 512, 64, 64  # as in sample.cu


def sample_takes(logits: torch.Tensor, top_k: int) -> bool:
    """Whether sample.cu runs this pick: fp32 logits [V] contiguous on a CUDA device, 0 < top_k <= 64 and < V."""
    return (logits.is_cuda and logits.dtype == torch.float32 and logits.dim() == 1 and logits.is_contiguous()
            and 0 < top_k <= K_MAX and top_k < logits.numel() < 2 ** 31 - 1)


def sample_cuda(logits: torch.Tensor, top_k: int, temperature: float, min_p: float, top_p: float, u: float,
                penalties: Optional[tuple[torch.Tensor, float, float]] = None
                ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Same contract as reference.sample_ref; what the kernel does not take runs the reference. top_p 1 reaches
    the kernel as infinity: the reference skips top_p there, and a running mass rounded above 1 must not drop
    the last candidate; one below fp32's smallest normal as that normal."""
    marks = None if penalties is None else penalties[0]
    if not sample_takes(logits, top_k) or (marks is not None and not _marks_fit(marks, logits)):
        return sample_ref(logits, top_k, temperature, min_p, top_p, u, penalties)
    rep, presence = (1.0, 0.0) if penalties is None else penalties[1:]
    dev = logits.device
    out = torch.empty(1, dtype=torch.int64, device=dev)
    part = torch.empty(BLOCKS * K_MAX, dtype=torch.int64, device=dev)
    weights = torch.empty(top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(top_k, dtype=torch.int64, device=dev)
    fn = get_function(SRC, "sample_top_k", dev, {"VOCAB": logits.numel()})
    # (a top_p below fp32's smallest normal would round to 0 and drop every candidate: raised to it, the first
    # candidate stays, as the reference keeps it)
    top_p = max(top_p, FLT_MIN) if top_p < 1.0 else float("inf")
    launch(fn, (BLOCKS, 1, 1), (THREADS, 1, 1),
           (logits, marks, np.float32(rep), np.float32(presence), np.int32(top_k), np.float32(temperature),
            np.float32(min_p), np.float32(top_p), np.float64(u), part, stream_flags(dev, 1), out, weights, ids))
    return out, weights, ids


def _marks_fit(marks: torch.Tensor, logits: torch.Tensor) -> bool:
    return (marks.dtype == torch.uint8 and marks.shape == logits.shape and marks.is_contiguous()
            and marks.device == logits.device)
