"""The PyTorch references against plain formulas (CPU).

The chunked GDN prefill (what the runtime runs without CUDA kernels, and what the CUDA kernels are
compared with) must match the float64 token-by-token recurrence over many shapes; the decode and
conv1d references must match loops written straight from their equations, the RMSNorms their formulas.
"""
import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from qwen35_fast import kernels
from qwen35_fast.kernels.conv1d.reference import (
    causal_conv1d_prefill_ref,
    causal_conv1d_states_ref,
    causal_conv1d_update_ref,
)
from qwen35_fast.kernels.gdn_decode.reference import gdn_decode_step_ref
from qwen35_fast.kernels.gdn_prefill.reference import (
    gate_and_beta,
    gdn_prefill_chunked,
    gdn_prefill_recurrent_f64,
    segment_bytes,
    segment_for,
)

from _models import rel

# decay strength: A = exp(A_log) in [lo, hi] and dt_bias; "strong" drives exp(g) towards 1e-3 per token
DECAY = {"weak": (0.01, 0.1, -4.0), "mid": (1.0, 16.0, 1.0), "strong": (8.0, 16.0, 3.0)}


def gdn_inputs(B, T, Hk, Hv, D, Dv, decay="mid", dtype=torch.float32, N=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo, hi, bias = DECAY[decay]
    q = torch.randn(B, T, Hk, D, generator=g).to(dtype)
    k = torch.randn(B, T, Hk, D, generator=g).to(dtype)
    v = torch.randn(B, T, Hv, Dv, generator=g).to(dtype)
    a = torch.randn(B, T, Hv, generator=g)
    b = torch.randn(B, T, Hv, generator=g)
    A_log = torch.empty(Hv).uniform_(lo, hi, generator=g).log()
    dt_bias = torch.full((Hv,), bias) + 0.1 * torch.randn(Hv, generator=g)
    return q, k, v, a, b, A_log, dt_bias


CASES = [  # B, T, Hk, Hv, D, Dv
    (1, 1, 1, 1, 16, 16),
    (1, 63, 2, 2, 32, 16),
    (1, 64, 2, 4, 16, 32),
    (2, 65, 1, 2, 32, 32),
    (1, 130, 2, 2, 16, 16),
    (2, 200, 2, 4, 32, 16),
]


@pytest.mark.parametrize("decay", list(DECAY))
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_chunked_matches_f64_recurrence(case, with_state, decay):
    B, T, Hk, Hv, D, Dv = case
    inputs = gdn_inputs(B, T, Hk, Hv, D, Dv, decay, seed=zlib.crc32(repr((case, with_state, decay)).encode()))
    h0 = torch.randn(B, Hv, D, Dv) * 0.5 if with_state else None
    o, S = gdn_prefill_chunked(*inputs, h0)
    o_ref, S_ref = gdn_prefill_recurrent_f64(*inputs, h0)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    assert o.shape == (B, T, Hv, Dv) and S.shape == (B, Hv, D, Dv)
    assert rel(o, o_ref) < 2e-5
    assert rel(S, S_ref) < 2e-5


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("lens", [[5, 0, 64, 1, 70], [0], [129], [1, 1, 1], [64, 64, 3, 0]])
def test_chunked_varlen_matches_f64_recurrence(lens, with_state):
    Hk, Hv, D, Dv = 2, 4, 16, 32
    T = sum(lens)
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(1, T, Hk, Hv, D, Dv, "mid", seed=len(lens) + T)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    N = len(lens)
    h0 = torch.randn(N, Hv, D, Dv) * 0.5 if with_state else None
    o, S = gdn_prefill_chunked(q, k, v, a, b, A_log, dt_bias, h0, cu)
    o_ref, S_ref = gdn_prefill_recurrent_f64(q, k, v, a, b, A_log, dt_bias, h0, cu)
    assert S.shape == (N, Hv, D, Dv)
    if T:
        assert rel(o, o_ref) < 2e-5
    assert rel(S, S_ref) < 2e-5
    # each packed sequence equals the same sequence run alone
    for n in range(N):
        s, e = cu[n].item(), cu[n + 1].item()
        o1, S1 = gdn_prefill_recurrent_f64(q[:, s:e], k[:, s:e], v[:, s:e], a[:, s:e], b[:, s:e], A_log, dt_bias,
                                           None if h0 is None else h0[n:n + 1])
        assert torch.allclose(o_ref[:, s:e], o1) and torch.allclose(S_ref[n], S1[0])


@pytest.mark.parametrize("segment", [64, 128])
def test_chunked_walks_segments_as_one(segment):
    """Walked a few chunks at a time (the segments' boundaries inside sequences, between them and at a
    sequence's end), the result is the recurrence's, and the output comes back contiguous."""
    lens = [5, 130, 0, 64, 257]
    Hk, Hv, D, Dv = 2, 4, 16, 32
    T = sum(lens)
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(1, T, Hk, Hv, D, Dv, "weak", seed=segment)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    h0 = torch.randn(len(lens), Hv, D, Dv) * 0.5
    o, S = gdn_prefill_chunked(q, k, v, a, b, A_log, dt_bias, h0, cu, segment=segment)
    o_ref, S_ref = gdn_prefill_recurrent_f64(q, k, v, a, b, A_log, dt_bias, h0, cu)
    assert o.is_contiguous() and rel(o, o_ref) < 2e-5 and rel(S, S_ref) < 2e-5
    with pytest.raises(ValueError, match="multiple of 64"):
        gdn_prefill_chunked(q, k, v, a, b, A_log, dt_bias, h0, cu, segment=96)


def _peak_bytes(fn) -> int:
    """The most CPU memory fn() held at once (the profiler's allocations and frees, in order)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        fn()
    now = peak = 0
    for e in sorted((e for e in p.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start):
        now += e.self_cpu_memory_usage
        peak = max(peak, now)
    return peak


def test_chunked_working_set_does_not_grow_with_the_prompt():
    """What the PyTorch path holds beyond its output stays under segment_bytes (what runtime.memory counts for
    it) at any length, instead of ~1.5K fp32 values per token and head for the whole prompt."""
    Hk, Hv, D, Dv, segment = 2, 8, 32, 32, 128
    for T in (256, 2048):
        inputs = gdn_inputs(1, T, Hk, Hv, D, Dv, "mid", dtype=torch.bfloat16, seed=T)
        peak = _peak_bytes(lambda: gdn_prefill_chunked(*inputs, segment=segment))
        output = T * Hv * Dv * 2 + Hv * D * Dv * 4
        assert peak - output <= segment_bytes(Hv, D, Dv, segment), (T, peak, output)


def test_segment_follows_the_device():
    """The CPU walks 256 tokens at a time (its cache); a GPU 1,024 (each segment's small operations are launched
    from Python); the call's default takes its inputs' device, and runtime.memory counts that segment's bytes."""
    from types import SimpleNamespace

    from qwen35_fast.kernels.gdn_prefill import reference
    from qwen35_fast.runtime.memory import reference_gdn_bytes

    assert segment_for(torch.device("cpu")) == segment_for("cpu") == reference.SEGMENT == 256
    assert segment_for(torch.device("cuda", 1)) == segment_for("mps") == reference.GPU_SEGMENT == 1024
    inputs = gdn_inputs(1, 600, 2, 4, 32, 32, "mid", dtype=torch.bfloat16, seed=5)
    o, s = gdn_prefill_chunked(*inputs)
    o256, s256 = gdn_prefill_chunked(*inputs, segment=256)
    assert torch.equal(o, o256) and torch.equal(s, s256)
    o1k, s1k = gdn_prefill_chunked(*inputs, segment=1024)  # the same sums in other segments: within fp32 rounding
    assert rel(o1k.float(), o.float()) < 1e-2 and rel(s1k, s) < 1e-5
    config = SimpleNamespace(linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128)
    # the segment of the device the model runs on: an unloaded model's weights wait on the cpu (its torch backend
    # picked for a GPU; the estimate asks room on that GPU before the weights come back)
    for device, picked, segment in (("cpu", None, 256), ("cuda", None, 1024), ("cpu", "cpu", 256),
                                    ("cpu", "cuda", 1024)):
        model = SimpleNamespace(backend=None, config=config, device=torch.device(device),
                                backend_device=picked and torch.device(picked))
        assert reference_gdn_bytes(model) == segment_bytes(32, 128, 128, segment)
    model = SimpleNamespace(backend=SimpleNamespace(use_cuda=True), config=config, device=torch.device("cuda"),
                            backend_device=torch.device("cuda"))
    assert reference_gdn_bytes(model) == 0


def test_chunked_bf16_inputs():
    inputs = gdn_inputs(1, 150, 2, 4, 32, 32, "mid", dtype=torch.bfloat16, seed=7)
    o, S = gdn_prefill_chunked(*inputs)
    o_ref, S_ref = gdn_prefill_recurrent_f64(*inputs)
    assert o.dtype == torch.bfloat16
    assert rel(o, o_ref) < 1e-2 and rel(S, S_ref) < 2e-5


def test_chunked_rejects_bad_head_ratio():
    inputs = gdn_inputs(1, 8, 3, 4, 16, 16)
    with pytest.raises(ValueError, match=r"^value heads \(4\) must be a multiple of q/k heads \(3\)$"):
        gdn_prefill_chunked(*inputs)


def test_gate_and_beta_formula():
    a, b = torch.randn(5, 3) * 10, torch.randn(5, 3) * 10
    A_log, dt_bias = torch.randn(3), torch.randn(3)
    g, beta = gate_and_beta(a, b, A_log, dt_bias, torch.float64)
    for i in range(5):
        for h in range(3):
            x = a[i, h].item() + dt_bias[h].item()
            sp = x if x > 20 else math.log1p(math.exp(x))
            assert g[i, h].item() == pytest.approx(-math.exp(A_log[h].item()) * sp, rel=1e-6, abs=1e-9)
            assert beta[i, h].item() == pytest.approx(1 / (1 + math.exp(-b[i, h].item())), rel=1e-6)


# ----------------------------------------------------------------------------- decode step

def decode_by_formula(q, k, v, a, b, A_log, dt_bias, state):
    """Straight from the equations, per sequence and head, float64."""
    N, Hk, D = q.shape
    Hv = v.shape[1]
    S = state.double().clone()
    o = torch.empty(N, Hv, v.shape[2], dtype=torch.float64)
    for n in range(N):
        for h in range(Hv):
            hk = h // (Hv // Hk)
            qv, kv = q[n, hk].double(), k[n, hk].double()
            qv = qv / torch.sqrt((qv * qv).sum() + 1e-6) / math.sqrt(D)
            kv = kv / torch.sqrt((kv * kv).sum() + 1e-6)
            x = a[n, h].double() + dt_bias[h].double()
            g = -A_log[h].double().exp() * F.softplus(x)
            beta = torch.sigmoid(b[n, h].double())
            Sh = S[n, h] * g.exp()
            u = beta * (v[n, h].double() - Sh.T @ kv)
            Sh = Sh + torch.outer(kv, u)
            S[n, h] = Sh
            o[n, h] = Sh.T @ qv
    return o, S


@pytest.mark.parametrize("N,Hk,Hv,D,Dv", [(1, 1, 1, 16, 16), (3, 2, 4, 32, 16), (4, 2, 2, 16, 32)])
def test_decode_ref_matches_formula(N, Hk, Hv, D, Dv):
    g = torch.Generator().manual_seed(N * 100 + Hv)
    q, k = torch.randn(N, Hk, D, generator=g), torch.randn(N, Hk, D, generator=g)
    v = torch.randn(N, Hv, Dv, generator=g)
    a, b = torch.randn(N, Hv, generator=g), torch.randn(N, Hv, generator=g)
    A_log, dt_bias = torch.randn(Hv, generator=g), torch.randn(Hv, generator=g)
    state = torch.randn(N, Hv, D, Dv, generator=g)
    o_want, S_want = decode_by_formula(q, k, v, a, b, A_log, dt_bias, state)
    ptr = state.data_ptr()
    o = gdn_decode_step_ref(q, k, v, a, b, A_log, dt_bias, state)
    assert state.data_ptr() == ptr
    assert rel(o, o_want) < 1e-5 and rel(state, S_want) < 1e-5


def test_decode_steps_equal_recurrence():
    """T decode steps from an initial state equal the prefill recurrence over those T tokens."""
    B, T, Hk, Hv, D, Dv = 2, 9, 2, 4, 16, 16
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(B, T, Hk, Hv, D, Dv, "mid", seed=3)
    h0 = torch.randn(B, Hv, D, Dv)
    o_ref, S_ref = gdn_prefill_recurrent_f64(q, k, v, a, b, A_log, dt_bias, h0)
    state = h0.clone()
    for t in range(T):
        o = gdn_decode_step_ref(q[:, t], k[:, t], v[:, t], a[:, t], b[:, t], A_log, dt_bias, state)
        assert rel(o, o_ref[:, t]) < 1e-5
    assert rel(state, S_ref) < 1e-5


# ----------------------------------------------------------------------------- causal conv1d

def conv_by_formula(x, weight, bias, init, lens):
    """Plain loops in float64 over packed sequences x: [T, C]."""
    C, W = weight.shape
    y = torch.empty(x.shape, dtype=torch.float64)
    states = []
    s = 0
    for n, L in enumerate(lens):
        hist = [init[n, :, j].double() if init is not None else torch.zeros(C, dtype=torch.float64)
                for j in range(W - 1)]
        for t in range(s, s + L):
            hist.append(x[t].double())
            acc = sum(weight[:, j].double() * hist[len(hist) - W + j] for j in range(W))
            if bias is not None:
                acc = acc + bias.double()
            y[t] = acc * torch.sigmoid(acc)
        states.append(torch.stack(hist[len(hist) - (W - 1):], dim=1))
        s += L
    return y, torch.stack(states)


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("lens", [[1], [2], [7], [3, 5, 1]])
def test_conv_prefill_ref_matches_formula(lens, with_init, with_bias, W):
    C = 6
    g = torch.Generator().manual_seed(sum(lens) * 10 + W)
    T = sum(lens)
    x = torch.randn(1, T, C, generator=g)
    weight, bias = torch.randn(C, W, generator=g), torch.randn(C, generator=g) if with_bias else None
    init = torch.randn(len(lens), C, W - 1, generator=g) if with_init else None
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    y, st = causal_conv1d_prefill_ref(x, weight, bias, init, cu)
    y_want, st_want = conv_by_formula(x[0], weight, bias, init, lens)
    assert torch.allclose(y[0].double(), y_want, atol=1e-5)
    assert torch.equal(st.double(), st_want)
    if len(lens) == 1:  # the batched form agrees with the packed form
        y2, st2 = causal_conv1d_prefill_ref(x, weight, bias, init, None)
        assert torch.equal(y, y2) and torch.equal(st, st2)


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("lens", [[0, 3, 0, 2], [2, 0], [0]])
def test_conv_prefill_ref_with_empty_sequences(lens, W):
    """Empty sequences among packed ones (a batch's prompt that was all cached): each keeps its own initial state
    and takes no token, and the others' outputs and states are the formula's, a sequence shorter than the filter
    keeping the tail of its initial state too."""
    C = 5
    g = torch.Generator().manual_seed(len(lens) * 10 + W)
    x = torch.randn(1, sum(lens), C, generator=g)
    weight, bias = torch.randn(C, W, generator=g), torch.randn(C, generator=g)
    init = torch.randn(len(lens), C, W - 1, generator=g)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    y, st = causal_conv1d_prefill_ref(x, weight, bias, init, cu)
    y_want, st_want = conv_by_formula(x[0], weight, bias, init, lens)
    assert st.shape == (len(lens), C, W - 1) and torch.equal(st.double(), st_want)
    assert torch.allclose(y[0].double(), y_want, atol=1e-5)
    for n, length in enumerate(lens):
        if length == 0:
            assert torch.equal(st[n], init[n])


@pytest.mark.parametrize("W", [2, 4, 5])
@pytest.mark.parametrize("with_init", [False, True])
def test_conv_states_ref_is_the_prefill_state_at_each_point(W, with_init):
    """The state after e tokens is what a prefill over the first e tokens leaves (0 tokens: the initial state);
    points outside 0..T are clamped."""
    T, C = 9, 5
    g = torch.Generator().manual_seed(W * 2 + with_init)
    x = torch.randn(1, T, C, generator=g).bfloat16()
    init = torch.randn(1, C, W - 1, generator=g).bfloat16() if with_init else None
    ends = torch.tensor([0, 1, W - 2, W - 1, 5, T, -3, T + 4])
    got = causal_conv1d_states_ref(x, init, ends, W)
    assert got.shape == (len(ends), C, W - 1) and got.dtype == x.dtype
    weight = torch.randn(C, W, generator=g)
    for s, e in enumerate(ends.clamp(0, T).tolist()):
        want = (init[0] if init is not None else torch.zeros(C, W - 1, dtype=x.dtype)) if e == 0 else \
            causal_conv1d_prefill_ref(x[:, :e], weight, None, init)[1][0]
        assert torch.equal(got[s], want), f"state after {e} tokens"


@pytest.mark.parametrize("with_bias", [False, True])
def test_conv_update_ref_matches_prefill(with_bias):
    """Feeding tokens one at a time through the update equals one prefill over them."""
    N, T, C, W = 3, 6, 5, 4
    g = torch.Generator().manual_seed(11)
    x = torch.randn(N, T, C, generator=g)
    weight, bias = torch.randn(C, W, generator=g), torch.randn(C, generator=g) if with_bias else None
    init = torch.randn(N, C, W - 1, generator=g)
    y_want, st_want = causal_conv1d_prefill_ref(x, weight, bias, init, None)
    state = init.clone()
    for t in range(T):
        y = causal_conv1d_update_ref(x[:, t], state, weight, bias)
        assert torch.allclose(y, y_want[:, t], atol=1e-6)
    assert torch.equal(state, st_want)


# ----------------------------------------------------------------------------- RMSNorm

def test_rms_norm_ref_matches_formula():
    """x / sqrt(mean(x^2) + eps) * (1 + w) in float64, rounded once to the input dtype."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(64, generator=g) * 0.3
    xd = x.double()
    want = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w.double())
    got = kernels.rms_norm(x, w, 1e-6)
    assert got.dtype == torch.bfloat16 and rel(got, want) < 4e-3


def test_gated_rms_norm_ref_matches_formula():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 9, 3, 128, generator=g)
    gate = torch.randn(2, 9, 3, 128, generator=g)
    w = torch.rand(128, generator=g)
    xd, gd = x.double(), gate.double()
    want = w.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * gd * torch.sigmoid(gd)
    assert rel(kernels.gated_rms_norm(x, gate, w, 1e-6), want) < 1e-6


def test_norm_ops_pass_opcheck():
    """The norms are torch custom ops with fake implementations (what torch.compile traces through)."""
    from qwen35_fast.kernels import ops
    x, gate = torch.randn(4, 2, 128), torch.randn(4, 2, 128)
    w = torch.rand(128)
    torch.library.opcheck(ops.rms_norm_op, (x, w, 1e-6, False))
    torch.library.opcheck(ops.gated_rms_norm_op, (x, gate, w, 1e-6, False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norms_are_transformers_norms_bit_for_bit(dtype):
    """The model's RMSNorm and the GDN output's gated norm equal transformers' Qwen3_5RMSNorm /
    Qwen3_5RMSNormGated bit for bit in each dtype (where each rounds to the activations' dtype matters in bf16),
    with a non-default eps."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

    from qwen35_fast.kernels.rms_norm.reference import gated_rms_norm_ref, rms_norm_ref
    g = torch.Generator().manual_seed(3)
    x, gate = (torch.randn(64, 128, generator=g) * 3).to(dtype), torch.randn(64, 128, generator=g).to(dtype)
    eps = 0.5  # large beside the rows' mean square: a dropped eps shows
    norm, gated = Qwen3_5RMSNorm(128, eps=eps), Qwen3_5RMSNormGated(128, eps=eps)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3, generator=g)
        gated.weight.normal_(1, 0.3, generator=g)
        assert torch.equal(rms_norm_ref(x, norm.weight, eps), norm(x))
        w = gated.weight.to(dtype)  # the model keeps the gated norm's weight in its dtype
        gated.weight.data = w.float() if dtype == torch.float32 else w
        assert torch.equal(gated_rms_norm_ref(x, gate, w, eps), gated(x, gate))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_norm_and_rotary_are_transformers_q_norm_and_rotary_bit_for_bit(dtype):
    """rms_norm_rope_ref (what the attention layers run on q and k without the fused kernel) equals transformers'
    Qwen3.5 attention: q_norm (Qwen3_5RMSNorm), then apply_rotary_pos_emb with the cos / sin its rotary embedding
    makes for M-RoPE positions (three position rows that differ, interleaved sections, a quarter of the head
    rotated), bit for bit in each dtype; with a non-default eps."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5RMSNorm,
        Qwen3_5TextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from qwen35_fast.kernels.rms_norm.reference import rms_norm_rope_ref

    from _models import tiny_config
    g = torch.Generator().manual_seed(4)
    B, T, H, hd = 1, 37, 4, 256
    q = (torch.randn(B, T, H, hd, generator=g) * 3).to(dtype)
    k = (torch.randn(B, T, 2, hd, generator=g) * 3).to(dtype)
    eps = 0.5
    norm = Qwen3_5RMSNorm(hd, eps=eps)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3, generator=g)
    positions = torch.stack([torch.arange(T) * 3, torch.arange(T) // 2, torch.arange(T) % 7]).view(3, 1, T) + 1000
    cos, sin = Qwen3_5TextRotaryEmbedding(tiny_config().text_config)(q, positions)
    assert cos.dtype == dtype and cos.shape == (1, T, hd // 4)
    with torch.no_grad():
        want_q, want_k = apply_rotary_pos_emb(norm(q).transpose(1, 2), norm(k).transpose(1, 2), cos, sin)
        got_q = rms_norm_rope_ref(q, norm.weight, eps, cos[0], sin[0])
        got_k = rms_norm_rope_ref(k, norm.weight, eps, cos[0], sin[0])
    assert torch.equal(got_q, want_q.transpose(1, 2)) and torch.equal(got_k, want_k.transpose(1, 2))
    assert not torch.equal(got_q[..., : hd // 4], norm(q)[..., : hd // 4])  # the rotary turned something


@pytest.mark.parametrize("packed", [False, True])
def test_gdn_and_conv_ops_pass_opcheck(packed):
    """The GDN and conv ops' fakes (what torch.compile plans with) say the real outputs' shapes and dtypes: a
    bf16 prefill's state is fp32, a packed call has one state per sequence (cu_seqlens' length less one)."""
    from qwen35_fast.kernels import ops
    g = torch.Generator().manual_seed(7)
    B, T, Hk, Hv, D, C, W = (1, 12, 1, 2, 16, 24, 4) if packed else (2, 12, 1, 2, 16, 24, 4)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32) if packed else None
    N = 2
    bf = dict(dtype=torch.bfloat16)
    q, k = torch.randn(B, T, Hk, D, generator=g).to(**bf), torch.randn(B, T, Hk, D, generator=g).to(**bf)
    v, a, b = (torch.randn(B, T, Hv, D, generator=g).to(**bf), torch.randn(B, T, Hv, generator=g).to(**bf),
               torch.randn(B, T, Hv, generator=g).to(**bf))
    A_log, dt_bias = torch.rand(Hv, generator=g), torch.rand(Hv, generator=g)
    h0 = torch.randn(N, Hv, D, D, generator=g)
    x, w = torch.randn(B, T, C, generator=g).to(**bf), torch.randn(C, W, generator=g).to(**bf)
    conv0 = torch.randn(N, C, W - 1, generator=g).to(**bf)
    utils = ("test_schema", "test_faketensor")
    for h in (None, h0):
        torch.library.opcheck(ops.gdn_chunk_prefill_op, (q, k, v, a, b, A_log, dt_bias, h, cu, False), test_utils=utils)
    if not packed:  # the states kept on the way: one sequence, [len(keep), Hv, D, Dv] fp32
        one = [x[:1] for x in (q, k, v, a, b)]
        torch.library.opcheck(ops.gdn_chunk_prefill_keep_op, (*one, A_log, dt_bias, h0[:1], [0, 0], False),
                              test_utils=utils)
    for init in (None, conv0):
        torch.library.opcheck(ops.causal_conv1d_prefill_op, (x, w, None, init, cu, False), test_utils=utils)
    torch.library.opcheck(ops.gdn_decode_step_op, (q[:1, 0], k[:1, 0], v[:1, 0], a[:1, 0], b[:1, 0], A_log,
                                                   dt_bias, h0[:1].clone(), False), test_utils=utils)
    torch.library.opcheck(ops.causal_conv1d_update_op, (x[:1, 0], conv0[:1].clone(), w, None, False),
                          test_utils=utils)


def test_ops_return_contiguous_outputs_as_their_fakes_say():
    """The CUDA launchers return contiguous tensors; so do the reference paths and the fakes (torch.compile
    plans with the fake's strides), for a dense input in another order too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qwen35_fast.kernels import ops
    x = torch.randn(2, 4, 128).transpose(0, 1)  # dense, not contiguous
    gate, w = torch.randn(4, 2, 128), torch.rand(128)
    xc = torch.randn(3, 2, 16).transpose(0, 1)  # [B, T, C] = [2, 3, 16], dense, not contiguous
    wc = torch.randn(16, 4)
    cases = [(ops.rms_norm_op, (x, w, 1e-6, False)), (ops.gated_rms_norm_op, (x, gate, w, 1e-6, False)),
             (ops.causal_conv1d_prefill_op, (xc, wc, None, None, None, False))]
    for op, args in cases:
        real = op(*args)
        real = real[0] if isinstance(real, tuple) else real
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        fake = fake[0] if isinstance(fake, tuple) else fake
        assert real.is_contiguous() and fake.stride() == real.stride(), op
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_conv_prefill_takes_conv1d_weights_and_its_fake_agrees():
    """nn.Conv1d's [C, 1, W] weight, which the CUDA launcher takes, gives the [C, W] weight's result in the
    reference too, and the op's fake (what torch.compile traces) has the real state's shape for both."""
    from qwen35_fast.kernels import ops
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(1, 9, 6, generator=g), torch.randn(6, 4, generator=g)
    y, st = causal_conv1d_prefill_ref(x, w)
    y3, st3 = causal_conv1d_prefill_ref(x, w[:, None])
    assert torch.equal(y, y3) and torch.equal(st, st3) and st.shape == (1, 6, 3)
    for weight in (w, w[:, None]):
        _, fake_state = ops._conv_prefill_fake(x, weight, None, None, None, False)
        assert fake_state.shape == st.shape


def test_the_residual_adds_return_the_sum_in_the_activations_dtype():
    """add_rms_norm_ref / add_layer_norm_ref: s = res + x rounded to x's dtype (as the kernels and the ops'
    fakes give it), whatever dtype the residual has, and the norm of that rounded sum: each output within one
    bf16 rounding of its formula in float64 (zero-centred RMSNorm x / sqrt(mean x^2 + eps) * (1 + w); LayerNorm
    (x - mean) / sqrt(var + eps) * w + b), with an eps large enough that dropping it shows."""
    from qwen35_fast.kernels.rms_norm.reference import add_rms_norm_ref
    from qwen35_fast.kernels.vision.reference import add_layer_norm_ref
    g = torch.Generator().manual_seed(3)
    res, x = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g).bfloat16()
    w, b = torch.randn(64, generator=g) * 0.3, torch.randn(64, generator=g) * 0.3
    lw, lb = (1 + w).bfloat16(), b.bfloat16()  # the LayerNorm's weights, in the activations' dtype
    eps = 1.0  # the rows' mean square is about 2
    one_rounding = dict(rtol=2 ** -8, atol=1e-6)

    def rms(s, eps):
        s = s.double()
        return s / (s.pow(2).mean(-1, keepdim=True) + eps).sqrt() * (1 + w.double())

    def layer(s, eps):
        s = s.double()
        c = s - s.mean(-1, keepdim=True)
        return c / (c.pow(2).mean(-1, keepdim=True) + eps).sqrt() * lw.double() + lb.double()

    s, y = add_rms_norm_ref(res, x, w, eps)
    assert s.dtype == y.dtype == torch.bfloat16 and torch.equal(s, (res + x.float()).bfloat16())
    assert torch.allclose(y.double(), rms(s, eps), **one_rounding)
    assert not torch.allclose(y.double(), rms(s, 1e-6), **one_rounding)
    s, y = add_layer_norm_ref(x, res, lw, lb, eps)
    assert s.dtype == y.dtype == torch.bfloat16 and torch.equal(s, (x.float() + res).bfloat16())
    assert torch.allclose(y.double(), layer(s, eps), **one_rounding)
    assert not torch.allclose(y.double(), layer(s, 1e-6), **one_rounding)


