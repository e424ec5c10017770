"""How much device memory a prefill or a generation needs beyond the weights, and the error when it is not there.

The numbers are estimates from the model's shapes, on the high side: what the caller (ComfyUI's model
management, in nodes/memory.py) should make room for before the run starts. A run that still runs
out of memory ends in a Qwen35Error that says how long the prompt was, what was needed and free, and
what to change.
"""
from __future__ import annotations

import math
import os

import torch

from .. import kernels
from ..kernels.gdn_prefill.reference import segment_bytes, segment_for
from ..kernels.paged_attention.reference import SCORE_BYTES
from .config import TextConfig, expected_shapes
from .devices import empty_cache
from .errors import Qwen35Error
from .kv_pool import model_sizes
from .kv_store import GROWTH
from .model import PREFILL_PIECE, Qwen35Model
from .quant import dequant_bytes
from .vision import GRAPH_PATCHES, graph_bucket, tower_passes

OVERHEAD = 256 << 20  # library workspaces (cuBLAS, kernels' scratch) and allocator rounding


def cache_bytes(model: Qwen35Model, positions: int) -> int:
    """What a sequence of `positions` tokens holds: attention K/V per position (in the model's K/V store,
    allocated with it) and its GDN states once (state_bytes, allocated per sequence)."""
    sizes = model_sizes(model.config, 1, model.dtype.itemsize)
    return positions * sizes["kv_bytes_per_token"] + sizes["snapshot_bytes"]


def state_bytes(model: Qwen35Model) -> int:
    """One sequence's GDN states (conv and recurrent): what a prefill or a generation allocates beyond the
    K/V store's blocks."""
    return cache_bytes(model, 0)


def _activation_bytes_per_token(model: Qwen35Model) -> int:
    """The largest one layer holds at once, per prompt token: the residual stream and its norm, plus the
    widest of the MLP (gate/up and their product), the GDN mixer (projections, conv output, fp32 math)
    and the attention mixer (q/gate/k/v, rotated copies, output). Attention is taken as SDPA's fused
    kernels run it (no T x T scores), as they do on CUDA for bf16 / fp16."""
    c = model.config
    b = model.dtype.itemsize
    qd, kd = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    mlp = b * 4 * c.intermediate_size
    gdn = (b * 2 * (c.conv_dim + c.value_dim + 2 * c.linear_num_value_heads)
           + 4 * 3 * (2 * c.key_dim + c.value_dim) + 4 * 3 * c.linear_num_value_heads * 64)
    att = b * 6 * (2 * qd + 2 * kd)  # the projection, normed and rotated q/k, SDPA's contiguous inputs and output
    return b * 4 * c.hidden_size + max(mlp, gdn, att)


SNAPSHOTS_PER_PREFILL = 3  # GDN states a prefill keeps besides its own: system prompt, media, turn end


def prefill_bytes(model: Qwen35Model, n_tokens: int, context: int | None = None) -> int:
    """Device memory a prefill of `n_tokens` needs beyond the weights and the K/V store (its K/V go into
    the store's blocks): its GDN states and the snapshots it keeps, the embedded prompt, one layer's activations
    for at most PREFILL_PIECE tokens (the pieces a long prompt is read in), the larger
    pools an auto store grows to when its free blocks do not hold the tokens (growth_bytes), and where the
    attention runs in PyTorch, what it gathers over the `context` positions (default: n_tokens; a follow-up
    turn's cached ones count too), where the GDN layers run in PyTorch, its working set (reference_gdn_bytes), and
    with 8-bit weights the piece of a matrix dequantized at once (quant.dequant_bytes)."""
    embedded = n_tokens * model.config.hidden_size * model.dtype.itemsize  # the prompt's input, read piece by piece
    piece = min(n_tokens, PREFILL_PIECE)
    return (1 + SNAPSHOTS_PER_PREFILL) * state_bytes(model) + embedded + piece * _activation_bytes_per_token(model) \
        + growth_bytes(model, n_tokens, (context or n_tokens) - n_tokens) \
        + reference_attention_bytes(model, context or n_tokens, piece) \
        + reference_gdn_bytes(model) + dequant_bytes(model) + OVERHEAD


