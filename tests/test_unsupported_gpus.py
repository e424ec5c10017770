"""GPUs and setups the CUDA kernels do not take, checked on the CPU with the card, CuPy, NVRTC and the driver faked:
cards before Ampere (Pascal, Volta, Turing) get a dtype they compute in and the PyTorch path with one message;
a missing, broken or too old CuPy / NVRTC, a driver older than NVRTC, ROCm, mps and xpu all end on the PyTorch
path with the reason and the fix, never an exception out of select_backend."""
import contextlib
import importlib.abc
import importlib.machinery
import sys

import pytest
import torch

from qwen35_fast import kernels
from qwen35_fast.kernels import cuda_build as cb
from qwen35_fast.runtime import Qwen35Error, devices, loader


def fake_card(monkeypatch, capability=(8, 6), name="Test Card", hip=None, cuda="12.8", cupy=True):
    """One CUDA card of `capability` as torch reports it, torch built for `cuda` (ROCm where `hip` is set),
    with or without CuPy; the backend's notes of this process cleared."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.version, "cuda", None if hip else cuda, raising=False)
    monkeypatch.setattr(kernels, "_warned", set())
    monkeypatch.setattr(cb, "_cards", {})  # (on a GPU machine the real card is kept there by the tests before)
    if not cupy:
        monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
        monkeypatch.delitem(sys.modules, "qwen35_fast.kernels.cuda_impl", raising=False)
        monkeypatch.delattr(kernels, "cuda_impl", raising=False)


def fallback_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "fall back to PyTorch" in r.getMessage()]


# ----------------------------------------------------------------------------- the dtype 'auto' takes

@pytest.mark.parametrize("capability, card, bf16_runs, dtype", [
    ((9, 0), "H100", True, torch.bfloat16), ((8, 6), "RTX 3090", True, torch.bfloat16),
    ((8, 0), "A100", True, torch.bfloat16), ((7, 5), "Tesla T4", True, torch.bfloat16),
    ((7, 0), "Tesla V100", True, torch.bfloat16), ((6, 1), "GTX 1080", False, torch.float32),
    ((5, 2), "Tesla M40", False, torch.float32)])
def test_auto_dtype_is_one_the_card_computes_in(monkeypatch, capability, card, bf16_runs, dtype):
    """bf16 where a bf16 matmul runs (Volta and Turing emulate it: slower than their fp16, but Qwen's activations
    overflow fp16), fp32 where cuBLAS refuses it (Pascal and before); never fp16 unless chosen. From Ampere on the
    card is not probed."""
    fake_card(monkeypatch, capability, card)
    monkeypatch.setattr(devices, "bf16_works", lambda device: bf16_runs if capability[0] < 8 else
                        pytest.fail("probed a card with bf16 of its own"))
    assert loader.resolve_dtype("auto", torch.device("cuda")) == dtype
    assert loader.resolve_dtype("auto", torch.device("cuda", 0)) == dtype


def test_auto_dtype_on_rocm_is_bf16(monkeypatch):
    """AMD GPUs report their gfx version as the capability: not compared with NVIDIA's."""
    fake_card(monkeypatch, (6, 0), "AMD Instinct MI50", hip="6.4")
    assert devices.cuda_auto_dtype(torch.device("cuda")) == torch.bfloat16


def test_bf16_chosen_on_a_card_whose_matmul_refuses_it_is_told_before_loading(monkeypatch):
    fake_card(monkeypatch, (6, 1), "NVIDIA GeForce GTX 1080")
    monkeypatch.setattr(devices, "bf16_works", lambda device: False)
    with pytest.raises(Qwen35Error, match=r"dtype 'bf16' chosen, but a bf16 matmul does not run on NVIDIA GeForce "
                                          r"GTX 1080 \(compute capability 6.1, .*\); choose dtype 'auto' \(fp32 "
                                          r"there\) or 'fp16'"):
        loader.resolve_dtype("bf16", torch.device("cuda"))
    assert loader.resolve_dtype("fp16", torch.device("cuda")) == torch.float16
    fake_card(monkeypatch, (7, 5), "Tesla T4")  # emulated there, slowly: the user's choice stands
    monkeypatch.setattr(devices, "bf16_works", lambda device: True)
    assert loader.resolve_dtype("bf16", torch.device("cuda")) == torch.bfloat16
    fake_card(monkeypatch, (8, 9), "RTX 4090")  # no probe where bf16 is the card's own
    monkeypatch.setattr(devices, "bf16_works", lambda device: pytest.fail("probed an Ada card"))
    assert loader.resolve_dtype("bf16", torch.device("cuda")) == torch.bfloat16


