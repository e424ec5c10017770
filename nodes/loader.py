"""Qwen35ModelLoader: a checkpoint from models/LLM or models/text_encoders -> QWEN35_MODEL."""
from __future__ import annotations

import logging
import weakref
from pathlib import Path

import comfy.model_management as mm
import torch
from comfy_api.latest import io

from .memory import ManagedModel, ModelHandle, outputs_now
from .models_folder import available_models, find_model, weights_bytes
from .types import Qwen35Model, cancellable, running, shown_again, workflow_id

log = logging.getLogger(__name__)

DTYPES = ["auto", "bf16", "fp16", "fp32"]
DEVICES = ["auto", "cuda", "cpu"]
BACKENDS = ["auto", "cuda", "torch"]
WEIGHTS = ["auto", "full", "int8"]

# The models this loader made and that something still holds, by checkpoint files and every setting but
# keep_loaded: a run that changes only keep_loaded (ComfyUI runs the node again for any changed input) takes the
# model in memory, through the same ManagedModel (ComfyUI's model management sees one entry per model), instead
# of reading the checkpoint again. Two loaders of one checkpoint with the same settings share it; each output
# (a ModelHandle) carries its own node's keep_loaded.
_loaded: dict[tuple, weakref.ref] = {}  # key -> its ManagedModel

# what a checkpoint folder's files may be that the runtime reads (weights, index, config, tokenizer, chat
# template, preprocessor settings); a README, an image or a file manager's own file (.DS_Store) changes nothing
READ_SUFFIXES = (".safetensors", ".json", ".jinja", ".txt")


