"""The vision tower's kernels (kernels/vision/: positions, rotary, LayerNorm, residual add + LayerNorm, attention)
against their PyTorch references, and the tower on the CUDA backend against the tower on the reference backend.

GPU tests: fresh seeded random inputs per case; torch's caching allocator is filled with NaN before each
launch so that an output element a kernel forgets to write shows up. The rotary and the residual sum are
bit for bit the reference; the LayerNorm's output is within one rounding of it (torch's kernel forms the
statistics with Welford's update, ours in two passes over the row: the fp32 values differ in the last
bits, which moves a rounding of the output now and then). The attention (sm_90a only) rounds P to bf16 for
its second product, as every flash attention does: it is checked against the fp32 attention within twice
the error of torch's own bf16 SDPA on the same inputs. The CPU tests check the references and the ops' fake
implementations.
"""
import pytest
import torch
import torch.nn.functional as F

from qwen35_fast import kernels
from qwen35_fast.kernels import ops
from qwen35_fast.kernels.vision.reference import (
    add_layer_norm_ref,
    grid_taps,
    layer_norm_ref,
    vision_attention_ref,
    vision_positions_ref,
    vision_rotary_ref,
)

from _models import poison_allocator, rel

DEV = "cuda"
gpu = pytest.mark.gpu
# LayerNorm output against torch's: |ours - ref| <= atol + rtol |ref| (rtol: one unit in the last place)
LN_TOL = {torch.bfloat16: dict(rtol=2 ** -7, atol=1e-3), torch.float16: dict(rtol=2 ** -10, atol=1e-4)}


