"""Launcher of the fused chunked-prefill kernel (gdn_prefill.cu) for the gated delta rule."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..cuda_build import TensorMap, arch_for_capability, get_function, launch, max_shared_memory

SRC = Path(__file__).resolve().parent / "gdn_prefill.cu"  # prep kernel + sequential kernel
SRC_FUSED = Path(__file__).resolve().parent / "gdn_prefill_fused.cu"  # one kernel
SRC_SPLIT = Path(__file__).resolve().parent / "gdn_prefill_split.cu"  # variant "split_o": state + output kernels
VARIANTS = (None, "split_o")  # None: the default dispatch (use_fused, choose_dv_split)
KERNEL = "gdn_chunk_prefill_fwd"
PREP_KERNEL = "gdn_chunk_prep"
D = 128
THREADS = 256
_ELEM = {torch.bfloat16: 2, torch.float16: 1}  # QF_BF16, QF_HALF (kernels/common.cuh)
_GATE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_sm_count: dict = {}
EXTRA_DEFINES: dict = {}  # development only: extra -D flags (PROFILE, variants) for bench scripts


def smem_bytes(dvs: int) -> int:
    """Dynamic shared memory of one main-kernel block walking dvs columns (mirrors Geo<W>::TOTAL in
    gdn_prefill.cu): 199 KB at 32, 169 KB at 64, 225 KB at 128; only sm_90 / sm_100 have that much."""
    vst, nst = dvs + 8, 3 if dvs <= 32 else 2
    stage = 2 * 64 * (D + 8) * 2 + 64 * vst * 2 + 2 * 64 * 72 * 2 + 4 * 64 * 4
    return nst * stage + D * vst * 2 + 3 * 64 * vst * 2


def smem_bytes_fused(dvs: int) -> int:
    """Dynamic shared memory of one block of gdn_prefill_fused.cu (mirrors its SM_TOTAL)."""
    vst, nst = dvs + 8, 3 if dvs <= 64 else 2
    return (nst * (2 * 64 * (D + 8) * 2 + 64 * vst * 2) + D * vst * 2 + 64 * vst * 2
            + 2 * 64 * 72 * 4 + 2 * 64 * 72 * 2 + 4 * 16 * 20 * 4 + 4 * 64 * 4)


# Measured (H200, CUDA-graph replay, after the prep kernel went to 4 blocks per SM): B=1 fused vs
# two-kernel 0.014 vs 0.019 ms at 64 tokens, 0.032 vs 0.029 at 256, 0.104 vs 0.072 at 1024; B=8 L=4096
# DVS 128: 1.40 vs 1.34 (bench/gdn_prefill_dev.py --paths fused,split --sizes ...). The fused kernel would
# win below ~190 tokens (by 5 us per layer), but compute-sanitizer racecheck reports shared-memory
# hazards in it (kernels/gdn_prefill/NOTES.md), so the default is the two-kernel path at every length.
FUSED_MAX_T = 0


def use_fused(T: int) -> bool:
    """Whether the default dispatch takes the single-kernel path (T: tokens per row, or all packed
    tokens): only up to FUSED_MAX_T, which is 0 until the fused kernel is racecheck-clean."""
    return T <= FUSED_MAX_T


def smem_bytes_split(dvs: int) -> int:
    """Dynamic shared memory of one gdn_chunk_state block (mirrors SM_TOTAL in gdn_prefill_split.cu)."""
    vst = dvs + 8
    stage = 64 * (D + 8) * 2 + 64 * vst * 2 + 64 * 72 * 2 + 4 * 64 * 4
    return 2 * stage + D * vst * 2 + 3 * 64 * vst * 2


OUT_SMEM = 64 * (D + 8) * 2 + D * 72 * 2 + 64 * 72 * 2 + 64 * 72 * 2 + 4 * 64 * 4  # gdn_chunk_out (OSM_TOTAL)
OUT_THREADS = 128
OUT_COLS = 64


def choose_dv_split_split_o(n_heads_total: int, device: torch.device) -> int:
    """State columns per gdn_chunk_state block: 32 (two blocks per SM) once that grid fills two
    blocks per SM, else 16 (B=1, Hv=32: 256 blocks, two per SM)."""
    return 32 if n_heads_total * (D // 32) >= 0.9 * 2 * _num_sms(device) else 16


PREP_MAX_HEADS = 4  # value heads one prep block can take (PREP_MAX_HEADS in gdn_prefill.cu)
PREP_SMEM = 2 * 64 * (D + 8) * 2 + 64 * 72 * 2 + 4 * 16 * 20 * 4 + (2 + 2 * PREP_MAX_HEADS) * 64 * 4  # PSM_TOTAL
PREP_THREADS = 256
PREP_BLOCKS_PER_SM = 4
# Cycles of one prep block (H200, PROFILE marks, 4 blocks of 8 warps per SM): ~19k to load K, Q and form
# K K^T, Q K^T, ~9k more per value head (L, the inverse, T; P alongside).
PREP_SHARED_CYCLES, PREP_HEAD_CYCLES = 19_000, 9_000
PREP_HPB: Optional[int] = None  # development only: force the value heads per prep block


def choose_prep_heads(Hk: int, Hv: int, slots: int, device: torch.device) -> int:
    """Value heads per prep block (a divisor of Hv / Hk, at most PREP_MAX_HEADS) with the fewest estimated
    cycles: waves of blocks times one block's life. One head per block when that fits in one wave."""
    r = Hv // Hk
    if PREP_HPB is not None:
        if r % PREP_HPB or PREP_HPB > PREP_MAX_HEADS:
            raise ValueError(f"PREP_HPB={PREP_HPB} must divide Hv / Hk = {r} and be at most {PREP_MAX_HEADS}")
        return PREP_HPB
    per_wave = PREP_BLOCKS_PER_SM * _num_sms(device)

    def cost(hpb):
        return -(-(Hv // hpb) * slots // per_wave) * (PREP_SHARED_CYCLES + hpb * PREP_HEAD_CYCLES)
    return min((d for d in range(1, min(r, PREP_MAX_HEADS) + 1) if r % d == 0), key=lambda d: (cost(d), d))


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_count:
        _sm_count[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_count[idx]


def choose_dv_split(n_heads_total: int, device: torch.device) -> int:
    """State columns per block: split the 128 value columns until the grid covers the SMs."""
    sms = _num_sms(device)
    for dvs in (128, 64):
        if n_heads_total * (D // dvs) >= 0.9 * sms:
            return dvs
    return 32


MAX_SLOTS = 65535  # the prep kernel's grid y: (chunk, sequence) slots of one call


def _prep_slots(B: int, T: int, N: int, cu_seqlens) -> int:
    """(chunk, head) slots of the prep buffers: B * ceil(T / 64), or ceil(T / 64) + N + 1 when packed."""
    slots = (T + 63) // 64 + N + 1 if cu_seqlens is not None else B * ((T + 63) // 64)
    if slots > MAX_SLOTS:
        raise ValueError(f"gdn prefill: {B} x {T} tokens make {slots} chunks of 64 in one call; the kernel takes "
                         f"at most {MAX_SLOTS} (about 4.19 million tokens): prefill in smaller pieces")
    return slots


def _fits(need: int, have: int, what: str) -> None:
    """Raise a clear error when a forced kernel configuration needs more shared memory than the card has."""
    if need > have:
        raise ValueError(f"gdn prefill: {what} needs {need} bytes of shared memory per block, this GPU allows "
                         f"{have}; leave dv_split / fused unset and the launcher picks a path that fits")


def _vec16(x: torch.Tensor) -> torch.Tensor:
    """x with a unit last stride and 16-byte aligned rows (cp.async copies 16 bytes), else a contiguous copy."""
    ok = (x.stride(-1) == 1 and x.data_ptr() % 16 == 0
          and all(s % 8 == 0 for s in x.stride()[:-1]))
    return x if ok else x.contiguous()


def gdn_chunk_prefill_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           A_log: torch.Tensor, dt_bias: torch.Tensor,
                           initial_state: Optional[torch.Tensor] = None,
                           cu_seqlens: Optional[torch.Tensor] = None,
                           dv_split: Optional[int] = None,
                           fused: Optional[bool] = None,
                           variant: Optional[str] = None,
                           segments: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule prefill on the GPU; same contract as reference.gdn_prefill_chunked.

    q, k: [B, T, Hk, 128]; v: [B, T, Hv, 128] (bf16 or fp16, Hv a multiple of Hk); a, b: [B, T, Hv];
    A_log, dt_bias: [Hv] fp32; initial_state: [N, Hv, 128, 128] fp32 or None; cu_seqlens: int32 [N + 1]
    with B == 1, or None (N = B). Returns o [B, T, Hv, 128] in v.dtype and the final state
    [N, Hv, 128, 128] fp32. `dv_split` (32, 64, 128) overrides the state columns per block, `fused`
    the choice between the one-kernel and the two-kernel path (see use_fused). `variant="split_o"`
    runs the opt-in three-kernel path (prep, state-only sequential kernel, parallel output kernel;
    gdn_prefill_split.cu); `dv_split` then may also be 16, and `fused` is ignored. `segments=False`
    turns off the sequence split of the two-kernel path (on by default where it applies: fewer than
    128 columns per block, a card with 225 KB of shared memory per block; see gdn_chunk_prefill_fwd).
    On cards with less shared memory per block than the two-kernel path needs (A100, RTX 30/40/50
    series) the default dispatch takes "split_o", whose blocks need at most 89 KB.
    Launch only: no synchronisation, capturable in a CUDA graph.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown gdn prefill variant {variant!r}; known: {VARIANTS}")
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
        cu_seqlens = cu_seqlens.to(torch.int32).contiguous()
    else:
        N = B
    dev = q.device
    q, k, v = _vec16(q), _vec16(k), _vec16(v)
    if a.dtype not in _GATE:
        a = a.float()
    if b.dtype not in _GATE:
        b = b.float()
    A_log = A_log.to(torch.float32).contiguous()
    dt_bias = dt_bias.to(torch.float32).contiguous()
    if initial_state is not None:
        if initial_state.shape != (N, Hv, D, D):
            raise ValueError(f"initial_state must be [{N}, {Hv}, 128, 128], got {tuple(initial_state.shape)}")
        initial_state = initial_state.to(torch.float32).contiguous()

    o = torch.empty(B, T, Hv, D, dtype=v.dtype, device=dev)
    ht = torch.empty(N, Hv, D, D, dtype=torch.float32, device=dev)
    if N == 0:
        return o, ht
    take_fused = use_fused(T) if fused is None else fused
    limit, auto_dvs = max_shared_memory(dev), choose_dv_split(N * Hv, dev)
    if variant is None and fused is None and dv_split is None and smem_bytes(auto_dvs) > limit:
        variant = "split_o"  # the card's blocks are too small for the sequential kernel
    if variant == "split_o":
        return _split_o(q, k, v, a, b, A_log, dt_bias, initial_state, cu_seqlens, o, ht, dv_split, B, T, Hk, Hv, N)
    dvs = dv_split or auto_dvs
    defines = {"DVS": dvs, "IN_T": _ELEM[v.dtype], "AB_T": _GATE[a.dtype], **EXTRA_DEFINES}
    if _GATE[b.dtype] != _GATE[a.dtype]:
        b = b.to(a.dtype)
    i64 = np.int64
    qs, ks = tuple(i64(x) for x in q.stride()[:3]), tuple(i64(x) for x in k.stride()[:3])
    vs = tuple(i64(x) for x in v.stride()[:3])
    abs_ = (*(i64(x) for x in a.stride()), *(i64(x) for x in b.stride()))
    if take_fused:
        _fits(smem_bytes_fused(dvs), limit, f"the fused kernel at dv_split {dvs}")
        fn = get_function(SRC_FUSED, KERNEL, dev, defines)
        launch(fn, (D // dvs, Hv, N), (THREADS, 1, 1),
               (q, k, v, a, b, A_log, dt_bias, initial_state, cu_seqlens, o, ht,
                np.int32(T), np.int32(Hk), np.int32(Hv), *qs, *ks, *vs, *abs_),
               shared_mem=smem_bytes_fused(dvs))
        return o, ht
    # Chunk-local matrices T, P (16-bit) and per-token vectors (G, beta, rk, rq), one slot per
    # (chunk, head); packed sequences use slot bos // 64 + n (see first_slot in the .cu).
    slots = _prep_slots(B, T, N, cu_seqlens)
    Tg = torch.empty(slots, Hv, 64, 64, dtype=v.dtype, device=dev)
    Pg = torch.empty_like(Tg)
    Fg = torch.empty(slots, Hv, 4, 64, dtype=torch.float32, device=dev)
    if slots:
        _prep(q, k, a, b, A_log, dt_bias, cu_seqlens, Tg, Pg, Fg, T, Hk, Hv, N, slots, qs, ks, abs_, defines)
    _fits(smem_bytes(dvs), limit, f"the sequential kernel at dv_split {dvs}")
    seg = segments is not False and dvs < D and smem_bytes(D) <= limit
    fn = get_function(SRC, KERNEL, dev, defines)
    keep: list = []  # packed copies the maps point at, alive until the kernel is queued
    maps = _tensor_maps(q, k, v, Tg, Pg, o, B, T, Hk, Hv, keep) if _uses_tma(dev, defines) else _zero_maps()
    launch(fn, (D // dvs, Hv, N), (THREADS, 1, 1),
           (q, k, v, Tg, Pg, Fg, initial_state, cu_seqlens, o, ht, np.int32(T), np.int32(Hk), np.int32(Hv),
            *qs, *ks, *vs, np.int32(seg), *maps),
           shared_mem=max(smem_bytes(dvs), smem_bytes(D)) if seg else smem_bytes(dvs))
    return o, ht


_sm90a: dict = {}  # device index -> whether its kernels are built for sm_90a (asked once, not per launch)


def _uses_tma(dev: torch.device, defines: dict) -> bool:
    """The sm_90a build of gdn_prefill.cu walks 128 state columns on wgmma, fed by TMA copies (the same
    test as the kernel's: an sm_90a target and no NO_WGMMA)."""
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _sm90a:
        _sm90a[idx] = arch_for_capability(*torch.cuda.get_device_capability(idx)) == "sm_90a"
    return _sm90a[idx] and not defines.get("NO_WGMMA")


L2_PROMOTION = 2  # the walk's tensor maps: L2 promotion 128 B (cuda_build.TensorMap)
_maps: dict = {}  # (address, dims, strides, promotion) -> TensorMap: the same tensors (a graph, the allocator's reuse) encode once
_zero: list = []


def _zero_maps() -> list:
    if not _zero:
        _zero.append(TensorMap.zero())
    return _zero * 6


def _map(x: torch.Tensor, dims: tuple, strides: tuple, box: tuple) -> TensorMap:
    key = (x.data_ptr(), dims, strides, L2_PROMOTION)
    m = _maps.get(key)
    if m is None:
        if len(_maps) >= 256:
            _maps.clear()
        m = _maps[key] = TensorMap(x.data_ptr(), dims, strides, box, L2_PROMOTION)
    return m


def _tensor_maps(q, k, v, Tg, Pg, o, B, T, Hk, Hv, keep: list) -> list:
    """Tensor maps of the wgmma walk's copies, in kernel order k, q, v, T, P, o: K, Q, V as [B][T][H][128]
    tiles of 64 tokens x 64 columns, T and P as 64 x 64 tiles of their [slots * Hv * 64][64] rows, and the
    output o (contiguous [B, T, Hv, 128]) in the tiles of V, which the walk stores full chunks through. A packed
    copy made for strides the copy engine refuses goes to `keep`: the caller holds it until the launch
    is queued (after that, stream order protects it)."""
    out = []
    for x, H in ((k, Hk), (q, Hk), (v, Hv)):
        try:
            sb, st, sh = (int(s) * x.element_size() for s in x.stride()[:3])
            out.append(_map(x, (D, H, T, B), (sh, st, sb), (64, 1, 64, 1)))
        except ValueError:  # strides the copy engine does not take (e.g. heads outermost): a packed copy
            x = x.contiguous()
            keep.append(x)
            sb, st, sh = (int(s) * x.element_size() for s in x.stride()[:3])
            out.append(_map(x, (D, H, T, B), (sh, st, sb), (64, 1, 64, 1)))
    rows = Tg.shape[0] * Hv * 64
    out += [_map(x, (64, rows), (128,), (64, 64)) for x in (Tg, Pg)]
    row = Hv * D * o.element_size()
    out.append(_map(o, (D, Hv, T, B), (D * o.element_size(), row, row * T), (64, 1, 64, 1)))
    return out


def _prep(q, k, a, b, A_log, dt_bias, cu_seqlens, Tg, Pg, Fg, T, Hk, Hv, N, slots, qs, ks, abs_, defines):
    """gdn_chunk_prep (gdn_prefill.cu): T, P and the per-token vectors of every (chunk, value head)."""
    dev = q.device
    hpb = choose_prep_heads(Hk, Hv, slots, dev)
    launch(get_function(SRC, PREP_KERNEL, dev, defines), (Hv // hpb, slots, 1), (PREP_THREADS, 1, 1),
           (q, k, a, b, A_log, dt_bias, cu_seqlens, Tg, Pg, Fg, np.int32(T), np.int32(Hk), np.int32(Hv),
            np.int32(N), np.int32(hpb), *qs, *ks, *abs_),
           shared_mem=PREP_SMEM)


_carveout_set: set = set()


def _prefer_smem(fn, dev: torch.device) -> None:
    """Ask for the largest shared-memory carveout once per kernel and device, so that two blocks of
    gdn_chunk_state (75-89 KB each at DVS 16/32) share an SM (the driver's default should, this makes sure)."""
    key = (id(fn), dev.index if dev.index is not None else torch.cuda.current_device())
    if key in _carveout_set:
        return
    _carveout_set.add(key)
    try:
        fn.preferred_shared_memory_carveout = 100
    except Exception:  # a hint only
        pass


def _split_o(q, k, v, a, b, A_log, dt_bias, initial_state, cu_seqlens, o, ht, dv_split, B, T, Hk, Hv, N):
    """Variant "split_o": prep (gdn_prefill.cu) -> gdn_chunk_state (state only; writes the 16-bit
    state entering every chunk and u) -> gdn_chunk_out (o for all chunks at once)."""
    dev = q.device
    dvs = dv_split or choose_dv_split_split_o(N * Hv, dev)
    if dvs not in (16, 32, 64, 128):
        raise ValueError(f"dv_split must be 16, 32, 64 or 128, got {dvs}")
    _fits(smem_bytes_split(dvs), max_shared_memory(dev), f"variant split_o at dv_split {dvs}")
    if _GATE[b.dtype] != _GATE[a.dtype]:
        b = b.to(a.dtype)
    base = {"IN_T": _ELEM[v.dtype], "AB_T": _GATE[a.dtype], **EXTRA_DEFINES}
    i64 = np.int64
    qs, ks = tuple(i64(x) for x in q.stride()[:3]), tuple(i64(x) for x in k.stride()[:3])
    vs = tuple(i64(x) for x in v.stride()[:3])
    abs_ = (*(i64(x) for x in a.stride()), *(i64(x) for x in b.stride()))
    slots = _prep_slots(B, T, N, cu_seqlens)
    Tg = torch.empty(slots, Hv, 64, 64, dtype=v.dtype, device=dev)
    Pg = torch.empty_like(Tg)
    Fg = torch.empty(slots, Hv, 4, 64, dtype=torch.float32, device=dev)
    Hs = torch.empty(slots, Hv, D, D, dtype=v.dtype, device=dev)  # 16-bit state entering each chunk
    Ug = torch.empty(slots, Hv, 64, D, dtype=v.dtype, device=dev)  # u of each chunk
    if slots:  # the prep kernel of the module the default B=1 path loads
        _prep(q, k, a, b, A_log, dt_bias, cu_seqlens, Tg, Pg, Fg, T, Hk, Hv, N, slots, qs, ks, abs_,
              {**base, "DVS": 32})
    fn = get_function(SRC_SPLIT, "gdn_chunk_state", dev, {**base, "DVS": dvs})
    _prefer_smem(fn, dev)
    launch(fn, (D // dvs, Hv, N), (THREADS, 1, 1),
           (k, v, Tg, Fg, initial_state, cu_seqlens, Hs, Ug, ht, np.int32(T), np.int32(Hk), np.int32(Hv),
            *ks, *vs),
           shared_mem=smem_bytes_split(dvs))
    if slots:
        out = get_function(SRC_SPLIT, "gdn_chunk_out", dev, {**base, "DVS": dvs})
        launch(out, (slots, Hv, D // OUT_COLS), (OUT_THREADS, 1, 1),
               (q, Pg, Fg, Hs, Ug, cu_seqlens, o, np.int32(T), np.int32(Hk), np.int32(Hv), np.int32(N), *qs),
               shared_mem=OUT_SMEM)
    return o, ht
