"""CUDA kernels against the PyTorch references on a GPU (decode step, causal conv1d prefill and update,
the RMSNorms).

Fresh random inputs per case; the caching allocator is filled with NaN before each launch so that an
output element the kernel forgets to write shows up; states are checked to be updated in place.
"""
import zlib

import pytest
import torch

from qwen35_fast import kernels
from qwen35_fast.kernels.conv1d.reference import (
    causal_conv1d_prefill_ref,
    causal_conv1d_states_ref,
    causal_conv1d_update_ref,
)
from qwen35_fast.kernels.gdn_decode.reference import gdn_decode_step_ref
from qwen35_fast.kernels.rms_norm.reference import (
    add_rms_norm_ref,
    gated_rms_norm_ref,
    rms_norm_ref,
    rms_norm_rope_ref,
    rope_ref,
)
from qwen35_fast.kernels.silu_mul.reference import silu_mul_ref

from _models import poison_allocator, rel

pytestmark = pytest.mark.gpu
DEV = "cuda"


TOL_OUT = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


# ----------------------------------------------------------------------------- decode step

def decode_inputs(N, Hk, Hv, D, Dv, dtype, gate_dtype, param_dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=DEV)  # noqa: E731
    q, k, v = r(N, Hk, D).to(dtype) * 3, r(N, Hk, D).to(dtype), r(N, Hv, Dv).to(dtype)
    a, b = (r(N, Hv) * 2).to(gate_dtype), (r(N, Hv) * 2).to(gate_dtype)
    A_log = torch.empty(Hv, device=DEV).uniform_(1, 16, generator=g).log().to(param_dtype)
    dt_bias = (r(Hv) * 0.5 + 1).to(param_dtype)
    state = r(N, Hv, D, Dv) * 0.3
    return q, k, v, a, b, A_log, dt_bias, state


DECODE_CASES = [  # N, Hk, Hv, D, Dv
    (1, 16, 32, 128, 128), (3, 16, 32, 128, 128), (8, 16, 32, 128, 128), (33, 16, 32, 128, 128),
    (2, 4, 4, 128, 128), (5, 2, 8, 64, 64), (4, 1, 2, 128, 64), (2, 2, 2, 32, 96),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype,gate_dtype,param_dtype", [
    (torch.bfloat16, torch.bfloat16, torch.float32), (torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.float16, torch.float16, torch.float16), (torch.float32, torch.float32, torch.float32)])
def test_decode_matches_reference(impl, case, dtype, gate_dtype, param_dtype):
    N, Hk, Hv, D, Dv = case
    for rep in range(2):  # fresh inputs each time
        seed = zlib.crc32(repr((case, dtype, gate_dtype, rep)).encode())  # the same in every process
        q, k, v, a, b, A_log, dt_bias, state = decode_inputs(N, Hk, Hv, D, Dv, dtype, gate_dtype, param_dtype,
                                                             seed=seed)
        state_ref = state.clone()
        o_ref = gdn_decode_step_ref(q, k, v, a, b, A_log, dt_bias, state_ref)
        ptr = state.data_ptr()
        poison_allocator(((N, Hv, Dv), dtype))
        o = impl.gdn_decode_step_cuda(q, k, v, a, b, A_log, dt_bias, state)
        torch.cuda.synchronize()
        assert state.data_ptr() == ptr
        assert o.shape == (N, Hv, Dv) and o.dtype == dtype
        assert not o.isnan().any() and not state.isnan().any()
        assert rel(state, state_ref) < 1e-5
        assert rel(o, o_ref) < TOL_OUT[dtype]


