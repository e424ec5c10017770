"""The values that travel on this pack's links."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from comfy_api.latest import io

from .memory import ModelHandle

Qwen35Model = io.Custom("QWEN35_MODEL")
Qwen35Prefill = io.Custom("QWEN35_PREFILL")


@dataclass(frozen=True)
class ModelPrefill:
    """A runtime Prefill and the model it belongs to. ComfyUI caches it and may hand it to many
    Generate nodes; the runtime never changes a Prefill, so each run starts from the same state."""
    model: ModelHandle
    prefill: Any
