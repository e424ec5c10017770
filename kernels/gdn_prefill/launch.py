"""Launcher of the chunked GDN prefill: the plan (plan.py) picks the path, this file runs it.

hopper:   gdn_chunk_prep (prep.cu) -> gdn_chunk_prefill_fwd (gdn_prefill.cu, sm_90a)
portable: gdn_chunk_prep (prep.cu) -> gdn_chunk_state -> gdn_chunk_out (portable.cu, sm_80 and later)
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..cuda_build import TensorMap, aligned16, card_of, get_function, keep_map, launch, tensor_map
from .plan import PORTABLE_OUT_THREADS, D, Plan, hopper_walk_smem, out_ranks, plan
from .reference import CHUNK, MAX_KEEP, check_keep

HERE = Path(__file__).resolve().parent
SRC_PREP = HERE / "prep.cu"
SRC_HOPPER = HERE / "gdn_prefill.cu"
SRC_PORTABLE = HERE / "portable.cu"
THREADS = 256
_ELEM = {torch.bfloat16: 2, torch.float16: 1}  # QF_BF16, QF_HALF (kernels/common.cuh)
_GATE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _vec16(x: torch.Tensor) -> torch.Tensor:
    """x with a unit last stride and 16-byte aligned rows (cp.async copies 16 bytes), else a contiguous copy."""
    ok = (x.stride(-1) == 1 and x.data_ptr() % 16 == 0
          and all(s % 8 == 0 for s in x.stride()[:-1]))
    return x if ok else x.contiguous()


def gdn_chunk_prefill_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           A_log: torch.Tensor, dt_bias: torch.Tensor,
                           initial_state: Optional[torch.Tensor] = None,
                           cu_seqlens: Optional[torch.Tensor] = None,
                           path: Optional[str] = None,
                           dv_split: Optional[int] = None,
                           segments: Optional[int] = None,
                           arch: Optional[str] = None,
                           defines: Optional[dict] = None,
                           fused_out: Optional[bool] = None, keep: Optional[list] = None) -> tuple:
    """Gated delta rule prefill on the GPU; same contract as reference.gdn_prefill_chunked (keep: the states
    after those token counts too, stored by the walk as it passes them).

    q, k: [B, T, Hk, 128]; v: [B, T, Hv, 128] (bf16 or fp16, Hv a multiple of Hk); a, b: [B, T, Hv];
    A_log, dt_bias: [Hv] fp32; initial_state: [N, Hv, 128, 128] fp32 or None; cu_seqlens: int32 [N + 1]
    with B == 1 and cu_seqlens[-1] == T (the Hopper walk reads a partial chunk's rows up to its 64th, past the
    last sequence too: rows there belong to none), or None (N = B). Returns o [B, T, Hv, 128] in v.dtype and the
    final state
    [N, Hv, 128, 128] fp32. path ("hopper" / "portable"), dv_split, segments and arch (the NVRTC target,
    e.g. "compute_80") and fused_out (portable: o formed in the state walk) override plan.plan's choice;
    defines adds -D flags to every module (tests).
    Launch only: no synchronisation, capturable in a CUDA graph.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if Dk != D or Dv != D or k.shape != q.shape or v.shape[:2] != (B, T):
        raise ValueError(f"gdn prefill kernel needs q, k [B, T, Hk, 128] and v [B, T, Hv, 128]; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of q/k heads ({Hk})")
    if v.dtype not in _ELEM or q.dtype != v.dtype or k.dtype != v.dtype:
        raise TypeError(f"q, k, v must share dtype bf16 or fp16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens needs a batch of 1 packed sequence, got B={B}")
        N = cu_seqlens.shape[0] - 1
        cu_seqlens = cu_seqlens.to(q.device, torch.int32).contiguous()  # (the kernel reads it there)
    else:
        N = B
    dev = q.device
    q, k, v = _vec16(q), _vec16(k), _vec16(v)
    if a.dtype not in _GATE:
        a = a.float()
    if b.dtype not in _GATE:
        b = b.float()
    if b.dtype != a.dtype:  # one dtype for both, the wider (no gate rounded to the other's precision)
        a, b = (x.to(torch.promote_types(a.dtype, b.dtype)) for x in (a, b))
    A_log = A_log.to(torch.float32).contiguous()
    dt_bias = dt_bias.to(torch.float32).contiguous()
    if initial_state is not None:
        if initial_state.shape != (N, Hv, D, D):
            raise ValueError(f"initial_state must be [{N}, {Hv}, 128, 128], got {tuple(initial_state.shape)}")
        initial_state = aligned16(initial_state.to(torch.float32))  # read in 8-byte pairs

    if keep is not None:
        check_keep(keep, N, T)
    o = torch.empty(B, T, Hv, D, dtype=v.dtype, device=dev)
    ht = torch.empty(N, Hv, D, D, dtype=torch.float32, device=dev)
    hk = torch.empty(len(keep or ()), Hv, D, D, dtype=torch.float32, device=dev)
    keep_at = [np.int32(c // CHUNK) for c in keep or ()] + [np.int32(-1)] * (MAX_KEEP - len(keep or ()))
    if N == 0:
        return (o, ht) if keep is None else (o, ht, hk)
    if T == 0:  # no tokens: each state as it came in (the walk's tensor maps take no empty dimension)
        ht = ht.copy_(initial_state) if initial_state is not None else ht.zero_()
        return (o, ht) if keep is None else (o, ht, hk)
    p = plan(B, T, N, Hk, Hv, cu_seqlens is not None, card_of(dev), path, dv_split, segments, arch, fused_out)
    prep, walk, out = _kernels(p, dev, v.dtype, a.dtype, defines)
    i64 = np.int64
    qs, ks = tuple(i64(x) for x in q.stride()[:3]), tuple(i64(x) for x in k.stride()[:3])
    vs = tuple(i64(x) for x in v.stride()[:3])
    # Chunk-local matrices T, P (16-bit; one allocation) and per-token vectors (G, beta, rk, rq), one slot per
    # (chunk, head); packed sequences use slot bos // 64 + n (see first_slot in seq.cuh).
    Tg, Pg = torch.empty(2, p.slots, Hv, 64, 64, dtype=v.dtype, device=dev).unbind(0)
    Fg = torch.empty(p.slots, Hv, 4, 64, dtype=torch.float32, device=dev)
    if p.slots:
        launch(prep, (Hv // p.prep_heads, p.slots, 1), (THREADS, 1, 1),
               (q, k, a, b, A_log, dt_bias, cu_seqlens, Tg, Pg, Fg, np.int32(T), np.int32(Hk), np.int32(Hv),
                np.int32(N), np.int32(p.prep_heads), *qs, *ks, *(i64(x) for x in a.stride()),
                *(i64(x) for x in b.stride())),
               shared_mem=p.prep_smem)
    if p.path == "hopper":
        held: list = []  # packed copies the maps point at, alive until the kernel is queued
        maps = _tensor_maps(q, k, v, Tg, Pg, o, B, T, Hk, Hv, held)
        launch(walk, p.grid(Hv, N), (THREADS, 1, 1),
               (q, k, v, Tg, Pg, Fg, initial_state, cu_seqlens, o, ht, *keep_at, hk, np.int32(T), np.int32(Hk),
                np.int32(Hv), *qs, *ks, *vs, np.int32(p.segments > 1), *maps),
               shared_mem=p.walk_smem)
    else:
        _portable(p, walk, out, q, k, v, Tg, Pg, Fg, initial_state, cu_seqlens, o, ht, keep_at, hk, B, T, Hk, Hv, N,
                  qs, ks, vs)
    return (o, ht) if keep is None else (o, ht, hk)


_kernel_sets: dict = {}


def _kernels(p: Plan, dev: torch.device, dtype: torch.dtype, gate: torch.dtype, defines: Optional[dict]) -> tuple:
    """The plan's kernels (prep, then the walk or the portable state kernel, then the portable out kernel or
    None), found once per build (the plan's fields its modules' defines take, dtypes, device and defines): each
    layer of a prefill asks again. Keyed by the builds, not by plans, which differ with every prompt length."""
    key = (p.path, p.arch, p.dv_split, p.fused_out, p.prep_smem, p.walk_smem, p.out_smem, dtype, gate, dev.index,
           tuple(sorted(defines.items())) if defines else ())
    fns = _kernel_sets.get(key)
    if fns is None:
        base = {"IN_T": _ELEM[dtype], **(defines or {})}
        prep = get_function(SRC_PREP, "gdn_chunk_prep", dev,
                            {**base, "AB_T": _GATE[gate], "PREP_SMEM": p.prep_smem}, arch=p.arch)
        if p.path == "hopper":
            walk_defines = {**base, "DVS": p.dv_split, "WALK_SMEM": hopper_walk_smem(p.dv_split),
                            "WALK128_SMEM": hopper_walk_smem(D)}
            fns = (prep, get_function(SRC_HOPPER, "gdn_chunk_prefill_fwd", dev, walk_defines, arch=p.arch), None)
        else:
            state_defines = {**base, "DVS": p.dv_split, "OUT_IN_WALK": int(p.fused_out),
                             "STATE_SMEM": p.walk_smem, "OUT_SMEM": p.out_smem}
            out = None if p.fused_out else get_function(SRC_PORTABLE, "gdn_chunk_out", dev, state_defines,
                                                         arch=p.arch)
            fns = (prep, get_function(SRC_PORTABLE, "gdn_chunk_state", dev, state_defines, arch=p.arch), out)
        _kernel_sets[key] = fns
    return fns


def _portable(p: Plan, state, out, q, k, v, Tg, Pg, Fg, h0, cu_seqlens, o, ht, keep_at, hk, B, T, Hk, Hv, N, qs, ks,
              vs):
    dev = o.device
    if p.fused_out:  # o formed in the walk
        Hs = Ug = None
    else:
        Hs = torch.empty(p.slots, Hv, D, D, dtype=v.dtype, device=dev)  # 16-bit state entering each chunk
        Ug = torch.empty(p.slots, Hv, 64, D, dtype=v.dtype, device=dev)  # u of each chunk
    launch(state, p.grid(Hv, N), (THREADS, 1, 1),
           (k, v, Tg, Fg, h0, cu_seqlens, Hs, Ug, ht, *keep_at, hk, q, Pg, o if p.fused_out else None,
            np.int32(T), np.int32(Hk), np.int32(Hv), np.int32(p.segments), *ks, *vs, *qs),
           shared_mem=p.walk_smem)
    if p.slots and not p.fused_out:
        ranks = out_ranks(B, T, cu_seqlens is not None, p.segments, p.slots)
        launch(out, (ranks, Hv, 1), (PORTABLE_OUT_THREADS, 1, 1),
               (q, Pg, Fg, Hs, Ug, cu_seqlens, o, np.int32(T), np.int32(Hk), np.int32(Hv), np.int32(N),
                np.int32(p.segments), *qs),
               shared_mem=p.out_smem)


L2_PROMOTION = 2  # the walk's tensor maps: L2 promotion 128 B (cuda_build.TensorMap)


def _map(x: torch.Tensor, dims: tuple, strides: tuple, box: tuple) -> TensorMap:
    return tensor_map(x, dims, strides, box, L2_PROMOTION)


_walk_maps: dict = {}


def _tensor_maps(q, k, v, Tg, Pg, o, B, T, Hk, Hv, held: list) -> tuple:
    """Tensor maps of the wgmma walk's copies, in kernel order k, q, v, T, P, o: K, Q, V as [B][T][H][128]
    tiles of 64 tokens x 64 columns, T and P as 64 x 64 tiles of their [slots * Hv * 64][64] rows, and the
    output o (contiguous [B, T, Hv, 128]) in the tiles of V, which the walk stores full chunks through. The six
    come from one lookup keyed by the addresses and strides (each layer of a prefill asks again; at most 256
    kept). A packed copy made for strides the copy engine refuses goes to `held`: the caller holds it until
    the launch is queued (after that, stream order protects it); maps of such copies are not kept."""
    key = (q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(), k.stride(), v.stride(), Tg.data_ptr(),
           Pg.data_ptr(), Tg.shape[0], o.data_ptr(), B, T, Hk, Hv)
    maps = _walk_maps.get(key)
    if maps is None:
        maps = _encode_maps(q, k, v, Tg, Pg, o, B, T, Hk, Hv, held)
        if not held:
            keep_map(_walk_maps, key, maps)
    return maps


def _encode_maps(q, k, v, Tg, Pg, o, B, T, Hk, Hv, held: list) -> tuple:
    out = []
    for x, H in ((k, Hk), (q, Hk), (v, Hv)):
        try:
            sb, st, sh = (int(s) * x.element_size() for s in x.stride()[:3])
            out.append(_map(x, (D, H, T, B), (sh, st, sb), (64, 1, 64, 1)))
        except ValueError:  # strides the copy engine does not take (e.g. heads outermost): a packed copy
            x = x.contiguous()
            held.append(x)
            sb, st, sh = (int(s) * x.element_size() for s in x.stride()[:3])
            out.append(_map(x, (D, H, T, B), (sh, st, sb), (64, 1, 64, 1)))
    rows = Tg.shape[0] * Hv * 64
    out += [_map(x, (64, rows), (128,), (64, 64)) for x in (Tg, Pg)]
    row = Hv * D * o.element_size()
    out.append(_map(o, (D, Hv, T, B), (D * o.element_size(), row, row * T), (64, 1, 64, 1)))
    return tuple(out)
