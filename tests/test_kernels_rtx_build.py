"""Decode, conv1d, the norms, the decode projections (gemv), int8 rows' dequantization, the vision tower's kernels and the sampled token built as an
RTX card gets them: PTX for compute_80 (which the driver finishes
for the GPU in hand) and no block above the 99 KB of shared memory that sm_86 / sm_89 / sm_120 give one
block; each against its reference. (The prefill's portable path has its own tests in test_gdn_prefill_cuda.py;
tests/test_kernels_compile.py compiles every source for sm_80 / 86 / 89 / 120 / 90a without a GPU.)"""
import pytest
import torch

from qwen35_fast.kernels.conv1d import launch as conv_launch
from qwen35_fast.kernels.conv1d.reference import causal_conv1d_prefill_ref, causal_conv1d_update_ref
from qwen35_fast.kernels.dequant import launch as dequant_launch
from qwen35_fast.kernels.dequant.reference import dequant_rows_ref
from qwen35_fast.kernels.gdn_decode import launch as decode_launch
from qwen35_fast.kernels.gdn_decode.reference import gdn_decode_step_ref
from qwen35_fast.kernels.gemv import launch as gemv_launch
from qwen35_fast.kernels.rms_norm import launch as norm_launch
from qwen35_fast.kernels.rms_norm.reference import gated_rms_norm_ref, rms_norm_ref
from qwen35_fast.kernels.sampling import launch as sample_launch
from qwen35_fast.kernels.sampling.reference import sample_ref
from qwen35_fast.kernels.vision import launch as vision_launch
from qwen35_fast.kernels.vision.reference import add_layer_norm_ref, vision_positions_ref, vision_rotary_ref

from _models import rel

pytestmark = pytest.mark.gpu
DEV = "cuda"
RTX_SMEM = 101376
ARCH = "compute_80"


@pytest.fixture
def rtx(monkeypatch):
    """Every module these launchers load is built for compute_80, and every launch is checked against the
    99 KB cap; returns the (module, arch, shared memory) of each launch."""
    seen = []
    for mod in (decode_launch, conv_launch, norm_launch, vision_launch, gemv_launch, dequant_launch, sample_launch):
        get, run = mod.get_function, mod.launch

        def get_function(src, name, dev, defines=None, get=get):
            fn = get(src, name, dev, defines, arch=ARCH)
            seen.append(("get", name))
            return fn

        def launch(fn, grid, block, args, shared_mem=0, run=run, **kw):
            assert shared_mem <= RTX_SMEM, f"a launch asks for {shared_mem} bytes of shared memory"
            seen.append(("launch", shared_mem))
            return run(fn, grid, block, args, shared_mem=shared_mem, **kw)

        monkeypatch.setattr(mod, "get_function", get_function)
        monkeypatch.setattr(mod, "launch", launch)
    monkeypatch.setattr(decode_launch, "_fns", {})  # its own cache of loaded kernels
    return seen


def _poison(shape, dtype):
    junk = [torch.full(shape, float("nan"), dtype=dtype, device=DEV) for _ in range(2)]
    del junk


@pytest.mark.parametrize("N", [1, 8, 64])
def test_decode(rtx, N):
    g = torch.Generator(device=DEV).manual_seed(N)
    r = lambda *s: torch.randn(*s, generator=g, device=DEV)  # noqa: E731
    Hk, Hv, D = 16, 32, 128
    q, k, v = (r(N, Hk, D) * 3).bfloat16(), r(N, Hk, D).bfloat16(), r(N, Hv, D).bfloat16()
    a, b = (r(N, Hv) * 2).bfloat16(), (r(N, Hv) * 2).bfloat16()
    A_log = torch.empty(Hv, device=DEV).uniform_(1, 16, generator=g).log()
    dt_bias = r(Hv) * 0.5 + 1
    state = r(N, Hv, D, D) * 0.3
    state_ref = state.clone()
    o_ref = gdn_decode_step_ref(q, k, v, a, b, A_log, dt_bias, state_ref)
    _poison((N, Hv, D), torch.bfloat16)
    o = decode_launch.gdn_decode_step_cuda(q, k, v, a, b, A_log, dt_bias, state)
    torch.cuda.synchronize()
    assert ("get", "gdn_decode_step") in rtx and any(e[0] == "launch" for e in rtx)
    assert not o.isnan().any() and rel(state, state_ref) < 1e-5 and rel(o, o_ref) < 1e-2


