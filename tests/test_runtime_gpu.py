"""The runtime on a GPU: kernels vs the PyTorch path, graphed decode vs eager decode."""
import pytest
import torch

from qwen35_fast.runtime import SamplingParams, generate, load_model, prefill_ids

from _models import make_hf_model, rel

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("gpu")
    make_hf_model(f, seed=4, vocab=248320, head_dim_lin=128)
    return f


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_kernels_match_the_pytorch_path(folder, dtype):
    model = load_model(folder, dtype=dtype, device="cuda", backend="cuda")
    assert model.backend.name == "cuda"
    ids = list(torch.randint(0, 248000, (300,), generator=torch.Generator().manual_seed(0)).tolist())
    ours = prefill_ids(model, ids).logits
    model.set_backend("torch")
    ref = prefill_ids(model, ids).logits
    assert rel(ours, ref) < 2e-2


def test_graphed_decode_gives_what_eager_decode_gives(folder, monkeypatch):
    model = load_model(folder, dtype="bf16", device="cuda", backend="cuda")
    pf = prefill_ids(model, list(range(7000, 7100)))
    sampled = SamplingParams(do_sample=True, temperature=0.8, top_p=0.9)
    graphed = [generate(model, pf, max_new_tokens=24, sampling=s, seed=3) for s in (SamplingParams(), sampled)]
    monkeypatch.setenv("QWEN35_CUDA_GRAPHS", "0")
    eager = [generate(model, pf, max_new_tokens=24, sampling=s, seed=3) for s in (SamplingParams(), sampled)]
    for g, e in zip(graphed, eager):
        assert g.token_ids == e.token_ids


def test_a_prefill_moved_to_ram_generates_the_same(folder):
    """ComfyUI unloads the model and parks cached prefills in RAM; generate brings the state back."""
    model = load_model(folder, dtype="bf16", device="cuda")
    pf = prefill_ids(model, list(range(9000, 9100)))
    before = generate(model, pf, max_new_tokens=12)
    pf.cache.to("cpu")
    assert all(t is None or t.device.type == "cpu" for t in pf.cache.ssm + pf.cache.k)
    assert generate(model, pf, max_new_tokens=12).token_ids == before.token_ids


def test_repeated_generations_do_not_grow_vram_and_workspaces_free():
    from qwen35_fast.runtime import demo_checkpoint, free_gpu_workspaces
    model = load_model(demo_checkpoint(), dtype="bf16", device="cuda", backend="auto")
    pf = prefill_ids(model, list(range(1000, 1040)))
    assert pf.logits.device.type == "cpu"  # a cached prefill holds no VRAM beyond its state
    generate(model, pf, max_new_tokens=8)
    torch.cuda.synchronize()
    after_one = torch.cuda.memory_allocated()
    for seed in range(4):  # each capture used a fresh pool stream once: one cuBLAS workspace apiece
        generate(model, pf, max_new_tokens=8, seed=seed)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == after_one
    weights = model.size_bytes()
    model.to("cpu")
    pf.cache.to("cpu")
    free_gpu_workspaces()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() < after_one - weights + 2**20
