"""runtime/rope.layout_positions against a token-by-token statement of Qwen3.5's multimodal positions: text
tokens count up from where the last part ended; a vision span's tokens take (t, row, column) of their patch
block plus that start, and the text after it starts at start + max(h, w); rope_delta is the largest position
+ 1 minus the token count."""
import random

import pytest

from qwen35_fast.runtime.rope import TextRun, VisionSpan, layout_positions


def _reference(parts):
    rows, s = [[], [], []], 0
    for part in parts:
        if isinstance(part, TextRun):
            for i in range(part.n):
                for r in rows:
                    r.append(s + i)
            s += part.n
        else:
            for t in range(part.t):
                for y in range(part.h):
                    for x in range(part.w):
                        for r, v in zip(rows, (t, y, x)):
                            r.append(s + v)
            s += max(part.h, part.w)
    n = len(rows[0])
    return rows, (max(max(r) for r in rows) + 1 - n) if n else 0


@pytest.mark.parametrize("seed", range(6))
def test_layout_positions_match_the_token_by_token_rule(seed):
    rng = random.Random(seed)
    for _ in range(200):
        parts = [TextRun(rng.randint(0, 9)) if rng.random() < 0.6
                 else VisionSpan(rng.randint(1, 5), rng.randint(1, 5), rng.randint(1, 3))
                 for _ in range(rng.randint(0, 7))]
        positions, delta = layout_positions(parts)
        rows, want_delta = _reference(parts)
        assert positions.tolist() == rows and delta == want_delta, parts
