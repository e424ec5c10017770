"""Small host values (ids, positions, block tables, plans) onto the device without stalling it.

torch's blocking host-to-device copy waits for everything already queued on the stream; a prompt makes
a dozen such copies, several of them behind the vision tower's 15 ms of kernels, and each one left the
GPU idle while Python queued the next work. A copy from pageable memory with non_blocking=True is staged
by the driver before the call returns (the host tensor may be dropped or changed at once) and waits for
nothing. A cold image prompt made 19 synchronisations (bench/ttft_profile.py before this), now 2 (the
image's content hash, before the tower, and the logits) or 3 with the prefix cache on;
tests/test_vision_gpu.py checks that none happens between the tower's launch and the logits.
"""
from __future__ import annotations

import torch


def upload(data, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    """`data` (a list, a tuple or a CPU tensor) as a tensor on `device`, queued without a synchronisation on
    CUDA (elsewhere a plain copy: the staging guarantee above is CUDA's)."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device is None:
        return t
    device = torch.device(device)
    return t.to(device, non_blocking=device.type == "cuda")


def host_logits(logits: torch.Tensor) -> torch.Tensor:
    """A prefill's logits [1, vocab] copied to the host, queued behind the prefill's kernels into pinned memory
    (torch pins the result of a non-blocking copy from CUDA): valid once the caller has synchronised, and no
    pageable copy after it (1 MB, ~0.1-0.2 ms of a reused prompt's ~9). Elsewhere the tensor itself."""
    return logits.to("cpu", non_blocking=logits.is_cuda)


__all__ = ["upload", "host_logits"]
