"""load_model: checkpoint on disk -> Qwen35Model on a device, with its tokenizer and kernel backend."""
from __future__ import annotations

import gc
import logging
import time
import traceback
from pathlib import Path

import torch

from .. import kernels
from . import progress
from .checkpoint import Checkpoint, WeightReader, locate
from .config import LINEAR, describe
from .devices import (
    DeviceUnsupported,
    bf16_works,
    check_device,
    cuda_auto_dtype,
    empty_cache,
    is_other_accelerator,
    usable,
)
from .errors import Qwen35Error
from .memory import free_bytes, is_out_of_memory, loading_out_of_memory, text_weight_bytes
from .model import Qwen35Model
from .quant import WEIGHTS, Int8Weight, fill_rows

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    asked = device
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        device = None
    if device is None:
        raise Qwen35Error(f"device {str(asked)!r} is not one of auto, cpu, cuda, cuda:N (or another accelerator "
                          "PyTorch knows: mps, xpu, ...)")
    if is_other_accelerator(device):
        why = usable(device)
        if why is not None:
            raise DeviceUnsupported(f"device {str(device)!r} asked for, but PyTorch {torch.__version__} cannot use "
                                    f"it here ({why}); choose device 'cpu' or 'auto'")
        return device
    if device.type == "cuda" and not torch.cuda.is_available():
        raise Qwen35Error(f"device {str(device)!r} asked for, but PyTorch sees no CUDA GPU "
                          f"(torch {torch.__version__}); choose device 'cpu' or 'auto'")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise Qwen35Error(f"device {str(device)!r} asked for, but PyTorch sees {torch.cuda.device_count()} CUDA "
                          f"GPU(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}; choose one of those")
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise Qwen35Error(f"dtype {dtype} is not one of auto, {', '.join(DTYPES)} (or "
                              f"{', '.join(map(str, DTYPES.values()))}): the model computes in these; FP8 checkpoints "
                              "load dequantized to one of them")
        return dtype
    if dtype == "auto":  # bf16 on GPUs that compute in it (other accelerators: where their bf16 matmul runs)
        if device.type == "cuda":
            return cuda_auto_dtype(device)
        if is_other_accelerator(device) and bf16_works(device):
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise Qwen35Error(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    if dtype == "bf16" and device.type == "cuda" and cuda_auto_dtype(device) != torch.bfloat16:
        # Pascal's cuBLAS refuses bf16 products: told here, not mid-prompt
        (major, minor), card = torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)
        raise Qwen35Error(f"dtype 'bf16' chosen, but a bf16 matmul does not run on {card} (compute capability "
                          f"{major}.{minor}, whose cuBLAS takes no bf16 products); choose dtype 'auto' (fp32 there) or "
                          "'fp16' (half the memory, but Qwen's activations can overflow fp16: NaN logits are named)")
    return DTYPES[dtype]