def rotary_inputs(N, H, hd, dtype, device, seed):
    """qkv [N, 3, H, hd] and cos / sin of random 2-D positions, as VisionPlan makes them."""
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = (torch.randn(N, 3, H, hd, generator=g, device=device) * 3).to(dtype)
    inv_freq = 1.0 / 10_000 ** (torch.arange(0, hd // 2, 2, dtype=torch.float32, device=device) / (hd // 2))
    pos = torch.randint(0, 64, (N, 2), generator=g, device=device).float()
    f = torch.cat([pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq], dim=1)
    emb = torch.cat([f, f], dim=1)
    return qkv, emb.cos(), emb.sin()


def positions_inputs(grids, D, hd, side, dtype, device, seed):
    """x [N, D], a position grid [side^2, D], the grids' table (t, h, w, first patch) and frequencies."""
    g = torch.Generator(device=device).manual_seed(seed)
    n = sum(t * h * w for t, h, w in grids)
    x = torch.randn(n, D, generator=g, device=device).to(dtype)
    pos = torch.randn(side * side, D, generator=g, device=device).to(dtype)
    firsts = [sum(t * h * w for t, h, w in grids[:i]) for i in range(len(grids))]
    table = torch.tensor([(t, h, w, f) for (t, h, w), f in zip(grids, firsts)], dtype=torch.int32,
                         device=device).view(-1, 4)
    inv_freq = 1.0 / 10_000 ** (torch.arange(0, hd // 2, 2, dtype=torch.float32, device=device) / (hd // 2))
    return x, pos, table, [v for gr in grids for v in gr], inv_freq


def norm_inputs(rows, D, dtype, device, seed):
    """x (a residual stream with an offset per row), y, weight near 1, bias near 0."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(rows, D, generator=g, device=device) * 2 + torch.randn(rows, 1, generator=g, device=device))
    y = torch.randn(rows, D, generator=g, device=device)
    w = 1 + 0.3 * torch.randn(D, generator=g, device=device)
    b = 0.3 * torch.randn(D, generator=g, device=device)
    return x.to(dtype), y.to(dtype), w.to(dtype), b.to(dtype)


# ----------------------------------------------------------------------------- references (CPU)

def test_rotary_ref_is_the_towers_expression():
    """The reference is the rotary the tower computed inline before the kernels ([N, 2, H, hd] in fp32),
    laid out as [2, N, H, hd]."""
    for dtype in (torch.float32, torch.bfloat16):
        qkv, cos, sin = rotary_inputs(37, 3, 72, dtype, "cpu", 0)
        qk, half = qkv[:, :2].float(), 36
        want = (qk * cos[:, None, None, :] + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
                * sin[:, None, None, :]).to(dtype)
        got = vision_rotary_ref(qkv, cos, sin)
        assert got.shape == (2, 37, 3, 72) and got.is_contiguous() and torch.equal(got, want.transpose(0, 1))


def test_positions_ref_interpolates_the_grid_and_lays_out_the_angles():
    """The reference against a direct reading of the layout: each patch's row and column in merge-block order,
    the position grid sampled bilinearly at (row (side - 1) / (h - 1), column (side - 1) / (w - 1)) in float64,
    a video's frames all at its first frame's positions, angles (row, column, row, column) x inv_freq."""
    grids, side, m = [(1, 4, 6), (3, 2, 4)], 5, 2
    x, pos, table, flat, inv_freq = positions_inputs(grids, 8, 16, side, torch.float32, "cpu", 0)
    got, cos, sin = vision_positions_ref(x, pos, flat, inv_freq, m)
    grid = pos.double().view(side, side, 8)
    n = 0
    for t, h, w in grids:
        for _ in range(t):
            for br in range(h // m):
                for bc in range(w // m):
                    for i in range(m * m):
                        r, c = br * m + i // m, bc * m + i % m
                        y, z = r * (side - 1) / max(h - 1, 1), c * (side - 1) / max(w - 1, 1)
                        y0, z0 = int(y), int(z)
                        y1, z1 = min(y0 + 1, side - 1), min(z0 + 1, side - 1)
                        want = ((1 - (y - y0)) * ((1 - (z - z0)) * grid[y0, z0] + (z - z0) * grid[y0, z1])
                                + (y - y0) * ((1 - (z - z0)) * grid[y1, z0] + (z - z0) * grid[y1, z1]))
                        assert torch.allclose(got[n].double() - x[n].double(), want, atol=1e-5)
                        angles = torch.tensor([r, c, r, c], dtype=torch.float64)[:, None] * inv_freq.double()
                        assert torch.allclose(cos[n].double(), angles.view(-1).cos(), atol=1e-5)
                        assert torch.allclose(sin[n].double(), angles.view(-1).sin(), atol=1e-5)
                        n += 1
    assert n == x.shape[0] and grid_taps(4, 6, m, side)[2].shape == (24, 4)


def layer_norm_f64(x, w, b, eps):
    """(x - mean) / sqrt(var + eps) * w + b over the last dimension in float64, var the biased (1/D) variance."""
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / (var + eps).sqrt() * w.double() + b.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layer_norm_refs_are_the_layer_norm_formula(dtype):
    """layer_norm_ref and add_layer_norm_ref against the formula in float64, with an eps (2.0) large beside the
    rows' variance (about 5) so that a dropped or misplaced eps shows; the sum is x + y rounded once to x's dtype,
    the normed output within one rounding of the formula (fp32: its own float error)."""
    x, y, w, b = norm_inputs(9, 48, dtype, "cpu", 1)
    eps = 2.0
    tol = dict(rtol=0, atol=2e-6) if dtype == torch.float32 else dict(rtol=torch.finfo(dtype).eps, atol=1e-3)
    assert torch.allclose(layer_norm_ref(x, w, b, eps).double(), layer_norm_f64(x, w, b, eps), **tol)
    s, out = add_layer_norm_ref(x, y, w, b, eps)
    assert s.dtype == out.dtype == dtype and torch.equal(s, (x.double() + y.double()).to(dtype))
    assert torch.allclose(out.double(), layer_norm_f64(s, w, b, eps), **tol)
    assert not torch.allclose(out.double(), layer_norm_f64(s, w, b, 1e-6), **tol)  # eps is large enough to show


def test_vision_ops_pass_opcheck():
    """Custom ops with fake implementations (what torch.compile traces through)."""
    qkv, cos, sin = rotary_inputs(5, 2, 16, torch.float32, "cpu", 2)
    x, y, w, b = norm_inputs(5, 32, torch.float32, "cpu", 3)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(ops.vision_rotary_op, (qkv, cos, sin, False), test_utils=checks)
    px, pos, table, flat, inv_freq = positions_inputs([(1, 2, 4), (2, 2, 2)], 8, 16, 3, torch.float32, "cpu", 4)
    torch.library.opcheck(ops.vision_positions_op, (px, pos, table, flat, inv_freq, 2, False), test_utils=checks)
    torch.library.opcheck(ops.layer_norm_op, (x, w, b, 1e-6, False), test_utils=checks)
    torch.library.opcheck(ops.add_layer_norm_op, (x, y, w, b, 1e-6, False), test_utils=checks)
    q, k, v = qkv[:, 0].contiguous(), qkv[:, 1].contiguous(), qkv[:, 2]
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    torch.library.opcheck(ops.vision_attention_op, (q, k, v, cu, 3, False), test_utils=checks)


def test_attention_ref_attends_within_segments():
    """Each segment's tokens see their own segment only: the reference equals SDPA on each segment alone, and
    changing another segment's keys changes nothing."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(10, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)  # an empty segment too
    got = vision_attention_ref(q, k, v, cu)
    for a, b in ((0, 3), (3, 10)):
        want = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1))
        assert torch.equal(got[a:b], want.transpose(0, 1))
    k2 = k.clone()
    k2[3:] += 1
    assert torch.equal(vision_attention_ref(q, k2, v, cu)[:3], got[:3])


# ----------------------------------------------------------------------------- positions (GPU)

POSITIONS_CASES = [  # grids, D, hd, side, merge: the released towers (48 x 48 grid, 2 x 2 merge) on one image,
    # images of several sizes, a video, a grid smaller / larger than the learned one, odd shapes
    ([(1, 64, 64)], 1152, 72, 48, 2), ([(1, 32, 24), (1, 16, 40), (4, 12, 16)], 1152, 72, 48, 2),
    ([(16, 46, 80)], 1024, 64, 48, 2), ([(1, 2, 2)], 768, 64, 48, 2), ([(1, 96, 100), (1, 2, 60)], 768, 64, 48, 2),
    ([(2, 6, 9), (1, 3, 3), (5, 9, 3)], 40, 8, 7, 3), ([(1, 4, 4)] * 37, 64, 16, 5, 2), ([(3, 2, 2)], 8, 4, 1, 1)]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", range(len(POSITIONS_CASES)))
def test_positions_match_reference(impl, case, dtype):
    grids, D, hd, side, m = POSITIONS_CASES[case]
    x, pos, table, flat, inv_freq = positions_inputs(grids, D, hd, side, dtype, DEV, case)
    n = x.shape[0]
    poison_allocator(((n, D), dtype), ((n, hd), torch.float32))
    got, cos, sin = impl.vision_positions_cuda(x, pos, table, flat, inv_freq, m)
    want, cos_r, sin_r = vision_positions_ref(x, pos, flat, inv_freq, m)
    assert got.shape == (n, D) and got.dtype == dtype and cos.shape == sin.shape == (n, hd)
    assert not (got.isnan().any() or cos.isnan().any() or sin.isnan().any())
    assert (cos - cos_r).abs().max() <= 2e-7 and (sin - sin_r).abs().max() <= 2e-7
    diff = (got.float() - want.float()).abs()
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    assert diff.max() <= ulp * (pos.float().abs().max() + x.float().abs().max()) and (diff > 0).float().mean() < 1e-3


@gpu
def test_positions_through_the_backend_and_fallback(impl):
    x, pos, table, flat, inv_freq = positions_inputs([(1, 8, 6), (2, 4, 4)], 64, 16, 6, torch.bfloat16, DEV, 9)
    be = kernels.select_backend("cuda", DEV, torch.bfloat16)
    grids = [tuple(flat[i:i + 3]) for i in range(0, len(flat), 3)]
    got = kernels.vision_positions(x, pos, table, grids, inv_freq, 2, backend=be)
    assert all(torch.equal(a, b) for a, b in zip(got, impl.vision_positions_cuda(x, pos, table, flat, inv_freq, 2)))
    for args in [(x.float(), pos.float()), (x[:, :60].contiguous(), pos[:, :60].contiguous()), (x, pos[:35]),
                 (x, pos.half())]:  # fp32, rows not of 8, a grid not square, another dtype: the reference
        want = vision_positions_ref(*args, flat, inv_freq, 2)
        assert all(torch.equal(a, b) for a, b in zip(impl.vision_positions_cuda(*args, table, flat, inv_freq, 2), want))
    empty = impl.vision_positions_cuda(x[:0], pos, table[:0], [], inv_freq, 2)
    assert [t.shape for t in empty] == [(0, 64), (0, 16), (0, 16)]


# ----------------------------------------------------------------------------- rotary (GPU)

ROTARY_CASES = [  # N, H, hd: the released towers (12 x 64, 16 x 64, 16 x 72), odd head counts, N off the block
    (4096, 16, 72), (1024, 16, 64), (300, 12, 64), (1, 16, 72), (7, 3, 72), (257, 5, 80), (33, 1, 8),
    (129, 7, 16), (2, 2, 128), (1000, 9, 24), (61, 11, 40), (4099, 16, 72)]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ROTARY_CASES, ids=lambda c: "x".join(map(str, c)))
def test_rotary_matches_reference(impl, case, dtype):
    N, H, hd = case
    qkv, cos, sin = rotary_inputs(N, H, hd, dtype, DEV, N * H + hd)
    poison_allocator(((2, N, H, hd), dtype))
    got = impl.vision_rotary_cuda(qkv, cos, sin)
    want = vision_rotary_ref(qkv, cos, sin)
    assert got.shape == (2, N, H, hd) and got.dtype == dtype and not got.isnan().any()
    assert torch.equal(got, want)  # the same fp32 products and sum, rounded once


def test_rotary_launch_covers_every_output_with_the_kernels_hg(monkeypatch):
    """The launcher's grid has one thread per 8 features of HG heads, HG as the module is built with (on the CPU:
    the launch recorded, not run)."""
    from qwen35_fast.kernels.vision import launch as L
    got = {}
    monkeypatch.setattr(L, "rotary_takes", lambda *a: True)
    monkeypatch.setattr(L, "aligned16", lambda t: t)
    monkeypatch.setattr(L, "get_function", lambda src, name, dev, defines: got.setdefault("defines", defines))
    monkeypatch.setattr(L, "launch", lambda fn, grid, block, args: got.update(grid=grid, block=block))
    n, h, hd = 37, 3, 72
    L.vision_rotary_cuda(torch.zeros(n, 3, h, hd), torch.zeros(n, hd), torch.zeros(n, hd))
    hg = got["defines"].get("HG", 2)  # rotary.cu's default
    threads = got["grid"][0] * got["block"][0]
    need = n * (2 * h // hg) * (hd // 8)
    assert need <= threads < need + got["block"][0]


def test_kernels_are_not_handed_operands_on_another_device():
    """A cos / sin, LayerNorm weight, residual, position grid or inv_freq on another device than the activations is
    not the kernels' (they would read a host or foreign pointer, and a fault there ends the CUDA context): the
    reference runs, and torch names the mismatch. Judged on CPU and meta tensors (no GPU needed)."""
    from qwen35_fast.kernels.vision.launch import norm_takes, positions_takes, rotary_takes
    meta = torch.device("meta")
    qkv, cs = torch.zeros(5, 3, 2, 16, dtype=torch.bfloat16), torch.zeros(5, 16)
    assert rotary_takes(qkv, cs, cs)
    assert not rotary_takes(qkv, cs.to(meta), cs) and not rotary_takes(qkv, cs, cs.to(meta))
    x, w = torch.zeros(4, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    assert norm_takes(x, x, w, w)
    assert not norm_takes(x, None, w.to(meta), w) and not norm_takes(x, None, w, w.to(meta))
    assert not norm_takes(x, x.to(meta), w, w)
    grids, table = [1, 2, 2], torch.tensor([[1, 2, 2, 0]], dtype=torch.int32)
    pos, inv = torch.zeros(4, 64, dtype=torch.bfloat16), torch.ones(4)
    assert positions_takes(x, pos, table, grids, inv)
    assert not positions_takes(x, pos.to(meta), table, grids, inv) and not positions_takes(x, pos, table, grids,
                                                                                           inv.to(meta))


def test_attention_launch_hands_the_kernel_its_six_maps(monkeypatch):
    """vision_attention_cuda passes attention.cu's tensor maps in its parameter order: Q in boxes of a tile's 192
    rows, K of its 128 keys, V of 128, 64, 8 and 1 tokens (a segment's last, partial tile is read in the boxes that
    never cross its end). The six are made once per addresses, shape and row strides of q, k and v: a view at the
    same addresses with another shape or row stride, or q, k, v at other addresses, gets its own, and at most 256
    are kept (on the CPU: the launch recorded, not run)."""
    from types import SimpleNamespace

    from qwen35_fast.kernels.vision import launch as L
    made, launched = [], []

    def tensor_map(x, dims, strides, box):
        made.append((x.data_ptr(), dims, strides, box))
        return made[-1]
    monkeypatch.setattr(L, "attention_takes", lambda *a: True)
    monkeypatch.setattr(L, "card_of", lambda dev: SimpleNamespace(sms=4))
    monkeypatch.setattr(L, "stream_flags", lambda dev, n: None)
    monkeypatch.setattr(L, "get_function", lambda *a: "vision_attention")
    monkeypatch.setattr(L, "tensor_map", tensor_map)
    monkeypatch.setattr(L, "launch", lambda fn, grid, block, args, shared_mem: launched.append(args))
    monkeypatch.setattr(L, "_qkv_maps", {})
    n, h, hd = 300, 2, 72
    qkv = torch.zeros(n, 3, h, hd, dtype=torch.bfloat16)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0, 100, n], dtype=torch.int32)
    L.vision_attention_cuda(q, k, v, cu, 200)
    dims, strides = (hd, h, n), (hd * 2, 3 * h * hd * 2)
    assert launched[0][:6] == ((q.data_ptr(), dims, strides, (64, 1, L.ATTN_ROWS)),
                               (k.data_ptr(), dims, strides, (64, 1, L.ATTN_KEYS)),
                               *((v.data_ptr(), dims, strides, (64, 1, rows)) for rows in (L.ATTN_KEYS, 64, 8, 1)))
    made.clear()
    L.vision_attention_cuda(q, k, v, cu, 200)
    assert made == [] and launched[1][:6] == launched[0][:6]
    packed = qkv.view(-1)[2 * h * hd:][:n * h * hd].view(n, h, hd)  # v's address and shape, rows of its own
    for other in (packed, v[:n - 1]):
        maps = L._attention_maps(q[:other.shape[0]], k[:other.shape[0]], other)
        assert [m[0] for m in maps] == [q.data_ptr(), k.data_ptr()] + [v.data_ptr()] * 4
        assert maps != L._attention_maps(q, k, v)
        assert (maps[2][1][2], maps[2][2][1]) == (other.shape[0], other.stride(0) * 2)
    maps = L._attention_maps(k, q, v)  # q's and k's shapes and strides at each other's address
    assert [m[0] for m in maps[:2]] == [k.data_ptr(), q.data_ptr()] and maps[2:] == L._attention_maps(q, k, v)[2:]
    for rows in range(1, 300):
        L._attention_maps(q[:rows], k[:rows], v[:rows])
    assert 0 < len(L._qkv_maps) <= 256


@gpu
def test_rotary_through_the_backend_and_fallback(impl):
    qkv, cos, sin = rotary_inputs(100, 4, 72, torch.bfloat16, DEV, 7)
    be = kernels.select_backend("cuda", DEV, torch.bfloat16)
    assert torch.equal(kernels.vision_rotary(qkv, cos, sin, backend=be), vision_rotary_ref(qkv, cos, sin))
    for q, c, s in [(qkv.float(), cos, sin), (qkv[..., :68].contiguous(), cos[:, :68], sin[:, :68]),
                    (qkv, cos.bfloat16(), sin.bfloat16())]:  # fp32, head dim 68, bf16 tables: the reference
        assert torch.equal(impl.vision_rotary_cuda(q, c, s), vision_rotary_ref(q, c, s))
    assert impl.vision_rotary_cuda(qkv[:0], cos[:0], sin[:0]).shape == (2, 0, 4, 72)


# ----------------------------------------------------------------------------- LayerNorm (GPU)

NORM_D = [8, 64, 768, 1024, 1152, 1280, 1288, 2048, 2568, 4096, 5120, 5128, 8192, 10240]


def _check_norm(got, want, dtype):
    assert got.dtype == dtype and got.shape == want.shape and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **LN_TOL[dtype])
    assert int((got != want).sum()) <= max(1, want.numel() // 100)  # almost every element bit for bit


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 7, 37, 1000])
@pytest.mark.parametrize("D", NORM_D)
def test_add_layer_norm_matches_reference(impl, D, rows, dtype):
    x, y, w, b = norm_inputs(rows, D, dtype, DEV, D * 1000 + rows)
    poison_allocator(((rows, D), dtype))
    s, out = impl.add_layer_norm_cuda(x, y, w, b, 1e-6)
    s_ref, out_ref = add_layer_norm_ref(x, y, w, b, 1e-6)
    assert torch.equal(s, s_ref)  # the new residual: exactly the bf16 / fp16 add
    _check_norm(out, out_ref, dtype)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", [3, 333])
