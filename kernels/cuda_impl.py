"""CUDA implementations of the kernels' operators, and the check that they can run on a device.

Imported only when a CUDA backend is considered (kernels/__init__.py, kernels/ops.py). Importing
it needs CuPy; an ImportError here means "no CUDA kernels" to `select_backend`.
"""
from __future__ import annotations

from pathlib import Path

import cupy  # noqa: F401  (an ImportError here tells select_backend that CuPy is missing)
import torch

from . import card_unfit
from .content_hash.launch import hash_words_cuda
from .conv1d.launch import causal_conv1d_prefill_cuda, causal_conv1d_states_cuda, causal_conv1d_update_cuda
from .dequant.launch import dequant_rows_cuda
from .gdn_decode.launch import gdn_decode_step_cuda
from .gemv.launch import gemv_add_rms_norm_cuda, gemv_cuda, gemv_silu_mul_cuda
from .rms_norm.launch import add_rms_norm_cuda, gated_rms_norm_cuda, rms_norm_cuda, rms_norm_rope_cuda
from .silu_mul.launch import silu_mul_cuda
from .vision.launch import (
    add_layer_norm_cuda,
    layer_norm_cuda,
    vision_attention_cuda,
    vision_positions_cuda,
    vision_rotary_cuda,
)

_PROBE_SRC = Path(__file__).with_name("probe.cu")
_status: dict = {}


def _probe(device: torch.device) -> None:
    """Compile and run a tiny bf16 kernel on `device`; raises if anything is off."""
    from .cuda_build import get_function, launch

    x = torch.arange(-64, 64, device=device, dtype=torch.float32).to(torch.bfloat16)
    y = torch.full((128,), float("nan"), device=device)
    with torch.cuda.device(device):
        launch(get_function(_PROBE_SRC, "probe_scale", device), (1, 1, 1), (128, 1, 1), (x, y, 128, 0.5))
        torch.cuda.synchronize(device)
    if not torch.equal(y, x.float() * 0.5):
        raise RuntimeError("the probe kernel ran but returned wrong values")


def cuda_status(device) -> tuple[bool, str]:
    """(ok, reason): whether the CUDA kernels run on `device`. Checked once per device."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"CUDA kernels need a CUDA device, not {device}"
    unfit = card_unfit(device)
    if unfit:
        return False, unfit
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _status:
        return _status[index]
    major, minor = torch.cuda.get_device_capability(index)
    card = f"{torch.cuda.get_device_name(index)} (compute capability {major}.{minor})"
    try:
        from .cuda_build import arch_for_capability
        arch = arch_for_capability(major, minor)
        _probe(torch.device("cuda", index))
        result = (True, f"CUDA kernels on {card}, built with NVRTC for {arch}")
    except Exception as e:  # compile errors, missing headers, driver too old for the cubin, ...
        result = (False, f"CUDA kernels failed on {card}: {type(e).__name__}: {e}")
    _status[index] = result
    return result


def gdn_chunk_prefill_cuda(q, k, v, a, b, A_log, dt_bias, initial_state=None, cu_seqlens=None, keep=None):
    """Chunked GDN prefill (kernels/gdn_prefill/launch.py); same contract as gdn_prefill_chunked."""
    from .gdn_prefill.launch import gdn_chunk_prefill_cuda as prefill
    return prefill(q, k, v, a, b, A_log, dt_bias, initial_state, cu_seqlens, keep=keep)


__all__ = ["cuda_status", "hash_words_cuda", "gdn_chunk_prefill_cuda", "gdn_decode_step_cuda",
           "causal_conv1d_prefill_cuda", "causal_conv1d_states_cuda", "causal_conv1d_update_cuda", "rms_norm_cuda", "gated_rms_norm_cuda",
           "rms_norm_rope_cuda", "add_rms_norm_cuda", "silu_mul_cuda", "dequant_rows_cuda", "gemv_cuda", "gemv_add_rms_norm_cuda", "gemv_silu_mul_cuda", "vision_positions_cuda", "vision_rotary_cuda", "vision_attention_cuda", "layer_norm_cuda",
           "add_layer_norm_cuda"]