def run_device(model: Qwen35Model) -> torch.device:
    """The device `model` runs on: the one its backend was picked for (Qwen35Model.backend_device), where the
    weights of an unloaded model are not (they wait on the cpu, or are let go, until the run moves them back), so
    an estimate made before that move is for the device that runs it; the weights' device before any pick."""
    return model.backend_device if model.backend_device is not None else model.device


def reference_gdn_bytes(model: Qwen35Model) -> int:
    """What the PyTorch form of the GDN prefill (where its kernel does not run) holds at once beyond its inputs and
    output: one segment's fp32 working set (it walks the sequences of a call one after another), the same whatever
    the prompt's length, its segment the one of the device the model runs on (run_device); 0 where the kernel
    runs."""
    if model.backend is not None and model.backend.use_cuda:
        return 0
    c = model.config
    return segment_bytes(c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                         segment_for(run_device(model)))


def reference_attention_bytes(model: Qwen35Model, context: int, new: int = 1) -> int:
    """What the PyTorch form of the paged attention (where its kernel does not run: kernels.paged_attention_on_kernel)
    allocates for `new` tokens over `context` positions: the keys and values gathered from the pool and in fp32,
    the values masked (a third fp32 copy), and one chunk of fp32 scores with its softmax; 0 where the kernel runs."""
    c = model.config
    if kernels.paged_attention_on_kernel(model.backend, model.dtype, c.head_dim):
        return 0
    per_position = c.num_key_value_heads * c.head_dim * (3 * 4 + 2 * model.dtype.itemsize)
    scores = min(SCORE_BYTES, 4 * c.num_attention_heads * max(1, context) * max(1, new))
    return max(1, context) * per_position + 2 * scores