@pytest.mark.parametrize("shape", [(0, 128), (1, 0, 128), (2, 0, 4, 128)])
def test_the_norm_launchers_take_no_rows(shape):
    """rms_norm.cu's launcher with no rows (a 2-D [0, D] or a batch of no tokens) returns empty results as the
    references do, before any kernel is built (so on the CPU too): the [R, H, D] view it forms of x must not
    take the token dimension of a 2-D x, 0 here, for H."""
    from qwen35_fast.kernels.rms_norm.launch import (
        add_rms_norm_cuda,
        gated_rms_norm_cuda,
        rms_norm_cuda,
        rms_norm_rope_cuda,
    )
    x, w = torch.empty(shape, dtype=torch.bfloat16), torch.rand(128)
    same = lambda t: t.shape == shape and t.dtype == x.dtype  # noqa: E731  (as the ops' fakes say: x's dtype)
    assert same(rms_norm_cuda(x, w, 1e-6))
    assert same(gated_rms_norm_cuda(x, x, w, 1e-6))
    s, y = add_rms_norm_cuda(x, x, w, 1e-6)
    assert same(s) and same(y)
    if len(shape) == 4:
        cos = torch.empty(0, 64, dtype=torch.bfloat16)
        assert same(rms_norm_rope_cuda(x, w, 1e-6, cos, cos))


