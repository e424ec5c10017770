"""CPU model of the "split_o" prefill variant (kernels/gdn_prefill/gdn_prefill_split.cu) against the f64 recurrence.

Mirrors the kernels' data flow and indexing, not their arithmetic order inside a tile: the prep kernel's
per-slot T, P and vectors (slot = first_slot(n) + chunk, with gaps between packed sequences), the state
kernel per (sequence, head, DVS column slice) writing the state entering each chunk into Hs[slot, h, :,
v0:v0+DVS] and u into Ug[slot, h, :, v0:v0+DVS], and the output kernel per (slot, head, 64 columns) that
finds its sequence by binary search over first_slot and writes only rows < length. Raw (un-normalised)
K, Q with the norm factors applied as scalings, zero rows past a sequence's end, as the kernels do.
With `rnd`, values are rounded to bf16 where the kernels store 16-bit data (T, P, the state for Q S, u,
and the hi + lo pairs of rhs and the scaled u), to check the error budget against the GPU tests' tolerances.
"""
import math

import pytest
import torch

from qwen35_fast.kernels.gdn_prefill.reference import gdn_prefill_recurrent_f64

from _models import rel

CH, D = 64, 128


def first_slot(cu, n, T):
    return cu[n] // CH + n if cu is not None else n * ((T + CH - 1) // CH)


def _r16(x, on):
    return x.to(torch.bfloat16).double() if on else x


def _split16(x, on):  # hi + lo 16-bit pair
    if not on:
        return x
    hi = x.to(torch.bfloat16).double()
    return hi + (x - hi).to(torch.bfloat16).double()


