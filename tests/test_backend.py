"""Which backend runs the GDN math, and the reason the user is given (decided without touching a GPU)."""
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


def test_unknown_backend():
    with pytest.raises(ValueError, match="'triton' is not one of auto, cuda, torch"):
        kernels.select_backend("triton", "cpu")