def test_decode_strided_inputs(impl):
    """q, k, v sliced out of one projection output (sequence stride larger than the row)."""
    N, Hk, Hv, D = 6, 16, 32, 128
    qkv = torch.randn(N, 2 * Hk * D + Hv * D, device=DEV, dtype=torch.bfloat16)
    q = qkv[:, :Hk * D].view(N, Hk, D)
    k = qkv[:, Hk * D:2 * Hk * D].view(N, Hk, D)
    v = qkv[:, 2 * Hk * D:].view(N, Hv, D)
    ab = torch.randn(N, 2 * Hv, device=DEV, dtype=torch.bfloat16)
    a, b = ab[:, :Hv], ab[:, Hv:]
    A_log, dt_bias = torch.rand(Hv, device=DEV) + 0.5, torch.randn(Hv, device=DEV)
    state = torch.randn(N, Hv, D, D, device=DEV) * 0.3
    state_ref = state.clone()
    o_ref = gdn_decode_step_ref(q, k, v, a, b, A_log, dt_bias, state_ref)
    poison_allocator(((N, Hv, D), torch.bfloat16))
    o = impl.gdn_decode_step_cuda(q, k, v, a, b, A_log, dt_bias, state)
    assert not o.isnan().any() and rel(state, state_ref) < 1e-5 and rel(o, o_ref) < 1e-2


def test_decode_many_steps_stay_close(impl):
    """64 steps: errors must not grow (the state feeds back)."""
    N, Hk, Hv, D = 4, 16, 32, 128
    q, k, v, a, b, A_log, dt_bias, state = decode_inputs(N, Hk, Hv, D, D, torch.bfloat16, torch.bfloat16,
                                                         torch.float32, seed=5)
    state_ref = state.clone()
    for t in range(64):
        q, k, v = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
        a, b = torch.randn_like(a), torch.randn_like(b)
        o_ref = gdn_decode_step_ref(q, k, v, a, b, A_log, dt_bias, state_ref)
        poison_allocator(((N, Hv, D), torch.bfloat16))  # each step's output starts as NaN
        o = impl.gdn_decode_step_cuda(q, k, v, a, b, A_log, dt_bias, state)
        assert not o.isnan().any() and not state.isnan().any(), t
    assert rel(state, state_ref) < 1e-4 and rel(o, o_ref) < 1e-2


# ----------------------------------------------------------------------------- causal conv1d

def conv_inputs(B, T, C, W, dtype, wdtype, seed, with_bias, with_init, N):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(B, T, C, generator=g, device=DEV).to(dtype)
    weight = (torch.randn(C, W, generator=g, device=DEV) * 0.5).to(wdtype)
    bias = torch.randn(C, generator=g, device=DEV).to(wdtype) if with_bias else None
    init = torch.randn(N, C, W - 1, generator=g, device=DEV).to(dtype) if with_init else None
    return x, weight, bias, init