@pytest.mark.parametrize("B,T,C", [(2, 1000, 8192), (1, 5, 200)])
def test_conv1d(rtx, B, T, C):
    g = torch.Generator(device=DEV).manual_seed(T)
    x = torch.randn(B, T, C, generator=g, device=DEV).bfloat16()
    w = torch.randn(C, 4, generator=g, device=DEV).bfloat16()
    bias = torch.randn(C, generator=g, device=DEV).bfloat16()
    init = torch.randn(B, C, 3, generator=g, device=DEV).bfloat16()
    y_ref, st_ref = causal_conv1d_prefill_ref(x, w, bias, init)
    _poison((B, T, C), torch.bfloat16)
    y, st = conv_launch.causal_conv1d_prefill_cuda(x, w, bias, init)
    torch.cuda.synchronize()
    assert torch.equal(st, st_ref) and not y.isnan().any()
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=1.6e-2, atol=1.6e-2)
    xs = torch.randn(B, C, generator=g, device=DEV).bfloat16()
    state = torch.randn(B, C, 3, generator=g, device=DEV).bfloat16()
    state_ref = state.clone()
    y_ref = causal_conv1d_update_ref(xs, state_ref, w, bias)
    _poison((B, C), torch.bfloat16)
    y = conv_launch.causal_conv1d_update_cuda(xs, state, w, bias)
    torch.cuda.synchronize()
    assert torch.equal(state, state_ref) and not y.isnan().any()
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=1.6e-2, atol=1.6e-2)
    assert {e[1] for e in rtx if e[0] == "get"} == {"causal_conv1d_prefill", "causal_conv1d_update"}


@pytest.mark.parametrize("D", [128, 4096])
def test_norms(rtx, D):
    g = torch.Generator(device=DEV).manual_seed(D)
    x = (torch.randn(37, D, generator=g, device=DEV) * 3).bfloat16()
    w = (torch.randn(D, generator=g, device=DEV) * 0.3).bfloat16()
    _poison((37, D), torch.bfloat16)
    y = norm_launch.rms_norm_cuda(x, w, 1e-6)
    assert not y.isnan().any() and rel(y, rms_norm_ref(x, w, 1e-6)) < 4e-3
    if D == 128:
        gate = torch.randn(37, D, generator=g, device=DEV).bfloat16()
        y = norm_launch.gated_rms_norm_cuda(x, gate, w, 1e-6)
        assert not y.isnan().any() and rel(y, gated_rms_norm_ref(x, gate, w, 1e-6)) < 4e-3
    assert ("get", "rms_norm_fwd") in rtx


