"""Decode steps replayed from one CUDA graph, so a token costs one graph launch of host time
instead of a few hundred kernel launches from Python."""
from __future__ import annotations

import gc
import logging
import os

import torch

from .model import Cache, DecodeSlot, Qwen35Model

log = logging.getLogger(__name__)
_warned = False
_side_streams: dict = {}


def side_stream(dev: torch.device) -> torch.cuda.Stream:
    """One stream per device for every warm-up and capture (decode steps and short prefills). Each stream
    that runs a matmul gets its own cuBLAS workspace (32 MiB on Hopper) that PyTorch keeps; a fresh pool
    stream per generation would pile up to 32 of them."""
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(torch.device("cuda", key))
    return _side_streams[key]


def capture_graph(dev: torch.device, run, restore=None, measure: bool = True):
    """run() once on the side stream (warm-up: kernel modules, library plans and workspaces), restore() after it
    where the warm-up changed state the captured run reads, then run() captured there: (the graph, what the
    captured run returned, the device memory its pool holds, or None without `measure`). The pool is measured
    from the reserved memory after the allocator's unused cache is given back, as torch.cuda.graph does again on
    entering the capture (a decode graph, captured once a generation, skips the measure and its second full
    garbage collection)."""
    side = side_stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    try:
        with torch.cuda.stream(side):
            run()
    finally:  # a warm-up that failed part-way (out of memory) changed state too: the caller goes on without a graph
        torch.cuda.current_stream(dev).wait_stream(side)
        if restore is not None:
            restore()
    graph = torch.cuda.CUDAGraph()
    # cuBLAS's workspace, made by the warm-up outside the graph's pool, is let go before the capture, so that the
    # captured products take one inside it (as torch's own graph trees do): free_gpu_workspaces (a model unloaded)
    # can then never free memory a kept graph of another model writes to. (Before the measure: the capture
    # gives the allocator's unused cache back on entering, the released workspace with it.)
    free_gpu_workspaces()
    before = None
    if measure:
        torch.cuda.synchronize(dev)
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(dev)
    try:
        with torch.cuda.graph(graph, stream=side):
            out = run()
    finally:
        free_gpu_workspaces()  # (the pool keeps the graph's; eager products take a new one outside it)
    return graph, out, None if before is None else torch.cuda.memory_reserved(dev) - before


def free_gpu_workspaces() -> None:
    """Frees the cuBLAS workspaces PyTorch keeps per stream (they come back with the next matmul):
    with the weights they are what a model leaves on the GPU after it is unloaded."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    for name in ("_cuda_clearCublasWorkspaces", "_cuda_clearCublasLtWorkspaces"):
        clear = getattr(torch._C, name, None)
        if clear is not None:
            clear()


class GraphedDecode:
    """One captured decode step over `cache`, for a generation of at most `most` positions.

    The token id, its position and the block table live in device tensors the graph reads (the table
    has room for `most` positions; the caller writes blocks added later with slot.set_blocks); the
    logits land in a static tensor that the next call overwrites.
    """

    def __init__(self, model: Qwen35Model, cache: Cache, most: int):
        dev = model.device
        self.cache = cache
        self.version = cache.store.version  # the store's tensors this graph reads
        self.ids = torch.zeros(1, dtype=torch.long, device=dev)
        self.slot = DecodeSlot(cache.store.pool.blocks_for(max(most, cache.capacity)), dev)
        self.slot.set_blocks(cache.seq.blocks)
        model.start_states(cache)  # an empty cache's zero states, here: the warm-up steps them and restore() resets
        states = [t for t in cache.conv + cache.ssm if t is not None]
        saved = [t.clone() for t in states]
        self.slot.set(cache.length)

        def restore():  # the warm-up stepped the GDN states: put them back
            for t, s in zip(states, saved):
                t.copy_(s)

        self.graph, self.logits, _ = capture_graph(
            dev, lambda: model.forward_decode_at(self.ids, self.slot, cache), restore, measure=False)

    def __call__(self, token: int | torch.Tensor) -> torch.Tensor:
        """Append `token` (an int, or a long tensor [1] on the device, copied there without a synchronisation)
        at the cache's end; returns fp32 logits [1, vocab] (valid until the next call)."""
        if isinstance(token, torch.Tensor):
            self.ids.copy_(token.view(1))
        else:
            self.ids.fill_(token)
        self.graph.replay()
        self.slot.advance()
        self.cache.length += 1
        return self.logits


def graphed_decode(model: Qwen35Model, cache: Cache, most: int) -> GraphedDecode | None:
    """A GraphedDecode on CUDA, with our kernels or with the PyTorch path (whose decode step reads nothing back
    to the host, so it captures too); None off CUDA, with QWEN35_CUDA_GRAPHS=0, or when capture failed:
    decode runs eagerly."""
    global _warned
    if model.device.type != "cuda" or os.environ.get("QWEN35_CUDA_GRAPHS", "1") == "0":
        return None
    try:
        return GraphedDecode(model, cache, most)
    except Exception as e:  # noqa: BLE001 - any capture failure leaves eager decoding, which always works
        if not _warned:
            _warned = True
            log.warning("Qwen3.5 decode runs without CUDA graphs (capture failed: %s)", e)
        return None
