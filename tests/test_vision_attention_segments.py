"""The vision attention kernel keeps its segments apart (GPU only; skipped without CUDA, and off sm_90a where the
kernel does not run).

A segment whose length is not a multiple of the 128-key tile reads, in its last key tile, the first tokens of the
next segment (the tensor map only zero-fills past token N). Their scores are masked to -inf, so P is exactly 0
there; their V rows are zeroed before P V, since 0 * inf and 0 * NaN are NaN: a non-finite V in the next segment
turned every row of the segment into NaN. Q and K of the next segment never reach it either (their rows are not
stored / their scores are replaced by -inf).
"""
import pytest
import torch

from qwen35_fast.kernels.vision.reference import vision_attention_ref

from _models import poison_allocator, rel

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _segment_inputs(lens, H, hd, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    n = sum(lens)
    q, k, v = ((torch.randn(n, H, hd, generator=g, device=DEV) * 2).bfloat16() for _ in range(3))
    cu = torch.tensor([0] + lens, device=DEV).cumsum(0).to(torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("hd", [72, 64])
@pytest.mark.parametrize("which,value", [("v", float("nan")), ("v", float("inf")), ("k", float("nan")),
                                         ("q", float("nan"))], ids=["v-nan", "v-inf", "k-nan", "q-nan"])
def test_vision_attention_segment_ignores_nonfinite_next_segment(impl, which, value, hd):
    """Two segments of 100 and 156 tokens; the second segment's q, k or v non-finite. The first segment's output
    must not depend on the second one (the reference attends within each segment): finite and equal to the
    attention of the first segment alone."""
    from qwen35_fast.kernels.vision.launch import attention_takes
    lens, H = [100, 156], 2
    q, k, v, cu = _segment_inputs(lens, H, hd, seed=hd)
    if not attention_takes(q, k, v, cu):
        pytest.skip("the vision attention kernel runs on sm_90a cards only")
    want = vision_attention_ref(q[:100].float(), k[:100].float(), v[:100].float(), cu[:2])
    {"q": q, "k": k, "v": v}[which][100:] = value
    poison_allocator(((sum(lens), H, hd), torch.bfloat16))
    got = impl.vision_attention_cuda(q, k, v, cu, max(lens))
    torch.cuda.synchronize()
    first = got[:100].float()
    assert torch.isfinite(first).all(), f"{which} = {value} in segment 2 reached segment 1's output"
    assert rel(first, want) < 1e-2