@pytest.mark.parametrize("D", NORM_D)
def test_layer_norm_matches_reference(impl, D, rows, dtype):
    x, _, w, b = norm_inputs(rows, D, dtype, DEV, D * 7 + rows)
    poison_allocator(((rows, D), dtype))
    _check_norm(impl.layer_norm_cuda(x, w, b, 1e-6), layer_norm_ref(x, w, b, 1e-6), dtype)


@gpu
def test_layer_norm_takes_batched_and_strided_inputs(impl):
    x, y, w, b = norm_inputs(2 * 50, 1152, torch.bfloat16, DEV, 11)
    x3, y3 = x.view(2, 50, 1152), y.view(2, 50, 1152)
    s, out = impl.add_layer_norm_cuda(x3, y3, w, b, 1e-6)
    assert s.shape == out.shape == (2, 50, 1152) and torch.equal(s, x3 + y3)
    _check_norm(out, layer_norm_ref(x3 + y3, w, b, 1e-6), torch.bfloat16)
    wide = torch.randn(100, 2 * 1152, device=DEV, dtype=torch.bfloat16)
    view = wide[:, 1152:]  # rows 2 * 1152 apart: copied to contiguous rows first
    assert torch.equal(impl.layer_norm_cuda(view, w, b, 1e-6), impl.layer_norm_cuda(view.contiguous(), w, b, 1e-6))


