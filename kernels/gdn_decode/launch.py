"""Launcher for gdn_decode.cu: one gated-delta-rule token for N sequences, state updated in place."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..cuda_build import get_function, launch

SRC = Path(__file__).with_name("gdn_decode.cu")
VT, THREADS = 32, 128  # value columns and threads per block, as in gdn_decode.cu
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _code(t: torch.Tensor, name: str) -> int:
    try:
        return DTYPE_CODE[t.dtype]
    except KeyError:
        raise TypeError(f"gdn_decode_step: {name} has dtype {t.dtype}; expected float32, float16 or bfloat16") from None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[N, H, X] with each sequence's H*X elements contiguous (any sequence stride)."""
    if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
        t = t.contiguous()
    return t


def gdn_decode_step_cuda(q, k, v, a, b, A_log, dt_bias, state):
    """q, k: [N, Hk, D]; v: [N, Hv, Dv]; a, b: [N, Hv]; A_log, dt_bias: [Hv];
    state: [N, Hv, D, Dv] fp32 contiguous, updated in place. Returns o: [N, Hv, Dv] in v.dtype."""
    N, Hk, D = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != N or a.shape != (N, Hv) or b.shape != (N, Hv):
        raise ValueError(f"gdn_decode_step: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"a {tuple(a.shape)}, b {tuple(b.shape)} do not match [N, Hk, D], [N, Hv, Dv], [N, Hv]")
    if Hv % Hk or D % 16 or Dv % VT:
        raise ValueError(f"gdn_decode_step: needs Hv % Hk == 0, D % 16 == 0, Dv % {VT} == 0 "
                         f"(Hk={Hk}, Hv={Hv}, D={D}, Dv={Dv})")
    if state.dtype != torch.float32 or tuple(state.shape) != (N, Hv, D, Dv) or not state.is_contiguous():
        raise ValueError(f"gdn_decode_step: state must be a contiguous float32 [N, Hv, D, Dv] = {(N, Hv, D, Dv)} "
                         f"tensor, got {state.dtype} {tuple(state.shape)} contiguous={state.is_contiguous()}")
    q, k, v = _rows(q), _rows(k), _rows(v)
    if a.stride(-1) != 1:
        a = a.contiguous()
    if b.stride(-1) != 1:
        b = b.contiguous()
    if b.dtype != a.dtype:
        b = b.to(a.dtype)
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    A_log, dt_bias = A_log.contiguous(), dt_bias.to(A_log.dtype).contiguous()
    out = torch.empty(N, Hv, Dv, dtype=v.dtype, device=v.device)
    if N == 0:
        return out
    defines = {"D": D, "DV": Dv, "TQ": _code(q, "q"), "TV": _code(v, "v"), "TA": _code(a, "a"),
               "TP": _code(A_log, "A_log")}
    fn = get_function(SRC, "gdn_decode_step", q.device, defines)
    launch(fn, (Dv // VT, Hv, N), (THREADS, 1, 1),
           (q, k, v, a, b, A_log, dt_bias, state, out, Hk, Hv,
            *(np.int64(t.stride(0)) for t in (q, k, v, a, b))))
    return out
