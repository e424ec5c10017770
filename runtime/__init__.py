"""The Qwen3.5 runtime: checkpoint loading, the forward pass, prefill, decode and sampling.

No ComfyUI imports here; the nodes are a thin layer over these functions.

    model = load_model("models/LLM/Qwen3.5-9B", dtype="bf16", device="cuda")
    pf = prefill(model, "Describe a lighthouse at dusk.")
    pf = prefill_multimodal(model, "What is in <image>?", images=image)  # ComfyUI IMAGE [B, H, W, C]
    out = generate(model, pf, max_new_tokens=200, sampling=SamplingParams(do_sample=True, temperature=0.7))
    pf2 = continue_prefill(model, pf, "And the sky?", previous_answer=out.text)  # runs only the new turn
"""
from .conversation import continue_prefill
from .decode_graph import free_gpu_workspaces
from .demo_checkpoint import demo_checkpoint
from .devices import DeviceUnsupported
from .errors import Qwen35Error
from .generate import Generation, Prefill, encode_prompt, generate, prefill, prefill_ids
from .loader import load_model
from .model import Cache, Qwen35Model
from .multimodal import prefill_multimodal, read_video
from .sampling import SamplingParams

__all__ = ["Qwen35Error", "DeviceUnsupported", "Generation", "Prefill", "encode_prompt", "generate", "prefill", "prefill_ids",
           "prefill_multimodal", "read_video", "continue_prefill", "load_model", "Cache", "Qwen35Model", "SamplingParams", "demo_checkpoint",
           "free_gpu_workspaces"]