def test_the_launchers_fallbacks_return_contiguous_outputs_as_the_fakes_say():
    """Where a CUDA launcher hands a call to the reference (a dtype or a weight it does not take), its result is
    contiguous like the kernel's and like the op's fake (what torch.compile plans the graph's strides with), for
    a dense input in another order too; the launchers' checks run before any kernel is built (so on the CPU)."""
    from qwen35_fast.kernels.rms_norm.launch import add_rms_norm_cuda, gated_rms_norm_cuda, rms_norm_cuda
    from qwen35_fast.kernels.silu_mul.launch import silu_mul_cuda
    from qwen35_fast.kernels.vision.launch import add_layer_norm_cuda, layer_norm_cuda
    x = torch.randn(4, 3, 64).transpose(0, 1)  # fp32: the kernels take bf16 / fp16
    w, b = torch.rand(64), torch.rand(64)
    outs = [rms_norm_cuda(x, w, 1e-6), gated_rms_norm_cuda(x, x, w, 1e-6), *add_rms_norm_cuda(x, x, w, 1e-6),
            silu_mul_cuda(torch.randn(4, 3, 128).transpose(0, 1)), layer_norm_cuda(x, w, b, 1e-6),
            *add_layer_norm_cuda(x, x, w, b, 1e-6)]
    xb = x.bfloat16()  # bf16, with a weight of another 16-bit type, which the kernel does not take
    outs += [rms_norm_cuda(xb, w.half(), 1e-6), *add_rms_norm_cuda(xb, xb, w.half(), 1e-6)]
    for i, t in enumerate(outs):
        assert t.is_contiguous(), (i, t.stride())