def growth_bytes(model: Qwen35Model, n_tokens: int, after: int = 0) -> int:
    """The new pool tensors an auto (growable) K/V store allocates, while the old ones are still there, when
    its free blocks (snapshots' blocks not counted) do not hold `n_tokens` more; 0 otherwise. after: the positions
    before them in a sequence forked from another (a follow-up turn), whose partly filled last block is copied:
    the fork takes that copy and the rest in one call (KVStore.share)."""
    bs = model._kv.block_size if getattr(model, "_kv", None) is not None else 1
    return _grown_bytes(model, [-(-(after + n_tokens) // bs) - after // bs])  # all but the full blocks shared


def generation_growth_bytes(model: Qwen35Model, n_prompt: int, answer: int) -> int:
    """growth_bytes for a generation of `answer` tokens after `n_prompt`: its fork copies the prefill's partly
    filled last block and takes the first token's room in one call, then the answer takes its room a step at a
    time (generate.kv_capacity), so an auto store may grow more than once, each time into new tensors while the
    old ones are still there."""
    store = getattr(model, "_kv", None)
    if store is None or not store.growable or answer <= 0:
        return 0
    from .generate import kv_capacity  # generate.py imports this module
    blocks_for = store.pool.blocks_for
    takes = [blocks_for(n_prompt + 1) - n_prompt // store.block_size]  # all but the full blocks shared
    end, capacity = n_prompt + answer, n_prompt + 1
    while capacity < end:
        step = kv_capacity(capacity + 1, capacity, end)
        takes.append(blocks_for(step) - blocks_for(capacity))
        capacity = step
    return _grown_bytes(model, takes)


def _grown_bytes(model: Qwen35Model, takes) -> int:
    """The most that growths of an auto store hold at once beyond it as it is now, for `takes` (blocks taken one
    call after another, KVStore._with_room: a growth to GROWTH times or as many as a call lacks, into new tensors
    while the old ones live); 0 for a fixed store or where the free blocks hold them all."""
    store = getattr(model, "_kv", None)
    if store is None or not store.growable:
        return 0
    blocks, free, most = store.num_blocks, store.pool.num_free, 0
    for n in takes:
        if n > free:
            grown = max(int(blocks * GROWTH), blocks + n - free)  # KVStore.grown_blocks
            most = max(most, grown + blocks - store.num_blocks)
            blocks, free = grown, free + grown - blocks
        free -= n
    return most * (store.nbytes // store.num_blocks)


def vision_bytes(model: Qwen35Model, grids) -> int:
    """Device memory the vision tower needs for the inputs of these grids (t, h, w) beyond its weights: the fp32
    pixels and the merged tokens of all of them, and for the patches of its largest pass (vision.tower_passes; on
    a GPU, for a pass a bucket graph may run, its bucket's: vision.graph_bucket) their pixels in the model's
    dtype and the widest block (residual, norm, q/k/v, q and k rotated in fp32, the MLP's hidden layer and its
    GELU); attention as SDPA's fused kernels run it. For the device the model runs on (run_device), where its
    weights may not be yet. 0 for a model without a tower or without inputs."""
    n_patches = sum(t * h * w for t, h, w in grids)
    if model.vision is None or n_patches <= 0:
        return 0
    vc = model.vision.config
    b = model.dtype.itemsize
    d, i = vc.hidden_size, vc.intermediate_size
    passes = tower_passes(grids)
    widest = max(sum(t * h * w for t, h, w in part) for part in passes)
    if len(passes) == 1 and run_device(model).type == "cuda" and graph_bucket(widest) <= GRAPH_PATCHES:
        widest = graph_bucket(widest)  # a padded graph's capture runs its bucket
    per_pass_patch = b * (vc.patch_dim + 5 * d + 3 * d + max(3 * d, 2 * i)) + 4 * 2 * d  # its pixels in the dtype
    return n_patches * (4 * vc.patch_dim + b * vc.out_hidden_size) + widest * per_pass_patch + OVERHEAD


# fp32 rows of the vocabulary a decode step holds at once: the logits, and with top_p / min_p and the penalties the
# sampler's sorted values, their int64 indices (two rows), cumulative sums and penalty marks; ~10.4 measured on the
# CPU with every setting on (vocabulary 131,072), 12 counted
SAMPLER_ROWS = 12


def generate_bytes(model: Qwen35Model, n_prompt: int, max_new_tokens: int) -> int:
    """Device memory a generation needs beyond the weights and the K/V store: its copy of the GDN states (the K/V
    blocks are shared with the prefill), the prompt and answer ids, one token's activations, the logits and the
    sampler's rows of the vocabulary (SAMPLER_ROWS), and the larger pools an auto store grows to when its free
    blocks do not hold the answer's K/V (generation_growth_bytes; a fixed store holds them or the generation stops
    with an error); where the attention runs in PyTorch, what it gathers over the whole context
    (reference_attention_bytes); with 8-bit weights the piece of a matrix dequantized at once (quant.dequant_bytes)."""
    answer = max(0, min(max_new_tokens, model.config.max_position_embeddings - n_prompt))
    return (state_bytes(model) + 8 * (n_prompt + 1) + SAMPLER_ROWS * model.config.vocab_size * 4
            + _activation_bytes_per_token(model) + generation_growth_bytes(model, n_prompt, answer)
            + reference_attention_bytes(model, n_prompt + answer) + dequant_bytes(model) + OVERHEAD)


def free_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes on `device`: the GPU's as the driver sees them (Apple's GPUs: what Metal recommends
    for the process, less what it holds), or the system's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    if device.type == "mps" and hasattr(torch.mps, "recommended_max_memory"):
        total = torch.mps.recommended_max_memory()
        return max(0, total - torch.mps.driver_allocated_memory()), total
    info = getattr(getattr(torch, device.type, None), "mem_get_info", None) if device.type != "cpu" else None
    if info is not None:  # xpu, ...
        return info(device)
    try:  # ComfyUI's own dependency, and the one answer on Windows (no sysconf) and macOS (no SC_AVPHYS_PAGES)
        import psutil
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except (ImportError, OSError, AttributeError):
        pass
    free = total = 0
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        free = os.sysconf("SC_AVPHYS_PAGES") * page  # unused pages only: the page cache not counted
    except (OSError, ValueError, AttributeError):
        pass
    return max(free, _mem_available()), total


def _mem_available() -> int:
    """Linux's MemAvailable (free pages plus the page cache and buffers it can drop), 0 where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def is_out_of_memory(e: BaseException) -> bool:
    """CUDA raises torch.OutOfMemoryError; the CPU allocator a plain RuntimeError that says so ("can't allocate
    memory"), Apple's MPS one that says "out of memory"; CuPy's driver calls CUDA_ERROR_OUT_OF_MEMORY, and a kernel
    launch that fails for it CUresult 2."""
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError)  # CuPy's CUDADriverError is one
                                                     and any(s in str(e) for s in OOM_TEXTS))


OOM_TEXTS = ("can't allocate memory", "out of memory", "CUDA_ERROR_OUT_OF_MEMORY", "(CUresult 2)")


def text_weight_bytes(config: TextConfig, dtype: torch.dtype, int8: bool = False) -> int:
    """What the text model's weights take once loaded: its matrices in `dtype` (int8: a byte a number and a
    scale a row, quant.py), the rest (norms, gates, convolutions) counted in `dtype` too."""
    total = 0
    for shape in expected_shapes(config).values():
        n = math.prod(shape)
        total += n + shape[0] * dtype.itemsize if int8 and len(shape) == 2 else n * dtype.itemsize
    return total


def loading_out_of_memory(name: str, config: TextConfig, dtype: torch.dtype, device: torch.device,
                          int8: bool = False) -> Qwen35Error:
    """The error for a load that ran out of device memory; call it once the half-built model is gone."""
    empty_cache(device)
    weights = text_weight_bytes(config, dtype, int8)
    free, total = free_bytes(device)
    gib = 2 ** 30
    kept = "with 8-bit weights" if int8 else f"in {str(dtype).removeprefix('torch.')}"
    smaller = "" if int8 else (f", load it with 8-bit weights (weights: int8, "
                               f"{text_weight_bytes(config, dtype, True) / gib:.2f} GiB)")
    return Qwen35Error(
        f"out of memory on {device} loading {name}: its text weights alone take {weights / gib:.2f} GiB {kept}, "
        f"and {free / gib:.2f} GiB of {total / gib:.2f} GiB is free. Pick a smaller Qwen3.5 model{smaller}, free "
        "memory (ComfyUI's 'Unload models', or close other programs on the GPU), or load it on the cpu")


def out_of_memory(model: Qwen35Model, what: str, needed: int) -> Qwen35Error:
    """The error for a run that ran out of device memory (`what`: "reading a prompt of N tokens"); call it
    once the failed run's tensors are gone."""
    dev = model.device
    empty_cache(dev)  # what the failed run held goes back, so `free` is what a retry would find
    free, total = free_bytes(dev)
    gib = 2 ** 30
    on_cpu = dev.type == "cpu"
    loads = [] if model.int8 else ["with int8 weights (the loader's weights input: half the memory)"]
    if model.dtype == torch.float32:
        loads.append("as bf16")
    if not on_cpu:
        loads.append("on the cpu")
    other = f"load the model {' or '.join(loads)}, or load a smaller Qwen3.5" if loads else "load a smaller Qwen3.5"
    return Qwen35Error(
        f"out of memory on {dev} {what}: that needs about "
        f"{needed / gib:.2f} GiB beyond the model's {model.size_bytes() / gib:.2f} GiB of weights and K/V cache, and "
        f"{free / gib:.2f} GiB of {total / gib:.2f} GiB is free. Shorten the prompt (or max_new_tokens), free "
        f"memory (ComfyUI's 'Unload models', or close other programs{'' if on_cpu else ' on the GPU'}), or {other}. "
        "The model is unchanged: the same run works once there is room")


__all__ = ["cache_bytes", "state_bytes", "prefill_bytes", "run_device", "vision_bytes", "generate_bytes",
           "generation_growth_bytes", "free_bytes", "out_of_memory",
           "is_out_of_memory", "loading_out_of_memory", "text_weight_bytes"]
