"""Makes the repository importable as `qwen35_fast` when it is not pip-installed (GPU machine, CI)."""
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# `python -m pytest` from the repository root puts the root on sys.path, and then our `kernels/`
# folder shadows the Hugging Face `kernels` package that transformers probes for (and imports).
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != ROOT]

if "qwen35_fast" not in sys.modules:
    try:
        import qwen35_fast  # noqa: F401  (pip install -e .)
    except ImportError:
        spec = importlib.util.spec_from_file_location("qwen35_fast", ROOT / "__init__.py",
                                                      submodule_search_locations=[str(ROOT)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["qwen35_fast"] = module
        spec.loader.exec_module(module)


def _has_cuda():
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_comfy = pytest.mark.skip(reason="set COMFYUI_DIR to a ComfyUI checkout to run")
    cuda = _has_cuda()
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(skip_gpu)
        if "comfyui" in item.keywords and not os.environ.get("COMFYUI_DIR"):
            item.add_marker(skip_comfy)
