"""Content fingerprints of tensors: what the prefix cache knows an image or a video by (runtime.prefix,
runtime.media)."""
from __future__ import annotations

import torch

from .. import kernels

_MASK = (1 << 64) - 1
_SEEDS = (0x51ED27, 0x2545F491)


def content_hash(t: torch.Tensor, backend: kernels.Backend | None = None) -> str:
    """A 128-bit fingerprint of a tensor's values (its dtype and shape included), computed where the
    tensor lies: each 64-bit word is scrambled with its index and summed (wrapping), in two independent
    lanes (kernels.hash_words: one kernel on the CUDA backend, the same bits as the torch expression); the
    last word's missing bytes are zeros. The same pixels give the same hash; a collision of two different
    images is as likely as one of two random 128-bit numbers."""
    h = StreamedHash(backend)
    h.add(t)
    return h.digest(tuple(t.shape), t.dtype)  # one read back


class StreamedHash:
    """content_hash of tensors laid end to end, taken one part at a time so that they are never in memory
    together (a video's frames as they are decoded). The lanes sum a scramble of each 64-bit word with its index,
    so the words of one part hashed with the seeds moved on by the index of its first word add up to the whole's
    lanes; the bytes of a part that ends inside a word are carried over to the next."""

    def __init__(self, backend: kernels.Backend | None = None):
        self.backend = backend
        self.lanes: torch.Tensor | None = None  # int64 [2], summed where the parts lie: one read back at the end
        self.words = 0
        self.tail: torch.Tensor | None = None  # uint8, fewer than 8 bytes

    def add(self, part: torch.Tensor) -> None:
        raw = part.detach().contiguous().view(-1).view(torch.uint8)
        if self.tail is not None or raw.storage_offset() % 8:  # words must be whole and aligned: a copy of the part
            raw = raw.clone() if self.tail is None else torch.cat([self.tail, raw])
        whole = raw.numel() // 8 * 8
        self._hash(raw[:whole])
        self.tail = raw[whole:].clone() if whole < raw.numel() else None

    def _hash(self, raw: torch.Tensor) -> None:
        if raw.numel():
            lanes = kernels.hash_words(raw.view(torch.int64), tuple(s + self.words for s in _SEEDS), self.backend)
            self.lanes = lanes if self.lanes is None else self.lanes + lanes  # int64: wraps, as the sum does
            self.words += raw.numel() // 8

    def digest(self, shape: tuple[int, ...], dtype: torch.dtype) -> str:
        """The hash of the parts together, taken as one tensor of `shape` and `dtype` (content_hash's text)."""
        if self.tail is not None:
            self._hash(torch.cat([self.tail, self.tail.new_zeros(8 - self.tail.numel())]))
            self.tail = None
        lanes = [x & _MASK for x in self.lanes.tolist()] if self.lanes is not None else [0, 0]
        return f"{lanes[0]:016x}{lanes[1]:016x}-{str(dtype)[6:]}-{'x'.join(map(str, shape))}"