# ----------------------------------------------------------------------------- cards before Ampere

@pytest.mark.parametrize("capability", [(7, 5), (7, 0), (6, 1)])
def test_an_older_card_runs_the_pytorch_path_told_once_without_cupy_asked(monkeypatch, caplog, capability):
    fake_card(monkeypatch, capability, "Old Card")
    monkeypatch.setitem(sys.modules, "cupy", None)  # CuPy is not even imported for such a card
    monkeypatch.delitem(sys.modules, "qwen35_fast.kernels.cuda_impl", raising=False)
    monkeypatch.delattr(kernels, "cuda_impl", raising=False)
    with caplog.at_level("WARNING"):
        got = [kernels.select_backend("auto", "cuda", torch.float16) for _ in range(3)]
        got.append(kernels.select_backend("auto", "cuda:0", torch.float16))
    assert all(b.name == "torch" for b in got)
    assert "compute capability 8.0 or newer; Old Card (compute capability %d.%d) is older" % capability in got[0].reason
    assert len(fallback_warnings(caplog)) == 1
    assert kernels.hopper_card("cuda") is False and kernels.compile_ahead("cuda") == 0
    with pytest.raises(RuntimeError, match=r"kernel backend 'cuda' chosen, but CUDA kernels need compute capability "
                                           r"8.0 or newer; .*; choose kernel backend 'auto' or 'torch'"):
        kernels.select_backend("cuda", "cuda", torch.float16)


# ----------------------------------------------------------------------------- CuPy and NVRTC

def test_no_cupy_under_a_pytorch_for_cuda_11_is_told_the_pytorch_it_needs(monkeypatch):
    """install.py has no CuPy for CUDA 11: "run install.py" would be the wrong fix."""
    fake_card(monkeypatch, cuda="11.8", cupy=False)
    b = kernels.select_backend("auto", "cuda", torch.bfloat16)
    assert b.name == "torch" and "CuPy is not installed" in b.reason
    assert "the kernels need a PyTorch built for CUDA 12 or 13 (this one is built for CUDA 11)" in b.reason
    assert "install.py" in b.reason and "installs the CuPy" not in b.reason