def test_conv_update_takes_conv1d_weights_as_its_launcher_does():
    """nn.Conv1d's [C, 1, W] weight, which the CUDA launchers and the prefill reference take, gives the [C, W]
    weight's step in the update reference too (it broadcast to [N, C, C] before, or failed)."""
    g = torch.Generator().manual_seed(8)
    w = torch.randn(6, 4, generator=g)
    for n in (1, 2):
        x, state = torch.randn(n, 6, generator=g), torch.randn(n, 6, 3, generator=g)
        s2, s3 = state.clone(), state.clone()
        y = causal_conv1d_update_ref(x, s2, w)
        assert torch.equal(causal_conv1d_update_ref(x, s3, w[:, None]), y) and torch.equal(s3, s2)


@pytest.mark.parametrize("T,keep,segment,with_h0", [(300, [64, 128, 256], 256, True), (130, [0, 128, 64, 64], 64, False),
                                                    (1000, [576, 960], 256, True), (64, [0], 64, True)])
def test_gdn_chunked_keeps_the_states_of_the_prefixes(T, keep, segment, with_h0):
    """keep: the state after each of those token counts (against the f64 recurrence over the prefix), from the
    same walk: o and the final state as without keep, bit for bit (the walk is cut on chunk boundaries only)."""
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(1, T, 1, 2, 32, 32, seed=T)
    h0 = torch.randn(1, 2, 32, 32, generator=torch.Generator().manual_seed(1)) * 0.1 if with_h0 else None
    o, ht, hk = gdn_prefill_chunked(q, k, v, a, b, A_log, dt_bias, h0, segment=segment, keep=keep)
    o0, ht0 = gdn_prefill_chunked(q, k, v, a, b, A_log, dt_bias, h0, segment=segment)
    assert torch.equal(o, o0) and torch.equal(ht, ht0) and hk.shape == (len(keep), 2, 32, 32)
    for e, c in enumerate(keep):
        want = (h0[0] if h0 is not None else torch.zeros(2, 32, 32)) if c == 0 else gdn_prefill_recurrent_f64(
            *(x[:, :c] for x in (q, k, v, a, b)), A_log, dt_bias, h0)[1][0]
        assert rel(hk[e], want) < 1e-5, (e, c)
    got = kernels.gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, h0, keep=keep)  # the op, on the reference
    assert all(torch.equal(x, y) for x, y in zip(got, gdn_prefill_chunked(q, k, v, a, b, A_log, dt_bias, h0, keep=keep)))


@pytest.mark.parametrize("keep,cu,match", [([32], None, "multiples of 64"), ([128], None, "0 .. 99"),
                                           ([0] * 9, None, "at most 8"), ([0], [0, 50, 100], "cu_seqlens")])
def test_gdn_keep_is_checked(keep, cu, match):
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(1, 100, 1, 2, 16, 16)
    cu = torch.tensor(cu, dtype=torch.int32) if cu else None
    with pytest.raises(ValueError, match=match):
        kernels.gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, cu_seqlens=cu, keep=keep)
