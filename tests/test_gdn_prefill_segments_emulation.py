"""CPU model of the sequence split of the prefill kernel (gdn_chunk_prefill_fwd with `seg`, gdn_prefill.cu)
against the f64 recurrence.

Mirrors the kernel's plan, not its arithmetic: per head, segments of ceil(chunks / nseg) chunks; for each
segment boundary a walk back over the chunks' total log-decays, 32 chunks per step, to the first chunk
where their sum reaches -SEG_DROP_BITS ln 2, at most half a segment back (else that head keeps the column
split); the walk that reaches chunk 0 starts there from the initial state. Each segment is then run in
float64 from a zero state at its warm-up start, and its outputs and (for the last segment) final state are
taken. With 2^-30 the result must equal the unsplit recurrence to about 1e-9; with 2^-1 it must not.
"""
import math

import pytest
import torch

from qwen35_fast.kernels.gdn_prefill.reference import gate_and_beta, gdn_prefill_recurrent_f64

from _models import rel

CH, SEG_MIN_CHUNKS = 64, 8


def plan(gend, nseg, drop_bits=30):
    """(per, first chunk of each segment's walk) as the kernel decides it, or None for the column split."""
    nch = len(gend)
    if nch < SEG_MIN_CHUNKS:
        return None
    per = -(-nch // nseg)
    maxw, thr = max(1, per // 2), -math.log(2) * drop_bits
    warm = [0] * nseg
    for s in range(1, nseg):
        cb = s * per
        if cb >= nch:
            continue
        lo, run, found, base = max(0, cb - maxw), 0.0, -1, cb - 1
        while base >= lo and found < 0:  # one warp step: lanes take chunks base, base - 1, ...
            sums = []
            for lane in range(32):
                j = base - lane
                run += gend[j] if j >= lo else 0.0
                sums.append((j, run))
            hits = [j for j, x in sums if j >= lo and x <= thr]
            if hits:
                found = hits[0]
            base -= 32
        if found < 0 and lo == 0:
            found = 0
        if found < 0:
            return None
        warm[s] = found
    return per, warm


def split_recurrence(q, k, v, a, b, A_log, dt_bias, h0, nseg, drop_bits=30):
    """o, final state of one sequence (B = 1) computed per head as the split would, plus the plans."""
    T, Hv = v.shape[1], v.shape[2]
    g, _ = gate_and_beta(a, b, A_log, dt_bias, torch.float64)  # [1, T, Hv]
    nch = -(-T // CH)
    o = torch.empty(1, T, Hv, v.shape[3], dtype=torch.float64)
    S = torch.empty(1, Hv, q.shape[3], v.shape[3], dtype=torch.float64)
    plans = []
    ratio = Hv // q.shape[2]
    for h in range(Hv):
        hk = h // ratio
        gend = [float(g[0, c * CH:(c + 1) * CH, h].sum()) for c in range(nch)]
        p = plan(gend, nseg, drop_bits)
        plans.append(p)
        args = lambda s, e: (q[:, s:e, hk:hk + 1], k[:, s:e, hk:hk + 1], v[:, s:e, h:h + 1],  # noqa: E731
                             a[:, s:e, h:h + 1], b[:, s:e, h:h + 1], A_log[h:h + 1], dt_bias[h:h + 1])
        if p is None:  # the column split: the whole sequence
            oh, Sh = gdn_prefill_recurrent_f64(*args(0, T), h0[:, h:h + 1])
            o[:, :, h], S[:, h] = oh[:, :, 0], Sh[:, 0]
            continue
        per, warm = p
        for s in range(nseg):
            cbeg, cend = min(s * per, nch), min(s * per + per, nch)
            if cbeg == cend:
                continue
            cw = warm[s] if s else 0
            init = h0[:, h:h + 1] if cw == 0 else None
            oh, Sh = gdn_prefill_recurrent_f64(*args(cw * CH, min(cend * CH, T)), init)
            o[:, cbeg * CH:min(cend * CH, T), h] = oh[:, (cbeg - cw) * CH:, 0]
            if cend == nch:
                S[:, h] = Sh[:, 0]
    return o, S, plans


def inputs(T, per_chunk, seed, D=16):
    """One sequence, one q/k head, value heads with about per_chunk[h] of log-decay per 64 tokens."""
    gen = torch.Generator().manual_seed(seed)
    Hv = len(per_chunk)
    q, k = torch.randn(1, T, 1, D, generator=gen), torch.randn(1, T, 1, D, generator=gen)
    v = torch.randn(1, T, Hv, D, generator=gen)
    a = 10.0 + 0.1 * torch.randn(1, T, Hv, generator=gen)  # softplus(a) ~ a ~ 10
    b = torch.randn(1, T, Hv, generator=gen)
    A_log = (-torch.tensor(per_chunk, dtype=torch.float32) / (64 * 10.0)).log()
    h0 = torch.randn(1, Hv, D, D, generator=gen) * 0.1
    return q, k, v, a, b, A_log, torch.zeros(Hv), h0


@pytest.mark.parametrize("T,nseg,per_chunk,taken", [
    (566, 4, (-50.0, -3.0), (True, False)),      # 9 chunks, an empty tail segment; 7 chunks > half of 3
    (4097, 4, (-3.0, -0.01), (True, False)),     # 7-chunk warm-ups (half a segment is 8); weak decay
    (1500, 2, (-8.0, -0.3), (True, False)),      # DVS 64: two segments
    (4096, 4, (-1000.0, -21.0), (True, True)),   # a warm-up of one chunk
])
def test_split_equals_the_recurrence(T, nseg, per_chunk, taken):
    x = inputs(T, per_chunk, seed=T + nseg)
    o_ref, S_ref = gdn_prefill_recurrent_f64(*x)
    o, S, plans = split_recurrence(*x, nseg)
    assert tuple(p is not None for p in plans) == taken
    assert rel(o, o_ref) < 1e-8 and rel(S, S_ref) < 1e-8, (rel(o, o_ref), rel(S, S_ref))


def test_the_walk_crosses_a_32_chunk_step():
    """-0.62 per chunk needs 34 chunks of warm-up (at most 35 with 282 chunks in 4 segments)."""
    gend = [-0.62] * 282
    per, warm = plan(gend, 4)
    assert per == 71 and [71 * s - warm[s] for s in (1, 2, 3)] == [34, 34, 34]
    assert plan(gend[:266], 4) is None  # 67 per segment: at most 33 back, and 33 are not enough


def test_a_weaker_cut_shows():
    """With 2^-1 the split drops e^-1 of the state at each segment start: visible, so the test above can fail."""
    x = inputs(4096, (-1.0,), seed=3)
    o_ref, _ = gdn_prefill_recurrent_f64(*x)
    o, _, plans = split_recurrence(*x, 4, drop_bits=1)
    assert plans[0] is not None and rel(o, o_ref) > 1e-3