def check_conv(y, st, y_ref, st_ref, dtype):
    assert not y.isnan().any() and not st.isnan().any()
    assert y.dtype == dtype and st.dtype == dtype
    assert torch.equal(st, st_ref), "final conv state must be the exact last inputs"
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("T", [1, 2, 3, 5, 64, 203, 1000])
@pytest.mark.parametrize("C", [8, 200, 1001, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_bias,with_init", [(False, False), (True, True), (True, False), (False, True)])
def test_conv_prefill_matches_reference(impl, T, C, dtype, with_bias, with_init):
    B, W = 2, 4
    x, weight, bias, init = conv_inputs(B, T, C, W, dtype, dtype, zlib.crc32(repr((T, C, dtype, with_bias)).encode()),
                                        with_bias, with_init, B)
    y_ref, st_ref = causal_conv1d_prefill_ref(x, weight, bias, init)
    poison_allocator(((B, T, C), dtype), ((B, C, W - 1), dtype))
    y, st = impl.causal_conv1d_prefill_cuda(x, weight, bias, init)
    torch.cuda.synchronize()
    check_conv(y, st, y_ref, st_ref, dtype)


@pytest.mark.parametrize("lens", [[1000], [3, 2, 1, 7], [100, 1, 64, 257, 2, 900], [65] * 9, [1] * 40])
@pytest.mark.parametrize("with_init", [False, True])
def test_conv_prefill_varlen(impl, lens, with_init):
    C, W, dtype = 8192, 4, torch.bfloat16
    T, N = sum(lens), len(lens)
    x, weight, bias, init = conv_inputs(1, T, C, W, dtype, torch.float32, T + N, True, with_init, N)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    y_ref, st_ref = causal_conv1d_prefill_ref(x, weight, bias, init, cu)
    poison_allocator(((1, T, C), dtype), ((N, C, W - 1), dtype))
    y, st = impl.causal_conv1d_prefill_cuda(x, weight, bias, init, cu)
    torch.cuda.synchronize()
    check_conv(y, st, y_ref, st_ref, dtype)


def test_conv_prefill_varlen_empty_sequences(impl):
    """Sequences of 0 tokens keep their initial state (compared with per-sequence reference calls,
    since reference.py cannot take an empty sequence)."""
    C, W, dtype = 1024, 4, torch.bfloat16
    lens = [0, 5, 0, 0, 130, 1, 0]
    T, N = sum(lens), len(lens)
    x, weight, bias, init = conv_inputs(1, T, C, W, dtype, dtype, 9, True, True, N)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    poison_allocator(((1, T, C), dtype), ((N, C, W - 1), dtype))
    y, st = impl.causal_conv1d_prefill_cuda(x, weight, bias, init, cu)
    for n in range(N):
        s, e = cu[n].item(), cu[n + 1].item()
        if s == e:
            assert torch.equal(st[n], init[n])
            continue
        y1, st1 = causal_conv1d_prefill_ref(x[:, s:e], weight, bias, init[n:n + 1])
        check_conv(y[:, s:e], st[n:n + 1], y1, st1, dtype)


def test_conv_prefill_strided_x(impl):
    """x as a channel slice of a wider projection output (token stride > C)."""
    B, T, C, W = 2, 300, 4096, 4
    big = torch.randn(B, T, C + 512, device=DEV, dtype=torch.bfloat16)
    x = big[:, :, 256:256 + C]
    weight = torch.randn(C, 1, W, device=DEV, dtype=torch.bfloat16)  # nn.Conv1d layout
    y_ref, st_ref = causal_conv1d_prefill_ref(x, weight[:, 0], None, None)
    poison_allocator(((B, T, C), torch.bfloat16), ((B, C, W - 1), torch.bfloat16))
    y, st = impl.causal_conv1d_prefill_cuda(x, weight, None, None)
    check_conv(y, st, y_ref, st_ref, torch.bfloat16)


@pytest.mark.parametrize("T", [1, 2, 64, 300])
@pytest.mark.parametrize("C", [8, 1000, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("W,with_init", [(4, True), (4, False), (2, True), (5, True)])
def test_conv_states_match_reference(impl, T, C, dtype, W, with_init):
    """Points at the start, inside the initial state's reach, in the middle, at the end and outside 0..T
    (clamped), on x as a channel slice of a wider projection (token stride > C), as the model passes it."""
    g = torch.Generator(device=DEV).manual_seed(zlib.crc32(repr((T, C, dtype, W, with_init)).encode()))
    for rep in range(2):
        x = torch.randn(1, T, C + 24, generator=g, device=DEV).to(dtype)[:, :, 16:16 + C]
        init = torch.randn(1, C, W - 1, generator=g, device=DEV).to(dtype) if with_init else None
        pts = [0, 1, W - 2, T // 2, T - 1, T, -1, T + 5]
        ends = torch.tensor(pts if rep == 0 else pts[::-1][:3], device=DEV)
        want = causal_conv1d_states_ref(x, init, ends, W)
        poison_allocator(((len(ends), C, W - 1), dtype))
        got = impl.causal_conv1d_states_cuda(x, init, ends.int() if rep else ends, W)
        torch.cuda.synchronize()
        assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("N", [1, 3, 64])
@pytest.mark.parametrize("C", [8, 1000, 8192])
@pytest.mark.parametrize("dtype,state_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                               (torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_conv_update_matches_reference(impl, N, C, dtype, state_dtype, with_bias):
    W = 4
    g = torch.Generator(device=DEV).manual_seed(N * C)
    for rep in range(2):
        x = torch.randn(N, C, generator=g, device=DEV).to(dtype)
        weight = torch.randn(C, W, generator=g, device=DEV).to(dtype)
        bias = torch.randn(C, generator=g, device=DEV).to(dtype) if with_bias else None
        state = torch.randn(N, C, W - 1, generator=g, device=DEV).to(state_dtype)
        state_ref = state.clone()
        y_ref = causal_conv1d_update_ref(x, state_ref, weight, bias)
        ptr = state.data_ptr()
        poison_allocator(((N, C), dtype))
        y = impl.causal_conv1d_update_cuda(x, state, weight, bias)
        torch.cuda.synchronize()
        assert state.data_ptr() == ptr and not y.isnan().any()
        assert torch.equal(state, state_ref)
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol)


def test_conv_update_state_slice_of_cache(impl):
    """The state is a slice of a larger per-slot cache (sequence stride > C*(W-1)), updated in place."""
    N, C, W = 4, 2048, 4
    cache = torch.randn(2 * N, C, W - 1, device=DEV, dtype=torch.bfloat16)
    state = cache[::2]
    x = torch.randn(N, C, device=DEV, dtype=torch.bfloat16)
    weight = torch.randn(C, W, device=DEV, dtype=torch.bfloat16)
    want_state = state.clone()
    y_ref = causal_conv1d_update_ref(x, want_state, weight, None)
    untouched = cache[1::2].clone()
    poison_allocator(((N, C), torch.bfloat16))  # the output starts as NaN
    y = impl.causal_conv1d_update_cuda(x, state, weight, None)
    assert not y.isnan().any()
    assert torch.equal(cache[::2], want_state) and torch.equal(cache[1::2], untouched)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=1.6e-2, atol=1.6e-2)


# ----------------------------------------------------------------------------- RMSNorm

NORM_TOL = {torch.float16: 1e-3, torch.bfloat16: 4e-3}  # relative Frobenius: a last-bit difference here and there


@pytest.mark.parametrize("D", [64, 128, 256, 1024, 2560, 4096, 5120])
@pytest.mark.parametrize("rows", [1, 7, 37, 1000])
@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.float16, torch.float32), (torch.float16, torch.float16)])
def test_rms_norm_matches_reference(impl, D, rows, dtype, wdtype):
    g = torch.Generator(device=DEV).manual_seed(D * rows)
    x = (torch.randn(rows, D, generator=g, device=DEV) * 3).to(dtype)
    w = (torch.randn(D, generator=g, device=DEV) * 0.3).to(wdtype)
    poison_allocator(((rows, D), dtype))
    y = impl.rms_norm_cuda(x, w, 1e-6)
    ref = rms_norm_ref(x, w, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape and not y.isnan().any()
    assert rel(y, ref) < NORM_TOL[dtype]
    assert (y == ref).float().mean() > 0.95  # the same roundings: almost every element bit for bit


@pytest.mark.parametrize("D", [128, 256])
@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                          (torch.float16, torch.float16)])
def test_gated_rms_norm_matches_reference(impl, D, dtype, wdtype):
    g = torch.Generator(device=DEV).manual_seed(D)
    B, T, H = 2, 77, 5
    x = torch.randn(B, T, H, D, generator=g, device=DEV).to(dtype)
    gate = (torch.randn(B, T, H, D, generator=g, device=DEV) * 2).to(dtype)
    w = (1 + 0.2 * torch.randn(D, generator=g, device=DEV)).to(wdtype)
    poison_allocator(((B, T, H, D), dtype))
    y = impl.gated_rms_norm_cuda(x, gate, w, 1e-6)
    ref = gated_rms_norm_ref(x, gate, w, 1e-6)
    assert y.shape == x.shape and not y.isnan().any()
    assert rel(y, ref) < NORM_TOL[dtype]
    assert (y == ref).float().mean() > 0.95


