"""Next-token choice: greedy, or temperature / top-k / top-p / min-p with repetition and presence penalties."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from .errors import Qwen35Error

MIN_TEMPERATURE = 1e-4  # logits / 1e-4 stay far inside fp32; below it sampling is greedy anyway


@dataclass(frozen=True)
class SamplingParams:
    """do_sample False is greedy (the other fields then only apply their penalties)."""
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0            # 0: off
    top_p: float = 1.0        # 1.0: off
    min_p: float = 0.0        # 0.0: off
    repetition_penalty: float = 1.0  # 1.0: off; >1 discourages tokens already in prompt or answer
    presence_penalty: float = 0.0    # 0.0: off; subtracted from the logit of every token already generated

    def check(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise Qwen35Error(f"{name} is {value!r}; it must be a finite number")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise Qwen35Error(f"top_k is {self.top_k!r} ({type(self.top_k).__name__}); it must be a whole number "
                              "(0 turns it off)")
        if self.do_sample and not self.temperature >= MIN_TEMPERATURE:
            raise Qwen35Error(f"temperature {self.temperature} must be at least {MIN_TEMPERATURE} when sampling "
                              "(smaller ones overflow the logits); turn sampling off for greedy decoding")
        if self.top_k < 0:
            raise Qwen35Error(f"top_k {self.top_k} must be >= 0 (0 turns it off)")
        if not 0.0 < self.top_p <= 1.0:
            raise Qwen35Error(f"top_p {self.top_p} must be in (0, 1] (1 turns it off)")
        if not 0.0 <= self.min_p < 1.0:
            raise Qwen35Error(f"min_p {self.min_p} must be in [0, 1) (0 turns it off)")
        if not self.repetition_penalty > 0:
            raise Qwen35Error(f"repetition_penalty {self.repetition_penalty} must be > 0 (1 turns it off)")


def generator_seed(seed: int) -> int:
    """The 64-bit generator seed for a user's seed of any size or sign, hashed from its full value: torch's
    CPU generator keeps only the low 32 bits of what it is given, so seeds s and s + 2**32 (or s + 2**64,
    out of its range altogether) would otherwise give the same text."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise Qwen35Error(f"seed is {seed!r} ({type(seed).__name__}); it must be a whole number")
    data = seed.to_bytes((seed.bit_length() + 8) // 8, "little", signed=True)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def apply_penalties(logits: torch.Tensor, seen: torch.Tensor, generated: torch.Tensor,
                    p: SamplingParams) -> torch.Tensor:
    """logits [V] fp32; seen: ids in prompt+answer; generated: ids in the answer so far."""
    logits = logits.clone()
    if p.repetition_penalty != 1.0 and seen.numel():
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    if p.presence_penalty != 0.0 and generated.numel():
        logits[generated] -= p.presence_penalty
    return logits


def candidates(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What sampling draws from, after temperature, top_k, min_p and top_p: (weights [C], ids [C] or None for
    every id in order), the weights the softmax's probabilities of the kept candidates (not renormalised;
    zero where min_p or top_p dropped one). top_k keeps the k highest logits (torch.topk's k: ties at the
    k-th are broken by it), so the rest of the step runs over k values, not the vocabulary (no sort of
    it); top_p walks the candidates from the most probable and keeps the smallest prefix whose mass reaches
    top_p (over the vocabulary sorted, where top_k is off)."""
    ids = None
    if p.top_k and p.top_k < logits.numel():
        logits, ids = torch.topk(logits, p.top_k)  # in descending order (a positive temperature keeps it)
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        if ids is None:
            probs, ids = torch.sort(probs, descending=True)
        probs = probs * (probs.cumsum(0) - probs < p.top_p)
    return probs, ids


def pick(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one id from penalised fp32 logits [V]: a long tensor [1] where the logits are, read by nothing
    on the host (a decode loop queues the next step behind it)."""
    if not p.do_sample:
        return torch.argmax(logits).view(1)
    weights, ids = candidates(logits, p)
    j = torch.multinomial(weights, 1, generator=generator)  # (weights need not sum to 1)
    return j if ids is None else ids[j]
