"""kernels/gemv: one row times a weight's transpose (the decode step's projections).

On the GPU, against the fp32 product over many shapes (fresh, reproducible inputs; NaN-poisoned outputs):
within the one rounding to the element type plus the fp32 sums' order. Cases the kernel does not take
run F.linear. A captured CUDA graph replays it; a model decodes the same tokens with it as with cuBLAS.
On any machine: the grid and the cases it takes."""
import pytest
import torch
import torch.nn.functional as F

from qwen35_fast import kernels
from qwen35_fast.kernels.gemv import launch as gemv_launch
from qwen35_fast.kernels.gemv.launch import (
    BLOCKS_PER_SM,
    MAX_K,
    MIN_RUN,
    ROWS,
    WARPS,
    grid_blocks,
    per_sm_of,
    split_of,
    takes,
)

from _models import int8_rows, poison_allocator

ULP = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # half an ulp, at most, relative to the value


@pytest.mark.parametrize("n_rows", [1, 2, 3, 15, 16, 17, 2560, 4096, 12352, 248320])
@pytest.mark.parametrize("sms", [46, 132])
@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("per_sm", [BLOCKS_PER_SM, 3, 2])
def test_grid_gives_every_warp_the_same_row_groups(n_rows, sms, split, per_sm):
    blocks = grid_blocks(n_rows, sms, split, per_sm)
    groups, per_block = -(-n_rows // ROWS), WARPS // split  # row groups, and those a block takes at once
    rounds = -(-groups // (blocks * per_block))  # row groups of the busiest warp
    assert 1 <= blocks <= sms * per_sm  # one wave of the blocks the card holds at once
    assert rounds == -(-groups // (sms * per_sm * per_block))  # no more than the fullest grid gives
    assert (blocks - 1) * per_block * rounds < groups  # no block without work


@pytest.mark.parametrize("k,smem_per_sm,per_sm", [
    (17408, 102400, 2), (12288, 102400, 4), (9216, 102400, 4),  # RTX 30 / 40 / 50: the 27B's down fits two
    (17408, 167936, 4), (MAX_K, 233472, 4), (MAX_K, 102400, 2), (17408, 65536, 1)])  # A100, H100; a small SM
def test_blocks_an_sm_holds_count_x_in_shared_memory(k, smem_per_sm, per_sm):
    """The grid's blocks an SM are those its shared memory holds (x's K bf16 values and the runtime's 1 KB a
    block): a grid of four an SM where two fit ran a second, short wave of blocks on a 27B int8 model's down."""
    assert per_sm_of(2 * k, smem_per_sm) == per_sm
    assert per_sm_of(2 * 12288 + WARPS * ROWS * 4, 102400) == 3  # a split's partial sums tip the 9B's down


@pytest.mark.parametrize("n_rows,k,sms,split", [
    (4096, 4096, 132, 2), (4096, 12288, 132, 2),  # 9B out_proj / o_proj, down: 2,048 row groups on 4,224 warps
    (2560, 9216, 132, 2), (2560, 4096, 132, 2),  # 4B down, out_proj
    (1024, 17408, 132, 4), (5, 24576, 132, 4),
    (12352, 4096, 132, 1), (24576, 4096, 132, 1), (8288, 2560, 132, 1),  # the row groups fill the grid
    (1024, 1024, 132, 1), (2048, 2048, 132, 1),  # 0.8B / 2B rows: too short to share
    (4096, 4096, 46, 1), (2560, 9216, 46, 1), (1024, 9216, 46, 2)])  # a 46-SM card's grid holds fewer warps
def test_warps_share_a_row_group_where_the_rows_leave_the_grid_idle(n_rows, k, sms, split):
    assert split_of(n_rows, k, sms) == split
    groups = -(-n_rows // ROWS)
    assert groups * split <= max(groups, sms * BLOCKS_PER_SM * WARPS)  # never more than one full grid of warps
    assert split == 1 or k // split >= MIN_RUN


@pytest.mark.parametrize("pro,n_rows,k,fused", [
    (1, 12352, 4096, True), (1, 24576, 4096, True), (1, 10240, 4096, True),  # 9B in_proj, gate_up, qkv
    (2, 4096, 12288, False),  # 9B down: the plain product splits, so silu_mul and it run apart
    (1, 12352, 2560, True), (1, 18432, 2560, True), (2, 2560, 9216, False),  # 4B: its norm rows on two warps
    (1, 12352, 1280, False),  # a row of 1,280 (not a Qwen3.5 size) would be one warp's: the norm apart
    (1, 12288, 2048, True), (2, 2048, 6144, False),  # 2B
    (1, 8224, 1024, True), (1, 7168, 1024, True), (2, 1024, 3584, True),  # 0.8B: its down does not split
    (1, 248320, 5120, True), (2, 5120, 17408, True)])  # 27B lm_head; its down fills the grid unsplit
def test_fused_launch_only_where_it_was_measured_faster(pro, n_rows, k, fused):
    assert gemv_launch.fuses(pro, n_rows, k, 132) == fused


def test_takes_nothing_off_a_cuda_device():
    assert not takes(torch.empty(1, 1, 4096, dtype=torch.bfloat16), torch.empty(64, 4096, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_takes_only_what_the_kernel_reads():
    w = torch.empty(64, 4096, dtype=torch.bfloat16, device="cuda")
    x = torch.empty(1, 1, 4096, dtype=torch.bfloat16, device="cuda")
    assert takes(x, w) and takes(x[0, 0], w)
    assert not takes(torch.empty(2, 4096, dtype=torch.bfloat16, device="cuda"), w)  # two rows
    assert not takes(x.float(), w.float()) and not takes(x, w.half())
    assert not takes(x[..., :4092], w[:, :4092])  # rows not 16-byte aligned (stride 4096, K 4092)
    assert not takes(torch.empty(MAX_K + 8, dtype=torch.bfloat16, device="cuda"),
                     torch.empty(4, MAX_K + 8, dtype=torch.bfloat16, device="cuda"))


def test_gemv_is_a_custom_op_torch_compile_traces():
    """The op's schema and fake implementation (what torch.compile traces through), and a compiled decode-like
    step with it gives the eager result (on the CPU: the reference behind the op)."""
    from qwen35_fast.kernels import ops
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, 1, 64, generator=g), torch.randn(48, 64, generator=g)
    torch.library.opcheck(ops.gemv_op, (x, w, None, False), test_utils=("test_schema", "test_faketensor"))
    q, s = torch.randint(-127, 128, (48, 64), generator=g, dtype=torch.int8), torch.rand(48, generator=g) / 127
    torch.library.opcheck(ops.gemv_op, (x, q, s, False), test_utils=("test_schema", "test_faketensor"))
    be = kernels.select_backend("torch", "cpu")

    def step(x):
        return kernels.gemv(torch.tanh(x), w, backend=be) * 2

    torch.testing.assert_close(torch.compile(step, fullgraph=True)(x), step(x))


@pytest.mark.parametrize("K,threads", [(1024, 128), (2048, 128), (2560, 64), (4096, 128), (5120, 128), (256, 32),
                                       (128, 16), (1152, 32)])
def test_a_one_row_norm_launch_sums_as_the_fused_norm(K, threads):
    """gemv_add_rms_norm is bit for bit rms_norm.cu's launch over a decode step's one row only when both sum with
    the same threads per row: both launchers take _tpr's (gemv's with no row count), and the norm launcher's
    few-rows policy (a whole block a row) starts at two rows."""
    from qwen35_fast.kernels.rms_norm.launch import FEW_ROWS, _tpr
    assert _tpr(K) == threads and gemv_launch.norm_threads_per_row(K) == threads
    assert _tpr(K, 1) == _tpr(K) and _tpr(K, FEW_ROWS + 1) == _tpr(K)
    assert _tpr(K, 2) == (256 if K // 8 % 256 == 0 else _tpr(K))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,K", [(1, 8), (3, 72), (17, 1024), (4096, 4096), (12352, 4096), (4096, 12288),
                                 (24576, 4096), (10240, 4096), (1024, 17408), (248320, 1024), (5, 24576)])
def test_gemv_is_the_product_rounded_once(N, K, dtype):
    g = torch.Generator(device="cuda").manual_seed(N * 131 + K)
    w = (torch.randn(N, K, generator=g, device="cuda") * 0.05).to(dtype)
    x = torch.randn(1, 1, K, generator=g, device="cuda").to(dtype)
    poison_allocator(((1, 1, N), dtype))
    y = kernels.gemv(x, w, backend=kernels.select_backend("cuda", "cuda"))
    exact = (x.double() @ w.double().T)
    assert y.shape == (1, 1, N) and y.dtype == dtype and not y.isnan().any()
    err = (y.double() - exact).abs()
    # the fp32 sums (a lane's K/32 products, then 5 shuffles) and one rounding of the result: at most half an
    # ulp, ULP relative to the value
    gamma = (K // 32 + 8) * 2.0 ** -24 * 1.01
    size = (w.double().abs() @ x.double().abs().view(K)).view(1, 1, N)
    bound = exact.abs() * ULP[dtype] + gamma * size * (1 + ULP[dtype])
    assert (err <= bound).all(), float((err - bound).max())


@pytest.mark.gpu
def test_gemv_takes_strided_rows_and_one_dimensional_x():
    g = torch.Generator(device="cuda").manual_seed(7)
    big = torch.randn(300, 4104, generator=g, device="cuda").bfloat16()
    w = big[::3, 8:]  # row stride 3 * 4104 elements, 16-byte aligned rows
    x = torch.randn(4096, generator=g, device="cuda").bfloat16()
    assert takes(x, w)
    y = kernels.gemv(x, w, backend=kernels.select_backend("cuda", "cuda"))
    torch.testing.assert_close(y.float(), (w.float() @ x.float()), rtol=ULP[torch.bfloat16], atol=1e-3)


@pytest.mark.gpu
def test_what_the_kernel_does_not_take_is_f_linear():
    be = kernels.select_backend("cuda", "cuda")
    g = torch.Generator(device="cuda").manual_seed(8)
    for x, w in ((torch.randn(2, 64, generator=g, device="cuda").bfloat16(),
                  torch.randn(32, 64, generator=g, device="cuda").bfloat16()),  # two rows
                 (torch.randn(1, 60, generator=g, device="cuda").bfloat16(),
                  torch.randn(32, 60, generator=g, device="cuda").bfloat16()),  # K not a multiple of 8
                 (torch.randn(1, 64, generator=g, device="cuda"), torch.randn(32, 64, generator=g, device="cuda"))):
        assert torch.equal(kernels.gemv(x, w, backend=be), F.linear(x, w))


@pytest.mark.gpu
def test_gemv_replays_in_a_cuda_graph():
    from qwen35_fast.kernels.gemv.launch import gemv_cuda
    g = torch.Generator(device="cuda").manual_seed(9)
    w = torch.randn(12352, 4096, generator=g, device="cuda").bfloat16()
    x = torch.randn(1, 4096, generator=g, device="cuda").bfloat16()
    gemv_cuda(x, w)  # load the module outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv_cuda(x, w)
    for seed in (10, 11):
        x.copy_(torch.randn(1, 4096, generator=g.manual_seed(seed), device="cuda").bfloat16())
        graph.replay()
        torch.testing.assert_close(y, gemv_cuda(x.clone(), w), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True])
def test_programmatic_launches_wait_for_the_products_they_read(graphed, monkeypatch):
    """Each product launched programmatically starts while the one before it still runs and reads that one's
    output: a chain of dependent products (the fused norm, the gate and split row groups among them; outputs
    NaN until written), eager and replayed in a CUDA graph, equals the same chain launched plainly, bit for bit,
    for a new input each time (a product that read its input before the one writing it was done would read
    the last input's values, or NaN)."""
    from qwen35_fast.kernels import cuda_build
    from qwen35_fast.kernels.gemv.launch import gemv_add_rms_norm_cuda, gemv_cuda, gemv_silu_mul_cuda
    g = torch.Generator(device="cuda").manual_seed(12)
    K, N1, I = 4096, 12352, 12288
    ws = [(torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).bfloat16()
          for n, k in ((N1, K), (K, N1 // 2), (2 * I, K), (K, I), (K, K))]
    nw = torch.randn(K, generator=g, device="cuda") * 0.1
    outs = [((1, n), torch.bfloat16) for n in (N1, K, 2 * I, K)]

    def chain(x):
        h = gemv_cuda(x, ws[0])  # in_proj
        h = gemv_cuda(h[..., : N1 // 2], ws[1])  # out_proj (row groups split between warps) of its output
        s, n = gemv_add_rms_norm_cuda(x, h, nw, 1e-6, ws[2], fuse=True)  # residual add + norm as x is staged
        h = gemv_silu_mul_cuda(n, ws[3], fuse=True)  # the MLP gate as x is staged
        return gemv_cuda(h + s, ws[4])  # a torch op between two products

    def fresh(seed):
        return torch.randn(1, K, generator=g.manual_seed(seed), device="cuda").bfloat16()

    assert cuda_build.card_of("cuda").programmatic == (torch.cuda.get_device_capability()[0] >= 9)
    x = fresh(0)
    if graphed:
        chain(x)  # the modules load outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = chain(x)
    for seed in range(1, 11):
        monkeypatch.setattr(cuda_build, "PROGRAMMATIC", False)
        want = chain(fresh(seed))
        monkeypatch.setattr(cuda_build, "PROGRAMMATIC", True)
        poison_allocator(*outs)
        if graphed:
            x.copy_(fresh(seed))
            y.fill_(float("nan"))
            graph.replay()
            assert torch.equal(y, want), seed
        else:
            assert torch.equal(chain(fresh(seed)), want), seed


@pytest.mark.gpu
def test_a_model_decodes_the_same_with_gemv_as_with_cublas(tmp_path, monkeypatch):
    """One decode step's logits from the same cache agree to bf16 rounding, and greedy generation (in its CUDA
    graph) gives the same tokens."""
    from qwen35_fast.runtime import generate, prefill

    from _models import kernels_model, rel, spy_graphs
    model = kernels_model(tmp_path, seed=12)
    steps = spy_graphs(monkeypatch)
    pf = prefill(model, "Describe a lighthouse at dusk in one sentence.")
    ids = torch.tensor([int(pf.logits.argmax())], device="cuda")
    logits, tokens = {}, {}
    for on in (False, True):
        model.set_decode_gemv(on)
        cache = pf.cache.clone(pf.cache.length + 8)
        logits[on] = model.forward_decode(ids, cache).float()
        assert model._gemv == on
        tokens[on] = generate(model, pf, max_new_tokens=16).token_ids
    assert rel(logits[True], logits[False]) < 1e-2
    assert len(steps) == 2 and all(g is not None for g in steps)  # both generations in a graph
    assert tokens[True] == tokens[False]


# ----------------------------------------------------------------------------- what forms x before it

def test_fused_projections_on_the_cpu_are_their_parts():
    """kernels.gemv_add_rms_norm / gemv_silu_mul on the reference backend: add_rms_norm (rms_norm without x)
    then gemv, silu_mul then gemv; their ops' schemas and fake implementations (torch.compile)."""
    from qwen35_fast.kernels import ops
    be = kernels.select_backend("torch", "cpu")
    g = torch.Generator().manual_seed(4)
    res, x = (torch.randn(1, 1, 256, generator=g).bfloat16() for _ in range(2))
    nw, w = torch.randn(256, generator=g) * 0.1, torch.randn(40, 256, generator=g).bfloat16()
    s, y = kernels.gemv_add_rms_norm(res, x, nw, 1e-6, w, backend=be)
    s0, n0 = kernels.add_rms_norm(res, x, nw, 1e-6, backend=be)
    assert torch.equal(s, s0) and torch.equal(y, kernels.gemv(n0, w, backend=be))
    s, y = kernels.gemv_add_rms_norm(res, None, nw, 1e-6, w, backend=be)
    assert s is res and torch.equal(y, kernels.gemv(kernels.rms_norm(res, nw, 1e-6, backend=be), w, backend=be))
    gu = torch.randn(1, 1, 512, generator=g).bfloat16()
    assert torch.equal(kernels.gemv_silu_mul(gu, w, backend=be), kernels.gemv(kernels.silu_mul(gu, backend=be), w,
                                                                               backend=be))
    for op, args in ((ops.gemv_add_rms_norm_op, (res, x, nw, 1e-6, w, None, False)),
                     (ops.gemv_rms_norm_op, (res, nw, 1e-6, w, None, False)), (ops.gemv_silu_mul_op, (gu, w, None, False))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_the_fused_decode_step_is_the_layer_loop_on_the_cpu(tmp_path, monkeypatch):
    """The model's fused decode step (_decode_gemv: what it runs with gemv on a GPU), taken here on the reference
    backend, gives the logits and states of its layer loop: the same roundings, in the same order."""
    from qwen35_fast.runtime import load_model, prefill_ids

    from _models import make_hf_model
    make_hf_model(tmp_path, seed=14, vocab=512, hidden=256, inter=512)
    model = load_model(tmp_path, dtype="bf16", device="cpu")
    calls, step = [], type(model)._decode_gemv
    monkeypatch.setattr(type(model), "_decode_gemv", lambda self, *a: calls.append(1) or step(self, *a))
    pf = prefill_ids(model, list(range(100, 130)))
    ids = torch.tensor([int(pf.logits.argmax())])
    out = {}
    for fused in (False, True):
        model.select_backend()
        model._gemv = fused  # (select_backend keeps it while the device stays)
        cache = pf.cache.clone(pf.cache.length + 4)
        out[fused] = (model.forward_decode(ids, cache), cache.ssm[0].clone(), cache.conv[0].clone())
    assert calls == [1]  # the fused step ran once, for the second decode
    for a, b in zip(out[True], out[False]):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm_dtype", ["same", torch.float32])
@pytest.mark.parametrize("with_x", [True, False])
@pytest.mark.parametrize("K", [1024, 2048, 2560, 4096, 5120])
def test_gemv_add_rms_norm_is_add_rms_norm_then_gemv(K, with_x, norm_dtype, dtype):
    """Every Qwen3.5 hidden size (two warps a row at 2,560, four at the others): the new residual and the
    projection bit for bit the two launches' (rms_norm.cu's add_rms_norm or rms_norm, then gemv with each row
    group on one warp, as the fused kernel sums it; a plain product of these shapes may share a group between
    warps: within the fp32 sums' order of it)."""
    from qwen35_fast.kernels.gemv.launch import gemv_add_rms_norm_cuda, gemv_cuda
    from qwen35_fast.kernels.rms_norm.launch import add_rms_norm_cuda, rms_norm_cuda
    g = torch.Generator(device="cuda").manual_seed(K + 7 * with_x)
    N = 1000 + K // 8  # not a multiple of the rows a grid takes at once
    res, x = (torch.randn(1, 1, K, generator=g, device="cuda").to(dtype) for _ in range(2))
    nw = (torch.randn(K, generator=g, device="cuda") * 0.2).to(dtype if norm_dtype == "same" else norm_dtype)
    w = (torch.randn(N, K, generator=g, device="cuda") * 0.05).to(dtype)
    poison_allocator(((1, 1, K), dtype), ((1, 1, N), dtype))
    s, y = gemv_add_rms_norm_cuda(res, x if with_x else None, nw, 1e-6, w, fuse=True)
    s0, n0 = add_rms_norm_cuda(res, x, nw, 1e-6) if with_x else (res, rms_norm_cuda(res, nw, 1e-6))
    assert torch.equal(s, s0) and (with_x or s is res)
    assert not y.isnan().any() and torch.equal(y, gemv_cuda(n0, w, split=1))
    torch.testing.assert_close(y, gemv_cuda(n0, w), rtol=2 * ULP[dtype], atol=1e-3)
    # as the model calls it (fused or not, as gemv.launch.fuses says): the two launches' values, bit for bit
    s, y = gemv_add_rms_norm_cuda(res, x if with_x else None, nw, 1e-6, w)
    assert torch.equal(s, s0) and torch.equal(y, gemv_cuda(n0, w))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,K", [(1024, 3584), (2560, 9216), (4096, 12288), (5120, 17408), (33, 8)])
def test_gemv_silu_mul_is_silu_mul_then_gemv(N, K, dtype):
    """The MLP's down projections of every Qwen3.5 size: the fused launch bit for bit silu_mul.cu then gemv
    with each row group on one warp (as it sums them); as the model calls it, silu_mul.cu then gemv."""
    from qwen35_fast.kernels.gemv.launch import gemv_cuda, gemv_silu_mul_cuda
    from qwen35_fast.kernels.silu_mul.launch import silu_mul_cuda
    g = torch.Generator(device="cuda").manual_seed(N + K)
    gu = (torch.randn(1, 1, 2 * K, generator=g, device="cuda") * 3).to(dtype)
    w = (torch.randn(N, K, generator=g, device="cuda") * 0.05).to(dtype)
    poison_allocator(((1, 1, N), dtype))
    y = gemv_silu_mul_cuda(gu, w, fuse=True)
    assert not y.isnan().any() and torch.equal(y, gemv_cuda(silu_mul_cuda(gu), w, split=1))
    assert torch.equal(gemv_silu_mul_cuda(gu, w), gemv_cuda(silu_mul_cuda(gu), w))  # fused or not, as fuses says


@pytest.mark.gpu
def test_fused_projections_fall_back_to_their_two_launches():
    """A hidden size not a multiple of 256, two rows, a norm weight of another length: the two launches."""
    from qwen35_fast.kernels.gemv.launch import gemv_add_rms_norm_cuda, gemv_cuda, gemv_silu_mul_cuda
    from qwen35_fast.kernels.rms_norm.launch import add_rms_norm_cuda
    from qwen35_fast.kernels.silu_mul.launch import silu_mul_cuda
    g = torch.Generator(device="cuda").manual_seed(21)
    for shape, K in (((1, 1, 192), 192), ((2, 256), 256)):
        res, x = (torch.randn(*shape, generator=g, device="cuda").bfloat16() for _ in range(2))
        nw, w = torch.randn(K, generator=g, device="cuda"), torch.randn(24, K, generator=g, device="cuda").bfloat16()
        s, y = gemv_add_rms_norm_cuda(res, x, nw, 1e-6, w)
        s0, n0 = add_rms_norm_cuda(res, x, nw, 1e-6)
        assert torch.equal(s, s0) and torch.equal(y, gemv_cuda(n0, w))
    gu, w = torch.randn(2, 64, generator=g, device="cuda").bfloat16(), torch.randn(8, 32, device="cuda").bfloat16()
    assert torch.equal(gemv_silu_mul_cuda(gu, w), gemv_cuda(silu_mul_cuda(gu), w))


@pytest.mark.gpu
def test_a_decode_step_with_fused_norms_is_the_unfused_step_bit_for_bit(tmp_path, monkeypatch):
    """A model of hidden size 256 (the fused kernels take it): one decode step's logits, and 12 greedy tokens
    in the step's CUDA graph, with the residual adds, norms and MLP gates formed inside the projections
    equal those with each as its own launch (the kernels' public calls replaced by their two launches)."""
    from qwen35_fast.runtime import generate, prefill

    from _models import kernels_model, spy_graphs
    model = kernels_model(tmp_path, seed=13, hidden=256, inter=512)
    steps = spy_graphs(monkeypatch)
    model.set_decode_gemv(True)
    pf = prefill(model, "Describe a lighthouse at dusk in one sentence.")
    ids = torch.tensor([int(pf.logits.argmax())], device="cuda")
    logits, tokens = {}, {}
    for fused in (True, False):
        if not fused:
            def add_norm(res, x, nw, eps, w, backend=None, scale=None):
                s, n = (kernels.add_rms_norm(res, x, nw, eps, backend=backend) if x is not None
                        else (res, kernels.rms_norm(res, nw, eps, backend=backend)))
                return s, kernels.gemv(n, w, backend=backend, scale=scale)
            monkeypatch.setattr(kernels, "gemv_add_rms_norm", add_norm)
            monkeypatch.setattr(kernels, "gemv_silu_mul", lambda gu, w, backend=None, scale=None: kernels.gemv(
                kernels.silu_mul(gu, backend=backend), w, backend=backend, scale=scale))
            model.set_decode_gemv(True)  # captured passes are made again
        cache = pf.cache.clone(pf.cache.length + 8)
        logits[fused] = model.forward_decode(ids, cache).float()
        tokens[fused] = generate(model, pf, max_new_tokens=12).token_ids
    assert torch.equal(logits[True], logits[False])
    assert len(steps) == 2 and all(g is not None for g in steps)  # both generations in the step's graph
    assert tokens[True] == tokens[False]


def test_int8_reference_is_the_fp32_product_times_the_scale_in_row_pieces(monkeypatch):
    """gemv_ref with a scale: (q x) in fp32 times the row's scale, rounded once; the rows converted a few at a
    time give what all at once gives."""
    from qwen35_fast.kernels.gemv import reference
    g = torch.Generator().manual_seed(5)
    q, s = int8_rows(70, 64, g, "cpu", torch.bfloat16)
    x = torch.randn(1, 1, 64, generator=g).bfloat16()
    want = ((x.float() @ q.float().T) * s.float()).bfloat16()
    assert torch.equal(reference.gemv_ref(x, q, s), want)
    monkeypatch.setattr(reference, "ROWS_AT_ONCE_BYTES", 64 * 4 * 8)  # 8 rows at a time
    assert torch.equal(reference.gemv_ref(x, q, s), want)


@pytest.mark.parametrize("n_rows,k,split", [
    (4096, 4096, 2), (2560, 4096, 2), (2048, 6144, 2), (4096, 12288, 2),  # 9B / 4B out_proj, 2B / 9B down
    (1024, 3584, 1), (12352, 4096, 1), (1024, 17408, 4), (5, 24576, 4)])
def test_int8_rows_split_by_their_weights(n_rows, k, split):
    """An int8 row's run is counted in weights as a 16-bit row's is (half the 16-byte pieces): a row group is
    shared only where each warp keeps MIN_RUN weights of it and the warps fit one grid."""
    assert split_of(n_rows, k, 132) == split
    assert split == 1 or k // split >= MIN_RUN


@pytest.mark.gpu
def test_takes_int8_rows_with_their_scales():
    x = torch.empty(1, 4096, dtype=torch.bfloat16, device="cuda")
    q = torch.empty(64, 4096, dtype=torch.int8, device="cuda")
    s = torch.empty(64, dtype=torch.bfloat16, device="cuda")
    assert takes(x, q, s) and not takes(x, q)  # int8 without its scales is no 16-bit matrix
    assert not takes(x, q, s.half()) and not takes(x, q, s[:32]) and not takes(x, q, s.float())
    assert not takes(x[..., :4088], q[:, :4088], s)  # K not a multiple of 16
    assert not takes(x[..., :4080], q[:, 8:4088], s)  # rows not 16-byte aligned


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,K", [(1, 16), (3, 80), (17, 1024), (4096, 4096), (12352, 4096), (4096, 12288),
                                 (1024, 17408), (248320, 1024), (5, 24576)])
def test_int8_gemv_is_the_scaled_product_rounded_once(N, K, dtype):
    """y = (q x) * s: the fp32 sums' order and one rounding from the exact value, row groups split between
    warps where split_of says (4096 x 12288, 1024 x 17408, 5 x 24576) or not."""
    g = torch.Generator(device="cuda").manual_seed(N * 17 + K)
    q, s = int8_rows(N, K, g, "cuda", dtype)
    x = torch.randn(1, 1, K, generator=g, device="cuda").to(dtype)
    poison_allocator(((1, 1, N), dtype))
    y = kernels.gemv(x, q, backend=kernels.select_backend("cuda", "cuda"), scale=s)
    assert y.shape == (1, 1, N) and y.dtype == dtype and not y.isnan().any()
    exact = (x.double() @ q.double().T) * s.double()
    gamma = (16 * -(-K // 512) + 8) * 2.0 ** -24 * 1.01  # a lane's sums (16 a piece), the shuffles, the scale
    size = (q.double().abs() @ x.double().abs().view(K)).view(1, 1, N) * s.double()
    bound = exact.abs() * ULP[dtype] + gamma * size * (1 + ULP[dtype])
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.gpu
@pytest.mark.parametrize("K,N", [(1024, 8224), (2560, 18432), (4096, 12352)])
def test_int8_fused_products_are_their_two_launches(K, N):
    """With int8 rows as with 16-bit ones: the residual add and norm, or the MLP's gate, formed as x is staged
    give the two launches' values bit for bit (each row group on one warp, as the fused kernel sums it)."""
    from qwen35_fast.kernels.gemv.launch import gemv_add_rms_norm_cuda, gemv_cuda, gemv_silu_mul_cuda
    from qwen35_fast.kernels.rms_norm.launch import add_rms_norm_cuda
    from qwen35_fast.kernels.silu_mul.launch import silu_mul_cuda
    g = torch.Generator(device="cuda").manual_seed(K)
    res, x = (torch.randn(1, 1, K, generator=g, device="cuda").bfloat16() for _ in range(2))
    nw = torch.randn(K, generator=g, device="cuda") * 0.2
    q, s = int8_rows(N, K, g, "cuda", torch.bfloat16)
    poison_allocator(((1, 1, N), torch.bfloat16))
    h, y = gemv_add_rms_norm_cuda(res, x, nw, 1e-6, q, fuse=True, scale=s)
    h0, n0 = add_rms_norm_cuda(res, x, nw, 1e-6)
    assert torch.equal(h, h0) and not y.isnan().any() and torch.equal(y, gemv_cuda(n0, q, split=1, scale=s))
    q2, s2 = int8_rows(K, N // 2, g, "cuda", torch.bfloat16)  # a down projection of half the width
    gu = (torch.randn(1, 1, N // 2 * 2, generator=g, device="cuda") * 3).bfloat16()
    y = gemv_silu_mul_cuda(gu, q2, fuse=True, scale=s2)
    assert not y.isnan().any() and torch.equal(y, gemv_cuda(silu_mul_cuda(gu), q2, split=1, scale=s2))


def test_the_fused_norms_fake_gives_the_sum_in_the_activations_dtype():
    """gemv_add_rms_norm returns s = res + x in x's dtype and the product of its norm in that dtype too (as
    add_rms_norm does), whatever dtype the residual has: the op's fake (what torch.compile plans with) says so."""
    from qwen35_fast.kernels import ops
    g = torch.Generator().manual_seed(5)
    res, x = torch.randn(1, 256, generator=g), torch.randn(1, 256, generator=g).bfloat16()
    nw, w = torch.randn(256, generator=g) * 0.1, torch.randn(40, 256, generator=g).bfloat16()
    s, y = ops.gemv_add_rms_norm_op(res, x, nw, 1e-6, w, None, False)
    assert s.dtype == y.dtype == torch.bfloat16
    torch.library.opcheck(ops.gemv_add_rms_norm_op, (res, x, nw, 1e-6, w, None, False),
                          test_utils=("test_schema", "test_faketensor"))