def test_norms_take_strided_views_as_the_model_has_them(impl):
    """Attention's q is one half of a [.., H, 2 hd] projection and GDN's gate z a column slice of the
    input projection: both are read in place (row strides the kernel takes), the result is contiguous."""
    B, T, H, hd = 2, 50, 4, 256
    qg = torch.randn(B, T, H, 2 * hd, device=DEV, dtype=torch.bfloat16)
    q = qg.chunk(2, dim=-1)[0]
    w = torch.randn(hd, device=DEV) * 0.1
    y = impl.rms_norm_cuda(q, w, 1e-6)
    assert y.is_contiguous() and torch.equal(y, impl.rms_norm_cuda(q.contiguous(), w, 1e-6))
    assert rel(y, rms_norm_ref(q, w, 1e-6)) < NORM_TOL[torch.bfloat16]
    Hv, dv = 8, 128
    proj = torch.randn(B, T, 3 * Hv * dv + 16, device=DEV, dtype=torch.bfloat16)
    z = proj[..., Hv * dv:2 * Hv * dv].reshape(B, T, Hv, dv)
    o = torch.randn(B, T, Hv, dv, device=DEV, dtype=torch.bfloat16)
    wn = torch.rand(dv, device=DEV, dtype=torch.bfloat16)
    y = impl.gated_rms_norm_cuda(o, z, wn, 1e-6)
    assert torch.equal(y, impl.gated_rms_norm_cuda(o, z.contiguous(), wn, 1e-6))
    assert rel(y, gated_rms_norm_ref(o, z, wn, 1e-6)) < NORM_TOL[torch.bfloat16]


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_norms_take_weights_not_16_byte_aligned(impl, wdtype):
    """The kernel reads the weight in 16-byte loads: a weight view that starts one element into its storage
    (a slice of a packed tensor) gives what the same weight in a storage of its own gives."""
    g = torch.Generator(device=DEV).manual_seed(11)
    D = 1024
    x = torch.randn(37, D, generator=g, device=DEV, dtype=torch.bfloat16)
    z = torch.randn(37, D, generator=g, device=DEV, dtype=torch.bfloat16)
    packed = (torch.randn(D + 1, generator=g, device=DEV) * 0.3).to(wdtype)
    w = packed[1:]
    assert w.data_ptr() % 16 != 0
    assert torch.equal(impl.rms_norm_cuda(x, w, 1e-6), impl.rms_norm_cuda(x, w.clone(), 1e-6))
    assert torch.equal(impl.gated_rms_norm_cuda(x, z, w, 1e-6), impl.gated_rms_norm_cuda(x, z, w.clone(), 1e-6))
    s, y = impl.add_rms_norm_cuda(z, x, w, 1e-6)
    assert torch.equal(y, impl.add_rms_norm_cuda(z, x, w.clone(), 1e-6)[1])
    assert rel(y, rms_norm_ref(s, w, 1e-6)) < NORM_TOL[torch.bfloat16]