def emulate(q, k, v, a, b, A_log, dt_bias, h0=None, cu=None, dvs=16, rnd=False):
    B, T, Hk, _ = q.shape
    Hv = v.shape[2]
    ratio = Hv // Hk
    cu_l = cu.tolist() if cu is not None else None
    N = B if cu is None else len(cu_l) - 1
    slots = (T + 63) // 64 + N + 1 if cu is not None else B * ((T + 63) // 64)
    q, k, v = q.double(), k.double(), v.double()
    a, b = a.double(), b.double()
    negA = -A_log.double().exp()
    dtb = dt_bias.double()
    # ---- prep kernel: one (slot, head) at a time
    Tg = torch.zeros(slots, Hv, CH, CH, dtype=torch.float64)
    Pg = torch.zeros_like(Tg)
    Fg = torch.zeros(slots, Hv, 4, CH, dtype=torch.float64)

    def seq_of_slot(slot):
        if cu_l is None:
            nch = (T + CH - 1) // CH
            n = slot // nch
            return n, slot - n * nch, n, 0, T
        lo, hi = 0, N - 1
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if first_slot(cu_l, mid, T) <= slot:
                lo = mid
            else:
                hi = mid - 1
        return lo, slot - first_slot(cu_l, lo, T), 0, cu_l[lo], cu_l[lo + 1] - cu_l[lo]

    def rows(x, batch, bos, tok0, length, head):  # 64 rows of a chunk, zero past the end
        out = torch.zeros(CH, x.shape[-1], dtype=torch.float64)
        m = max(0, min(CH, length - tok0))
        out[:m] = x[batch, bos + tok0:bos + tok0 + m, head]
        return out, m

    idx = torch.arange(CH)
    for slot in range(slots):
        n, c, batch, bos, length = seq_of_slot(slot)
        if c * CH >= length:
            continue
        for h in range(Hv):
            hk = h // ratio
            K, m = rows(k, batch, bos, c * CH, length, hk)
            Q, _ = rows(q, batch, bos, c * CH, length, hk)
            x = torch.zeros(CH, dtype=torch.float64)
            y = torch.zeros(CH, dtype=torch.float64)
            x[:m] = a[batch, bos + c * CH:bos + c * CH + m, h] + dtb[h]
            y[:m] = b[batch, bos + c * CH:bos + c * CH + m, h]
            gv = torch.where(idx < m, negA[h] * torch.nn.functional.softplus(x), torch.zeros(()).double())
            bt = torch.where(idx < m, torch.sigmoid(y), torch.zeros(()).double())
            G = gv.cumsum(0)
            rk = torch.rsqrt((K * K).sum(-1) + 1e-6)
            rq = torch.rsqrt((Q * Q).sum(-1) + 1e-6) * D ** -0.5
            E = torch.exp(torch.clamp(G[:, None] - G[None, :], max=0))
            L = torch.tril(bt[:, None] * rk[:, None] * rk[None, :] * E * (K @ K.T), -1)
            Tm = torch.linalg.inv(torch.eye(CH, dtype=torch.float64) + L)
            P = torch.tril(rq[:, None] * rk[None, :] * E * (Q @ K.T))
            Tg[slot, h], Pg[slot, h] = _r16(Tm, rnd), _r16(P, rnd)
            Fg[slot, h] = torch.stack([G, bt, rk, rq])
    # ---- state kernel: grid (128 / dvs, Hv, N)
    Hs = torch.full((slots, Hv, D, D), float("nan"), dtype=torch.float64)
    Ug = torch.full((slots, Hv, CH, D), float("nan"), dtype=torch.float64)
    ht = torch.full((N, Hv, D, D), float("nan"), dtype=torch.float64)
    for n in range(N):
        batch, bos, length = (n, 0, T) if cu_l is None else (0, cu_l[n], cu_l[n + 1] - cu_l[n])
        slot0 = first_slot(cu_l, n, T)
        for h in range(Hv):
            hk = h // ratio
            for v0 in range(0, D, dvs):
                S = (torch.zeros(D, dvs, dtype=torch.float64) if h0 is None
                     else h0[n, h, :, v0:v0 + dvs].double().clone())
                for c in range((length + CH - 1) // CH):
                    s_ = slot0 + c
                    K, _ = rows(k, batch, bos, c * CH, length, hk)
                    V, _ = rows(v[..., v0:v0 + dvs], batch, bos, c * CH, length, h)
                    G, bt, rk, _ = Fg[s_, h]
                    Sb = _r16(S, rnd)
                    Hs[s_, h, :, v0:v0 + dvs] = Sb
                    rhs = _split16(bt[:, None] * (V - (rk * G.exp())[:, None] * (K @ Sb)), rnd)
                    u = Tg[s_, h] @ rhs
                    Ug[s_, h, :, v0:v0 + dvs] = _r16(u, rnd)
                    us = _split16((rk * (G[-1] - G).exp())[:, None] * u, rnd)
                    S = G[-1].exp() * S + K.T @ us
                ht[n, h, :, v0:v0 + dvs] = S
    # ---- output kernel: grid (slots, Hv, 2)
    o = torch.full((B, T, Hv, D), float("nan"), dtype=torch.float64)
    for slot in range(slots):
        n, c, batch, bos, length = seq_of_slot(slot)
        if c * CH >= length:
            continue
        for h in range(Hv):
            Q, m = rows(q, batch, bos, c * CH, length, h // ratio)
            G, _, _, rq = Fg[slot, h]
            for v0 in range(0, D, 64):
                oc = (rq * G.exp())[:, None] * (Q @ Hs[slot, h, :, v0:v0 + 64]) + Pg[slot, h] @ Ug[slot, h, :, v0:v0 + 64]
                o[batch, bos + c * CH:bos + c * CH + m, h, v0:v0 + 64] = _r16(oc[:m], rnd)
    return o, ht


def _inputs(B, T, Hk, Hv, h0_n, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, D, generator=g).bfloat16()
    k = torch.randn(B, T, Hk, D, generator=g).bfloat16()
    v = torch.randn(B, T, Hv, D, generator=g).bfloat16()
    a = torch.randn(B, T, Hv, generator=g)
    b = torch.randn(B, T, Hv, generator=g)
    A_log = torch.empty(Hv).uniform_(1.0, 16.0, generator=g).log()
    dt_bias = torch.randn(Hv, generator=g) * 0.5
    h0 = None if h0_n is None else torch.randn(h0_n, Hv, D, D, generator=g) * 0.1
    return q, k, v, a, b, A_log, dt_bias, h0


@pytest.mark.parametrize("dvs", [16, 32, 128])
@pytest.mark.parametrize("lens,ratio,with_h0", [
    ([1, 129, 0, 64, 70, 2], 2, True),
    ([65, 0, 1, 130], 1, False),
    (None, 2, False),  # B = 2, T = 150
])
def test_split_o_model_exact(lens, ratio, with_h0, dvs):
    """Without 16-bit roundings the model equals the f64 recurrence: the algebra and indexing are right."""
    if lens is None:
        B, T, cu = 2, 150, None
        N = 2
    else:
        B, T = 1, sum(lens)
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        N = len(lens)
    x = _inputs(B, T, 1, ratio, N if with_h0 else None, seed=sum(lens or [7]) + dvs)
    o, ht = emulate(*x, cu=cu, dvs=dvs)
    o_ref, ht_ref = gdn_prefill_recurrent_f64(*x, cu)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()  # every token and state column written
    assert rel(o, o_ref) < 1e-10 and rel(ht, ht_ref) < 1e-10


def test_split_o_model_bf16_budget():
    """With the kernels' 16-bit roundings the errors stay inside the GPU tests' tolerances."""
    lens = [300, 1, 200]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    x = _inputs(1, sum(lens), 1, 2, len(lens), seed=5)
    o, ht = emulate(*x, cu=cu, dvs=32, rnd=True)
    o_ref, ht_ref = gdn_prefill_recurrent_f64(*x, cu)
    eo, es = rel(o, o_ref), rel(ht, ht_ref)
    assert math.isfinite(eo) and eo <= 5e-3 and es <= 3e-3, (eo, es)
