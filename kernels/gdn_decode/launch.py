"""Launcher for gdn_decode.cu: one gated-delta-rule token for N sequences, state updated in place."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..cuda_build import get_function, launch

SRC = Path(__file__).with_name("gdn_decode.cu")
# (value columns, threads) per block: gdn_decode.cu's VT and THREADS, for N <= TINY_N, N <= SMALL_N and above.
# H200, graph replay, Qwen3.5 shapes (bench/variants.py): (32, 128) 68/87/91% of copy bandwidth at N = 8/64/256,
# (64, 128) 68/90/95%, (16, 64) 69/79/83%, (64, 256) 61/89/95%. (32, 128) also fits any D % 16, Dv % 32.
# At N = 8 a plain torch copy of the same bytes takes 10.0 us (79% of copy bandwidth) against our 11.7 us;
# capping the blocks per SM so that late blocks read while early ones write is slower (13-16 us;
# bench/decode_occupancy.py, 2026-11-30): every block must read its whole tile before it can write. Smaller
# blocks let the early ones write sooner: at N = 8, (16, 32) one warp per block 11.2 us (71%), (16, 64) 11.5,
# (32, 128) 11.7, (8, 32) 13.8; at N = 32 (32, 128) keeps the lead, 38.6 us vs 42.0 for (16, 32)
# (bench/results/decode-variants-h200.txt). Streaming cache hints on the state (__ldcs / __stcs) did not help.
CONFIG = {"tiny": (16, 32), "small": (32, 128), "large": (64, 128)}
TINY_N, SMALL_N = 8, 32
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_fns: dict = {}  # (defines..., device) -> kernel: keeps the per-token host path short


def _code(t: torch.Tensor, name: str) -> int:
    try:
        return DTYPE_CODE[t.dtype]
    except KeyError:
        raise TypeError(f"gdn_decode_step: {name} has dtype {t.dtype}; expected float32, float16 or bfloat16") from None


MAX_N = 65535  # sequences a launch: the grid's z (Dv // VT, Hv, N)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[N, H, X] with each sequence's H*X elements contiguous (any sequence stride)."""
    st = t.stride()
    return t if st[2] == 1 and st[1] == t.shape[2] else t.contiguous()


def _tile(N: int, D: int, Dv: int) -> tuple[int, int]:
    size = "tiny" if N <= TINY_N else "small" if N <= SMALL_N else "large"
    for vt, threads in (CONFIG[size], (32, 128)):
        if Dv % vt == 0 and D % (threads // (vt // 4)) == 0:
            return vt, threads
    raise ValueError(f"gdn_decode_step: needs D % 16 == 0 and Dv % 32 == 0 (D={D}, Dv={Dv})")


def gdn_decode_step_cuda(q, k, v, a, b, A_log, dt_bias, state):
    """q, k: [N, Hk, D]; v: [N, Hv, Dv]; a, b: [N, Hv]; A_log, dt_bias: [Hv];
    state: [N, Hv, D, Dv] fp32 contiguous, updated in place. Returns o: [N, Hv, Dv] in v.dtype."""
    N, Hk, D = q.shape
    _, Hv, Dv = v.shape
    if k.shape != q.shape or v.shape[0] != N or a.shape != (N, Hv) or b.shape != (N, Hv):
        raise ValueError(f"gdn_decode_step: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"a {tuple(a.shape)}, b {tuple(b.shape)} do not match [N, Hk, D], [N, Hv, Dv], [N, Hv]")
    if Hv % Hk:
        raise ValueError(f"gdn_decode_step: value heads ({Hv}) must be a multiple of q/k heads ({Hk})")
    if N > MAX_N:  # (the runtime steps one sequence a call)
        raise ValueError(f"gdn_decode_step: {N} sequences in one call; the kernel takes at most {MAX_N:,} (its "
                         "grid's z): step them in calls of up to that many")
    if state.dtype != torch.float32 or state.shape != (N, Hv, D, Dv) or not state.is_contiguous():
        raise ValueError(f"gdn_decode_step: state must be a contiguous float32 [N, Hv, D, Dv] = {(N, Hv, D, Dv)} "
                         f"tensor, got {state.dtype} {tuple(state.shape)} contiguous={state.is_contiguous()}")
    if state.data_ptr() % 16:  # read and written in place in 16-byte vectors; a copy would not be updated
        raise ValueError(f"gdn_decode_step: state must start on a 16-byte boundary (it starts at byte "
                         f"{state.data_ptr() % 16} of one: a view at an offset); pass a tensor of its own")
    # each pair in one dtype, the wider of the two (the reference computes in fp32: nothing rounded narrower)
    if k.dtype != q.dtype:
        q, k = (x.to(torch.promote_types(q.dtype, k.dtype)) for x in (q, k))
    if b.dtype != a.dtype:
        a, b = (x.to(torch.promote_types(a.dtype, b.dtype)) for x in (a, b))
    if dt_bias.dtype != A_log.dtype:
        A_log, dt_bias = (x.to(torch.promote_types(A_log.dtype, dt_bias.dtype)) for x in (A_log, dt_bias))
    q, k, v = _rows(q), _rows(k), _rows(v)
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(1) != 1:
        b = b.contiguous()
    if A_log.stride(0) != 1:
        A_log = A_log.contiguous()
    if dt_bias.stride(0) != 1:
        dt_bias = dt_bias.contiguous()
    out = torch.empty((N, Hv, Dv), dtype=v.dtype, device=v.device)
    if N == 0:
        return out
    vt, threads = _tile(N, D, Dv)
    key = (D, Dv, vt, threads, q.dtype, v.dtype, a.dtype, A_log.dtype, q.device)
    fn = _fns.get(key)
    if fn is None:
        defines = {"D": D, "DV": Dv, "VT": vt, "THREADS": threads, "TQ": _code(q, "q"), "TV": _code(v, "v"),
                   "TA": _code(a, "a"), "TP": _code(A_log, "A_log")}
        fn = _fns[key] = get_function(SRC, "gdn_decode_step", q.device, defines)
    launch(fn, (Dv // vt, Hv, N), (threads, 1, 1),
           (q, k, v, a, b, A_log, dt_bias, state, out, np.int32(Hk), np.int32(Hv),
            np.int64(q.stride(0)), np.int64(k.stride(0)), np.int64(v.stride(0)), np.int64(a.stride(0)),
            np.int64(b.stride(0))))
    return out
