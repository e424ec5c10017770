"""The values that travel on this pack's links."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import comfy.model_management as mm
import comfy.utils
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
    # its place in a list of prefills one node run made (the one-prompt-per-image mode; a Continue after one
    # keeps its parent's): such a prefill's states wait off the GPU (ManagedModel.park)
    item: int = 0
    items: int = 1


def shown_again() -> dict:
    """Schema flags for a node whose panel shows its `ui` (the loader's and the prefills' stats): ComfyUI sends
    a node's `ui` again when its output comes from the cache (a new tab, a reloaded page, another workflow) only
    for output nodes and for nodes with has_intermediate_output, which ComfyUI has had since 2026-03; an older one
    takes the node without it (its panel then stays blank when the output is cached)."""
    fields = getattr(io.Schema, "__dataclass_fields__", {})
    return {"has_intermediate_output": True} if "has_intermediate_output" in fields else {}


@contextmanager
def cancellable(bar: bool = True):
    """Around a prefill or a model load: ComfyUI's Cancel lands between the pieces of a long prompt, the passes of
    the vision tower and the weights of a load (runtime.progress; nothing of the prefill or the model stays), and
    with `bar` the node's progress bar follows the prompt's pieces or the weights read (a node with a bar of its
    own, over a batch, passes False)."""
    from ..runtime import progress
    shown = None

    def hook(stage: str, done: int, total: int) -> None:
        nonlocal shown
        mm.throw_exception_if_processing_interrupted()
        if bar and stage in ("prompt", "load"):
            shown = shown or comfy.utils.ProgressBar(total)
            shown.update_absolute(done, total)
    with progress.reporting(hook):
        yield
