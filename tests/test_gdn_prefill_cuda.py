"""The GDN chunked-prefill CUDA kernels against the f64 recurrence, on both paths of plan.py: the Hopper
path (sm_90a: prep + wgmma walk with the sequence split) and the portable path (prep + state walk with
column slices and segments + output kernel), the latter built as the RTX cards get it (compute_80 PTX on
an sm_90 card) wherever the GPU can run that."""

import pytest
import torch

from qwen35_fast.kernels.gdn_prefill.reference import gdn_prefill_recurrent_f64

from _models import poison_allocator, rel

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


def make_inputs(B, T, Hk, Hv, dtype, decay, h0_n=None, gate_dtype=torch.float32, packed=False, seed=0):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
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


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


PORTABLE_ARCH = "compute_80" if _hopper() else None  # on the H200: the PTX an sm_80-class build gives
# How each test calls the launcher: a path, and a forced split or segment count
PATHS = {"hopper": {"path": "hopper"}, "hopper_noseg": {"path": "hopper", "segments": 1},
         "portable": {"path": "portable", "arch": PORTABLE_ARCH},
         "portable_seg": {"path": "portable", "arch": PORTABLE_ARCH, "dv_split": 64, "segments": 4},
         "portable_16": {"path": "portable", "arch": PORTABLE_ARCH, "dv_split": 16, "segments": 1},
         "portable_out_kernel": {"path": "portable", "arch": PORTABLE_ARCH, "fused_out": False},
         "portable_fused_long": {"path": "portable", "arch": PORTABLE_ARCH, "dv_split": 32, "segments": 1,
                                 "fused_out": True}}
ALL = list(PATHS)
MAIN = ["hopper", "portable", "portable_seg"]


@pytest.fixture(autouse=True)
def _skip_hopper_elsewhere(request):
    path = request.node.callspec.params.get("path", "") if hasattr(request.node, "callspec") else ""
    if path.startswith("hopper") and not _hopper():
        pytest.skip("the Hopper path needs an sm_90 GPU")


_ref_cache: dict = {}  # one entry: the f64 reference of the last inputs (the paths of one case share it)


def reference(key, *args):
    if key is None or key not in _ref_cache:
        _ref_cache.clear()
        out = gdn_prefill_recurrent_f64(*args)
        if key is None:
            return out
        _ref_cache[key] = out
    return _ref_cache[key]