def _fill(model: Qwen35Model, ckpt: Checkpoint, report: bool = False) -> None:
    """Copy every checkpoint tensor into its (possibly fused) parameter; with `report`, progress.report("load",
    tensors read, all of them) after each (a caller's cancel lands there: load_model frees what it made)."""
    c = model.config
    hv = c.linear_num_value_heads
    qd, kd = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    # text-model tensor name -> (parameter, first row) ; fused matrices take several tensors
    targets: dict[str, tuple[torch.Tensor, int]] = {
        "embed_tokens.weight": (model.embed, 0), "norm.weight": (model.final_norm, 0)}
    if model.lm_head is not None:
        targets["lm_head.weight"] = (model.lm_head, 0)
    for i, blk in enumerate(model.blocks):
        p, m = f"layers.{i}.", blk.mixer
        targets.update({p + "input_layernorm.weight": (blk.input_norm, 0),
                        p + "post_attention_layernorm.weight": (blk.post_norm, 0),
                        p + "mlp.gate_proj.weight": (blk.gate_up, 0),
                        p + "mlp.up_proj.weight": (blk.gate_up, c.intermediate_size),
                        p + "mlp.down_proj.weight": (blk.down, 0)})
        if blk.kind == LINEAR:
            a = p + "linear_attn."
            targets.update({a + "in_proj_qkv.weight": (m.in_proj, 0),
                            a + "in_proj_z.weight": (m.in_proj, c.conv_dim),
                            a + "in_proj_b.weight": (m.in_proj, c.conv_dim + c.value_dim),
                            a + "in_proj_a.weight": (m.in_proj, c.conv_dim + c.value_dim + hv),
                            a + "conv1d.weight": (m.conv_w, 0), a + "A_log": (m.A_log, 0),
                            a + "dt_bias": (m.dt_bias, 0), a + "norm.weight": (m.norm_w, 0),
                            a + "out_proj.weight": (m.out_proj, 0)})
        else:
            s = p + "self_attn."
            targets.update({s + "q_proj.weight": (m.qkv, 0), s + "k_proj.weight": (m.qkv, 2 * qd),
                            s + "v_proj.weight": (m.qkv, 2 * qd + kd), s + "o_proj.weight": (m.o_proj, 0),
                            s + "q_norm.weight": (m.q_norm, 0), s + "k_norm.weight": (m.k_norm, 0)})
    # one blocking copy_ into the parameter: from a CPU tensor it converts the dtype on the host, so no weight has
    # a second, file-dtype copy in device memory; FP8 weights are dequantized on the device a few thousand rows at
    # a time, straight into the parameter; an 8-bit matrix quantizes its rows a slice at a time on its device
    with WeightReader(ckpt.fp8) as reader, torch.no_grad():
        for done, (name, (param, row)) in enumerate(targets.items(), 1):
            file, stored = ckpt.tensors[name]
            if isinstance(param, Int8Weight):  # (FP8 rows rounded to the model's dtype first: a bf16 file's int8 rows)
                for r0, part in reader.rows(file, stored, param.device):
                    fill_rows(param, row + r0, part.to(param.dtype) if stored in ckpt.fp8 else part)
            else:
                shape = reader.shape(file, stored)
                into = param[row:row + shape[0]]
                reader.get(file, stored, param.dtype, out=into.unsqueeze(1) if name.endswith("conv1d.weight") else into)
            if report:
                progress.report("load", done, len(targets))


def refill(model: Qwen35Model) -> None:
    """Reads the weights of `model` (text and vision tower) again from the checkpoint load_model read them from,
    into its parameters where they are now (Qwen35Model.reload_weights), with progress.report("load", ...) after
    each text-model tensor as load_model's (a caller's cancel lands there: reload_weights lets them go again)."""
    ckpt = model.checkpoint
    _fill(model, ckpt, report=True)
    if model.vision is not None:
        from .vision import fill_vision, locate_vision
        fill_vision(model.vision, locate_vision(ckpt))


def file_stamp(ckpt: Checkpoint) -> tuple:
    """(file, size, modification time) of every file the checkpoint's weights come from."""
    files = sorted({f for f, _ in ckpt.tensors.values()} | {f for f, _ in ckpt.others.values()})
    if ckpt.path.is_dir() and (ckpt.path / "config.json").is_file():  # read again with the vision tower's weights
        files.append(ckpt.path / "config.json")
    return tuple((str(f), st.st_size, st.st_mtime_ns) for f in files for st in [Path(f).stat()])


def check_unchanged(ckpt: Checkpoint, stamp: tuple) -> None:
    """Raises Qwen35Error naming the file when a checkpoint file changed or went away since `stamp` was taken."""
    for name, size, mtime in stamp:
        f = Path(name)
        try:
            st = f.stat()
        except OSError:
            raise Qwen35Error(f"{f} is gone since {ckpt.path.name} was loaded, and the model's weights had been let "
                              "go from memory (RAM was short when ComfyUI unloaded it), so they cannot be read "
                              "again; put the file back, or load the model anew") from None
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            raise Qwen35Error(f"{f} changed on disk since {ckpt.path.name} was loaded, and the model's weights had "
                              "been let go from memory (RAM was short when ComfyUI unloaded it): they are not read "
                              "again from another file; load the model anew (run the loader again)")


def _attach_vision(model: Qwen35Model, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device) -> None:
    """Loads the checkpoint's vision tower into model.vision; a missing or broken one leaves None and the
    reason in model.vision_note (text prompts work either way)."""
    from .vision import load_vision, locate_vision
    try:
        found = locate_vision(ckpt)
    except Qwen35Error as e:
        model.vision_note = str(e)
        log.warning("Qwen3.5 vision tower not loaded: %s", e)
        return
    if found is None:
        model.vision_note = f"{ckpt.path.name} has no vision-tower weights (model.visual.*)"
        return
    model.vision = load_vision(found, dtype, device)
    model.vision_note = f"vision tower {found.config.shape_name}"


