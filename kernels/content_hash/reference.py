"""PyTorch reference of content_hash.cu: each 64-bit word w_i of a tensor's bytes is scrambled with its index,
and the results are summed (wrapping), in two lanes with different seeds."""
from __future__ import annotations

import torch

MULTS = (0x3C79AC492BA7B653, 0x1C69B3F74AC4AE35)  # the scramble's odd multipliers (as signed int64 below)


def as_signed(x: int) -> int:
    """A 64-bit pattern (an int in 0 .. 2^64 - 1, or any int taken mod 2^64) as the int64 with those bits."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def mix(x: torch.Tensor) -> torch.Tensor:
    """A fixed invertible scramble of int64 words: twice an xor with the word shifted right by 29 (arithmetic,
    as torch shifts int64) then a wrapping multiply, then an xor with the word shifted right by 32."""
    for mult in MULTS:
        x = (x ^ (x >> 29)) * as_signed(mult)
    return x ^ (x >> 32)


def hash_words_ref(words: torch.Tensor, seeds: tuple[int, int]) -> torch.Tensor:
    """words: int64 [N]. Returns int64 [2] on words' device: lane s = sum_i mix(w_i ^ mix(i + seeds[s]))
    (wrapping)."""
    index = torch.arange(words.numel(), dtype=torch.int64, device=words.device)
    return torch.stack([mix(words ^ mix(index + seed)).sum() for seed in seeds])