def run_and_check(q, k, v, a, b, A_log, dt_bias, h0, cu_seqlens=None, o_tol=O_TOL, state_tol=STATE_TOL,
                  ref_key=None, **kw):
    B, T, Hv = v.shape[:3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    poison_allocator(((B, T, Hv, 128), v.dtype), ((N, Hv, 128, 128), torch.float32))
    o, ht = _launcher()(q, k, v, a, b, A_log, dt_bias, h0, cu_seqlens, **kw)
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


@pytest.mark.parametrize("path", ALL)
@pytest.mark.parametrize("T,B,ratio,with_h0,decay,dtype", CASES)
def test_prefill_vs_f64(T, B, ratio, with_h0, decay, dtype, path):
    Hk = 2 if T < 4000 else 1
    seed = 1000 * T + 10 * B + ratio  # both paths of a case see the same inputs and share one reference
    inputs = make_inputs(B, T, Hk, Hk * ratio, dtype, decay, B if with_h0 else None, seed=seed)
    run_and_check(*inputs, **PATHS[path], ref_key=(T, B, ratio, with_h0, decay, dtype, seed))


# the Hopper walk splits into 128 / dv_split segments or none; the portable one into any number
@pytest.mark.parametrize("path,dv_split,segments",
                         [("hopper", d, s) for d in (32, 64, 128) for s in (None, 1)]
                         + [("portable", d, s) for d in (16, 32, 64) for s in (None, 1, 3)])
@pytest.mark.parametrize("decay", ["weak", "model"])
def test_every_dv_split(path, dv_split, segments, decay):
    inputs = make_inputs(2, 700, 2, 4, torch.bfloat16, decay, 2, seed=dv_split + (segments or 0))
    run_and_check(*inputs, path=path, dv_split=dv_split, segments=segments,
                  arch=PORTABLE_ARCH if path == "portable" else None, ref_key=("dvs", decay, dv_split, segments))


def test_bad_overrides_are_clear_errors():
    inputs = make_inputs(1, 8, 1, 1, torch.bfloat16, "model")
    with pytest.raises(ValueError, match=r"^gdn prefill path must be 'hopper' or 'portable', got 'nope'$"):
        _launcher()(*inputs, path="nope")
    with pytest.raises(ValueError, match=r"^dv_split must be one of \(16, 32, 64\) on the portable path, got 128$"):
        _launcher()(*inputs, path="portable", dv_split=128)


@pytest.mark.parametrize("path", MAIN)
@pytest.mark.parametrize("with_h0", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen(with_h0, dtype, path):
    lens = [1, 129, 1000, 64, 806, 63, 0, 2]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    inputs = make_inputs(1, int(cu[-1]), 2, 4, dtype, "model", len(lens) if with_h0 else None,
                         seed=11 + with_h0 + 2 * (dtype == torch.float16))
    run_and_check(*inputs, cu_seqlens=cu, **PATHS[path], ref_key=("varlen", with_h0, dtype))


@pytest.mark.parametrize("path", MAIN)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("with_h0", [True, False])
def test_no_tokens_leave_each_state_as_it_came(path, packed, with_h0):
    """T = 0 (one row, or packed sequences all empty): no output rows, each state the initial one (zeros
    without one), on every path (the Hopper walk's tensor maps take no empty dimension)."""
    n = 3 if packed else 1
    q, k, v, a, b, A_log, dt_bias, h0 = make_inputs(1, 0, 2, 4, torch.bfloat16, "model", n if with_h0 else None)
    cu = torch.zeros(n + 1, dtype=torch.int32, device="cuda") if packed else None
    o, ht = _launcher()(q, k, v, a, b, A_log, dt_bias, h0, cu, **PATHS[path])
    assert o.shape == (1, 0, 4, 128) and ht.shape == (n, 4, 128, 128)
    assert torch.equal(ht, h0 if with_h0 else torch.zeros_like(ht))


@pytest.mark.parametrize("decay", ["weak", "model"])
@pytest.mark.parametrize("path", MAIN)
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


@pytest.mark.parametrize("path", MAIN)
def test_packed_heads_and_gate_dtypes(path):
    inputs = make_inputs(2, 200, 2, 4, torch.bfloat16, "model", 2, gate_dtype=torch.bfloat16, packed=True)
    assert not inputs[0].is_contiguous()
    run_and_check(*inputs, **PATHS[path])


@pytest.mark.parametrize("path", MAIN)
def test_qwen35_shapes(path):
    """Hk 16, Hv 32 as in Qwen3.5-9B, bf16, initial state; the default Dv split for B = 1."""
    inputs = make_inputs(1, 700, 16, 32, torch.bfloat16, "model", 1, seed=700)
    run_and_check(*inputs, **PATHS[path], ref_key="qwen35")


@pytest.mark.parametrize("path", MAIN)
def test_deterministic(path):
    inputs = make_inputs(1, 500, 2, 4, torch.bfloat16, "model", 1, seed=1)
    o1, h1 = _launcher()(*inputs, **PATHS[path])
    o2, h2 = _launcher()(*inputs, **PATHS[path])
    assert torch.equal(o1, o2) and torch.equal(h1, h2)


@pytest.mark.parametrize("path", MAIN)
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


# ---------------------------------------------------------------- the sequence split (both paths)
def chunk_decay_gates(B, T, per_chunk, seed):
    """a, A_log, dt_bias giving value head h a log-decay of about per_chunk[h] per 64 tokens."""
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    Hv = len(per_chunk)
    a = 10.0 + 0.1 * torch.randn(B, T, Hv, generator=g, device="cuda")  # softplus(a) ~ a ~ 10
    A_log = (-torch.tensor(per_chunk, device="cuda") / (64 * 10.0)).log()
    return a, A_log, torch.zeros(Hv, device="cuda")


SPLITS = {"hopper": [{"path": "hopper", "dv_split": 32}, {"path": "hopper", "dv_split": 32, "segments": 1}],
          "portable": [{"path": "portable", "arch": PORTABLE_ARCH, "dv_split": 64, "segments": 4},
                       {"path": "portable", "arch": PORTABLE_ARCH, "dv_split": 32, "segments": 7},
                       {"path": "portable", "arch": PORTABLE_ARCH, "dv_split": 64, "segments": 1}]}


@pytest.mark.parametrize("path", ["hopper", "portable"])
@pytest.mark.parametrize("T,B,per_chunk,with_h0", [
    (566, 1, (-50.0, -3.0), True),     # 9 chunks: segments of 3, 3, 3 and an empty one (4 segments)
    (4097, 2, (-3.0, -3.0), False),    # 7 chunks of warm-up per boundary (half a segment is 8)
    (4097, 1, (-3.0, -0.01), True),    # one head split, the other (weak decay) walks unsplit
    (18000, 1, (-0.62,), True),        # 34 chunks of warm-up: the walk back crosses one 32-chunk step
])
def test_sequence_split_vs_f64(path, T, B, per_chunk, with_h0):
    Hv = len(per_chunk)
    q, k, v, _, b, _, _, h0 = make_inputs(B, T, 1, Hv, torch.bfloat16, "model", B if with_h0 else None, seed=T)
    a, A_log, dt_bias = chunk_decay_gates(B, T, per_chunk, seed=T)
    for kw in SPLITS[path]:
        run_and_check(q, k, v, a, b, A_log, dt_bias, h0, ref_key=("segments", T, B, per_chunk, with_h0), **kw)


@pytest.mark.parametrize("path", ["hopper", "portable"])
def test_sequence_split_is_taken_per_head(path):
    """With the warm-up cut at 2^-1 instead of 2^-30, the split drops e^-1 of the state at every segment
    start: the heads it takes show that error, the weak-decay heads (walked unsplit) stay exact."""
    kw = SPLITS[path][0]
    T, per_chunk = 4096, (-1.0, -0.005, -1.0, -0.005)
    q, k, v, _, b, _, _, h0 = make_inputs(1, T, 2, 4, torch.bfloat16, "model", 1, seed=5)
    a, A_log, dt_bias = chunk_decay_gates(1, T, per_chunk, seed=5)
    o, ht = _launcher()(q, k, v, a, b, A_log, dt_bias, h0, defines={"SEG_DROP_BITS": 1}, **kw)
    o_ref, _ = gdn_prefill_recurrent_f64(q, k, v, a, b, A_log, dt_bias, h0)
    rows = torch.cat([torch.arange(16) + 64 * c for c in (16, 32, 48)])  # first rows of segments 1, 2, 3
    err = [rel(o[0, rows, h], o_ref[0, rows, h]) for h in range(4)]
    assert min(err[0], err[2]) > 0.05 and max(err[1], err[3]) <= O_TOL, err
    o_off, _ = _launcher()(q, k, v, a, b, A_log, dt_bias, h0, **{**kw, "segments": 1})
    assert torch.equal(o[..., 1, :], o_off[..., 1, :]) and torch.equal(o[..., 3, :], o_off[..., 3, :])


@pytest.mark.parametrize("path", ["hopper", "portable"])
@pytest.mark.parametrize("Hk,Hv", [(2, 4), (1, 3), (1, 4)])
def test_prep_value_heads_per_block(monkeypatch, path, Hk, Hv):
    """The prep kernel forms K K^T, Q K^T once for all value heads of a q/k head (hpb = Hv / Hk) or once
    per value head (hpb = 1): the same numbers either way, and right against the f64 recurrence."""
    from qwen35_fast.kernels.gdn_prefill import plan as P
    lens = [300, 1, 129]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    inputs = make_inputs(1, sum(lens), Hk, Hv, torch.bfloat16, "model", len(lens), seed=Hv)
    outs = []
    try:
        for hpb in (1, Hv // Hk):
            asked = []
            monkeypatch.setattr(P, "prep_heads", lambda *a, hpb=hpb: asked.append(hpb) or hpb)
            P.plan.cache_clear()  # plan() is memoised: else the first iteration's plan (and its hpb) serves both
            run_and_check(*inputs, cu_seqlens=cu, ref_key=("hpb", Hk, Hv), **PATHS[path])
            outs.append(_launcher()(*inputs, cu, **PATHS[path]))
            assert asked, "the plan did not ask prep_heads: this run did not take the patched value"
    finally:
        monkeypatch.undo()
        P.plan.cache_clear()  # no plan with a patched value outlives the test
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("dv_split", [32, 64])
def test_hopper_sequence_split_at_each_column_split(dv_split):
    """4 segments (DVS 32) or 2 (DVS 64) per head; one head split (3 chunks of warm-up), one weak-decay
    head on the column split; with and without the split, each against f64."""
    if not _hopper():
        pytest.skip("the Hopper path needs an sm_90 GPU")
    T, B, per_chunk = 1500, 2, (-8.0, -0.01)
    q, k, v, _, b, _, _, h0 = make_inputs(B, T, 1, 2, torch.bfloat16, "model", B, seed=dv_split)
    a, A_log, dt_bias = chunk_decay_gates(B, T, per_chunk, seed=dv_split)
    key = ("split-dvs", dv_split)
    run_and_check(q, k, v, a, b, A_log, dt_bias, h0, path="hopper", dv_split=dv_split, ref_key=key)
    run_and_check(q, k, v, a, b, A_log, dt_bias, h0, path="hopper", dv_split=dv_split, segments=1, ref_key=key)


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper(), reason="wgmma needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ks,n,c0,trans_a", [(1, 128, 0, 0), (4, 128, 0, 0), (2, 64, 0, 0), (4, 64, 64, 0),
                                             (4, 128, 0, 1), (3, 64, 64, 1)])
def test_wgmma_tiles(ks, n, c0, trans_a, dtype):
    """wgmma.cuh against torch: the A fragments (plain and transposed ldmatrix), the canonical B layout,
    its descriptors and the accumulator layout the prefill walk relies on."""

    import numpy as np

    from qwen35_fast.kernels import cuda_build
    from qwen35_fast.kernels.gdn_prefill import launch as L
    src = L.HERE / "wgmma_check.cu"
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
    for kw in ({"path": "hopper"}, {"path": "hopper", "dv_split": 128}, PATHS["portable"]):
        if kw["path"] == "hopper" and not _hopper():
            continue
        run_and_check(q, k, v, a, b, A_log, dt_bias, h0, ref_key=("scale", scale), **kw)


@pytest.mark.parametrize("dv_split,segments", [(16, None), (32, None), (64, None), (64, 1), (32, 4)])
@pytest.mark.parametrize("T,B,packed", [(1, 1, False), (200, 2, False), (1000, 1, False), (3000, 1, False),
                                        (801, 1, True)])
def test_outputs_formed_by_the_state_kernel_equal_the_output_kernels(T, B, packed, dv_split, segments):
    """fused_out (the state walk forms o: Q S beside K S, P u at the next step) gives o bit for bit as
    gdn_chunk_out (the same products in the same order), and the same final state, with and without segments;
    rows past each sequence's end are never written."""
    lens = [300, 1, 500] if packed else None
    N = len(lens) if packed else B
    q, k, v, a, b, A_log, dt_bias, h0 = make_inputs(1 if packed else B, T, 2, 4, torch.bfloat16, "model", N)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32) if packed else None
    kw = {"path": "portable", "arch": PORTABLE_ARCH, "dv_split": dv_split, "segments": segments}
    poison_allocator(((q.shape[0], T, v.shape[2], 128), v.dtype), ((N, v.shape[2], 128, 128), torch.float32))
    o1, h1 = _launcher()(q, k, v, a, b, A_log, dt_bias, h0, cu, fused_out=True, **kw)
    o2, h2 = _launcher()(q, k, v, a, b, A_log, dt_bias, h0, cu, fused_out=False, **kw)
    assert torch.isfinite(o1).all()
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    torch.testing.assert_close(h1, h2, rtol=0, atol=0)


@pytest.mark.parametrize("path", MAIN)
def test_an_initial_state_at_an_odd_offset_gives_the_same_result(path):
    """An fp32 initial state viewed 8 bytes into its storage (contiguous, not 16-byte aligned: the walk reads
    it in 8-byte pairs from an aligned start) gives what the same values at an aligned start give."""
    q, k, v, a, b, A_log, dt_bias, h0 = make_inputs(1, 100, 2, 4, torch.bfloat16, "model", 1, seed=5)
    flat = torch.empty(h0.numel() + 2, dtype=torch.float32, device="cuda")
    odd = flat[2:].view(h0.shape)
    odd.copy_(h0)
    assert odd.data_ptr() % 16 == 8
    o, ht = _launcher()(q, k, v, a, b, A_log, dt_bias, h0, **PATHS[path])
    o2, ht2 = _launcher()(q, k, v, a, b, A_log, dt_bias, odd, **PATHS[path])
    assert torch.equal(o, o2) and torch.equal(ht, ht2) and torch.equal(odd, h0)


# keep: the states after those token counts, stored by the walk as it passes them. Against the f64 recurrence
# over each prefix, on every path and split: at chunk 0 (the initial state), inside a segment, at the sequence
# split's segment boundaries (4 segments of 17 chunks at 4,097 tokens, 2 value heads a q/k head: the Hopper
# walk's plan, 32 columns, and portable_seg's), twice the same; outputs poisoned, and o and the final state as a
# call without keep gives them.
KEEP_CASES = [(1000, (0, 64, 512, 960), "model", True),
              (4097, (64, 1088, 2176, 2240, 3264, 4032, 4032), "model", False),
              (700, (640,), "weak", True), (65, (0, 64), "strong", False),
              (300, (0, 64, 128, 192, 256, 256, 128, 64), "model", True)]
_kept_ref: dict = {}


@pytest.mark.parametrize("path", ALL)
@pytest.mark.parametrize("T,keep,decay,with_h0", KEEP_CASES)
def test_kept_states_vs_f64(path, T, keep, decay, with_h0):
    inputs = make_inputs(1, T, 2, 4, torch.bfloat16, decay, 1 if with_h0 else None, seed=T + len(keep))
    q, k, v, a, b, A_log, dt_bias, h0 = inputs
    key = (T, keep, decay, with_h0)
    if key not in _kept_ref:
        _kept_ref.clear()
        _kept_ref[key] = {c: (h0[0].double() if h0 is not None else torch.zeros(4, 128, 128, device="cuda",
                                                                                 dtype=torch.float64)) if c == 0
                          else gdn_prefill_recurrent_f64(*(x[:, :c] for x in (q, k, v, a, b)), A_log, dt_bias, h0)[1][0]
                          for c in set(keep)}
    poison_allocator(((len(keep), 4, 128, 128), torch.float32), ((1, T, 4, 128), torch.bfloat16))
    o, ht, hk = _launcher()(*inputs, keep=list(keep), **PATHS[path])
    o0, ht0 = _launcher()(*inputs, **PATHS[path])
    assert torch.equal(o, o0) and torch.equal(ht, ht0)
    assert hk.shape == (len(keep), 4, 128, 128) and torch.isfinite(hk).all()
    for e, c in enumerate(keep):
        assert rel(hk[e], _kept_ref[key][c]) <= STATE_TOL, (e, c)


def test_keep_is_checked():
    inputs = make_inputs(2, 200, 2, 4, torch.bfloat16, "model", None)
    for keep, B, match in (([64], 2, "one sequence"), ([30], 1, "multiples of 64"), ([256], 1, "0 .. 199"),
                           ([0] * 9, 1, "at most 8")):
        with pytest.raises(ValueError, match=match):
            _launcher()(*(x[:B] if x is not None and x.dim() > 1 else x for x in inputs), keep=keep)
