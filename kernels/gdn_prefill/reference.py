"""PyTorch references for the gated delta rule prefill.

Both functions compute, per sequence and value head h (q/k head h // (Hv // Hk)):

    g_t    = -exp(A_log) * softplus(a_t + dt_bias)        log decay, fp32
    beta_t = sigmoid(b_t)
    q_t, k_t = l2norm(q_t), l2norm(k_t);  q_t *= D ** -0.5
    S_t    = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T      S: [D, Dv]
    o_t    = S_t^T q_t

`gdn_prefill_chunked` is the fast PyTorch path (WY form over chunks of 64, fp32); it is what the
runtime runs where no CUDA kernel is available. `gdn_prefill_recurrent_f64` is the float64
token-by-token ground truth the tests compare every implementation against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
SEGMENT = 4 * CHUNK  # tokens a sequence is walked at a time on the CPU (gdn_prefill_chunked)
GPU_SEGMENT = 16 * CHUNK  # ... and on a GPU (segment_for)
L2_EPS = 1e-6


def gate_and_beta(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, dtype=torch.float32):
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), both in `dtype`. a, b: [..., Hv]."""
    g = -A_log.to(dtype).exp() * F.softplus(a.to(dtype) + dt_bias.to(dtype))
    return g, torch.sigmoid(b.to(dtype))


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _split(cu_seqlens, B, T):
    """(batch row, start, end) of every sequence."""
    if cu_seqlens is None:
        return [(i, 0, T) for i in range(B)]
    if B != 1:
        raise ValueError(f"cu_seqlens needs a batch of 1 packed sequence, got B={B}")
    bounds = cu_seqlens.tolist()
    return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def _prepare(q, k, v, a, b, A_log, dt_bias, dtype):
    """Heads first, q/k expanded to the value heads, normalised and scaled. Returns [B, H, T, *]."""
    Hk, Hv = q.shape[2], v.shape[2]
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of q/k heads ({Hk})")
    g, beta = gate_and_beta(a, b, A_log, dt_bias, dtype)
    q = l2norm(q.to(dtype)).repeat_interleave(Hv // Hk, dim=2) * q.shape[-1] ** -0.5
    k = l2norm(k.to(dtype)).repeat_interleave(Hv // Hk, dim=2)
    return (q.transpose(1, 2), k.transpose(1, 2), v.to(dtype).transpose(1, 2),
            g.transpose(1, 2), beta.transpose(1, 2))


def gdn_prefill_recurrent_f64(q, k, v, a, b, A_log, dt_bias, initial_state=None, cu_seqlens=None):
    """Token-by-token float64 recurrence. Shapes as `gdn_prefill_chunked`; returns float64 (o, state)."""
    B, T, _, D = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    Q, K, V, G, Beta = _prepare(q, k, v, a, b, A_log, dt_bias, torch.float64)
    seqs = _split(cu_seqlens, B, T)
    o = torch.zeros(B, Hv, T, Dv, dtype=torch.float64, device=q.device)
    states = []
    for n, (row, s, e) in enumerate(seqs):
        S = (torch.zeros(Hv, D, Dv, dtype=torch.float64, device=q.device) if initial_state is None
             else initial_state[n].to(torch.float64).clone())
        for t in range(s, e):
            S = S * G[row, :, t].exp()[:, None, None]
            kt = K[row, :, t]
            u = Beta[row, :, t, None] * (V[row, :, t] - torch.einsum("hd,hdv->hv", kt, S))
            S = S + kt[:, :, None] * u[:, None, :]
            o[row, :, t] = torch.einsum("hd,hdv->hv", Q[row, :, t], S)
        states.append(S)
    return o.transpose(1, 2), _stacked(states, (Hv, D, Dv), torch.float64, q.device)


def _chunked_one(Q, K, V, G, Beta, S):
    """One sequence, all heads. Q, K: [H, T, D]; V: [H, T, Dv]; G, Beta: [H, T]; S: [H, D, Dv] fp32."""
    H, T, D = Q.shape
    pad = (-T) % CHUNK
    if pad:  # padded steps have beta = 0 and g = 0: they leave the state untouched
        Q, K, V = (F.pad(x, (0, 0, 0, pad)) for x in (Q, K, V))
        G, Beta = F.pad(G, (0, pad)), F.pad(Beta, (0, pad))
    n = Q.shape[1] // CHUNK
    Q, K, V = (x.reshape(H, n, CHUNK, x.shape[-1]) for x in (Q, K, V))
    Gc = G.reshape(H, n, CHUNK).cumsum(-1)
    Beta = Beta.reshape(H, n, CHUNK)
    idx = torch.arange(CHUNK, device=Q.device)
    diff = Gc[..., :, None] - Gc[..., None, :]
    lower = idx[:, None] >= idx[None, :]
    decay = torch.where(lower, diff, torch.full_like(diff, -torch.inf)).exp()  # exp(G_i - G_j), j <= i
    del diff
    # (I + L) u = diag(beta) (V - diag(exp G) K S0), L = diag(beta) (K K^T o strictly lower decay)  =>  u = Wv - Wk S0.
    # (I + L)^-1 is formed once (a solve against the identity: 64 right-hand sides) and applied to both right-hand
    # sides as products: on a 2-core CPU a 1,024-token prefill of 0.8B shapes took 16% less than with a solve for
    # each side (128 right-hand sides apiece, LAPACK's batched triangular solve is slow per column).
    Lmat = Beta[..., None] * (K @ K.transpose(-1, -2)) * (decay * (idx[:, None] > idx[None, :]))
    eye = torch.eye(CHUNK, dtype=Q.dtype, device=Q.device)
    inv = torch.linalg.solve_triangular(eye + Lmat, eye.expand_as(Lmat), upper=False, unitriangular=True)
    del Lmat
    Wv = inv @ (Beta[..., None] * V)
    Wk = inv @ ((Beta * Gc.exp())[..., None] * K)
    del inv
    P = (Q @ K.transpose(-1, -2)) * decay
    Qg = Q * Gc.exp()[..., None]
    Kend = K * (Gc[..., -1:] - Gc).exp()[..., None]
    gend = Gc[..., -1].exp()
    out = torch.empty_like(V)
    for c in range(n):
        u = Wv[:, c] - Wk[:, c] @ S
        out[:, c] = Qg[:, c] @ S + P[:, c] @ u
        S = S * gend[:, c, None, None] + Kend[:, c].transpose(-1, -2) @ u
    return out.reshape(H, n * CHUNK, -1)[:, :T], S


def gdn_prefill_chunked(q, k, v, a, b, A_log, dt_bias, initial_state=None, cu_seqlens=None, segment=None, keep=None):
    """Chunked gated delta rule in fp32 (PyTorch path).

    q, k: [B, T, Hk, D]; v: [B, T, Hv, Dv]; a, b: [B, T, Hv] raw gate projections;
    A_log, dt_bias: [Hv]; initial_state: [N, Hv, D, Dv] fp32 or None;
    cu_seqlens: int32 [N + 1] with B == 1 for packed sequences, else None (N = B).
    Returns o: [B, T, Hv, Dv] in v.dtype (contiguous), final state: [N, Hv, D, Dv] fp32; with keep (token
    counts, see check_keep) also the states after the first k tokens for each k of keep [len(keep), Hv, D, Dv].

    Each sequence is walked `segment` tokens at a time (a multiple of CHUNK; default segment_for(q.device)),
    also cut at each k of keep (on chunk boundaries: the chunks, and so the numbers, are the same): the fp32
    working set (segment_bytes) stays that of one segment whatever the prompt's length.
    """
    segment = segment_for(q.device) if segment is None else segment
    if segment <= 0 or segment % CHUNK:
        raise ValueError(f"segment must be a positive multiple of {CHUNK} tokens, got {segment}")
    B, T, _, D = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    seqs = _split(cu_seqlens, B, T)
    if keep is not None:
        check_keep(keep, len(seqs), T)
    kept = {}
    o = torch.empty(B, T, Hv, Dv, dtype=v.dtype, device=q.device)
    states = []
    for n, (row, s, e) in enumerate(seqs):
        S = (torch.zeros(Hv, D, Dv, dtype=torch.float32, device=q.device) if initial_state is None
             else initial_state[n].to(torch.float32))
        bounds = sorted({*range(s, e, segment), *(s + c for c in keep or ()), e})
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if lo - s in (keep or ()):
                kept[lo - s] = S
            Q, K, V, G, Beta = _prepare(*(x[row:row + 1, lo:hi] for x in (q, k, v, a, b)), A_log, dt_bias,
                                        torch.float32)
            out, S = _chunked_one(Q[0], K[0], V[0], G[0], Beta[0], S)
            o[row, lo:hi] = out.transpose(0, 1)
        states.append(S)
    ht = _stacked(states, (Hv, D, Dv), torch.float32, q.device)
    if keep is None:
        return o, ht
    return o, ht, _stacked([kept[c] for c in keep], (Hv, D, Dv), torch.float32, q.device)


MAX_KEEP = 8  # the kernels' (seq.cuh)


def check_keep(keep, N: int, T: int) -> None:
    """keep, the token counts whose states a prefill call also returns: at most MAX_KEEP, each a multiple of CHUNK
    with 0 <= k < T (the state after T is the final one), in a call of one sequence; else a ValueError."""
    if N != 1:
        raise ValueError(f"keep: states are kept in a call of one sequence, this one has {N}")
    if len(keep) > MAX_KEEP:
        raise ValueError(f"keep: at most {MAX_KEEP} states, got {len(keep)}")
    bad = [c for c in keep if c % CHUNK or not 0 <= c < T]
    if bad:
        raise ValueError(f"keep: token counts must be multiples of {CHUNK} in 0 .. {T - 1} (the call's {T} tokens), "
                         f"got {bad}")


def _stacked(states: list, shape: tuple, dtype, device) -> torch.Tensor:
    """The sequences' final states [N, *shape]; [0, *shape] for a call without sequences (as the kernels give)."""
    return torch.stack(states) if states else torch.empty(0, *shape, dtype=dtype, device=device)


def segment_for(device: torch.device) -> int:
    """Tokens gdn_prefill_chunked walks at a time on `device`. A segment adds ~128 operations to the chunks' own
    (a 9B-shaped layer's 4,096 tokens: 4,547 aten operations in segments of 256, 3,011 of 1,024, 2,626 in one),
    and on a GPU each is a launch from Python: ~1,500 launches a layer between 256 and 1,024. On the CPU the
    short segment keeps the working set in cache (the same call took 394 ms in segments of 256, 398 of 1,024,
    687 of 2,048, 2 cores; bench/gdn_reference_segment.py, results/gdn-reference-segment-cpu.json); on a GPU
    1,024 holds 252 MiB at the 9B's shapes where 256 holds 66, and takes 13.8 ms where 256 took 24.8 and one
    pass 10.9 (an H100, results/gdn-reference-segment-h100.json)."""
    return SEGMENT if torch.device(device).type == "cpu" else GPU_SEGMENT


def segment_bytes(Hv: int, D: int, Dv: int, segment: int = SEGMENT) -> int:
    """The most gdn_prefill_chunked holds at once beyond its inputs and output, for Hv value heads: one
    segment's fp32 tensors (per token and head: q, k, v expanded and normalised, their padded copies, the two
    WY solves, the decayed q and k and the output, 5 chunk-wide matrices), the state and its next value."""
    return 4 * Hv * (segment * (3 * D + 3 * Dv + 2 * (D + Dv) + D + Dv + Dv + 5 * CHUNK) + 2 * D * Dv)