class _BrokenCupy(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import cupy` fails with an AttributeError, as a CuPy built for another NumPy does."""

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "cupy" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise AttributeError("module 'numpy' has no attribute 'bool8'")


def test_a_cupy_that_fails_on_import_is_the_pytorch_path_not_a_traceback(monkeypatch, caplog):
    fake_card(monkeypatch)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.delitem(sys.modules, "qwen35_fast.kernels.cuda_impl", raising=False)
    monkeypatch.delattr(kernels, "cuda_impl", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenCupy()] + sys.meta_path)
    with caplog.at_level("WARNING"):
        b = kernels.select_backend("auto", "cuda", torch.bfloat16)
        kernels.select_backend("auto", "cuda", torch.bfloat16)
    assert b.name == "torch"
    assert "CuPy is installed but cannot be imported (AttributeError: module 'numpy' has no attribute" in b.reason
    assert "reinstall the CuPy that matches this PyTorch's CUDA" in b.reason
    assert len(fallback_warnings(caplog)) == 1


@pytest.mark.parametrize("torch_cuda, fix", [
    ("12.8", "install 'cupy-cuda12x' in place of this CuPy, and 'nvidia-cuda-nvrtc-cu12==12.8.*'"),
    ("11.8", "the kernels need a PyTorch built for CUDA 12 or 13 (this one is built for CUDA 11)")])
def test_an_nvrtc_older_than_cuda_12_is_refused_before_it_builds_the_probe(monkeypatch, torch_cuda, fix):
    """A CuPy for CUDA 11 loads NVRTC 11, which builds the probe kernel but not every kernel: without this the
    backend would be chosen and a prompt fail on a kernel NVRTC 11 cannot compile."""
    monkeypatch.setattr(torch.version, "cuda", torch_cuda, raising=False)
    monkeypatch.setattr(cb, "nvrtc_version", lambda: (11, 8))
    with pytest.raises(cb.KernelBuildError, match=r"NVRTC 11.8 is older than the kernels take \(CUDA 12 or 13\)") as e:
        cb.arch_for_capability(8, 6)
    assert fix in str(e.value)


# ----------------------------------------------------------------------------- a driver older than NVRTC

@pytest.fixture
def refusing_driver(monkeypatch, tmp_path):
    """get_function's module loading on the CPU: every module is compiled (counted) into tmp_path and the driver,
    of `state["driver"]` (cudaDriverGetVersion's number), refuses each with `state["error"]`."""
    import cupy
    state = {"compiled": 0, "driver": 12040, "error": "CUDA_ERROR_UNSUPPORTED_PTX_VERSION: the provided PTX was "
                                                      "compiled with an unsupported toolchain."}

    def load_or_compile(source, src_path, arch, defines):
        state["compiled"] += 1
        path = tmp_path / f"{src_path.stem}-{arch}.ptx"
        path.write_text("// PTX")
        return path

    class Module:
        def __init__(self, path):
            raise RuntimeError(state["error"])
    monkeypatch.setattr(cb, "_load_or_compile", load_or_compile)
    monkeypatch.setattr(cupy, "RawModule", Module)
    monkeypatch.setattr(cupy.cuda, "Device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(cupy.cuda.runtime, "driverGetVersion", lambda: state["driver"])
    monkeypatch.setattr(cb, "nvrtc_version", lambda: (12, 9))
    return state


def test_a_driver_older_than_nvrtc_names_the_fix_without_compiling_again(refusing_driver, caplog):
    src = cb.KERNELS_DIR / "probe.cu"
    with caplog.at_level("WARNING"), pytest.raises(cb.KernelBuildError) as e:
        cb._load_function(src.read_text(), src, "compute_90", None, "probe_scale", 0)
    assert "UNSUPPORTED_PTX_VERSION" in str(e.value)
    assert ("the NVIDIA driver runs CUDA 12.4, older than the NVRTC 12.9 that compiled it: update the NVIDIA "
            "driver, or pip install 'nvidia-cuda-nvrtc-cu12==12.4.*'") in str(e.value)
    assert refusing_driver["compiled"] == 1  # compiled again, it would be refused again
    assert "cached kernel module" not in caplog.text  # nothing was cached: no such note


def test_a_refused_module_under_a_driver_of_an_older_cuda_major_names_the_driver_update(refusing_driver,
                                                                                        monkeypatch):
    refusing_driver.update(driver=12080, error="CUDA_ERROR_NO_BINARY_FOR_GPU: no kernel image is available")
    monkeypatch.setattr(cb, "nvrtc_version", lambda: (13, 0))
    src = cb.KERNELS_DIR / "probe.cu"
    with pytest.raises(cb.KernelBuildError, match=r"refused the kernel module .*, compiled just now .*the NVIDIA "
                                                  r"driver runs CUDA 12.8, older than the NVRTC 13.0 .*update the "
                                                  r"NVIDIA driver to one for CUDA 13.0 or newer"):
        cb._load_function(src.read_text(), src, "sm_86", None, "probe_scale", 0)
    assert refusing_driver["compiled"] == 2  # any other refusal: built again once, as a damaged cached module is


def test_a_driver_as_new_as_nvrtc_adds_no_driver_hint(refusing_driver):
    refusing_driver.update(driver=12090, error="CUDA_ERROR_INVALID_IMAGE: device kernel image is invalid")
    src = cb.KERNELS_DIR / "probe.cu"
    with pytest.raises(cb.KernelBuildError) as e:
        cb._load_function(src.read_text(), src, "sm_86", None, "probe_scale", 0)
    assert "NVIDIA driver" not in str(e.value)


def test_the_probe_refused_by_an_old_driver_is_the_pytorch_path_told_once(monkeypatch, caplog):
    """The whole way: cuda_status's probe fails as the driver refuses its module; the model runs on PyTorch and
    the user is told once, with the driver fix, however often the backend is chosen again (moves, reloads)."""
    from qwen35_fast.kernels import cuda_impl
    fake_card(monkeypatch, (12, 0), "NVIDIA GeForce RTX 5090")
    monkeypatch.setattr(cuda_impl, "_status", {})
    monkeypatch.setattr(cb, "supported_archs", lambda: (80, 86, 89, 90, 120))
    monkeypatch.setattr(cb, "nvrtc_version", lambda: (12, 9))

    def probe(device):
        raise cb.KernelBuildError("the CUDA driver refused the kernel module probe.cubin (CUDA_ERROR_UNSUPPORTED_"
                                  "PTX_VERSION)" + "; the NVIDIA driver runs CUDA 12.8, older than the NVRTC 12.9 "
                                  "that compiled it: update the NVIDIA driver")
    monkeypatch.setattr(cuda_impl, "_probe", probe)
    with caplog.at_level("WARNING"):
        got = [kernels.select_backend("auto", "cuda", torch.bfloat16) for _ in range(3)]
    assert all(b.name == "torch" for b in got)
    assert got[0].reason.startswith("PyTorch fallback: CUDA kernels failed on NVIDIA GeForce RTX 5090 (compute "
                                    "capability 12.0): KernelBuildError: the CUDA driver refused")
    warned = fallback_warnings(caplog)
    assert len(warned) == 1 and "update the NVIDIA driver" in warned[0]
    assert any(r.name == "qwen35_fast.kernels" for r in caplog.records)  # a logger under the pack's: ComfyUI shows it


# ----------------------------------------------------------------------------- ROCm, mps, xpu

def test_rocm_is_the_pytorch_path_without_cupy_or_nvrtc_asked(monkeypatch):
    fake_card(monkeypatch, (9, 0), "AMD Instinct MI210", hip="6.4.1")
    monkeypatch.setattr(cb, "_nvrtc", lambda: pytest.fail("NVRTC asked on ROCm"))
    b = kernels.select_backend("auto", "cuda", torch.bfloat16)
    assert b.name == "torch" and "need an NVIDIA GPU; this PyTorch runs AMD GPUs through ROCm 6.4.1" in b.reason
    with pytest.raises(RuntimeError, match="choose kernel backend 'auto' or 'torch'"):
        kernels.select_backend("cuda", "cuda", torch.bfloat16)


@pytest.mark.parametrize("kind", ["mps", "xpu"])
def test_apple_and_intel_gpus_run_the_pytorch_path(monkeypatch, kind):
    dev = torch.device(kind)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        b = kernels.select_backend("auto", dev, dtype)
        assert b.name == "torch" and b.reason == f"PyTorch reference path (model on {kind})"
    with pytest.raises(RuntimeError, match=f"kernel backend 'cuda' needs a CUDA device, the model is on {kind}"):
        kernels.select_backend("cuda", dev, torch.bfloat16)
    assert kernels.hopper_card(dev) is False and kernels.compile_ahead(dev) == 0
    monkeypatch.setattr(loader, "bf16_works", lambda d: True)
    assert loader.resolve_dtype("auto", dev) == torch.bfloat16
    monkeypatch.setattr(loader, "bf16_works", lambda d: False)
    assert loader.resolve_dtype("auto", dev) == torch.float32

