"""The GDN chunked-prefill CUDA kernels (one-kernel and two-kernel paths, the two-kernel path's sequence
split, and the opt-in "split_o" variant: prep + state-only sequential kernel + parallel output kernel)
against the f64 recurrence."""
import math

import pytest
import torch

from qwen35_fast.kernels.gdn_prefill.reference import gdn_prefill_recurrent_f64

from _models import rel

pytestmark = pytest.mark.gpu

O_TOL, STATE_TOL = 5e-3, 3e-3
DECAYS = {  # (A = exp(A_log) range, scale of a, shift of a): from near-identity gates to near-reset ones
    "weak": ((1e-3, 1e-2), 1.0, -2.0),
    "model": ((1.0, 16.0), 1.0, 0.0),
    "strong": ((1.0, 16.0), 2.0, 3.0),
}


def _launcher():
    from qwen35_fast.kernels.gdn_prefill.launch import gdn_chunk_prefill_cuda
    return gdn_chunk_prefill_cuda


def make_inputs(B, T, Hk, Hv, dtype, decay, h0_n=None, gate_dtype=torch.float32, packed=False, seed=None):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed if seed is not None else torch.seed() % 2 ** 31)
    dev = "cuda"
    (alo, ahi), a_scale, a_shift = DECAYS[decay]
    if packed:  # q, k, v as head slices of one projection, like a fused qkv linear produces
        qkv = torch.randn(B, T, (2 * Hk + Hv) * 128, generator=g, device=dev).to(dtype)
        q = qkv[..., :Hk * 128].view(B, T, Hk, 128)
        k = qkv[..., Hk * 128:2 * Hk * 128].view(B, T, Hk, 128)
        v = qkv[..., 2 * Hk * 128:].view(B, T, Hv, 128)
    else:
        q = torch.randn(B, T, Hk, 128, generator=g, device=dev).to(dtype)
        k = torch.randn(B, T, Hk, 128, generator=g, device=dev).to(dtype)
        v = torch.randn(B, T, Hv, 128, generator=g, device=dev).to(dtype)
    a = (torch.randn(B, T, Hv, generator=g, device=dev) * a_scale + a_shift).to(gate_dtype)
    b = torch.randn(B, T, Hv, generator=g, device=dev).to(gate_dtype)
    A_log = torch.empty(Hv, device=dev).uniform_(alo, ahi, generator=g).log()
    dt_bias = torch.randn(Hv, generator=g, device=dev) * 0.5
    h0 = None if h0_n is None else torch.randn(h0_n, Hv, 128, 128, generator=g, device=dev) * 0.1
    return q, k, v, a, b, A_log, dt_bias, h0