def pick_int8(weights: str, config, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether load_model keeps the matrices in 8 bits: as `weights` says ("full", "int8"), or for "auto" where
    the text weights in `dtype` would leave less than a tenth of the device's memory (at least 1 GiB) free for
    the vision tower, the K/V cache and the runs; the 8-bit ones then take about half as much."""
    if weights not in WEIGHTS:
        raise Qwen35Error(f"weights {weights!r} is not one of {', '.join(WEIGHTS)} (int8: the matrices in 8 bits, "
                          "half the memory of bf16; auto: int8 only where the full weights do not fit)")
    if weights != "auto":
        return weights == "int8"
    free, total = free_bytes(device)
    if device.type == "cuda":  # what PyTorch's allocator holds unused is free to this load too
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    room = max(1 << 30, total // 10)
    return text_weight_bytes(config, dtype) + room > free


def _clear_frames(error: BaseException) -> None:
    """Drop the local variables of the finished frames in the tracebacks of `error` and of the errors it was
    raised from or while handling (traceback.clear_frames leaves the frame still running)."""
    chain, seen = [error], set()
    while chain:
        e = chain.pop()
        if e is not None and id(e) not in seen:
            seen.add(id(e))
            traceback.clear_frames(e.__traceback__)
            chain += [e.__cause__, e.__context__]


def load_model(path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
               backend: str = "auto", weights: str = "full") -> Qwen35Model:
    """Load a Qwen3.5 checkpoint (a Hugging Face folder or one .safetensors file).

    dtype: auto (bf16 on CUDA where a bf16 matmul runs, fp32 on older cards: devices.cuda_auto_dtype; bf16 where
    another accelerator's bf16 matmul runs; else fp32), bf16, fp16, fp32:
    what the model computes in. weights: full (the text model's matrices in dtype), int8 (in 8 bits with a scale
    a row, computed in dtype: half the memory of bf16, quant.py), auto (int8 where the full ones would not fit
    the device's free memory, pick_int8; model.int8 says which).
    device: auto, cuda, cuda:N, cpu, or another
    accelerator PyTorch drives (mps, xpu, ...: the PyTorch path, checked there once on a short prompt;
    DeviceUnsupported where it does not run). backend: auto, cuda, torch (what runs every
    custom kernel: GDN, norms, gemv, paged and vision attention, sampling; see kernels.select_backend).
    Raises Qwen35Error, naming the file and the fix, for anything wrong with the input; nothing
    stays allocated when it does.
    """
    if backend not in kernels.BACKENDS:
        raise Qwen35Error(f"kernel backend {backend!r} is not one of {', '.join(kernels.BACKENDS)}")
    t0 = time.perf_counter()
    ckpt = locate(path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    int8 = pick_int8(weights, ckpt.config, dt, dev)
    from .tokenizer import load_tokenizer
    tokenizer = load_tokenizer(ckpt.tokenizer_dir)
    if backend != "torch":
        kernels.compile_ahead(dev)  # on worker threads, while the weights are read
    model, oom = None, False
    try:
        model = Qwen35Model(ckpt.config, dt, dev, int8)
        _fill(model, ckpt, report=True)
        _attach_vision(model, ckpt, dt, dev)
        model.requested_backend = backend
        model.select_backend()
    except BaseException as e:
        oom = is_out_of_memory(e)
        if not oom:
            # the traceback's frames (_fill, _attach_vision, select_backend...) hold the model: cleared, the error
            # keeps its type, message and lines, and the model's memory is freed before the cache is emptied
            _clear_frames(e)
            del model
            gc.collect()
            empty_cache(dev)
            raise
    if oom:  # out of the except block: the traceback, and the half-built model it holds, are gone
        model = None
        gc.collect()
        raise loading_out_of_memory(ckpt.path.name, ckpt.config, dt, dev, int8)
    model.tokenizer = tokenizer
    model.path = ckpt.path
    model.checkpoint, model.checkpoint_stamp = ckpt, file_stamp(ckpt)  # where reload_weights reads them again
    if is_other_accelerator(dev):  # the PyTorch path on mps, xpu, ...: every operator it takes must be there
        failed = None
        try:
            check_device(model)
        except DeviceUnsupported as e:
            failed = DeviceUnsupported(str(e))  # without the traceback, whose frames hold the model
        if failed is not None:
            model = None
            gc.collect()
            empty_cache(dev)
            raise failed
    fp8 = f" ({len(ckpt.fp8)} FP8 weights dequantized)" if ckpt.fp8 else ""
    kept = ", matrices in 8 bits" if int8 else ""
    log.info("Loaded %s: %s, %s%s%s on %s in %.1f s; GDN backend: %s", ckpt.path.name, describe(ckpt.config),
             str(dt).replace("torch.", ""), kept, fp8, dev, time.perf_counter() - t0, model.backend.reason)
    return model
