"""Next-token choice: greedy, or temperature / top-k / top-p / min-p, with repetition and presence penalties."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from .. import kernels
from .errors import Qwen35Error, flag, real_number, whole_number

MIN_TEMPERATURE = 1e-4  # logits / 1e-4 stay far inside fp32; below it sampling is greedy anyway
# the penalties' range: logits divided or multiplied by the repetition penalty, or less the presence penalty, stay
# far inside fp32 (a penalty of 1e-38 made them inf, every weight NaN, and the draw the last id)
REPETITION_RANGE = (1e-3, 1e3)
MAX_PRESENCE = 1e4
_M64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """do_sample False is greedy (the other fields then only apply their penalties). top_k keeps exactly k
    candidates, the lower ids first where logits tie at the k-th (transformers keeps every id tied with the k-th:
    with bf16 logits ties are common, so the two can keep different sets)."""
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0            # 0: off
    top_p: float = 1.0        # 1.0: off
    min_p: float = 0.0        # 0.0: off
    repetition_penalty: float = 1.0  # 1.0: off; >1 discourages tokens already in prompt or answer
    presence_penalty: float = 0.0    # 0.0: off; subtracted from the logit of every token already generated

    def check(self) -> None:
        object.__setattr__(self, "do_sample", flag("do_sample", self.do_sample, "True (sample) or False (greedy)"))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"):
            value = real_number(getattr(self, name))
            if value is None or not math.isfinite(value):
                raise Qwen35Error(f"{name} is {getattr(self, name)!r}; it must be a finite number")
            object.__setattr__(self, name, value)  # numpy's floats and 0-d tensors as Python's
        top_k = whole_number(self.top_k)
        if top_k is None:
            raise Qwen35Error(f"top_k is {self.top_k!r} ({type(self.top_k).__name__}); it must be a whole number "
                              "(0 turns it off)")
        object.__setattr__(self, "top_k", top_k)  # numpy's integers as Python's
        if self.do_sample and not self.temperature >= MIN_TEMPERATURE:
            raise Qwen35Error(f"temperature {self.temperature} must be at least {MIN_TEMPERATURE} when sampling "
                              "(smaller ones overflow the logits); turn sampling off for greedy decoding")
        if self.top_k < 0:
            raise Qwen35Error(f"top_k {self.top_k} must be >= 0 (0 turns it off)")
        if not 0.0 < self.top_p <= 1.0:
            raise Qwen35Error(f"top_p {self.top_p} must be in (0, 1] (1 turns it off)")
        if not 0.0 <= self.min_p < 1.0:
            raise Qwen35Error(f"min_p {self.min_p} must be in [0, 1) (0 turns it off)")
        lo, hi = REPETITION_RANGE
        if not lo <= self.repetition_penalty <= hi:
            raise Qwen35Error(f"repetition_penalty {self.repetition_penalty} must be in [{lo:g}, {hi:g}] (1 turns it "
                              "off; above 1 discourages repeats)")
        if not abs(self.presence_penalty) <= MAX_PRESENCE:
            raise Qwen35Error(f"presence_penalty {self.presence_penalty} must be within +-{MAX_PRESENCE:g} (0 turns it "
                              "off)")


def draw_seed(seed: int) -> int:
    """The 64-bit seed of a generation's draws (draw_uniform) for a user's seed of any size or sign, hashed
    from its full value: seeds s and s + 2**64 give different text."""
    whole = whole_number(seed)
    if whole is None:
        raise Qwen35Error(f"seed is {seed!r} ({type(seed).__name__}); it must be a whole number")
    data = whole.to_bytes((whole.bit_length() + 8) // 8, "little", signed=True)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def draw_uniform(seed: int, n: int) -> float:
    """The uniform in [0, 1) that draws answer token n of a generation with 64-bit seed `seed` (draw_seed's):
    the top 53 bits of splitmix64's output at seed + (n + 1) * 0x9E3779B97F4A7C15 (wrapping). A function of the
    seed and n alone: no generator state, the same draws on every device and backend."""
    x = (seed + (n + 1) * 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return ((x ^ (x >> 31)) >> 11) * 2.0 ** -53


def penalty_marks(prompt_ids: list[int], p: SamplingParams, vocab: int, device: torch.device) -> torch.Tensor | None:
    """The marks pick's penalties read and update (kernels.sample), the prompt's ids marked; None where the
    settings penalise nothing."""
    if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0:
        return None
    return kernels.penalty_marks(torch.tensor(prompt_ids, dtype=torch.long, device=device), vocab)


def pick(logits: torch.Tensor, p: SamplingParams, seed: int, n: int, backend: kernels.Backend | None = None,
         marks: torch.Tensor | None = None) -> torch.Tensor:
    """Answer token n from fp32 logits [V]: the argmax, or a draw at draw_uniform(seed, n) from the settings'
    candidates; with marks (penalty_marks) the penalties first, and the id marked (kernels.sample: one kernel on
    the CUDA backend for top_k 1 to 64, greedy with penalties as top_k 1). A long tensor [1] where the logits
    are, read by nothing on the host (a decode loop queues the next step behind it)."""
    penalties = None if marks is None else (marks, p.repetition_penalty, p.presence_penalty)
    if not p.do_sample:
        if penalties is None:
            return torch.argmax(logits, 0, keepdim=True)
        return kernels.sample(logits, 1, 1.0, 0.0, 1.0, 0.0, backend, penalties)[0]  # argmax: ties to the lower id
    return kernels.sample(logits, p.top_k, p.temperature, p.min_p, p.top_p, draw_uniform(seed, n), backend,
                          penalties)[0]