@gpu
def test_layer_norm_falls_back_where_the_kernel_does_not_apply(impl):
    """fp32 activations, fp32 weights, rows not a multiple of 8 or above MAX_D: the reference exactly."""
    for D, dtype, wdtype in [(1152, torch.float32, torch.float32), (1152, torch.bfloat16, torch.float32),
                             (100, torch.bfloat16, torch.bfloat16), (12288, torch.bfloat16, torch.bfloat16)]:
        x, y, w, b = norm_inputs(3, D, dtype, DEV, D)
        w, b = w.to(wdtype), b.to(wdtype)
        if dtype == wdtype:  # torch's CUDA LayerNorm takes no mixed dtypes
            assert torch.equal(impl.layer_norm_cuda(x, w, b, 1e-6), layer_norm_ref(x, w, b, 1e-6))
            s, out = impl.add_layer_norm_cuda(x, y, w, b, 1e-6)
            s_ref, out_ref = add_layer_norm_ref(x, y, w, b, 1e-6)
            assert torch.equal(s, s_ref) and torch.equal(out, out_ref)
        else:
            from qwen35_fast.kernels.vision.launch import norm_takes
            assert not norm_takes(x, y, w, b)
    s, out = impl.add_layer_norm_cuda(*norm_inputs(0, 1152, torch.bfloat16, DEV, 0), 1e-6)
    assert s.shape == out.shape == (0, 1152)


