"""Launchers for conv1d.cu: causal depthwise conv1d + SiLU over a prompt, and its one-token update."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..cuda_build import get_function, launch

SRC = Path(__file__).with_name("conv1d.cu")
THREADS = 128  # as in conv1d.cu
# bytes of x per thread and token; tokens whose loads are issued together. H200, C = 8192, bf16 (bench/variants.py):
# 8 B x 8 reaches 78% of copy bandwidth at L = 32768 (16 B x 4: 75%, 16 B x 8: 71%, 16 B x 16: 51%).
VEC_BYTES, UNROLL = 8, 8
# tokens per thread at least: a short prompt's tokens spread over more blocks. H200, the 9B conv after a
# cached prefix (bench/variants.py --conv-chunks, results/conv-chunks-h200.json): 64 tokens 11.6 us at 16,
# 9.9 at 8, 9.4 at 4; 256 tokens 13.0 / 11.5 / 14.9; 1,294 and 4,096 tokens the same at each
MIN_CHUNK = 8
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_num_sms: dict = {}


def _code(t: torch.Tensor, name: str) -> int:
    try:
        return DTYPE_CODE[t.dtype]
    except KeyError:
        raise TypeError(f"causal_conv1d: {name} has dtype {t.dtype}; expected float32, float16 or bfloat16") from None


def _sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _num_sms:
        _num_sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _num_sms[idx]


def _weight(weight: torch.Tensor, C: int) -> torch.Tensor:
    """[C, W] contiguous (also accepts nn.Conv1d's [C, 1, W])."""
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"causal_conv1d: weight must be [C, W] with C={C}, got {tuple(weight.shape)}")
    return weight.contiguous()


