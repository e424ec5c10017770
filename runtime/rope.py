"""Rotary positions of the text model: plain text and Qwen3.5's interleaved multimodal (M-RoPE) form.

Every token has three position ids (temporal, height, width). Text tokens have all three equal and
count up by one. The tokens of one vision span (an image, or one 2-frame slice of a video) after the
2x2 merge form a (1, h, w) grid starting at the running position s: (s, s + row, s + column). The
text after the span continues at s + max(h, w), which is one past the largest id in the span. So a
prompt with images uses fewer positions than it has tokens; `rope_delta` = (largest id + 1) -
(number of tokens) is what a decoded token adds to its cache slot to get its position.

The rotary half of a head has rotary_dim / 2 frequencies. `mrope_section` (t, h, w), e.g. [11, 11,
10] for 32 frequencies, is interleaved: frequency i reads the height id when i % 3 == 1 and
i < 3 * h_sec, the width id when i % 3 == 2 and i < 3 * w_sec, and the temporal id otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def inv_freq(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """[rotary_dim / 2] fp32 inverse frequencies."""
    return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)


def section_index(rotary_dim: int, mrope_section, device=None) -> torch.Tensor:
    """[rotary_dim / 2] long: which position id (0 = t, 1 = h, 2 = w) each frequency reads."""
    _, h, w = mrope_section
    return torch.tensor([1 if i % 3 == 1 and i < 3 * h else 2 if i % 3 == 2 and i < 3 * w else 0
                         for i in range(rotary_dim // 2)], dtype=torch.long, device=device)


def cos_sin(positions: torch.Tensor, freqs: torch.Tensor, sections: torch.Tensor, dtype: torch.dtype):
    """cos, sin [T, rotary_dim] in `dtype` for position ids [3, T] (half-split layout: both halves equal)."""
    angles = positions[..., None].float() * freqs  # [3, T, rd/2]
    f = angles.gather(0, sections[None, None, :].expand(1, angles.shape[1], -1))[0]
    emb = torch.cat([f, f], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@dataclass(frozen=True)
class TextRun:
    """n text tokens."""
    n: int


@dataclass(frozen=True)
class VisionSpan:
    """The tokens of one image or one 2-frame video slice, after the merge: an h x w grid (t = 1)."""
    h: int
    w: int
    t: int = 1

    @property
    def n(self) -> int:
        return self.t * self.h * self.w


def layout_positions(parts) -> tuple[torch.Tensor, int]:
    """Position ids [3, T] for a prompt laid out as TextRun / VisionSpan parts, on the host (the model uploads
    them, and reads the rope deltas at cuts from them without a synchronisation), and its rope_delta. Built in
    numpy, consecutive text runs as one range (a chat prompt has a dozen of them)."""
    total = sum(part.n for part in parts)
    positions = np.empty((3, total), dtype=np.int64)
    at, s, top = 0, 0, -1  # at: the next token, s: its position, top: the largest position so far
    text_from = None  # the token where the current stretch of text runs starts
    for part in (*parts, None):
        if isinstance(part, TextRun):
            text_from = at if text_from is None else text_from
            at += part.n
            continue
        if text_from is not None and at > text_from:  # the text stretch before this part: one range
            positions[:, text_from:at] = np.arange(s, s + at - text_from)
            s += at - text_from
            top = max(top, s - 1)
        text_from = None
        if part is None:
            break
        # (t, row, column) of each patch block, after the text before it
        positions[:, at:at + part.n] = np.indices((part.t, part.h, part.w)).reshape(3, -1) + s
        top = max(top, s + max(part.t, part.h, part.w) - 1)
        s += max(part.h, part.w)
        at += part.n
    delta = top + 1 - total if total else 0
    return torch.from_numpy(positions), delta


__all__ = ["inv_freq", "section_index", "cos_sin", "TextRun", "VisionSpan", "layout_positions"]