def _poison(*shapes_dtypes):
    """Leave NaN in the caching allocator's free blocks so that outputs the kernel fails to write show."""
    nbytes = sum(math.prod(s) * torch.tensor([], dtype=d).element_size() for s, d in shapes_dtypes)
    junk = torch.full((nbytes // 4 + 4096,), float("nan"), device="cuda")
    del junk


# How each test calls the launcher: the default dispatch, a forced path, or the opt-in variant.
PATHS = {"default": {}, "fused": {"fused": True}, "two": {"fused": False}, "split_o": {"variant": "split_o"},
         "noseg": {"fused": False, "segments": False}}
_ref_cache: dict = {}  # one entry: the f64 reference of the last inputs (the paths of one case share it)


def reference(key, *args):
    if key is None or key not in _ref_cache:
        _ref_cache.clear()
        out = gdn_prefill_recurrent_f64(*args)
        if key is None:
            return out
        _ref_cache[key] = out
    return _ref_cache[key]


def run_and_check(q, k, v, a, b, A_log, dt_bias, h0, cu_seqlens=None, dv_split=None, fused=None, o_tol=O_TOL,
                  state_tol=STATE_TOL, variant=None, ref_key=None, segments=None):
    B, T, Hv = v.shape[:3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    _poison(((B, T, Hv, 128), v.dtype), ((N, Hv, 128, 128), torch.float32))
    o, ht = _launcher()(q, k, v, a, b, A_log, dt_bias, h0, cu_seqlens, dv_split=dv_split, fused=fused,
                        variant=variant, segments=segments)
    o_ref, ht_ref = reference(ref_key, q, k, v, a, b, A_log, dt_bias, h0, cu_seqlens)
    assert o.shape == (B, T, Hv, 128) and o.dtype == v.dtype
    assert ht.shape == (N, Hv, 128, 128) and ht.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    eo, es = (rel(o, o_ref) if T else 0.0), rel(ht, ht_ref)
    assert eo <= o_tol and es <= state_tol, f"o err {eo:.2e}, state err {es:.2e}"
    return eo, es


# (T, B, Hv/Hk, initial state, decay, dtype): every T with both batch sizes, the rest cycled
CASES = []
_cycle = [(1, True, "model", torch.bfloat16), (2, False, "weak", torch.bfloat16), (2, True, "strong", torch.float16),
          (1, False, "weak", torch.float16), (2, True, "weak", torch.bfloat16), (1, True, "strong", torch.bfloat16)]
for i, (T, B) in enumerate((T, B) for T in (1, 63, 64, 65, 1000, 4097) for B in (1, 3)):
    CASES.append((T, B) + _cycle[i % len(_cycle)])


@pytest.mark.parametrize("path", ["default", "noseg", "split_o"])
@pytest.mark.parametrize("T,B,ratio,with_h0,decay,dtype", CASES)
def test_prefill_vs_f64(T, B, ratio, with_h0, decay, dtype, path):
    Hk = 2 if T < 4000 else 1
    seed = 1000 * T + 10 * B + ratio  # both paths of a case see the same inputs and share one reference
    inputs = make_inputs(B, T, Hk, Hk * ratio, dtype, decay, B if with_h0 else None, seed=seed)
    run_and_check(*inputs, **PATHS[path], ref_key=(T, B, ratio, with_h0, decay, dtype, seed))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dv_split", [32, 64, 128])
@pytest.mark.parametrize("decay", ["weak", "model"])
def test_every_dv_split(dv_split, decay, fused):
    inputs = make_inputs(2, 300, 2, 4, torch.bfloat16, decay, 2)
    run_and_check(*inputs, dv_split=dv_split, fused=fused)


@pytest.mark.parametrize("dv_split", [16, 32, 64, 128])
@pytest.mark.parametrize("decay", ["weak", "model"])
def test_split_o_every_dv_split(dv_split, decay):
    inputs = make_inputs(2, 300, 2, 4, torch.bfloat16, decay, 2)
    run_and_check(*inputs, dv_split=dv_split, variant="split_o")


def test_unknown_variant():
    inputs = make_inputs(1, 8, 1, 1, torch.bfloat16, "model")
    with pytest.raises(ValueError, match="variant"):
        _launcher()(*inputs, variant="nope")


@pytest.mark.parametrize("path", ["fused", "two", "split_o"])
@pytest.mark.parametrize("with_h0", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen(with_h0, dtype, path):
    lens = [1, 129, 1000, 64, 806, 63, 0, 2]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    inputs = make_inputs(1, int(cu[-1]), 2, 4, dtype, "model", len(lens) if with_h0 else None,
                         seed=11 + with_h0 + 2 * (dtype == torch.float16))
    run_and_check(*inputs, cu_seqlens=cu, **PATHS[path], ref_key=("varlen", with_h0, dtype))


@pytest.mark.parametrize("decay", ["weak", "model"])
@pytest.mark.parametrize("path", ["fused", "two", "split_o"])
def test_varlen_matches_separate_calls(path, decay):
    lens = [100, 1, 700]  # 700 tokens: 11 chunks, split in segments unless the decay is weak
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v, a, b, A_log, dt_bias, h0 = make_inputs(1, sum(lens), 2, 4, torch.bfloat16, decay, len(lens))
    o, ht = _launcher()(q, k, v, a, b, A_log, dt_bias, h0, cu, **PATHS[path])
    for i in range(len(lens)):
        s, e = int(cu[i]), int(cu[i + 1])
        oi, hi = _launcher()(q[:, s:e], k[:, s:e], v[:, s:e], a[:, s:e], b[:, s:e], A_log, dt_bias, h0[i:i + 1],
                             **PATHS[path])
        torch.testing.assert_close(o[:, s:e], oi, rtol=0, atol=0)
        torch.testing.assert_close(ht[i:i + 1], hi, rtol=0, atol=0)


@pytest.mark.parametrize("path", ["fused", "two", "split_o"])
def test_packed_heads_and_gate_dtypes(path):
    inputs = make_inputs(2, 200, 2, 4, torch.bfloat16, "model", 2, gate_dtype=torch.bfloat16, packed=True)
    assert not inputs[0].is_contiguous()
    run_and_check(*inputs, **PATHS[path])


@pytest.mark.parametrize("path", ["fused", "two", "split_o"])
def test_qwen35_shapes(path):
    """Hk 16, Hv 32 as in Qwen3.5-9B, bf16, initial state; the default Dv split for B = 1."""
    inputs = make_inputs(1, 700, 16, 32, torch.bfloat16, "model", 1, seed=700)
    run_and_check(*inputs, **PATHS[path], ref_key="qwen35")


@pytest.mark.parametrize("path", ["fused", "two", "split_o"])
def test_deterministic(path):
    inputs = make_inputs(1, 500, 2, 4, torch.bfloat16, "model", 1, seed=1)
    o1, h1 = _launcher()(*inputs, **PATHS[path])
    o2, h2 = _launcher()(*inputs, **PATHS[path])
    assert torch.equal(o1, o2) and torch.equal(h1, h2)


@pytest.mark.parametrize("path", ["fused", "two", "split_o"])
def test_cuda_graph_capture(path):
    """The launch captures into a CUDA graph (no host sync, no host reads of device data); replays
    on new inputs copied into the captured buffers match eager calls."""
    lens = [70, 1, 600]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    static = make_inputs(1, sum(lens), 2, 4, torch.bfloat16, "model", len(lens), seed=3)
    fn = lambda: _launcher()(*static, cu, **PATHS[path])  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile and load outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, h_g = fn()
    fresh = make_inputs(1, sum(lens), 2, 4, torch.bfloat16, "model", len(lens), seed=4)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    o_e, h_e = _launcher()(*fresh, cu, **PATHS[path])
    torch.testing.assert_close(o_g, o_e, rtol=0, atol=0)
    torch.testing.assert_close(h_g, h_e, rtol=0, atol=0)


# ---------------------------------------------------------------- the sequence split of the two-kernel path
def chunk_decay_gates(B, T, per_chunk, seed):
    """a, A_log, dt_bias giving value head h a log-decay of about per_chunk[h] per 64 tokens."""
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    Hv = len(per_chunk)
    a = 10.0 + 0.1 * torch.randn(B, T, Hv, generator=g, device="cuda")  # softplus(a) ~ a ~ 10
    A_log = (-torch.tensor(per_chunk, device="cuda") / (64 * 10.0)).log()
    return a, A_log, torch.zeros(Hv, device="cuda")


@pytest.mark.parametrize("T,B,per_chunk,with_h0", [
    (566, 1, (-50.0, -3.0), True),     # 9 chunks: segments of 3, 3, 3 and an empty one
    (4097, 2, (-3.0, -3.0), False),    # 7 chunks of warm-up per boundary (half a segment is 8)
    (4097, 1, (-3.0, -0.01), True),    # one head split, the other (weak decay) keeps the column split
    (18000, 1, (-0.62,), True),        # 34 chunks of warm-up: the walk back crosses one 32-chunk step
])
def test_sequence_split_vs_f64(T, B, per_chunk, with_h0):
    Hv = len(per_chunk)
    q, k, v, _, b, _, _, h0 = make_inputs(B, T, 1, Hv, torch.bfloat16, "model", B if with_h0 else None, seed=T)
    a, A_log, dt_bias = chunk_decay_gates(B, T, per_chunk, seed=T)
    run_and_check(q, k, v, a, b, A_log, dt_bias, h0, ref_key=("segments", T, B, per_chunk, with_h0))
    run_and_check(q, k, v, a, b, A_log, dt_bias, h0, segments=False, ref_key=("segments", T, B, per_chunk, with_h0))


def test_sequence_split_is_taken_per_head(monkeypatch):
    """With the warm-up cut at 2^-1 instead of 2^-30, the split drops e^-1 of the state at every segment
    start: the heads it takes show that error, the weak-decay heads (column split) stay exact."""
    from qwen35_fast.kernels.gdn_prefill import launch as L
    monkeypatch.setitem(L.EXTRA_DEFINES, "SEG_DROP_BITS", 1)
    T, per_chunk = 4096, (-1.0, -0.005, -1.0, -0.005)
    q, k, v, _, b, _, _, h0 = make_inputs(1, T, 2, 4, torch.bfloat16, "model", 1, seed=5)
    a, A_log, dt_bias = chunk_decay_gates(1, T, per_chunk, seed=5)
    o, ht = _launcher()(q, k, v, a, b, A_log, dt_bias, h0)
    o_ref, _ = gdn_prefill_recurrent_f64(q, k, v, a, b, A_log, dt_bias, h0)
    rows = torch.cat([torch.arange(16) + 64 * c for c in (16, 32, 48)])  # first rows of segments 1, 2, 3
    err = [rel(o[0, rows, h], o_ref[0, rows, h]) for h in range(4)]
    assert min(err[0], err[2]) > 0.05 and max(err[1], err[3]) <= O_TOL, err
    monkeypatch.delitem(L.EXTRA_DEFINES, "SEG_DROP_BITS")
    o_off, _ = _launcher()(q, k, v, a, b, A_log, dt_bias, h0, segments=False)
    assert torch.equal(o[..., 1, :], o_off[..., 1, :]) and torch.equal(o[..., 3, :], o_off[..., 3, :])


@pytest.mark.parametrize("Hk,Hv", [(2, 4), (1, 3), (1, 4)])
def test_prep_value_heads_per_block(monkeypatch, Hk, Hv):
    """The prep kernel forms K K^T, Q K^T once for all value heads of a q/k head (hpb = Hv / Hk) or once
    per value head (hpb = 1): the same numbers either way, and right against the f64 recurrence."""
    from qwen35_fast.kernels.gdn_prefill import launch as L
    lens = [300, 1, 129]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    inputs = make_inputs(1, sum(lens), Hk, Hv, torch.bfloat16, "model", len(lens), seed=Hv)
    outs = []
    for hpb in (1, Hv // Hk):
        monkeypatch.setattr(L, "PREP_HPB", hpb)
        run_and_check(*inputs, cu_seqlens=cu, ref_key=("hpb", Hk, Hv))
        outs.append(_launcher()(*inputs, cu))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("dv_split", [32, 64])
def test_sequence_split_at_each_column_split(dv_split):
    """4 segments (DVS 32) or 2 (DVS 64) per head; one head split (3 chunks of warm-up), one weak-decay
    head on the column split; with and without the split, each against f64."""
    T, B, per_chunk = 1500, 2, (-8.0, -0.01)
    q, k, v, _, b, _, _, h0 = make_inputs(B, T, 1, 2, torch.bfloat16, "model", B, seed=dv_split)
    a, A_log, dt_bias = chunk_decay_gates(B, T, per_chunk, seed=dv_split)
    key = ("split-dvs", dv_split)
    run_and_check(q, k, v, a, b, A_log, dt_bias, h0, dv_split=dv_split, fused=False, ref_key=key)
    run_and_check(q, k, v, a, b, A_log, dt_bias, h0, dv_split=dv_split, fused=False, segments=False, ref_key=key)


def _hopper():
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper(), reason="wgmma needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ks,n,c0,trans_a", [(1, 128, 0, 0), (4, 128, 0, 0), (2, 64, 0, 0), (4, 64, 64, 0),
                                             (4, 128, 0, 1), (3, 64, 64, 1)])
def test_wgmma_tiles(ks, n, c0, trans_a, dtype):
    """wgmma.cuh against torch: the A fragments (plain and transposed ldmatrix), the canonical B layout,
    its descriptors and the accumulator layout the prefill walk relies on."""
    from pathlib import Path

    import numpy as np

    from qwen35_fast.kernels import cuda_build
    from qwen35_fast.kernels.gdn_prefill import launch as L
    src = Path(L.__file__).parent / "wgmma_check.cu"
    fn = cuda_build.get_function(src, "wgmma_check", "cuda", {"IN_T": L._ELEM[dtype]})
    K = 16 * ks
    A = torch.randn(64, K, device="cuda").to(dtype)
    B = torch.randn(K, 128, device="cuda").to(dtype)
    D = torch.full((64, n), float("nan"), device="cuda")
    a_in = A.t().contiguous() if trans_a else A
    cuda_build.launch(fn, (1, 1, 1), (128, 1, 1), (a_in, B, D, ks, n, c0, trans_a,
                                                    np.int32(2048), np.int32(128)))
    torch.cuda.synchronize()
    ref = A.float() @ B.float()[:, c0:c0 + n]
    assert rel(D, ref) < 1e-5, rel(D, ref)


@pytest.mark.parametrize("scale", [1e-3, 1e3])
def test_large_and_small_values(scale):
    """v (and with it u and the state) scaled far from 1: on Hopper the state update takes the scaled u in
    fp16 (range 6e-5 .. 65504 in normal numbers, clamped, never inf); relative errors must not care about
    the scale. h0 scales with v, as a real model's state would."""
    q, k, v, a, b, A_log, dt_bias, h0 = make_inputs(1, 1000, 2, 4, torch.bfloat16, "weak", 1, seed=7)
    v, h0 = (v.float() * scale).to(v.dtype), h0 * scale
    for dv_split in (None, 128):
        run_and_check(q, k, v, a, b, A_log, dt_bias, h0, dv_split=dv_split, ref_key=("scale", scale))


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper(), reason="the wgmma walk is the default on sm_90 only")
@pytest.mark.parametrize("T,B,dtype,dv_split", [(1000, 3, torch.bfloat16, 128), (1000, 3, torch.float16, 128),
                                                (4097, 1, torch.bfloat16, None)])
def test_mma_sync_walk_on_hopper(monkeypatch, T, B, dtype, dv_split):
    """NO_WGMMA=1 builds the mma.sync 128-column walk (what Blackwell-class cards run) on the H200, where
    the wgmma walk is the default: whole heads (DVS 128) and the walks of the sequence split (4,097 tokens)
    stay right against f64, and the two walks agree to the one rounding they do differently (the wgmma
    walk's state update takes the scaled u in fp16, the mma.sync walk as bf16 hi + lo)."""
    from qwen35_fast.kernels.gdn_prefill import launch as L
    inputs = make_inputs(B, T, 2, 4, dtype, "model", B, seed=T + B)
    key = ("walks", T, B, dtype)
    run_and_check(*inputs, dv_split=dv_split, fused=False, ref_key=key)
    o_wg, ht_wg = _launcher()(*inputs, dv_split=dv_split, fused=False)
    monkeypatch.setitem(L.EXTRA_DEFINES, "NO_WGMMA", 1)
    run_and_check(*inputs, dv_split=dv_split, fused=False, ref_key=key)
    o_mma, ht_mma = _launcher()(*inputs, dv_split=dv_split, fused=False)
    assert rel(o_wg, o_mma) < 4e-3 and rel(ht_wg, ht_mma) < 1e-3, (rel(o_wg, o_mma), rel(ht_wg, ht_mma))
