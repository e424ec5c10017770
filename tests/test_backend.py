"""Which backend runs the custom kernels, and the reason the user is given (decided without touching a GPU)."""
import pytest
import torch

from qwen35_fast import kernels


def test_torch_requested():
    b = kernels.select_backend("torch", "cuda", torch.bfloat16)
    assert b.name == "torch" and not b.use_cuda and "requested" in b.reason


def test_cpu_device():
    assert kernels.select_backend("auto", "cpu").name == "torch"
    with pytest.raises(RuntimeError, match="needs a CUDA device, the model is on cpu"):
        kernels.select_backend("cuda", "cpu")


def test_fp32_models_run_the_pytorch_path():
    b = kernels.select_backend("auto", "cuda", torch.float32)
    assert b.name == "torch" and "take bf16/fp16, the model is float32" in b.reason
    with pytest.raises(RuntimeError, match="take bf16 or fp16, the model is float32"):
        kernels.select_backend("cuda", "cuda", torch.float32)


def test_fp16_models_are_told_where_attention_runs(monkeypatch, caplog):
    """The kernels run an fp16 model but for the paged attention (bf16 only): the reason says so, logged once."""
    import sys
    import types
    fake = types.ModuleType("qwen35_fast.kernels.cuda_impl")
    fake.cuda_status = lambda device: (True, "CUDA kernels on a test card")
    monkeypatch.setitem(sys.modules, "qwen35_fast.kernels.cuda_impl", fake)
    monkeypatch.setattr(kernels, "cuda_impl", fake, raising=False)
    monkeypatch.setattr(kernels, "_warned", set())
    monkeypatch.setattr(kernels, "card_unfit", lambda device: "")
    with caplog.at_level("WARNING"):
        half = [kernels.select_backend("auto", "cuda", torch.float16) for _ in range(2)]
        bf16 = kernels.select_backend("auto", "cuda", torch.bfloat16)
    assert half[0].name == "cuda" and "fp16: attention over the K/V cache runs on the PyTorch path" in half[0].reason
    assert bf16.name == "cuda" and bf16.reason == "CUDA kernels on a test card"
    assert sum("load the model as bf16" in r.getMessage() for r in caplog.records) == 1


def fake_card(monkeypatch, capability=(8, 9), hip=None, cupy=True):
    """A CUDA card of `capability` as torch reports it (ROCm where `hip` is a version), with or without CuPy."""
    import sys
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Test Card")
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(kernels, "_warned", set())
    if not cupy:
        monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
        monkeypatch.delitem(sys.modules, "qwen35_fast.kernels.cuda_impl", raising=False)
        monkeypatch.delattr(kernels, "cuda_impl", raising=False)


@pytest.mark.parametrize("cupy", [True, False])
def test_cards_the_kernels_cannot_run_on_are_named_before_cupy_is_asked(monkeypatch, cupy):
    """An AMD card (ROCm) or one older than compute capability 8.0 is told so whether CuPy is there or not (a
    ROCm install gets no CuPy from install.py: "install CuPy" would be the wrong fix)."""
    fake_card(monkeypatch, hip="6.4", cupy=cupy)
    b = kernels.select_backend("auto", "cuda", torch.bfloat16)
    assert b.name == "torch" and "need an NVIDIA GPU; this PyTorch runs AMD GPUs through ROCm 6.4" in b.reason
    fake_card(monkeypatch, capability=(7, 5), cupy=cupy)
    with pytest.raises(RuntimeError, match=r"compute capability 8.0 or newer; Test Card \(compute capability 7.5\)"):
        kernels.select_backend("cuda", "cuda", torch.bfloat16)


def test_a_card_without_cupy_is_told_how_to_install_it(monkeypatch, caplog):
    fake_card(monkeypatch, cupy=False)
    with caplog.at_level("WARNING"):
        b = kernels.select_backend("auto", "cuda", torch.bfloat16)
    assert b.name == "torch" and b.reason.startswith("PyTorch fallback: CuPy is not installed (")
    assert "run `python install.py` in the pack's folder with ComfyUI's Python" in b.reason
    assert "then restart ComfyUI" in caplog.text


def test_unknown_backend():
    with pytest.raises(ValueError, match="'triton' is not one of auto, cuda, torch"):
        kernels.select_backend("triton", "cpu")


def test_a_second_import_of_the_pack_shares_its_ops():
    """With the repository root on sys.path (pytest does that for a checkout whose folder name has a
    dash), anything that imports a top-level `kernels` (transformers up to 5.24 probed for the Hugging Face
    package that way; 5.25 depends on that package and imports it by name) gets our kernels/ folder: a
    second import of the pack. It must reuse the registered ops; registering them again left the first ones
    dangling and their next call failed ("vector::reserve") or segfaulted. The second import is made here
    directly, as that probe made it."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = f"""
import gc, sys
sys.path.insert(0, {str(root / "bench")!r})
import _import  # the repository as qwen35_fast
import torch
import qwen35_fast.kernels.ops as first
sys.path.insert(0, {str(root)!r})
import kernels.ops  # a top-level `kernels`: ours, a second time
assert sys.modules["kernels"].__file__.startswith({str(root)!r})
N, Hk, Hv, D = 1, 2, 4, 128
args = lambda: (torch.randn(N, Hk, D), torch.randn(N, Hk, D), torch.randn(N, Hv, D), torch.randn(N, Hv),
                torch.randn(N, Hv), torch.zeros(Hv), torch.zeros(Hv), torch.randn(N, Hv, D, D), False)
gc.collect()
for _ in range(3):
    assert first.gdn_decode_step_op(*args()).shape == (N, Hv, D)
    assert sys.modules["kernels.ops"].gdn_decode_step_op(*args()).shape == (N, Hv, D)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


@pytest.mark.parametrize("error", [ImportError("No module named 'cupy'"), "old card"])
def test_a_gpu_the_kernels_cannot_describe_is_no_hopper_card(monkeypatch, error):
    """The model asks gemv_preferred (hopper_card) on every CUDA device, the PyTorch backend's too: on a GPU
    where CuPy or NVRTC is missing, or one older than compute capability 8.0 (card_of raises there), the
    answer is no, not an exception that stops the model from loading."""
    from qwen35_fast.kernels import cuda_build

    def card_of(device):
        if error == "old card":
            raise cuda_build.KernelBuildError("compute capability 7.5 is below 8.0, which the kernels need")
        raise error
    monkeypatch.setattr(cuda_build, "card_of", card_of)
    assert kernels.hopper_card("cuda") is False and kernels.gemv_preferred("cuda:0") is False
    assert kernels.hopper_card("cpu") is False
