"""PyTorch references for the depthwise causal conv1d + SiLU in front of each GDN layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_prefill_ref(x, weight, bias=None, initial_state=None, cu_seqlens=None):
    """y = silu(causal depthwise conv(x)).

    x: [B, T, C]; weight: [C, W]; bias: [C] or None; initial_state: [N, C, W-1] (the inputs before
    x, oldest first) or None; cu_seqlens: int32 [N + 1] with B == 1, else None (N = B).
    Returns y: [B, T, C] in x.dtype and the final state [N, C, W-1] in x.dtype.
    """
    B, T, C = x.shape
    if weight.dim() == 3 and weight.shape[1] == 1:  # nn.Conv1d's [C, 1, W], as the kernel's launcher takes it
        weight = weight[:, 0]
    W = weight.shape[1]
    seqs = ([(i, 0, T) for i in range(B)] if cu_seqlens is None
            else [(0, s, e) for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())])
    y = torch.empty_like(x)
    wf = weight.float()
    states = []
    for n, (row, s, e) in enumerate(seqs):
        prev = (torch.zeros(W - 1, C, dtype=x.dtype, device=x.device) if initial_state is None
                else initial_state[n].to(x.dtype).t())
        xs = torch.cat([prev, x[row, s:e]])  # [W-1+L, C]: the inputs before x, then x, a row a step
        states.append(xs[xs.shape[0] - (W - 1):].t())
        if e == s:  # an empty sequence keeps its initial state
            continue
        # y_t = silu(sum_j w[:, j] x_(t-W+1+j)): W passes over the rows as they lie (a conv1d wants the steps
        # innermost, i.e. the rows transposed there and back, 3-4x the time on a CPU)
        xf, L = xs.float(), e - s
        acc = xf[W - 1:] * wf[:, W - 1]
        for j in range(W - 1):
            acc.addcmul_(xf[j:j + L], wf[:, j])
        if bias is not None:
            acc += bias.float()
        y[row, s:e] = F.silu(acc, inplace=True).to(x.dtype)
    return y, torch.stack(states) if states else x.new_empty(0, C, W - 1)


def causal_conv1d_update_ref(x, conv_state, weight, bias=None):
    """One token per sequence. x: [N, C]; conv_state: [N, C, W-1] updated in place. Returns y: [N, C]."""
    if weight.dim() == 3 and weight.shape[1] == 1:  # nn.Conv1d's [C, 1, W], as the kernel's launcher takes it
        weight = weight[:, 0]
    xs = torch.cat([conv_state, x[:, :, None].to(conv_state.dtype)], dim=2)  # [N, C, W]
    out = (xs.float() * weight.float()[None]).sum(-1)
    if bias is not None:
        out = out + bias.float()
    conv_state.copy_(xs[:, :, 1:])
    return F.silu(out).to(x.dtype)


def causal_conv1d_states_ref(x, initial_state, ends, width: int):
    """The conv state after ends[s] tokens of x [1, T, C] for each s of ends [S] (clamped to 0..T): the W-1
    inputs before that point, oldest first, from initial_state [1, C, W-1] (zeros when None) where the point
    lies fewer than W-1 tokens in; what causal_conv1d_prefill_ref returns as the final state of x[:, :ends[s]].
    Returns [S, C, W-1] in x.dtype."""
    _, T, C = x.shape
    prev = (torch.zeros(C, width - 1, dtype=x.dtype, device=x.device) if initial_state is None
            else initial_state[0].to(x.dtype))
    history = torch.cat([prev.transpose(0, 1), x[0]])  # [W-1 + T, C]: row W-1 + p is input p
    rows = ends.to(device=x.device, dtype=torch.long).clamp(0, T)[:, None] + torch.arange(width - 1, device=x.device)
    return history[rows].transpose(1, 2).contiguous()
