"""kernels/dequant: an int8 matrix times its rows' scales, in the compute dtype (what a prompt's matmul with int8
weights multiplies by).

On the GPU, bit for bit against the PyTorch expression (the 16-bit patterns, so a sign of zero counts) over many
shapes and row slices (fresh, reproducible inputs; NaN-poisoned outputs; a zero, a negative zero and an
overflowing scale); the cases the kernel takes, and those it does not run the expression; the op's fake
implementation against the kernel; an int8 model reads a prompt through it to the logits the expression gives.
On any machine: the reference is the fp32 product rounded once, and the op's schema and fake implementation
(torch.compile) on the reference path."""
import pytest
import torch

from qwen35_fast import kernels
from qwen35_fast.kernels import ops
from qwen35_fast.kernels.dequant.launch import takes
from qwen35_fast.kernels.dequant.reference import dequant_rows_ref

from _models import int8_rows, poison_allocator


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_is_the_fp32_product_rounded_once(dtype):
    g = torch.Generator().manual_seed(1)
    q, s = int8_rows(37, 48, g, "cpu", dtype)
    y = dequant_rows_ref(q, s)
    assert y.dtype == dtype and y.shape == q.shape and y.is_contiguous()
    assert torch.equal(y, (q.float() * s.float()[:, None]).to(dtype))


def test_op_runs_the_reference_off_cuda_and_has_a_fake():
    g = torch.Generator().manual_seed(2)
    q, s = int8_rows(5, 32, g, "cpu", torch.bfloat16)
    be = kernels.select_backend("torch", "cpu")
    assert torch.equal(kernels.dequant_rows(q, s, backend=be), dequant_rows_ref(q, s))
    torch.library.opcheck(ops.dequant_rows_op, (q, s, False))


@pytest.mark.gpu
def test_takes():
    q = torch.empty(64, 4096, dtype=torch.int8, device="cuda")
    s = torch.empty(64, dtype=torch.bfloat16, device="cuda")
    assert takes(q, s) and takes(q[3:40], s[3:40]) and takes(q, s.half())
    assert not takes(q, s.float()) and not takes(q, s[:32]) and not takes(q.float(), s)
    assert not takes(q[:, :4088], s)  # a width not a multiple of 16
    assert not takes(q[:, 8:4088], s)  # rows not 16-byte aligned
    assert not takes(torch.empty(64, 4088, dtype=torch.int8, device="cuda")[:, :4080], s)  # a row stride of 4,088
    assert not takes(q, torch.empty(128, dtype=torch.bfloat16, device="cuda")[::2])  # scales not contiguous
    assert not takes(q.cpu(), s.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("R,C", [(1, 16), (3, 80), (17, 1024), (4097, 4096), (2560, 9216), (1024, 17408), (5, 24576)])
def test_kernel_is_the_expression_bit_for_bit(R, C, dtype):
    from qwen35_fast.kernels.dequant.launch import dequant_rows_cuda
    g = torch.Generator(device="cuda").manual_seed(R * 31 + C)
    q, s = int8_rows(R, C, g, "cuda", dtype)
    s[0] = 0  # a row of zeros' scale: negative zeros where q < 0
    poison_allocator(((R, C), dtype))
    y = dequant_rows_cuda(q, s)
    assert y.dtype == dtype and not y.isnan().any()
    assert torch.equal(_bits(y), _bits(dequant_rows_ref(q, s)))
    lo, hi = R // 3, R - R // 4  # a piece of the rows, as quant.linear takes them
    if hi > lo:
        assert torch.equal(_bits(dequant_rows_cuda(q[lo:hi], s[lo:hi])), _bits(dequant_rows_ref(q[lo:hi], s[lo:hi])))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_keeps_the_signs_and_overflows_of_the_expression(dtype):
    """A negative zero scale, a scale whose products overflow fp16, and one that underflows to subnormals:
    the kernel's 16-bit patterns are the expression's; the op's fake matches the kernel (opcheck on CUDA)."""
    from qwen35_fast.kernels.dequant.launch import dequant_rows_cuda
    g = torch.Generator(device="cuda").manual_seed(4)
    q, s = int8_rows(4, 2560, g, "cuda", dtype)
    s[0], s[1], s[2] = -0.0, 60000.0 if dtype == torch.float16 else 3e38, 1e-7
    y = dequant_rows_cuda(q, s)
    assert torch.equal(_bits(y), _bits(dequant_rows_ref(q, s))) and y[1].isinf().any()
    torch.library.opcheck(ops.dequant_rows_op, (q, s, True))


@pytest.mark.gpu
def test_what_the_kernel_does_not_take_runs_the_expression():
    from qwen35_fast.kernels.dequant.launch import dequant_rows_cuda
    g = torch.Generator(device="cuda").manual_seed(3)
    q, s = int8_rows(9, 72, g, "cuda", torch.bfloat16)
    odd_stride = torch.randint(-127, 128, (9, 88), generator=g, device="cuda", dtype=torch.int8)[:, :80]
    for qq, ss in ((q[:, :40], s), (q, s.float()), (q.t().contiguous().t()[:, :64], s), (odd_stride, s)):
        assert not takes(qq, ss) and torch.equal(_bits(dequant_rows_cuda(qq, ss)), _bits(dequant_rows_ref(qq, ss)))


@pytest.mark.gpu
def test_an_int8_prompt_reads_its_matrices_through_the_kernel(tmp_path, monkeypatch):
    """An int8 model on the kernels backend reads a prompt with each matrix dequantized by the kernel (every
    Int8Weight's rows, the LM head in pieces), to the logits the PyTorch expression gives bit for bit."""
    from qwen35_fast.kernels import cuda_impl
    from qwen35_fast.runtime import load_model, prefill, quant

    from _models import kernels_model
    kernels_model(tmp_path, seed=17, hidden=256, inter=512)  # the checkpoint and its tokenizer
    model = load_model(tmp_path, dtype="bf16", device="cuda", backend="cuda", weights="int8")
    monkeypatch.setattr(quant, "DEQUANT_BYTES", 64 << 10)  # the larger matrices in pieces of rows
    calls, real = [], cuda_impl.dequant_rows_cuda
    monkeypatch.setattr(cuda_impl, "dequant_rows_cuda", lambda q, s: calls.append(q.shape) or real(q, s))
    text = "Describe a lighthouse at dusk in one sentence."
    kernel = prefill(model, text, use_cache=False).logits
    # every layer's matrices but the last layer's, some in pieces (the embedding is looked up; the LM head and the
    # last layer's products after its K/V take the last token's row alone: gemv)
    last = f"blocks.{len(model.blocks) - 1}."
    layers = [m for name, m in model.named_modules()
              if isinstance(m, quant.Int8Weight) and name.startswith("blocks.") and not name.startswith(last)]
    assert layers and len(calls) > len(layers) and {tuple(c)[1] for c in calls} == {m.shape[1] for m in layers}
    monkeypatch.setattr(cuda_impl, "dequant_rows_cuda", dequant_rows_ref)
    assert torch.equal(kernel, prefill(model, text, use_cache=False).logits)