# ----------------------------------------------------------------------------- attention (GPU, sm_90a)

ATTN_CASES = [  # segment lengths, heads, head dim: one image of each tower, several, video slices, ragged ends
    ([4096], 16, 72), ([1024], 12, 64), ([1024, 1024], 16, 64), ([3600] * 3, 16, 72), ([1], 16, 72),
    ([63, 200, 1000, 4133, 129, 192], 16, 72), ([7] * 40, 3, 72), ([193, 384, 385], 1, 64), ([128, 0, 130], 5, 72),
    ([256, 2], 16, 64), ([5000], 2, 72), ([3] * 1100, 2, 64)]  # the last: more segments than the kernel keeps in shared memory


def attention_inputs(lens, H, hd, seed, spare=0):
    """q, k (contiguous [N, H, hd], as the rotary writes them) and v (strided: a view of a [N, 3, H, hd] qkv),
    cu_seqlens; `spare` NaN rows after N in every buffer (past the tensors: never read)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    n = sum(lens)
    qkv = torch.full((n + spare, 3, H, hd), float("nan"), device=DEV, dtype=torch.bfloat16)
    qkv[:n] = (torch.randn(n, 3, H, hd, generator=g, device=DEV) * 2).bfloat16()
    qk = torch.full((2, n + spare, H, hd), float("nan"), device=DEV, dtype=torch.bfloat16)
    qk[:, :n] = qkv[:n, :2].transpose(0, 1)
    cu = torch.tensor([0] + lens, device=DEV).cumsum(0).to(torch.int32)
    return qk[0, :n], qk[1, :n], qkv[:n, 2], cu


def attention_flags(device, n):
    """The launcher's flag buffer of the current stream (kernels/cuda_build.py stream_flags)."""
    from qwen35_fast.kernels.cuda_build import stream_flags as flags
    return flags(torch.device(device), n)


