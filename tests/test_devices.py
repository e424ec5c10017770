"""Accelerators other than CUDA (Apple's mps, Intel's xpu, ...): the PyTorch path runs there after a check on a
short prompt, and where PyTorch cannot use the device, or the check fails, the error names it and the fix (the
loader node then loads on the CPU). This machine has none of them: the check runs on the CPU standing in for
one, and a failing operator is simulated."""
import gc

import pytest
import torch

from qwen35_fast import kernels
from qwen35_fast.kernels import cuda_impl
from qwen35_fast.runtime import DeviceUnsupported, Qwen35Error, Qwen35Model, devices, load_model, loader, prefill

from _models import make_hf_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("ck")
    make_hf_model(f, seed=5, vocab=248320, max_pos=4096)
    return f


@pytest.fixture
def cpu_as_accelerator(monkeypatch):
    """The CPU taken for an accelerator other than CUDA by the loader (the check runs there)."""
    monkeypatch.setattr(loader, "is_other_accelerator", lambda d: True)


def unusable(kind: str) -> bool:
    return devices.usable(torch.device(kind)) is not None


@pytest.mark.skipif(not unusable("mps"), reason="this machine has an Apple GPU")
def test_an_accelerator_pytorch_cannot_use_here_names_it_and_the_fix(folder):
    with pytest.raises(DeviceUnsupported, match=r"device 'mps' asked for, but PyTorch \S+ cannot use it here "
                                                r"\(.+\); choose device 'cpu' or 'auto'"):
        load_model(folder, device="mps")


def test_the_check_runs_the_model_and_the_model_then_works(folder, cpu_as_accelerator, monkeypatch):
    ran = []
    real = devices.check_device
    monkeypatch.setattr(loader, "check_device", lambda m: ran.append(real(m)))
    model = load_model(folder, dtype="fp32", device="cpu")
    assert len(ran) == 1 and model.vision is not None  # the check took the image path too
    pf = prefill(model, "Hello")
    assert pf.logits.shape == (model.config.vocab_size,)


@pytest.mark.parametrize("where", ["text", "sampling", "vision"])
def test_an_operator_missing_on_the_device_fails_the_load_with_the_fix(folder, cpu_as_accelerator, monkeypatch,
                                                                        where):
    def missing(*args, **kwargs):
        raise NotImplementedError("The operator 'aten::frobnicate' is not currently implemented for the MPS device")

    if where == "text":
        monkeypatch.setattr(kernels, "rms_norm", missing)
    elif where == "sampling":
        monkeypatch.setattr(kernels, "sample", missing)
    else:
        monkeypatch.setattr(kernels, "vision_positions", missing)
    gc.collect()
    before = sum(isinstance(o, Qwen35Model) for o in gc.get_objects())
    with pytest.raises(DeviceUnsupported, match=r"the model does not run on cpu with PyTorch \S+ \(NotImplementedError: "
                                                r"The operator 'aten::frobnicate' .*\); load it on the cpu \(device 'cpu'\)"):
        try:
            load_model(folder, dtype="fp32", device="cpu")
        except DeviceUnsupported:  # the error holds no model: a caller may load on the CPU while it handles it
            gc.collect()
            assert sum(isinstance(o, Qwen35Model) for o in gc.get_objects()) == before
            raise


def test_other_device_strings(folder):
    with pytest.raises(Qwen35Error, match=r"device 'tpu9' is not one of auto, cpu, cuda, cuda:N \(or another "
                                          r"accelerator PyTorch knows"):
        load_model(folder, device="tpu9")


def test_auto_dtype_is_bf16_where_the_accelerator_runs_it(monkeypatch):
    mps = torch.device("mps")
    assert loader.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setattr(loader, "bf16_works", lambda d: False)
    assert loader.resolve_dtype("auto", mps) == torch.float32
    monkeypatch.setattr(loader, "bf16_works", lambda d: True)
    assert loader.resolve_dtype("auto", mps) == torch.bfloat16
    assert devices.bf16_works(torch.device("cpu"))  # the probe itself, where bf16 runs


def test_rocm_is_told_the_kernels_need_an_nvidia_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.4.1", raising=False)
    ok, reason = cuda_impl.cuda_status(torch.device("cuda"))
    assert not ok and reason == "CUDA kernels need an NVIDIA GPU; this PyTorch runs AMD GPUs through ROCm 6.4.1"
    be = kernels.select_backend("auto", "cuda", torch.bfloat16)
    assert be.name == "torch" and "ROCm 6.4.1" in be.reason



def test_free_memory_of_other_accelerators(monkeypatch):
    from qwen35_fast.runtime.memory import free_bytes
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 48 << 30)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 10 << 30)
    assert free_bytes(torch.device("mps")) == (38 << 30, 48 << 30)
    monkeypatch.setattr(torch.xpu, "mem_get_info", lambda d: (3 << 30, 16 << 30))
    assert free_bytes(torch.device("xpu", 0)) == (3 << 30, 16 << 30)
    free, total = free_bytes(torch.device("cpu"))
    assert 0 < free <= total