def causal_conv1d_prefill_cuda(x, weight, bias=None, initial_state=None, cu_seqlens=None):
    """x: [B, T, C]; weight: [C, W]; bias: [C] or None; initial_state: [N, C, W-1] or None;
    cu_seqlens: int32 [N + 1] with B == 1, from 0 to T (not checked: that would wait for the GPU), else None (N = B).
    Returns y: [B, T, C] (x.dtype) and the final state [N, C, W-1] (x.dtype)."""
    B, T, C = x.shape
    weight = _weight(weight, C)
    W = weight.shape[1]
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"causal_conv1d_prefill: cu_seqlens needs a batch of 1 packed sequence, got B={B}")
        cu_seqlens = cu_seqlens.to(x.device, torch.int32).contiguous()  # (the kernel reads it there)
        N = cu_seqlens.shape[0] - 1
    else:
        N = B
    if x.stride(2) != 1:
        x = x.contiguous()
    if initial_state is not None:
        if tuple(initial_state.shape) != (N, C, W - 1):
            raise ValueError(f"causal_conv1d_prefill: initial_state must be [N, C, W-1] = {(N, C, W - 1)}, "
                             f"got {tuple(initial_state.shape)}")
        initial_state = initial_state.to(x.dtype).contiguous()  # the reference rounds it to x's dtype too
    if bias is not None:
        bias = bias.contiguous()
    y = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    final = torch.empty(N, C, W - 1, dtype=x.dtype, device=x.device)
    if N == 0 or C == 0:  # nothing to compute (and no grid of 0 blocks)
        return y, final

    es = x.element_size()
    vec = max(1, VEC_BYTES // es)
    aligned = (C % vec == 0 and x.data_ptr() % 16 == 0 and (x.stride(0) * es) % 16 == 0
               and (x.stride(1) * es) % 16 == 0)
    if not aligned:
        vec = 1
    total = B * T
    groups = -(-C // (vec * THREADS))
    # tokens per thread: long enough to amortise the W-1 halo, short enough for ~4 waves of blocks
    chunk = 64
    while chunk > MIN_CHUNK and groups * -(-total // chunk) < 4 * _sms(x.device):
        chunk //= 2
    chunks = max(1, -(-total // chunk))
    if chunks > 65535:  # grid y
        raise ValueError(f"causal_conv1d_prefill: {B} x {T} tokens make {chunks} chunks of {chunk}; the kernel takes "
                         f"at most 65,535 (about 4.19 million tokens): run it in smaller pieces")
    defines = {"W": W, "VEC": vec, "UNROLL": UNROLL, "TX": _code(x, "x"), "TW": _code(weight, "weight"),
               "TB": _code(bias, "bias") if bias is not None else 0,
               "HAS_BIAS": int(bias is not None), "HAS_INIT": int(initial_state is not None),
               "VARLEN": int(cu_seqlens is not None)}
    fn = get_function(SRC, "causal_conv1d_prefill", x.device, defines)
    launch(fn, (groups, chunks, 1), (THREADS, 1, 1),
           (x, weight, bias, initial_state, cu_seqlens, y, final, C, T, N, total, chunk,
            np.int64(x.stride(0)), np.int64(x.stride(1))))
    return y, final


def causal_conv1d_update_cuda(x, conv_state, weight, bias=None):
    """x: [N, C]; conv_state: [N, C, W-1], shifted in place (any sequence stride, (C, W-1) contiguous);
    weight: [C, W]; bias: [C] or None. Returns y: [N, C] in x.dtype."""
    N, C = x.shape
    weight = _weight(weight, C)
    W = weight.shape[1]
    if conv_state.shape[0] != N or conv_state.shape[1:] != (C, W - 1):
        raise ValueError(f"causal_conv1d_update: conv_state must be [N, C, W-1] = {(N, C, W - 1)}, "
                         f"got {tuple(conv_state.shape)}")
    if conv_state.stride(2) != 1 or conv_state.stride(1) != W - 1:
        raise ValueError("causal_conv1d_update: conv_state must be contiguous in its (C, W-1) dimensions "
                         f"(strides {conv_state.stride()}); it is updated in place, so no copy is made")
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    y = torch.empty(N, C, dtype=x.dtype, device=x.device)
    if N == 0 or C == 0:
        return y
    defines = {"W": W, "VEC": 1, "TX": _code(x, "x"), "TS": _code(conv_state, "conv_state"),
               "TW": _code(weight, "weight"), "TB": _code(bias, "bias") if bias is not None else 0,
               "HAS_BIAS": int(bias is not None)}
    fn = get_function(SRC, "causal_conv1d_update", x.device, defines)
    launch(fn, (-(-N * C // THREADS), 1, 1), (THREADS, 1, 1),
           (x, conv_state, weight, bias, y, N, C, np.int64(x.stride(0)), np.int64(conv_state.stride(0))))
    return y


def causal_conv1d_states_cuda(x, initial_state, ends, width: int):
    """The conv states after ends[s] tokens of x (reference.causal_conv1d_states_ref). x: [1, T, C] (channels
    contiguous); initial_state: [1, C, W-1] or None (zeros); ends: [S] int32 / int64 on x's device (clamped
    to 0..T, read on the device); width: W. Returns [S, C, W-1] in x.dtype."""
    B, T, C = x.shape
    if B != 1 or ends.dim() != 1:
        raise ValueError(f"causal_conv1d_states: needs x [1, T, C] and ends [S], got x {tuple(x.shape)}, "
                         f"ends {tuple(ends.shape)}")
    if x.stride(2) != 1:
        x = x.contiguous()
    if initial_state is not None:
        if tuple(initial_state.shape) != (1, C, width - 1):
            raise ValueError(f"causal_conv1d_states: initial_state must be [1, C, W-1] = {(1, C, width - 1)}, "
                             f"got {tuple(initial_state.shape)}")
        initial_state = initial_state.to(x.dtype).contiguous()
    ends = ends.to(x.device, torch.long).contiguous()
    S = ends.shape[0]
    out = torch.empty(S, C, width - 1, dtype=x.dtype, device=x.device)
    if S == 0 or C == 0:
        return out
    fn = get_function(SRC, "causal_conv1d_states", x.device,
                      {"W": width, "TX": _code(x, "x"), "HAS_INIT": int(initial_state is not None)})
    launch(fn, (-(-C // THREADS), S, 1), (THREADS, 1, 1),
           (x, initial_state, ends, out, C, T, np.int64(x.stride(1))))
    return out