def attention_against_fp32(impl, case, seed, spare, **launch):
    """The kernel on a case's fresh inputs (its output poisoned first; skipped off sm_90a): the inputs, its
    output, the fp32 attention and torch's bf16 attention (as fp32) of the same inputs."""
    from qwen35_fast.kernels.vision.launch import attention_takes
    lens, H, hd = case
    q, k, v, cu = attention_inputs(lens, H, hd, seed, spare=spare)
    if not attention_takes(q, k, v, cu):
        pytest.skip("the vision attention kernel runs on sm_90a cards only")
    poison_allocator(((q.shape[0], H, hd), torch.bfloat16))
    got = impl.vision_attention_cuda(q, k, v, cu, max(lens), **launch)
    want = vision_attention_ref(q.float(), k.float(), v.float(), cu)
    return (q, k, v, cu), got, want, vision_attention_ref(q, k, v, cu).float()


@gpu
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: f"{len(c[0])}seg-{max(c[0])}x{c[1]}x{c[2]}")
def test_attention_matches_fp32_within_torch_bf16_error(impl, case):
    lens, H, hd = case
    _, got, want, torch_bf16 = attention_against_fp32(impl, case, sum(lens) + H + hd, spare=300)
    assert got.shape == (sum(lens), H, hd) and got.dtype == torch.bfloat16 and not got.isnan().any()
    assert rel(got.float(), want) <= 2 * rel(torch_bf16, want) + 1e-4
    assert (got.float() - want).abs().max() <= 2 * (torch_bf16 - want).abs().max() + 1e-3


