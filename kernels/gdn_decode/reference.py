"""PyTorch reference for the one-token gated delta rule step (see gdn_prefill/reference.py for the math)."""
from __future__ import annotations

import torch

from ..gdn_prefill.reference import gate_and_beta, l2norm


def gdn_decode_step_ref(q, k, v, a, b, A_log, dt_bias, state):
    """One token for N sequences; updates `state` in place.

    q, k: [N, Hk, D]; v: [N, Hv, Dv]; a, b: [N, Hv]; A_log, dt_bias: [Hv];
    state: [N, Hv, D, Dv] fp32. Returns o: [N, Hv, Dv] in v.dtype.
    """
    Hk, Hv, D = q.shape[1], v.shape[1], q.shape[2]
    g, beta = gate_and_beta(a, b, A_log, dt_bias)
    qf = l2norm(q.float()).repeat_interleave(Hv // Hk, dim=1) * D ** -0.5
    kf = l2norm(k.float()).repeat_interleave(Hv // Hk, dim=1)
    S = state * g.exp()[..., None, None]
    u = beta[..., None] * (v.float() - torch.einsum("nhd,nhdv->nhv", kf, S))
    S = S + kf[..., :, None] * u[..., None, :]
    state.copy_(S)
    return torch.einsum("nhd,nhdv->nhv", qf, S).to(v.dtype)