@pytest.mark.parametrize("D", [1152, 5120])
def test_vision_kernels(rtx, D):
    g = torch.Generator(device=DEV).manual_seed(D)
    qkv = (torch.randn(37, 3, 16, 72, generator=g, device=DEV) * 3).bfloat16()
    cos, sin = torch.randn(37, 72, generator=g, device=DEV), torch.randn(37, 72, generator=g, device=DEV)
    _poison((2, 37, 16, 72), torch.bfloat16)
    assert torch.equal(vision_launch.vision_rotary_cuda(qkv, cos, sin), vision_rotary_ref(qkv, cos, sin))
    x, y = (torch.randn(37, D, generator=g, device=DEV).bfloat16() for _ in range(2))
    w, b = (1 + 0.3 * torch.randn(D, generator=g, device=DEV)).bfloat16(), torch.randn(D, generator=g, device=DEV).bfloat16()
    _poison((37, D), torch.bfloat16)
    s, out = vision_launch.add_layer_norm_cuda(x, y, w, b, 1e-6)
    s_ref, out_ref = add_layer_norm_ref(x, y, w, b, 1e-6)
    assert torch.equal(s, s_ref) and not out.isnan().any() and rel(out, out_ref) < 4e-3
    pe = torch.randn(48 * 48, D, generator=g, device=DEV).bfloat16()
    table = torch.tensor([[1, 4, 6, 0], [3, 2, 2, 24]], dtype=torch.int32, device=DEV)
    inv_freq = torch.rand(18, generator=g, device=DEV)
    _poison((36, D), torch.bfloat16)
    got = vision_launch.vision_positions_cuda(x[:36], pe, table, [1, 4, 6, 3, 2, 2], inv_freq, 2)
    want = vision_positions_ref(x[:36], pe, [1, 4, 6, 3, 2, 2], inv_freq, 2)
    assert not got[0].isnan().any() and rel(got[0], want[0]) < 4e-3
    assert rel(got[1], want[1]) < 1e-6 and rel(got[2], want[2]) < 1e-6  # cos, sin
    assert {e[1] for e in rtx if e[0] == "get"} == {"vision_positions", "vision_rotary", "layer_norm_fwd"}


@pytest.mark.parametrize("N,K", [(4096, 4096), (1024, 17408)])
def test_gemv(rtx, N, K):
    g = torch.Generator(device=DEV).manual_seed(N + K)
    w = (torch.randn(N, K, generator=g, device=DEV) * 0.05).bfloat16()
    x = torch.randn(1, K, generator=g, device=DEV).bfloat16()
    _poison((1, N), torch.bfloat16)
    y = gemv_launch.gemv_cuda(x, w)
    assert not y.isnan().any() and rel(y, x.float() @ w.float().T) < 4e-3
    q = torch.randint(-127, 128, (N, K), generator=g, device=DEV, dtype=torch.int8)  # int8 rows, a scale each
    s = (torch.rand(N, generator=g, device=DEV) * 1e-3).bfloat16()
    _poison((1, N), torch.bfloat16)
    y = gemv_launch.gemv_cuda(x, q, scale=s)
    assert not y.isnan().any() and rel(y, (x.float() @ q.float().T) * s.float()) < 4e-3
    assert ("get", "gemv") in rtx


def test_dequant(rtx):
    g = torch.Generator(device=DEV).manual_seed(7)
    q = torch.randint(-127, 128, (1031, 2560), generator=g, device=DEV, dtype=torch.int8)
    s = (torch.rand(1031, generator=g, device=DEV) * 1e-3).bfloat16()
    _poison((1031, 2560), torch.bfloat16)
    y = dequant_launch.dequant_rows_cuda(q, s)
    assert torch.equal(y.view(torch.int16), dequant_rows_ref(q, s).view(torch.int16))  # bit for bit, zeros' signs too
    assert ("get", "dequant_rows") in rtx


@pytest.mark.parametrize("top_k", [1, 20, 64])
def test_sample(rtx, top_k):
    g = torch.Generator(device=DEV).manual_seed(top_k)
    logits = (torch.randn(248320, generator=g, device=DEV) * 3).bfloat16().float()  # ties
    marks = (torch.rand(248320, generator=g, device=DEV) < 0.2).to(torch.uint8)
    ref_marks = marks.clone()
    tok, weights, ids = sample_launch.sample_cuda(logits, top_k, 0.7, 0.0, 0.8, 0.37, (marks, 1.2, 1.5))
    rtok, rweights, rids = sample_ref(logits, top_k, 0.7, 0.0, 0.8, 0.37, (ref_marks, 1.2, 1.5))
    assert torch.equal(ids, rids) and int(tok) == int(rtok) and torch.equal(marks, ref_marks)
    torch.testing.assert_close(weights, rweights, rtol=2e-6, atol=1e-9)
    assert ("get", "sample_top_k") in rtx