@gpu
@pytest.mark.parametrize("ctas", [1, 2, 5, 7, 13, 64])
@pytest.mark.parametrize("case", [([4096], 16, 72), ([63, 200, 1000, 4133, 129, 192], 4, 72), ([3600] * 3, 2, 64),
                                  ([7] * 40, 3, 72), ([3840, 256], 6, 72)], ids=lambda c: f"{len(c[0])}seg-{max(c[0])}x{c[1]}x{c[2]}")
def test_attention_on_few_ctas_splits_blocks_exactly(impl, case, ctas):
    """A grid of few CTAs: whole rounds, then runs of key tiles that begin and end inside blocks (the partial
    state handed from CTA to CTA and merged), against the same fp32 bound; twice, bit for bit, and within
    rounding of the one-CTA-per-SM grid."""
    lens, H, _ = case
    (q, k, v, cu), got, want, torch_bf16 = attention_against_fp32(impl, case, 7 * ctas + H, spare=64, ctas=ctas)
    assert not got.isnan().any()
    assert rel(got.float(), want) <= 2 * rel(torch_bf16, want) + 1e-4
    assert torch.equal(impl.vision_attention_cuda(q, k, v, cu, max(lens), ctas=ctas), got)
    full = impl.vision_attention_cuda(q, k, v, cu, max(lens))
    assert (full.float() - got.float()).abs().max() <= 2 ** -6 * full.float().abs().max()
    torch.cuda.synchronize()
    assert not attention_flags(q.device, 1).any()  # every flag a launch set, its reader set back to zero