def _files_key(path: Path) -> tuple:
    """The checkpoint's files by name, size and modification time: a file replaced on disk is read again (for a
    single file, the tokenizer.json beside it too, which the runtime reads when it is there)."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir()
                       if p.suffix.lower() in READ_SUFFIXES and not p.name.startswith(".") and p.is_file())
    else:
        files = [path] + [p for p in [path.parent / "tokenizer.json"] if p.is_file()]
    return (str(path.resolve()),) + tuple((p.name, st.st_size, st.st_mtime_ns) for p in files for st in [p.stat()])


def _pick_device(device: str) -> torch.device:
    from ..runtime import Qwen35Error

    if device not in DEVICES:
        raise Qwen35Error(f"device {device!r} is not one of {', '.join(DEVICES)}")
    comfy_device = mm.get_torch_device()
    if device == "auto":
        return comfy_device
    if device == "cuda":
        if comfy_device.type != "cuda":  # ComfyUI's memory manager only knows the device it runs on
            why = ("PyTorch sees no CUDA GPU (torch " + torch.__version__ + ")" if not torch.cuda.is_available()
                   else "it was started with --cpu")
            raise Qwen35Error(f"device 'cuda' chosen, but ComfyUI runs on {comfy_device.type}: {why}; choose "
                              "device 'auto' or 'cpu' (or start ComfyUI on a GPU)")
        return comfy_device  # the GPU ComfyUI was started on
    return torch.device(device)


class Qwen35ModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Qwen35ModelLoader",
            **shown_again(),
            display_name="Qwen3.5 Model Loader",
            category="Qwen3.5",
            description="Loads a Qwen3.5 checkpoint: a folder in models/LLM or one .safetensors file in "
                        "models/LLM or models/text_encoders.",
            search_aliases=["qwen", "llm", "load language model"],
            inputs=[
                io.Combo.Input("model", options=list(available_models()),
                               tooltip="Checkpoint folders in models/LLM/<name>/ and single .safetensors files "
                                       "in models/LLM or models/text_encoders."),
                io.Combo.Input("dtype", options=DTYPES, default="auto",
                               tooltip="Weight precision. auto: bf16 on a GPU where a bf16 matmul runs (from "
                                       "Ampere natively; V100, T4 and RTX 20xx emulate it, slower but right), else "
                                       "fp32 (GTX 10xx and older; the CPU). fp16 (half of fp32's memory) runs on "
                                       "any GPU, but Qwen's activations can overflow it."),
                io.Combo.Input("device", options=DEVICES, default="auto",
                               tooltip="auto: the device ComfyUI runs on (cpu when started with --cpu). On "
                                       "Apple (mps), Intel (xpu) and other non-CUDA GPUs the PyTorch path runs "
                                       "there, checked once on a short prompt; the cpu where it does not."),
                io.Combo.Input("backend", options=BACKENDS, default="auto", display_name="kernel backend",
                               tooltip="auto: the CUDA kernels when CuPy can compile them for this GPU, "
                                       "else PyTorch. The choice and its reason show on the node."),
                io.Boolean.Input("keep_loaded", default=True,
                                 tooltip="On: the model stays in VRAM until ComfyUI needs the memory. "
                                         "Off: its VRAM is given back after every Generate."),
                io.Int.Input("cache_budget_mb", default=0, min=0, max=1 << 20, step=256, advanced=True,
                             optional=True, display_name="K/V cache budget (MiB)",
                             tooltip="Memory for the paged K/V cache that every prefill and generation of this "
                                     "model shares; a quarter of it holds the saved states that let a later "
                                     "prompt reuse an earlier one's system prompt and images (room for at least "
                                     "8). Counted with the model in ComfyUI's memory management. 0: auto (room "
                                     "for 64K tokens, at most a quarter of the memory free after loading; it "
                                     "grows when a prompt needs more). A fixed budget never grows: a prompt that "
                                     "does not fit is an error."),
                io.Combo.Input("weights", options=WEIGHTS, default="auto", advanced=True, optional=True,
                               tooltip="How the text model's weight matrices are kept. full: in the dtype. int8: "
                                       "in 8 bits with a scale per row, computed in the dtype: half the memory of "
                                       "bf16 (a 9B model in ~9 GiB instead of ~17), answers close to full but not "
                                       "the same; it decodes faster than full weights and reads prompts slower. auto: full "
                                       "where it fits the device's free memory after other models are moved out, "
                                       "else int8; the node says which."),
            ],
            outputs=[Qwen35Model.Output(display_name="model")],
            hidden=[io.Hidden.extra_pnginfo],  # the workflow's id (workflow_id); not part of ComfyUI's cache key
        )

    @classmethod
    def fingerprint_inputs(cls, model, **_):
        """The checkpoint's files by size and modification time: a file replaced on disk under the same name
        makes ComfyUI run the loader again (its cached output would hold the old weights, or fail to read
        them again after letting them go)."""
        path = find_model(model)
        return _files_key(path) if path is not None else model

    @classmethod
    def execute(cls, model, dtype="auto", device="auto", backend="auto", keep_loaded=True,
                cache_budget_mb=0, weights="auto") -> io.NodeOutput:
        from ..runtime import Qwen35Error
        from ..runtime.loader import _clear_frames

        path = find_model(model)
        if path is None:
            raise Qwen35Error(f"model {model!r} is not in models/LLM or models/text_encoders; put a checkpoint "
                              "folder in models/LLM/<name>/ (or a .safetensors file in models/text_encoders) "
                              "and refresh the node list")
        target = _pick_device(device)
        if isinstance(cache_budget_mb, bool) or not isinstance(cache_budget_mb, int) or cache_budget_mb < 0:
            raise Qwen35Error(f"cache_budget_mb is {cache_budget_mb!r}; it must be a whole number of MiB, 0 for auto")
        if weights not in WEIGHTS:
            raise Qwen35Error(f"weights {weights!r} is not one of {', '.join(WEIGHTS)}")
        key = (_files_key(path), dtype, device, str(target), backend, cache_budget_mb, weights)
        # this loader node in its workflow; none for a prompt that names no workflow (the API, scripts: another
        # workflow's node may have the same id, and letting its model go would read the weights again each switch)
        workflow, node_id = workflow_id(cls.hidden), running()[1]
        node = (workflow, node_id) if workflow is not None and node_id is not None else None
        managed = _loaded.get(key, lambda: None)()
        # the model this node output before goes first (its VRAM and RAM free for this one), unless another
        # loader node outputs it too: ComfyUI's cache would keep it, last of all (memory.outputs_now)
        outputs_now(node, managed)
        if managed is not None:
            log.info("Qwen3.5: %s is in memory with these settings; not read again", path)
            managed.load()  # back on its device first when ComfyUI had unloaded it
            runtime_model = managed.model
        else:
            runtime_model, device_note = _load(path, dtype, device, target, backend, weights, cache_budget_mb << 20)
            try:
                runtime_model.setup_kv(cache_budget_mb << 20 if cache_budget_mb else None)
            except BaseException as e:
                # a new model's weights go with it before the cache is emptied: the traceback keeps this frame
                # and setup_kv's, whose `self` is the model (cleared here; the error and its message stay)
                _clear_frames(e)
                del runtime_model
                mm.soft_empty_cache()
                raise
            load_device = torch.device("cpu") if device_note else target
            # (with --gpu-only ComfyUI's offload device is its GPU: a model that runs on the cpu waits there)
            offload_device = load_device if load_device.type == "cpu" else mm.text_encoder_offload_device()
            managed = ManagedModel(runtime_model, load_device, offload_device)
            managed.device_note = device_note
            managed.load()
            _loaded[key] = weakref.ref(managed)
            outputs_now(node, managed)
        store = runtime_model.kv
        info = {
            "path": str(path),
            "backend": runtime_model.backend.name,
            "backend_reason": runtime_model.backend.reason,
            "device": str(runtime_model.device),
            "dtype": str(runtime_model.dtype).removeprefix("torch."),
            "weights": "int8" if runtime_model.int8 else "full",
            "size_mb": round(runtime_model.size_bytes() / 2**20, 1),
            # the most it holds: the K/V blocks and the snapshots' room (at least 8 states, past a small budget)
            "cache_mb": round((store.nbytes + store.pool.snapshot_budget_bytes) / 2**20, 1),
            "cache_tokens": store.num_blocks * store.block_size,
        }
        if managed.device_note:
            info["device_note"] = managed.device_note
        log.info("Qwen3.5: loaded %s on %s (%s, %s weights), backend %s: %s", path, info["device"], info["dtype"],
                 info["weights"], info["backend"], info["backend_reason"])
        return io.NodeOutput(ModelHandle(managed, keep_loaded, node), ui={"qwen35_model": [info]})


def _load(path: Path, dtype: str, device: str, target: torch.device, backend: str, weights: str,
          kv_budget: int = 0):
    """(the runtime model read from `path`, a note when it went to the cpu instead of `target`). kv_budget: a
    fixed K/V cache budget (bytes; 0 for auto, which sizes itself to the memory free after the load), allocated
    right after the weights: room is made for it too."""
    from ..runtime import DeviceUnsupported, load_model
    from ..runtime.loader import resolve_dtype

    for key in [k for k, ref in _loaded.items() if ref() is None]:
        del _loaded[key]
    if target.type != "cpu":
        # Make room before reading: other models' VRAM goes first, as ComfyUI does for its own.
        # (auto: room for the full weights, so that int8 is taken only where they cannot fit)
        need = weights_bytes(path, resolve_dtype(dtype, target).itemsize, int8=weights == "int8")
        mm.free_memory(need * 1.1 + kv_budget + mm.minimum_inference_memory(), target)
    try:
        with cancellable():  # a progress bar over the weights read; Cancel lands between them
            return load_model(path, dtype=dtype, device=str(target), backend=backend, weights=weights), ""
    except DeviceUnsupported as e:
        if device != "auto":  # ("cuda" and "cpu" never get here)
            raise
        device_note = f"on the cpu: {e}"
    # ComfyUI runs on an accelerator (mps, xpu, ...) the model does not run on
    log.warning("Qwen3.5: loading %s %s", path, device_note)
    mm.soft_empty_cache()
    with cancellable():
        return load_model(path, dtype=dtype, device="cpu", backend=backend, weights=weights), device_note

