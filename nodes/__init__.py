"""ComfyUI nodes (V3 schema): thin adapters over the runtime; nothing here computes a token."""
from comfy_api.latest import ComfyExtension, io

from .continue_prefill import Qwen35ContinuePrefill
from .loader import Qwen35ModelLoader
from .models_folder import ensure_llm_folder
from .multimodal import Qwen35MultimodalPrefill
from .text import Qwen35Generate, Qwen35TextPrefill

NODES = [Qwen35ModelLoader, Qwen35TextPrefill, Qwen35MultimodalPrefill, Qwen35ContinuePrefill, Qwen35Generate]


class Qwen35Extension(ComfyExtension):
    async def on_load(self) -> None:
        ensure_llm_folder()

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return NODES


__all__ = ["NODES", "Qwen35Extension", "Qwen35ContinuePrefill", "Qwen35Generate", "Qwen35ModelLoader",
           "Qwen35MultimodalPrefill", "Qwen35TextPrefill"]