@gpu
def test_attention_split_blocks_in_a_graph_and_on_another_stream(impl):
    """Launches that hand partial blocks on, replayed from a CUDA graph between eager launches and run on a side
    stream (each stream its own flags; the graph its own): the same output every time, every flag back at zero."""
    lens = [4096, 1000, 63]
    (q, k, v, cu), got, want, torch_bf16 = attention_against_fp32(impl, (lens, 16, 72), 11, spare=64, ctas=5)
    assert rel(got.float(), want) <= 2 * rel(torch_bf16, want) + 1e-4
    from qwen35_fast.kernels.cuda_build import _FLAGS
    kept = dict(_FLAGS)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        replayed = impl.vision_attention_cuda(q, k, v, cu, max(lens), ctas=5)
    assert set(_FLAGS) == set(kept)  # the capture's flags are the graph's own (a fill on each replay), not kept
    for _ in range(3):
        replayed.fill_(float("nan"))
        g.replay()
        assert torch.equal(replayed, got)
        assert torch.equal(impl.vision_attention_cuda(q, k, v, cu, max(lens), ctas=5), got)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = impl.vision_attention_cuda(q, k, v, cu, max(lens), ctas=5)
        flags_side = attention_flags(q.device, 1)
    torch.cuda.synchronize()
    assert torch.equal(on_side, got)
    assert flags_side.data_ptr() != attention_flags(q.device, 1).data_ptr()
    assert not flags_side.any() and not attention_flags(q.device, 1).any()


@gpu
def test_attention_backend_and_fallbacks(impl):
    """Through the backend, and the reference exactly where the kernel does not take the call: fp16, fp32,
    head dim 80, K with its heads not packed, the segment starts on the CPU (the kernel reads them on the GPU)."""
    from qwen35_fast.kernels.vision.launch import attention_takes
    q, k, v, cu = attention_inputs([300, 77], 4, 72, 9)
    be = kernels.select_backend("cuda", DEV, torch.bfloat16)
    if attention_takes(q, k, v, cu):
        assert kernels.vision_attention_takes(q, k, v, cu, backend=be)
        assert torch.equal(kernels.vision_attention(q, k, v, cu, 300, backend=be), impl.vision_attention_cuda(q, k, v, cu, 300))
    assert not kernels.vision_attention_takes(q, k, v, cu, backend=None)
    wide = torch.randn(377, 4, 2 * 72, device=DEV, dtype=torch.bfloat16)[..., :72]  # heads 144 apart
    for args in [(q.half(), k.half(), v.half()), (q.float(), k.float(), v.float()),
                 tuple(torch.randn(377, 4, 80, device=DEV, dtype=torch.bfloat16) for _ in range(3)), (q, wide, v)]:
        assert not attention_takes(*args, cu)
        assert torch.equal(impl.vision_attention_cuda(*args, cu, 300), vision_attention_ref(*args, cu))
    assert not attention_takes(q, k, v, cu.cpu())
    assert torch.equal(impl.vision_attention_cuda(q, k, v, cu.cpu(), 300), vision_attention_ref(q, k, v, cu.cpu()))


# ----------------------------------------------------------------------------- the tower (GPU)

@gpu
@pytest.mark.parametrize("width,heads", [(1152, 16), (768, 12)], ids=["16x72", "12x64"])
def test_tower_on_kernels_matches_tower_on_references(width, heads):
    """Two images of different sizes (two attention groups) and a 2-frame-slice video through a 4-block
    tower: the kernels' backend against the references' backend, same bf16 weights."""
    from qwen35_fast.runtime.vision import VisionConfig, VisionTower
    vc = VisionConfig(depth=4, hidden_size=width, intermediate_size=4 * width, num_heads=heads, out_hidden_size=2048)
    tower = VisionTower(vc, torch.bfloat16, torch.device(DEV))
    g = torch.Generator(device=DEV).manual_seed(width)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if p.dim() == 1:  # norms near (1, 0), biases small
                one = float("norm" in name and name.endswith("_w"))
                p.copy_(one + 0.2 * torch.randn(p.shape, generator=g, device=DEV))
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=DEV) * p.shape[-1] ** -0.5)
    grids = [(1, 32, 24), (1, 16, 40), (4, 12, 16)]
    plan = tower.plan(grids)
    pixels = torch.randn(plan.n_patches, vc.patch_dim, generator=g, device=DEV).to(torch.bfloat16)
    be = kernels.select_backend("cuda", DEV, torch.bfloat16)
    assert be.use_cuda
    want = tower(pixels, plan)  # no backend: the references
    got = tower(pixels, plan, backend=be)
    assert got.shape == want.shape and not got.isnan().any()
    assert rel(got.float(), want.float()) < 1e-2  # bf16 rounding differences carried through 4 blocks
