"""Launcher of content_hash.cu: the prefix cache's content hash in one pass over the words."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..cuda_build import card_of, get_function, launch
from .reference import as_signed, hash_words_ref

SRC = Path(__file__).with_name("content_hash.cu")
THREADS = 256  # as in content_hash.cu
BLOCKS_PER_SM = 8  # enough blocks in flight to stream the words at memory speed


def hash_words_cuda(words: torch.Tensor, seeds: tuple[int, int]) -> torch.Tensor:
    """Same contract as reference.hash_words_ref (int64 [N] -> int64 [2]); words not contiguous int64 on a
    CUDA device run the reference."""
    if not (words.is_cuda and words.dtype == torch.int64 and words.dim() == 1 and words.is_contiguous()):
        return hash_words_ref(words, seeds)
    out = torch.zeros(2, dtype=torch.int64, device=words.device)
    n = words.numel()
    if n == 0:
        return out
    blocks = min((n + THREADS - 1) // THREADS, BLOCKS_PER_SM * card_of(words.device).sms)
    launch(get_function(SRC, "content_hash", words.device), (blocks, 1, 1), (THREADS, 1, 1),
           (words, np.int64(n), np.int64(as_signed(seeds[0])), np.int64(as_signed(seeds[1])), out))
    return out
