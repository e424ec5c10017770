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


@pytest.mark.parametrize("section", [(11, 11, 10), (6, 14, 12), (16, 7, 9)])
def test_cos_sin_equal_transformers_interleaved_multimodal_rotary(section):
    """cos / sin for (t, h, w) ids that all differ, against transformers' Qwen3.5 rotary: each frequency reads
    the id its section says (a swap of the h and w sections, or an off-by-one at a section's end, shows)."""
    import torch
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from qwen35_fast.runtime.rope import cos_sin, inv_freq, section_index
    theta, head_dim, factor = 10_000.0, 256, 0.25
    rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor,
            "mrope_section": list(section), "mrope_interleaved": True}
    hf = Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(head_dim=head_dim, rope_parameters=rope))
    n = torch.arange(40)
    positions = torch.stack([n, 3 * n + 7, 5 * n + 11])  # [3, T]
    want_cos, want_sin = hf(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    rd = int(head_dim * factor)
    cos, sin = cos_sin(positions, inv_freq(rd, theta), section_index(rd, section), torch.float32)
    torch.testing.assert_close(cos, want_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin[0], rtol=0, atol=1e-6)
