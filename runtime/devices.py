"""Devices the runtime runs on: the CPU, NVIDIA GPUs (the CUDA kernels where they build, else PyTorch), and
the other accelerators PyTorch drives (Apple's `mps`, Intel's `xpu`, Ascend's `npu`, ...), where the PyTorch
path runs.

ComfyUI hands the loader the device it runs on. On an accelerator other than CUDA the kernels do not run
and not every PyTorch operator is there (which depends on the PyTorch and OS versions), so `load_model`
checks the model there once, on a short prompt through the paths a workflow takes (`check_device`), and
says what failed and what to choose instead.
"""
from __future__ import annotations

import torch

from .errors import Qwen35Error


class DeviceUnsupported(Qwen35Error):
    """The model cannot run on the device asked for (an accelerator PyTorch cannot use here, or one that
    lacks an operator the model needs); the CPU can run it."""


def is_other_accelerator(device: torch.device) -> bool:
    """A device that is neither the CPU nor CUDA (ROCm's GPUs are CUDA devices to PyTorch)."""
    return device.type not in ("cpu", "cuda")


def usable(device: torch.device) -> str | None:
    """None where PyTorch can make tensors on `device`, else why not (its error)."""
    if device.type == "meta":
        return "the meta device holds no data"
    try:
        torch.empty(1, device=device)
    except Exception as e:  # noqa: BLE001 - whatever the backend raises (a missing module, an assertion) says why
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{type(e).__name__}: {first[:200]}"
    return None


def bf16_works(device: torch.device) -> bool:
    """Whether a bf16 matmul runs on `device` (Apple's GPUs have bf16 from macOS 14)."""
    try:
        a = torch.ones(4, 4, dtype=torch.bfloat16, device=device)
        return float((a @ a).float().sum().cpu()) == 64.0
    except Exception:  # noqa: BLE001 - no bf16 there, however the backend says so
        return False


def cuda_auto_dtype(device: torch.device) -> torch.dtype:
    """What dtype 'auto' computes in on the CUDA `device`: bf16 from compute capability 8.0 (Ampere and newer;
    AMD GPUs under ROCm too) and on the older cards where a bf16 matmul runs (Volta, Turing: V100, T4, RTX 20xx,
    where PyTorch emulates it in fp32, slower than their fp16 but right), fp32 where it does not (Pascal and
    before: cuBLAS refuses bf16 products, CUBLAS_STATUS_NOT_SUPPORTED). Never fp16 by default: Qwen models are
    trained in bf16, and their activations overflow fp16's 65,504 in some layers (Qwen2 on V100 in fp16 answers
    with NaN, QwenLM/Qwen3 issues 826 and 868); fp16 stays a choice, and a NaN there is named with the fix.
    (torch.cuda.is_bf16_supported() would not tell: it counts the emulation, and asks the current device.)"""
    if getattr(torch.version, "hip", None):
        return torch.bfloat16
    major, _ = torch.cuda.get_device_capability(device)
    if major >= 8 or bf16_works(device):
        return torch.bfloat16
    return torch.float32


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (for timings); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        module = getattr(torch, device.type, None)
        sync = getattr(module, "synchronize", None)
        if sync is not None:
            try:
                sync(device)  # xpu and others: that device, not the current one
            except TypeError:  # mps: one device, no argument
                sync()


def empty_cache(device: torch.device) -> None:
    """Give the allocator's unused cached memory on `device` back."""
    module = torch.cuda if device.type == "cuda" else getattr(torch, device.type, None)
    release = getattr(module, "empty_cache", None) if device.type != "cpu" else None
    if release is not None:
        release()


def check_device(model) -> None:
    """Run the model once on a short prompt on an accelerator other than CUDA: a prefill, two sampled tokens
    with a repetition penalty, and, with a vision tower, a small image. Raises DeviceUnsupported naming what
    failed and the fix."""
    from .generate import generate, prefill_ids
    from .memory import is_out_of_memory
    from .sampling import SamplingParams

    dev = model.device
    try:
        ids = model.tokenizer.encode("Qwen")[:4] or [0]
        pf = prefill_ids(model, ids, use_cache=False)
        generate(model, pf, max_new_tokens=2,
                 sampling=SamplingParams(do_sample=True, top_k=20, temperature=0.7, repetition_penalty=1.1))
        if model.vision is not None:
            from .multimodal import prefill_multimodal
            image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(0))
            prefill_multimodal(model, "What is it?", images=image, use_cache=False)
    except Qwen35Error:
        raise
    except Exception as e:  # noqa: BLE001 - an operator missing or failing there, however the backend says so
        if is_out_of_memory(e):  # the device runs the model, the memory is short: that error, as it is
            raise
        what = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DeviceUnsupported(
            f"the model does not run on {dev} with PyTorch {torch.__version__} ({type(e).__name__}: {what[:300]}); "
            "load it on the cpu (device 'cpu'), or update PyTorch") from None