def _rope_tables(T, rd, dtype, g):
    angles = torch.rand(T, rd // 2, generator=g, device=DEV) * 100
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("D,rd", [(256, 64), (128, 32), (128, 64), (64, 16)])
@pytest.mark.parametrize("T,H", [(1, 16), (5, 4), (300, 16)])
@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_rms_norm_rope_is_the_norm_kernel_then_the_rotary(impl, D, rd, T, H, dtype, wdtype):
    """The fused q / k norm + rotary gives, bit for bit, rms_norm_cuda followed by the rotary's PyTorch
    expression (the same roundings: the norm rounded, each product and the sum rounded); against the
    all-PyTorch reference it differs only where the norm does (NORM_TOL)."""
    g = torch.Generator(device=DEV).manual_seed(D * T + rd)
    qg = (torch.randn(1, T, H, 2 * D, generator=g, device=DEV) * 3).to(dtype)
    q = qg.chunk(2, dim=-1)[0]  # strided, as the model's q
    w = (torch.randn(D, generator=g, device=DEV) * 0.3).to(wdtype)
    cos, sin = _rope_tables(T, rd, dtype, g)
    poison_allocator(((1, T, H, D), dtype))
    y = impl.rms_norm_rope_cuda(q, w, 1e-6, cos, sin)
    assert y.shape == q.shape and y.is_contiguous() and not y.isnan().any()
    assert torch.equal(y, rope_ref(impl.rms_norm_cuda(q, w, 1e-6), cos, sin))
    ref = rms_norm_rope_ref(q, w, 1e-6, cos, sin)
    assert rel(y, ref) < NORM_TOL[dtype] and (y == ref).float().mean() > 0.95


def test_rms_norm_rope_falls_back_where_the_kernel_does_not_apply(impl):
    """Rotary widths the kernel does not take (not a multiple of 16, a sixteenth not a power of two, past the
    first warp's vectors), fp32, and cos / sin of another dtype run the reference exactly (in x's dtype, as the
    op's fake says)."""
    g = torch.Generator(device=DEV).manual_seed(3)
    for D, rd, dtype, cdtype in [(256, 24, torch.bfloat16, torch.bfloat16), (256, 48, torch.bfloat16, torch.bfloat16),
                                 (2048, 512, torch.bfloat16, torch.bfloat16), (128, 32, torch.float32, torch.float32),
                                 (128, 32, torch.bfloat16, torch.float32)]:
        x = torch.randn(1, 9, 4, D, generator=g, device=DEV).to(dtype)
        w = torch.randn(D, generator=g, device=DEV) * 0.1
        cos, sin = _rope_tables(9, rd, cdtype, g)
        assert torch.equal(impl.rms_norm_rope_cuda(x, w, 1e-6, cos, sin),
                           rms_norm_rope_ref(x, w, 1e-6, cos, sin).to(dtype))


def test_rms_norm_rope_takes_cos_sin_at_an_odd_offset(impl):
    """cos / sin viewed 8 bytes into their storage (contiguous, not 16-byte aligned; the kernel reads them in
    16-byte vectors) give what aligned copies give."""
    g = torch.Generator(device=DEV).manual_seed(8)
    x = torch.randn(1, 7, 4, 128, generator=g, device=DEV).bfloat16()
    w = torch.randn(128, generator=g, device=DEV) * 0.3
    cos, sin = _rope_tables(7, 32, torch.bfloat16, g)
    odd = [torch.empty(t.numel() + 4, dtype=t.dtype, device=DEV)[4:].view(t.shape).copy_(t) for t in (cos, sin)]
    assert all(t.data_ptr() % 16 == 8 for t in odd)
    assert torch.equal(impl.rms_norm_rope_cuda(x, w, 1e-6, *odd), impl.rms_norm_rope_cuda(x, w, 1e-6, cos, sin))


def test_decode_refuses_a_state_it_cannot_update_in_place(impl):
    """The decode step updates its fp32 state in place in 16-byte vectors: a state viewed 8 bytes into its
    storage is refused by name (a copy would not be the caller's state), and nothing is written."""
    q, k, v, a, b, A_log, dt_bias, state = decode_inputs(2, 2, 4, 128, 128, torch.bfloat16, torch.bfloat16,
                                                         torch.float32, 4)
    odd = torch.empty(state.numel() + 2, device=DEV)[2:].view(state.shape).copy_(state)
    with pytest.raises(ValueError, match="16-byte boundary"):
        impl.gdn_decode_step_cuda(q, k, v, a, b, A_log, dt_bias, odd)
    assert torch.equal(odd, state)


def test_conv_prefill_of_no_channels_launches_nothing(impl):
    """C = 0 (no channels): empty outputs of the right shapes, no grid of 0 blocks."""
    x = torch.empty(1, 5, 0, device=DEV, dtype=torch.bfloat16)
    y, final = impl.causal_conv1d_prefill_cuda(x, torch.empty(0, 4, device=DEV, dtype=torch.bfloat16))
    assert y.shape == (1, 5, 0) and final.shape == (1, 0, 3)

@pytest.mark.parametrize("D", [1024, 2048, 4096, 5120])
@pytest.mark.parametrize("rows", [1, 37, 1000])
@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_add_rms_norm_is_the_add_then_the_norm_kernel(impl, D, rows, dtype, wdtype):
    """The residual add and the norm in one pass: the sum bit for bit torch's add, the norm bit for bit the
    norm kernel's on that sum (and within NORM_TOL of the reference)."""
    g = torch.Generator(device=DEV).manual_seed(D + rows)
    res = (torch.randn(1, rows, D, generator=g, device=DEV) * 4).to(dtype)
    x = torch.randn(1, rows, D, generator=g, device=DEV).to(dtype)
    w = (torch.randn(D, generator=g, device=DEV) * 0.3).to(wdtype)
    poison_allocator(((1, rows, D), dtype))
    s, y = impl.add_rms_norm_cuda(res, x, w, 1e-6)
    assert torch.equal(s, res + x) and not y.isnan().any()
    assert torch.equal(y, impl.rms_norm_cuda(res + x, w, 1e-6))
    assert rel(y, add_rms_norm_ref(res, x, w, 1e-6)[1]) < NORM_TOL[dtype]


@pytest.mark.parametrize("I", [8, 64, 12288, 17408])
@pytest.mark.parametrize("rows", [1, 5, 700])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_is_the_pytorch_expression_bit_for_bit(impl, I, rows, dtype):
    g = torch.Generator(device=DEV).manual_seed(I + rows)
    gu = (torch.randn(1, rows, 2 * I, generator=g, device=DEV) * 4).to(dtype)
    poison_allocator(((1, rows, I), dtype))
    y = impl.silu_mul_cuda(gu)
    assert y.shape == (1, rows, I) and torch.equal(y, silu_mul_ref(gu))


def test_silu_mul_falls_back_where_the_kernel_does_not_apply(impl):
    """fp32, halves that are not a multiple of 8 and rows that are not 16-byte aligned run the reference."""
    g = torch.Generator(device=DEV).manual_seed(5)
    for gu in (torch.randn(3, 64, generator=g, device=DEV), torch.randn(3, 20, generator=g, device=DEV).bfloat16(),
               torch.randn(3, 130, generator=g, device=DEV).bfloat16()[:, 1:129]):
        assert torch.equal(impl.silu_mul_cuda(gu), silu_mul_ref(gu))


def test_norms_fall_back_where_the_kernel_does_not_apply(impl):
    """fp32 inputs and row lengths the kernel does not take (not a multiple of 8, D / 8 neither dividing
    nor a multiple of 32, above MAX_D) give the reference's result exactly; zero rows give an empty result."""
    for D, dtype in [(4096, torch.float32), (100, torch.bfloat16), (96, torch.bfloat16), (8192, torch.bfloat16)]:
        x = torch.randn(3, D, device=DEV, dtype=dtype)
        w = torch.randn(D, device=DEV)
        assert torch.equal(impl.rms_norm_cuda(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    assert impl.rms_norm_cuda(torch.empty(0, 7, 128, device=DEV, dtype=torch.bfloat16),
                              torch.zeros(128, device=DEV), 1e-6).shape == (0, 7, 128)


# ----------------------------------------------------------------------------- integration

def test_select_backend_auto_picks_cuda():
    backend = kernels.select_backend("auto", "cuda")
    assert backend.name == "cuda", backend.reason
    assert kernels.select_backend("cuda", "cuda").use_cuda


def test_custom_ops_under_torch_compile(impl):
    backend = kernels.select_backend("cuda", "cuda")
    N, Hk, Hv, D, C, W = 4, 16, 32, 128, 8192, 4
    q, k, v, a, b, A_log, dt_bias, state = decode_inputs(N, Hk, Hv, D, D, torch.bfloat16, torch.bfloat16,
                                                         torch.float32, seed=21)
    x = torch.randn(N, C, device=DEV, dtype=torch.bfloat16)
    weight = torch.randn(C, W, device=DEV, dtype=torch.bfloat16)
    conv_state = torch.randn(N, C, W - 1, device=DEV, dtype=torch.bfloat16)
    wn, wf = torch.rand(D, device=DEV, dtype=torch.bfloat16), torch.randn(D, device=DEV) * 0.1  # the norms' weights

    def step(q, k, v, a, b, state, x, conv_state):
        y = kernels.causal_conv1d_update(x, conv_state, weight, None, backend=backend)
        o = kernels.gdn_decode_step(q * 1.0, k, v, a, b, A_log, dt_bias, state, backend=backend)
        o = kernels.gated_rms_norm(o, v, wn, 1e-6, backend=backend)
        return kernels.rms_norm(o * 2, wf, 1e-6, backend=backend), y + 1

    s1, c1 = state.clone(), conv_state.clone()
    o_eager, y_eager = step(q, k, v, a, b, s1, x, c1)
    compiled = torch.compile(step, fullgraph=True)
    s2, c2 = state.clone(), conv_state.clone()
    o_comp, y_comp = compiled(q, k, v, a, b, s2, x, c2)
    torch.testing.assert_close(o_comp, o_eager, rtol=0, atol=0)
    torch.testing.assert_close(y_comp, y_eager)  # y + 1 may round differently once fused
    assert torch.equal(s1, s2) and torch.equal(c1, c2)


def test_cuda_graph_capture_decode_and_conv_update(impl):
    N, Hk, Hv, D, C, W = 8, 16, 32, 128, 8192, 4
    q, k, v, a, b, A_log, dt_bias, state = decode_inputs(N, Hk, Hv, D, D, torch.bfloat16, torch.bfloat16,
                                                         torch.float32, seed=33)
    x = torch.randn(N, C, device=DEV, dtype=torch.bfloat16)
    weight = torch.randn(C, W, device=DEV, dtype=torch.bfloat16)
    conv_state = torch.randn(N, C, W - 1, device=DEV, dtype=torch.bfloat16)

    def step():
        y = impl.causal_conv1d_update_cuda(x, conv_state, weight, None)
        o = impl.gdn_decode_step_cuda(q, k, v, a, b, A_log, dt_bias, state)
        return o, y

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm up: compile and load outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, y_static = step()

    for rep in range(3):  # new inputs into the captured buffers, replay, compare
        for t in (q, k, v, a, b, x):
            t.copy_(torch.randn_like(t))
        state_ref, conv_ref = state.clone(), conv_state.clone()
        y_ref = causal_conv1d_update_ref(x, conv_ref, weight, None)
        o_ref = gdn_decode_step_ref(q, k, v, a, b, A_log, dt_bias, state_ref)
        graph.replay()
        torch.cuda.synchronize()
        assert rel(state, state_ref) < 1e-5 and rel(o_static, o_ref) < 1e-2
        assert torch.equal(conv_state, conv_ref)
        torch.testing.assert_close(y_static.float(), y_ref.float(), rtol=1.6e-2, atol=1.6e-2)


# ----------------------------------------------------------------------------- content hash

@pytest.mark.parametrize("n", [0, 1, 7, 255, 256, 257, 65_537, 3_145_728 + 5])
def test_hash_words_is_the_reference_bit_for_bit(impl, n):
    """One pass of wrapping sums: the same two lanes as the torch expression, whatever the block order."""
    from qwen35_fast.kernels.content_hash.reference import hash_words_ref
    g = torch.Generator(device="cuda").manual_seed(n)
    words = torch.randint(-2 ** 63, 2 ** 63 - 1, (n,), dtype=torch.int64, device="cuda", generator=g)
    seeds = (0x51ED27, 0x2545F491)
    got = impl.hash_words_cuda(words, seeds)
    assert got.dtype == torch.int64 and got.shape == (2,)
    assert torch.equal(got, hash_words_ref(words, seeds)) and torch.equal(got.cpu(), hash_words_ref(words.cpu(), seeds))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_words_on_another_gpu_are_hashed_there_not_on_the_current_one(impl):
    """A source image on cuda:1 while the model's device (the current one) is cuda:0: its key is the torch
    expression on cuda:1, never the kernel launched on cuda:0 over cuda:1's memory."""
    from qwen35_fast.kernels.content_hash.reference import hash_words_ref
    be = kernels.select_backend("cuda", "cuda:0", torch.bfloat16)
    words = torch.randint(-2 ** 63, 2 ** 63 - 1, (70_001,), dtype=torch.int64, device="cuda:1")
    with torch.cuda.device(0):
        got = kernels.hash_words(words, (3, 5), be)
    assert got.device == words.device and torch.equal(got.cpu(), hash_words_ref(words.cpu(), (3, 5)))

def test_content_hash_is_the_same_on_the_kernel_and_on_the_cpu(impl):
    """An image's key does not depend on where it was hashed: the kernel, torch on the GPU, torch on the CPU;
    a change of one pixel changes it."""
    from qwen35_fast.runtime.fingerprint import content_hash
    be = kernels.select_backend("cuda", "cuda", torch.bfloat16)
    for t in (torch.rand(4096, 1536, device="cuda"), torch.randint(0, 255, (3, 1001), dtype=torch.uint8, device="cuda")):
        key = content_hash(t, be)
        assert key == content_hash(t) == content_hash(t.cpu())
        t.view(-1)[t.numel() // 2] += 1
        assert content_hash(t, be) != key
