"""Small host values (ids, positions, block tables, plans) onto the device without stalling it.

torch's blocking host-to-device copy waits for everything already queued on the stream; a prompt makes a dozen
such copies, several of them behind the vision tower's 15 ms of kernels, and each one left the GPU idle while
Python queued the next work. A small copy from pageable memory with non_blocking=True is staged by the driver
before the call returns (the host tensor may be dropped or changed at once) and waits for nothing up to a
size: behind 0.1 s of queued work on the H200, copies of 128 KB to 1 MB returned within 0.3 ms, one of 8 MB
waited for the queue (51.7 ms; bench/upload_wait.py), so copies above PINNED_ABOVE go through pinned memory. A
cold image prompt made 19 synchronisations (bench/ttft_profile.py before this), now 2 (the image's content
hash, before the tower, and the logits) or 3 with the prefix cache on; tests/test_vision_gpu.py checks that
none happens between the tower's launch and the logits.
"""
from __future__ import annotations

import functools

import torch

from .errors import Qwen35Error

# bytes above which a copy to the GPU is staged in pinned memory first (the driver stages smaller pageable
# copies itself without waiting: measured up to 1 MB, tests/test_host.py)
PINNED_ABOVE = 1 << 20


def upload(data, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    """`data` (a list, a tuple or a CPU tensor) as a tensor on `device`, queued without a synchronisation on
    CUDA, however large (elsewhere a plain copy)."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device is None:
        return t
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    if t.numel() * t.element_size() > PINNED_ABOVE:
        t = t.pin_memory()  # (torch's caching host allocator keeps it until the copy has read it)
    return t.to(device, non_blocking=True)


def host_logits(logits: torch.Tensor) -> torch.Tensor:
    """A prefill's logits [1, vocab] copied to the host, queued behind the prefill's kernels into pinned memory
    (torch pins the result of a non-blocking copy from CUDA): valid once the caller has synchronised, and no
    pageable copy after it (1 MB, ~0.1-0.2 ms of a reused prompt's ~9). On the CPU the tensor itself; from other
    accelerators a blocking copy."""
    return logits.to("cpu", non_blocking=logits.is_cuda)


def on_model_device(fn):
    """Runs fn(model, ...) with the model's GPU as the current CUDA device when it is another one: our kernels
    launch on the current device's stream, with the kernel modules loaded there (a model on cuda:1 while the
    current device is 0 would otherwise launch on GPU 0). Elsewhere fn runs as it is. Anything but a model
    (a path, say) is a Qwen35Error that says to load one."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        model = args[0] if args else kwargs.get("model")
        dev = getattr(model, "device", None)
        if not isinstance(dev, torch.device) or not hasattr(model, "config"):
            raise Qwen35Error(f"{fn.__name__} needs the model that load_model returns, got a {type(model).__name__}; "
                              "load it first: model = load_model(path)")
        if dev.type != "cuda" or dev.index is None or dev.index == torch.cuda.current_device():
            return fn(*args, **kwargs)
        with torch.cuda.device(dev):
            return fn(*args, **kwargs)
    return run


__all__ = ["upload", "host_logits", "on_model_device"]
