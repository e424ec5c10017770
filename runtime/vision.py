"""The Qwen3.5 vision tower: pixel patches -> vision tokens in the language model's width.

    patches [N, C*T*P*P] --patch embed (Conv3d with stride = kernel, i.e. one matmul)--> [N, D]
      + learned position grid (side x side, bilinearly resampled to each image's patch grid)
      -> depth x (LayerNorm, attention with 2-D rotary, LayerNorm, GELU-tanh MLP), residual
      -> merger: LayerNorm, 2x2 neighbouring patches concatenated, MLP -> [N/4, text hidden]

Patches arrive in merge-block order (block row, block column, row in block, column in block), as
transformers' processor and `media.py` lay them out, so the merger's 2x2 groups are four
consecutive rows. Attention is full (non-causal) inside one image or one 2-frame slice of a video
and never crosses them: under the CUDA backend in bf16 on H100 / H200, one launch of our kernel over every
slice (`kernels.vision_attention`, through the slices' offsets `cu_seqlens`); otherwise under the CUDA
backend (NVIDIA sm80+ with the kernels built, bf16 / fp16: `backend.use_cuda`), slices of several lengths as
one variable-length flash attention launch where this torch has `varlen_attn`; in every other case (slices of
one length, ROCm and other accelerators, fp32, the PyTorch backend, the CPU) one batched SDPA call per distinct
slice length (`groups`).

The patches' positions (the interpolated position grid and the rotary's angles, made from the grids), the
rotary and the LayerNorms (each after the first fused with the residual add before it) are `kernels`
operators: CUDA kernels under the text model's backend, the PyTorch references without one.

Sizes come from the checkpoint (config.json's `vision_config`, or the tensor shapes of a single
file): the released towers are 12 x 768 (0.8B), 24 x 1024 (2B, 4B) and 27 x 1152 (9B, 27B).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from . import progress
from .checkpoint import (
    LOADABLE_DTYPES,
    Checkpoint,
    Fp8Weight,
    WeightReader,
    fp8_block_of,
    fp8_weights,
    quant_method_of,
    read_config,
)
from .errors import Qwen35Error
from .host import upload

log = logging.getLogger(__name__)

VISION_PREFIXES = ("model.visual.", "visual.")
LAYER_NORM_EPS = 1e-6
# Heads of the released towers by width: a single .safetensors file does not say (64 or 72 per head);
# a tower of another width in a single file is read as heads of 64
HEADS_BY_WIDTH = {768: 12, 1024: 16, 1152: 16}


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    rope_theta: float = 10_000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one patch row: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @property
    def shape_name(self) -> str:
        return f"{self.depth}x{self.hidden_size}"


def vision_config_from_hf(cfg: dict, source: str = "config.json") -> VisionConfig | None:
    """The tower's sizes from a Hugging Face Qwen3.5 config (None when it has no vision_config)."""
    v = cfg.get("vision_config")
    if not v:
        return None
    def read(name: str, alias: str):  # transformers' attribute_map: the alias, where given, sets the attribute
        return v[alias] if alias in v else v[name]
    try:
        rope = v.get("rope_parameters") or {}
        text = cfg.get("text_config", {})
        return VisionConfig(
            depth=read("depth", "num_hidden_layers"), hidden_size=v["hidden_size"],
            intermediate_size=v["intermediate_size"], num_heads=read("num_heads", "num_attention_heads"),
            out_hidden_size=v.get("out_hidden_size", text.get("hidden_size")),
            patch_size=v.get("patch_size", 16), temporal_patch_size=v.get("temporal_patch_size", 2),
            spatial_merge_size=v.get("spatial_merge_size", 2), in_channels=v.get("in_channels", 3),
            num_position_embeddings=v.get("num_position_embeddings", 2304),
            # (an older config's rope_theta beside the sizes, as transformers reads it where rope_parameters has none)
            rope_theta=rope.get("rope_theta", v.get("rope_theta", 10_000.0)))
    except KeyError as e:
        raise Qwen35Error(f"{source}: vision_config lacks {e.args[0]!r}; re-download the checkpoint's config.json")


def infer_vision_config(shapes: dict[str, tuple[int, ...]], source: str) -> VisionConfig:
    """The tower's sizes from tensor shapes keyed without prefix ('blocks.0.attn.qkv.weight', ...)."""
    def shape(name):
        if name not in shapes:
            raise Qwen35Error(f"{source}: vision tensor {name!r} is missing; the vision tower in this file is "
                              "incomplete (text prompts still work)")
        return shapes[name]

    patch = shape("patch_embed.proj.weight")
    if len(patch) != 5 or not all(patch):
        raise Qwen35Error(f"{source}: vision tensor 'patch_embed.proj.weight' has shape {list(patch)}, not the "
                          "[width, channels, frames, patch, patch] of a Qwen3.5 tower; the vision weights are "
                          "damaged or another model's (text prompts still work)")
    hidden, channels, t, p, _ = patch
    blocks = [int(k.split(".")[1]) for k in shapes if k.startswith("blocks.") and k.split(".")[1].isdigit()]
    if not blocks:
        raise Qwen35Error(f"{source}: the vision tower has no blocks (no vision tensor 'blocks.N.*'); the vision "
                          "tower in this file is incomplete (text prompts still work)")
    depth = 1 + max(blocks)
    merged_in = shape("merger.linear_fc1.weight")[1]
    return VisionConfig(
        depth=depth, hidden_size=hidden, intermediate_size=shape("blocks.0.mlp.linear_fc1.weight")[0],
        num_heads=HEADS_BY_WIDTH.get(hidden, max(1, hidden // 64)),
        out_hidden_size=shape("merger.linear_fc2.weight")[0], patch_size=p, temporal_patch_size=t,
        spatial_merge_size=int(round((merged_in // hidden) ** 0.5)), in_channels=channels,
        num_position_embeddings=shape("pos_embed.weight")[0])


def expected_vision_shapes(vc: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tower tensor (names without prefix) and its shape."""
    d, i, m = vc.hidden_size, vc.intermediate_size, vc.hidden_size * vc.merge_unit
    out = {"patch_embed.proj.weight": (d, vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size),
           "patch_embed.proj.bias": (d,), "pos_embed.weight": (vc.num_position_embeddings, d),
           "merger.norm.weight": (d,), "merger.norm.bias": (d,),
           "merger.linear_fc1.weight": (m, m), "merger.linear_fc1.bias": (m,),
           "merger.linear_fc2.weight": (vc.out_hidden_size, m), "merger.linear_fc2.bias": (vc.out_hidden_size,)}
    for b in range(vc.depth):
        p = f"blocks.{b}."
        out.update({p + "norm1.weight": (d,), p + "norm1.bias": (d,), p + "norm2.weight": (d,),
                    p + "norm2.bias": (d,), p + "attn.qkv.weight": (3 * d, d), p + "attn.qkv.bias": (3 * d,),
                    p + "attn.proj.weight": (d, d), p + "attn.proj.bias": (d,),
                    p + "mlp.linear_fc1.weight": (i, d), p + "mlp.linear_fc1.bias": (i,),
                    p + "mlp.linear_fc2.weight": (d, i), p + "mlp.linear_fc2.bias": (d,)})
    return out


# --- the per-call plan: everything that depends on the image sizes only ---------------------------

@dataclass(frozen=True)
class VisionPlan:
    """Index math for one tower call, made once from the grids (none of it reads pixels), in one upload.

    grids: (t, h, w) per image / video in patches; table: int32 [G, 4] on the tower's device, each grid's
    t, h, w and first patch (kernels.vision_positions makes the positions and rotary angles from it);
    inv_freq: fp32 [head_dim / 4], the rotary's frequencies of one axis; groups: (token index [S*L] or None
    when the group is every token in order, S slices, L tokens each) per slice length, for SDPA (none in a
    padded plan, whose attention reads cu_seqlens whatever runs it);
    cu_seqlens: int32 [slices + 1] where each attention slice (an image, a video's temporal patch) starts,
    and max_len, its longest (a padded plan: its patches, a bound for every layout of its bucket). padded: the
    last grid is the padding of a bucket graph (pad_grids), whose plan tensors other layouts overwrite.
    """
    grids: tuple[tuple[int, int, int], ...]
    table: torch.Tensor
    inv_freq: torch.Tensor
    groups: tuple[tuple[torch.Tensor | None, int, int], ...]
    cu_seqlens: torch.Tensor
    max_len: int
    padded: bool = False

    @property
    def n_patches(self) -> int:
        return sum(t * h * w for t, h, w in self.grids)


@functools.lru_cache(maxsize=8)
def _inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """The rotary's frequencies of one axis (a quarter of the head each for h and w), fp32, made on the host
    as transformers makes them."""
    return (1.0 / theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2))).numpy()


def plan(vc: VisionConfig, grids, device: torch.device, pad_to: int | None = None) -> VisionPlan:
    """The VisionPlan for images / videos of these patch grids [(t, h, w), ...]: a few host integers copied to
    the device as one array without waiting (upload); the per-patch work is the tower's first kernel. pad_to:
    the patches of a bucket graph (graph_bucket): the grids, then a grid of padding up to that many patches."""
    grids = tuple((int(t), int(h), int(w)) for t, h, w in grids)
    if pad_to is not None:
        grids = pad_grids(grids, pad_to, vc.spatial_merge_size)
    m = vc.spatial_merge_size
    for t, h, w in grids:
        if t < 1 or h < m or w < m or h % m or w % m:
            raise Qwen35Error(f"vision grid {(t, h, w)} is not a whole number of {m}x{m} patch blocks")
    sizes = [t * h * w for t, h, w in grids]
    table = np.array([(t, h, w, s) for (t, h, w), s in zip(grids, np.cumsum([0] + sizes[:-1]))], dtype=np.int32)
    # attention slices: one per image, one per temporal patch of a video; grouped by length
    lengths = [h * w for t, h, w in grids for _ in range(t)]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_len.setdefault(n, []).append(int(starts[i]))
    inv_freq = _inv_freq(vc.head_dim, vc.rope_theta)
    buf = upload(torch.from_numpy(np.concatenate([table.reshape(-1), starts, inv_freq.view(np.int32)])), device=device)
    g, s = table.size, starts.size
    def order(n, firsts):  # the tokens of the slices of length n, in turn (SDPA's batch of them)
        return upload(torch.from_numpy((np.asarray(firsts)[:, None] + np.arange(n)[None, :]).reshape(-1)), device=device)

    groups = () if pad_to is not None else tuple((None if len(by_len) == 1 else order(n, f), len(f), n)
                                                 for n, f in by_len.items())  # (a padded plan's attention: cu_seqlens)
    return VisionPlan(grids, buf[:g].view(len(grids), 4), buf[g + s:].view(torch.float32), groups, buf[g:g + s],
                      max(lengths) if pad_to is None else pad_to, pad_to is not None)


# A graph may also stand for other grids of the same layout (images, slices) whose patches fall in its bucket:
# it runs graph_bucket(n) patches, the inputs' and then a grid of padding, an attention segment of its own (no
# image's token attends to it, and every other operator works patch by patch). Its replays take the inputs'
# plan (the grids' table, the segments' starts) into the tensors the graph reads; the padding's rows are zeros
# and its tokens are dropped. Images of about one size (896 x 1152, 832 x 1216, 768 x 1344: 3,952 to 4,032
# patches, bucket 4,096; 1024 x 1024's 4,096 patches fall in the next, 4,608) then share one graph instead of
# each running eagerly, ~280 launches from Python.
def graph_bucket(n: int) -> int:
    """The patches of the bucket graph for n patches: the next multiple above n (never n itself: the padding is
    a grid) of an eighth of the power of two at or below n, and of 64; at most 12.5% more patches (+64)."""
    step = max(64, 1 << max(0, n.bit_length() - 4))
    return (n // step + 1) * step


def pad_grids(grids: tuple[tuple[int, int, int], ...], total: int, merge: int) -> tuple[tuple[int, int, int], ...]:
    """The grids, then one image of (merge, rest / merge) patches filling them up to `total` patches."""
    rest = total - sum(t * h * w for t, h, w in grids)
    if rest <= 0 or rest % (merge * merge):
        raise ValueError(f"cannot pad {total - rest} patches to {total} with {merge} x {merge} blocks")
    return grids + ((1, merge, rest // merge),)


# A call over more than TOWER_PASS_PATCHES patches runs the tower in passes of whole images and 2-frame video
# slices, as equal as those allow. The tower's attention never crosses an image or a slice, and every other
# operator works patch by patch, so the tokens are those of one pass; what a layer holds at once is one pass's
# activations: on the 27 x 1152 tower, by runtime/memory.py's estimate, ~48 KB a patch, 2.2 GiB for a video at
# the default pixel budget (at most 49,152 patches: a patch covers two frames) in one pass, 1.1 GiB in two passes
# of 24,576; passes of up to 32,768 keep the GEMMs at their full rate.
TOWER_PASS_PATCHES = 32768


def tower_passes(grids, limit: int | None = None) -> list[tuple[tuple[int, int, int], ...]]:
    """The grids (t, h, w) of the tower's passes over these inputs, in order: all in one pass when their patches
    add up to at most `limit` (default TOWER_PASS_PATCHES), else consecutive runs of at most `limit` (an image or
    a slice above it alone), a video's grid split between its temporal slices, as even as the slices allow; the
    passes' patches, one after another, are the inputs'."""
    limit = TOWER_PASS_PATCHES if limit is None else limit
    grids = [(int(t), int(h), int(w)) for t, h, w in grids]
    total = sum(t * h * w for t, h, w in grids)
    if total <= limit:
        return [tuple(grids)]
    target = -(-total // -(-total // limit))  # the patches of a pass when the fewest passes split them evenly
    passes, part, size = [], [], 0
    for i, (t, h, w) in enumerate(grids):
        for _ in range(t):
            if part and size + h * w > limit:
                passes.append(part)
                part, size = [], 0
            if part and part[-1][0] == i:
                part[-1] = (i, part[-1][1] + 1)
            else:
                part.append((i, 1))
            size += h * w
            if size >= target:
                passes.append(part)
                part, size = [], 0
    if part:
        passes.append(part)
    return [tuple((n, grids[i][1], grids[i][2]) for i, n in p) for p in passes]


# --- weights and forward ------------------------------------------------------------------------

# The tower keeps its last PLAN_CACHE plans of at most PLAN_CACHE_PATCHES patches (a few hundred bytes each;
# with images of several sizes, the SDPA path's token order, 8 bytes a patch): four sizes, each with the padded
# plan its bucket graph replays (a size replayed through a bucket graph takes two)
PLAN_CACHE, PLAN_CACHE_PATCHES = 8, 16384
# The second call in a row with the same grids (on a GPU, with the kernels) captures the tower as one CUDA
# graph and later calls replay it: the tower's ~300 launches from Python cost more host time than its GPU
# work on the H200's host (14 ms for 12.5), and a replay lets the host go on queueing the text layers while
# the GPU runs the tower. One graph is kept (its memory, counted in the model's size: the activations of one
# call, estimated ~0.1-0.2 GB for 4,096 patches of the 27 x 1152 tower), for at most GRAPH_PATCHES patches.
GRAPH_PATCHES = 16384


class TowerGraph:
    """One tower call captured for fixed grids and backend (or, from a padded plan, for every layout of its
    bucket): pixels are copied into its input, the graph is replayed, and its output copied out (the next
    replay overwrites the graph's own)."""

    def __init__(self, tower: "VisionTower", p: "VisionPlan", backend: kernels.Backend, pixels: torch.Tensor, key):
        from .decode_graph import capture_graph  # (it imports the model, which imports this module)
        self.key = key
        with torch.inference_mode(False):  # normal tensors: replays copy into them in inference mode (ComfyUI) or not
            self.pixels = pixels.clone()
            if p.padded:  # (the tensors other layouts' plans are copied into)
                p = dataclasses.replace(p, table=p.table.clone(), cu_seqlens=p.cu_seqlens.clone())
        self.plan = p  # the replays read its tensors: they live as long as the graph, whatever the tower keeps
        self.graph, self.out, self.pool_bytes = capture_graph(pixels.device,
                                                              lambda: tower(self.pixels, p, backend=backend))

    @property
    def nbytes(self) -> int:
        """Device memory the graph holds: its input and its pool (counted in the model's size)."""
        return self.pixels.numel() * self.pixels.element_size() + self.pool_bytes

    def __call__(self, pixels: torch.Tensor, p: "VisionPlan | None" = None) -> torch.Tensor:
        """The tower's output for `pixels`; p: their padded plan, for a bucket graph (its table and segment
        starts replace the ones the graph reads; the rows after the pixels are zeros, their tokens dropped)."""
        n = pixels.shape[0]
        if p is not None:
            self.plan.table.copy_(p.table)
            self.plan.cu_seqlens.copy_(p.cu_seqlens)
        self.pixels[:n].copy_(pixels)
        if n < self.pixels.shape[0]:
            self.pixels[n:].zero_()
        self.graph.replay()
        return self.out[:n * self.out.shape[0] // self.pixels.shape[0]].clone()

_VARLEN: list = []


def _varlen_attn():
    """torch.nn.attention.varlen.varlen_attn (flash attention over packed sequences of several lengths),
    or None where this torch has none."""
    if not _VARLEN:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            varlen_attn = None
        _VARLEN.append(varlen_attn)
    return _VARLEN[0]


def _param(*shape, dtype, device):
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class VisionBlock(nn.Module):
    def __init__(self, vc: VisionConfig, dtype, device):
        super().__init__()
        d, i = vc.hidden_size, vc.intermediate_size
        e = dict(dtype=dtype, device=device)
        self.norm1_w, self.norm1_b = _param(d, **e), _param(d, **e)
        self.qkv_w, self.qkv_b = _param(3 * d, d, **e), _param(3 * d, **e)
        self.proj_w, self.proj_b = _param(d, d, **e), _param(d, **e)
        self.norm2_w, self.norm2_b = _param(d, **e), _param(d, **e)
        self.fc1_w, self.fc1_b = _param(i, d, **e), _param(i, **e)
        self.fc2_w, self.fc2_b = _param(d, i, **e), _param(d, **e)


class VisionTower(nn.Module):
    """Weights of the tower; `forward(pixels, plan)` runs it."""

    def __init__(self, vc: VisionConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config = vc
        d, m = vc.hidden_size, vc.hidden_size * vc.merge_unit
        e = dict(dtype=dtype, device=device)
        self.patch_w, self.patch_b = _param(d, vc.patch_dim, **e), _param(d, **e)
        self.pos_embed = _param(vc.num_position_embeddings, d, **e)
        self.blocks = nn.ModuleList(VisionBlock(vc, dtype, device) for _ in range(vc.depth))
        self.merge_norm_w, self.merge_norm_b = _param(d, **e), _param(d, **e)
        self.merge_fc1_w, self.merge_fc1_b = _param(m, m, **e), _param(m, **e)
        self.merge_fc2_w, self.merge_fc2_b = _param(vc.out_hidden_size, m, **e), _param(vc.out_hidden_size, **e)
        self._plans: dict[tuple, VisionPlan] = {}  # grids, or (grids, pad_to) -> plan; least recently used first
        self._graph: TowerGraph | None = None
        self._last = None  # (grids, backend) of the last call
        self._last_bucket = None  # its bucket graph's key (_bucket_key), None where it had none
        self._replays: dict = {}  # backend name -> _replays_other_layouts (for this device and dtype)
        self._no_graph: set = set()  # keys whose capture failed: they run eagerly

    @property
    def device(self) -> torch.device:
        return self.patch_w.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype, as they are now (a .to(dtype) changes it)."""
        return self.patch_w.dtype

    def plan(self, grids, pad_to: int | None = None) -> VisionPlan:
        """The plan of these grids (padded to pad_to patches: a bucket graph's, as `plan` makes it), kept for
        the next call with the same grids (images of one size, the frames of a batch: its host work and upload
        are not repeated)."""
        grids = tuple((int(t), int(h), int(w)) for t, h, w in grids)
        key = grids if pad_to is None else (grids, pad_to)
        p = self._plans.pop(key, None)
        if p is None:
            p = plan(self.config, grids, self.device, pad_to=pad_to)
        if p.n_patches <= PLAN_CACHE_PATCHES:
            self._plans[key] = p  # most recent last
            while len(self._plans) > PLAN_CACHE:
                self._plans.pop(next(iter(self._plans)))
        return p

    def _apply(self, fn, recurse=True):
        self.forget_kept()
        return super()._apply(fn, recurse)

    def forget_kept(self) -> None:
        """Drops the plans and the graph kept for the weights where they are: before a move (Qwen35Model._apply
        calls it first, so that a move failing part-way leaves no graph over freed weights)."""
        self._plans.clear()  # their tensors are where the weights were
        self._graph = self._last = self._last_bucket = None  # and the graph reads the weights' old addresses
        self._replays.clear()  # (another device or dtype may take other kernels)
        self._no_graph.clear()  # (a capture that failed for want of memory may succeed there)

    def graph_bytes(self) -> int:
        """Device memory of the kept CUDA graph (0 without one)."""
        return self._graph.nbytes if self._graph is not None else 0

    def run(self, pixels, grids, backend: kernels.Backend | None = None) -> torch.Tensor:
        """forward over `pixels` of these grids (one tensor, or one per input: not joined into a copy of them
        all) with the kept plan; on a GPU with the kernels, the second call in a row with the same grids captures
        a CUDA graph (TowerGraph, GRAPH_PATCHES) that later calls with them replay. The same kernels run either
        way: the output is the same. Two calls in a row with other grids of one layout in one bucket
        (graph_bucket) capture a padded graph instead, which later calls of that layout and bucket replay, a
        repeat of one size among them (one graph is kept: the bucket's serves its sizes, an exact one only a
        size): more patches, so the output is the eager one's within the rounding of products of another size
        (cuBLAS may pick another algorithm, our attention's split blocks fall elsewhere; where our attention
        kernel does not run, the padded plan takes varlen flash attention where one size would take SDPA). Over more
        than TOWER_PASS_PATCHES patches it runs eagerly in passes (tower_passes), each taking its own rows of the
        pixels to the device."""
        parts = list(pixels) if isinstance(pixels, (list, tuple)) else [pixels]
        passes = tower_passes(grids)
        rows, want = sum(t.shape[0] for t in parts), sum(t * h * w for t, h, w in grids)
        if rows != want:
            raise Qwen35Error(f"vision input has {rows} patch rows, the grids {[tuple(g) for g in grids]} need {want}")
        if len(passes) > 1:
            self._last = self._last_bucket = None
            out, lo = [], 0
            for part in passes:
                if lo:
                    progress.report("vision", lo, want)  # a caller's cancel lands here, between passes
                p = self.plan(part)
                out.append(self(self._rows(parts, lo, lo + p.n_patches), p, backend=backend))
                lo += p.n_patches
            return torch.cat(out)
        p = self.plan(grids)
        x = self._rows(parts, 0, p.n_patches)
        key = (p.grids, backend.name if backend is not None else None)
        graphable = self._graphable(x, p, backend, key)
        bucket = self._bucket_key(p, backend) if graphable else None
        last, self._last = self._last, key
        last_bucket, self._last_bucket = self._last_bucket, bucket
        if graphable and self._graph is not None and self._graph.key == key:
            return self._graph(x)
        if bucket is not None and self._graph is not None and self._graph.key == bucket:
            return self._graph(x, self.plan(p.grids, pad_to=bucket[1]))
        if graphable and last == key:
            gkey, gplan, gx = key, p, x
        elif bucket is not None and last_bucket == bucket and bucket not in self._no_graph:
            gkey, gplan = bucket, self.plan(p.grids, pad_to=bucket[1])
            gx = torch.cat([x, x.new_zeros(bucket[1] - x.shape[0], x.shape[1])])
        else:
            return self(x, p, backend=backend)
        self._graph = None  # one graph: the old one's memory goes first
        try:
            self._graph = TowerGraph(self, gplan, backend, gx, gkey)
        except Exception as e:  # noqa: BLE001 - a capture the card or a library refuses: this size runs eagerly
            self._no_graph.add(gkey)
            log.warning("qwen35: the vision tower runs without a CUDA graph for grids %s (%s)", gplan.grids, e)
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            return self(x, p, backend=backend)
        return self._graph(x)  # (a padded capture: its own plan is this call's)

    def _rows(self, parts: list, lo: int, hi: int) -> torch.Tensor:
        """Rows lo .. hi of the pixel tensors `parts` taken one after another, on the tower's device and dtype."""
        rows, start = [], 0
        for t in parts:
            a, b = max(lo, start), min(hi, start + t.shape[0])
            if a < b:
                rows.append(t[a - start:b - start].to(self.device, self.dtype))
            start += t.shape[0]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _graphable(self, x: torch.Tensor, p: VisionPlan, backend: kernels.Backend | None, key) -> bool:
        """Whether this call may replay or capture a graph: on a GPU with the kernels, not too large, not
        refused before, graphs not turned off, and not itself inside a compile or a capture."""
        return (x.is_cuda and backend is not None and backend.use_cuda and p.n_patches <= GRAPH_PATCHES
                and key not in self._no_graph and os.environ.get("QWEN35_CUDA_GRAPHS", "1") != "0"
                and not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing())

    def _bucket_key(self, p: VisionPlan, backend: kernels.Backend | None):
        """The key of the bucket graph that may stand for this plan's grids (the bucket's patches, the number of
        grids and of attention segments, the backend), or None: it must fit GRAPH_PATCHES, and the attention must
        read its segments from the device (our kernel, or torch's varlen flash attention), not run one SDPA call
        per slice length of the grids the graph was captured with."""
        n, m = graph_bucket(p.n_patches), self.config.spatial_merge_size
        if n > GRAPH_PATCHES or (n - p.n_patches) % (m * m):  # (the padding: whole m x m blocks)
            return None
        name = backend.name if backend is not None else None
        ok = self._replays.get(name)
        if ok is None:
            ok = self._replays[name] = self._replays_other_layouts(backend)
        return ("bucket", n, len(p.grids), p.cu_seqlens.numel() - 1, name) if ok else None

    def _replays_other_layouts(self, backend: kernels.Backend) -> bool:
        """Whether a graph of this tower reads the layout from the plan's tensors alone, so that a replay may take
        another layout's: the positions kernel takes it (it reads the grids' table; the reference reads the host's
        grids) and the attention reads the segments from cu_seqlens (our kernel, or torch's varlen flash attention;
        not one SDPA call per slice length)."""
        vc, dev = self.config, self.device
        if self.dtype not in (torch.bfloat16, torch.float16) or vc.hidden_size % 8:  # (kernels.vision_positions)
            return False
        if _varlen_attn() is not None:
            return True
        q = torch.empty(0, vc.num_heads, vc.head_dim, dtype=self.dtype, device=dev)
        return kernels.vision_attention_takes(q, q, q, torch.empty(2, dtype=torch.int32, device=dev), backend=backend)

    def _attention(self, blk: VisionBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, p: VisionPlan,
                   be: kernels.Backend | None, ours: list) -> torch.Tensor:
        """ours: [whether our attention kernel takes the layers' q, k, v], asked at the first layer (every layer's
        have the same shapes, strides, dtype and device) and kept there for the others: one check a call."""
        vc = self.config
        n, d = x.shape
        qkv = F.linear(x, blk.qkv_w, blk.qkv_b).view(n, 3, vc.num_heads, vc.head_dim)
        # 2-D rotary over the whole head (h features, then w features), q and k together, in fp32
        q, k = kernels.vision_rotary(qkv, cos, sin, backend=be).unbind(0)
        v = qkv[:, 2]
        if not ours:
            ours.append(kernels.vision_attention_takes(q, k, v, p.cu_seqlens, backend=be))
        if ours[0]:  # ours: sm_90a, head dim 64 / 72
            out = kernels.vision_attention(q, k, v, p.cu_seqlens, p.max_len, backend=be)
            return F.linear(out.reshape(n, d), blk.proj_w, blk.proj_b)
        if (len(p.groups) > 1 or p.padded) and be is not None and be.use_cuda and _varlen_attn() is not None:
            out = _varlen_attn()(q, k, v.contiguous(), p.cu_seqlens, p.cu_seqlens, p.max_len, p.max_len)
            return F.linear(out.reshape(n, d), blk.proj_w, blk.proj_b)
        if p.padded:  # the segments its tensors hold now (a bucket graph's replays rewrite them), one call each
            out, bounds = torch.empty_like(v), p.cu_seqlens.tolist()
            for a, b in zip(bounds, bounds[1:]):
                o = F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)))
                out[a:b] = o.transpose(0, 1)
            return F.linear(out.reshape(n, d), blk.proj_w, blk.proj_b)
        out = torch.empty_like(v) if len(p.groups) > 1 else None
        for index, s, length in p.groups:  # one batched call per distinct slice length
            qs, ks, vs = (t if index is None else t.index_select(0, index) for t in (q, k, v))
            o = F.scaled_dot_product_attention(*(t.view(s, length, vc.num_heads, vc.head_dim).transpose(1, 2)
                                                 for t in (qs, ks, vs)))
            o = o.transpose(1, 2).reshape(s * length, vc.num_heads, vc.head_dim)
            if index is None:
                out = o
            else:
                out.index_copy_(0, index, o)
        return F.linear(out.reshape(n, d), blk.proj_w, blk.proj_b)

    @staticmethod
    def _mlp(blk: VisionBlock, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # fc1's bias and the tanh GELU in the GEMM's epilogue (cuBLASLt), before the bf16 rounding
            h = torch._addmm_activation(blk.fc1_b, x, blk.fc1_w.t(), use_gelu=True)
        else:  # (the CPU's _addmm_activation takes the erf GELU)
            h = F.gelu(F.linear(x, blk.fc1_w, blk.fc1_b), approximate="tanh")
        return F.linear(h, blk.fc2_w, blk.fc2_b)

    @torch.no_grad()  # not inference_mode: torch.compile traces this (inference tensors break its functionalisation)
    def forward(self, pixels: torch.Tensor, p: VisionPlan, backend: kernels.Backend | None = None) -> torch.Tensor:
        """pixels [N, C*T*P*P] (normalised, merge-block order) -> vision tokens [N / 4, out_hidden].

        backend: the text model's kernel backend (model.select_backend()); None runs the PyTorch references.
        """
        vc = self.config
        if pixels.shape != (p.n_patches, vc.patch_dim):
            raise Qwen35Error(f"vision input has shape {list(pixels.shape)}, the grids need "
                              f"[{p.n_patches}, {vc.patch_dim}]")
        x = F.linear(pixels.to(self.device, self.dtype), self.patch_w, self.patch_b)
        # + the learned position grid interpolated to each image, and the rotary's cos / sin, from the grids
        x, cos, sin = kernels.vision_positions(x, self.pos_embed, p.table, p.grids, p.inv_freq, vc.spatial_merge_size,
                                               backend=backend)
        # every LayerNorm after the first runs fused with the residual add before it: a block's norm2 after
        # its attention, the next block's norm1 (the merger's norm after the last block) after its MLP
        norms = [(blk.norm1_w, blk.norm1_b) for blk in self.blocks] + [(self.merge_norm_w, self.merge_norm_b)]
        h = kernels.layer_norm(x, *norms[0], LAYER_NORM_EPS, backend=backend)
        ours: list = []
        for blk, next_norm in zip(self.blocks, norms[1:]):
            x, h = kernels.add_layer_norm(x, self._attention(blk, h, cos, sin, p, backend, ours), blk.norm2_w,
                                          blk.norm2_b, LAYER_NORM_EPS, backend=backend)
            x, h = kernels.add_layer_norm(x, self._mlp(blk, h), *next_norm, LAYER_NORM_EPS, backend=backend)
        h = h.reshape(-1, vc.hidden_size * vc.merge_unit)
        return F.linear(F.gelu(F.linear(h, self.merge_fc1_w, self.merge_fc1_b)), self.merge_fc2_w, self.merge_fc2_b)

    def size_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parameters())

    def flops(self, grids) -> float:
        """Matmul FLOPs of one call (projections, MLPs, attention, merger)."""
        vc = self.config
        d, i, m = vc.hidden_size, vc.intermediate_size, vc.hidden_size * vc.merge_unit
        n = sum(t * h * w for t, h, w in grids)
        attn = sum(t * (h * w) ** 2 for t, h, w in grids) * 4 * d
        per_block = 2 * n * (3 * d * d + d * d + 2 * d * i) + attn
        return 2 * n * vc.patch_dim * d + vc.depth * per_block + 2 * (n // vc.merge_unit) * (m * m + m * vc.out_hidden_size)


# --- finding and reading the weights --------------------------------------------------------------

# checkpoint name (without prefix) -> (attribute path on the tower); the conv weight is flattened
def _targets(tower: VisionTower) -> dict[str, torch.Tensor]:
    t = {"patch_embed.proj.weight": tower.patch_w, "patch_embed.proj.bias": tower.patch_b,
         "pos_embed.weight": tower.pos_embed, "merger.norm.weight": tower.merge_norm_w,
         "merger.norm.bias": tower.merge_norm_b, "merger.linear_fc1.weight": tower.merge_fc1_w,
         "merger.linear_fc1.bias": tower.merge_fc1_b, "merger.linear_fc2.weight": tower.merge_fc2_w,
         "merger.linear_fc2.bias": tower.merge_fc2_b}
    names = {"norm1": "norm1", "norm2": "norm2", "attn.qkv": "qkv", "attn.proj": "proj",
             "mlp.linear_fc1": "fc1", "mlp.linear_fc2": "fc2"}
    for b, blk in enumerate(tower.blocks):
        for ck, attr in names.items():
            t[f"blocks.{b}.{ck}.weight"] = getattr(blk, attr + "_w")
            t[f"blocks.{b}.{ck}.bias"] = getattr(blk, attr + "_b")
    return t


@dataclass(frozen=True)
class VisionCheckpoint:
    config: VisionConfig
    tensors: dict[str, tuple[Path, str]]  # name without prefix -> (file, name in file)
    fp8: dict[str, Fp8Weight] = field(default_factory=dict)  # name in file -> its dequantization


def locate_vision(ckpt: Checkpoint) -> VisionCheckpoint | None:
    """The vision tower's config and tensors among the files checkpoint.locate found and checked (their header
    entries, ckpt.others); None when it has none."""
    path, text_hidden = ckpt.path, ckpt.config.hidden_size
    entries = {name: entry for name, entry in ckpt.others.items() if name.startswith(VISION_PREFIXES)}
    if not entries:
        return None
    cfg = None
    if path.is_dir() and (path / "config.json").exists():
        cfg = read_config(path / "config.json")  # UTF-8 whatever the locale; a bad file named
    side, fp8 = fp8_weights(entries, path, fp8_block_of(cfg, path / "config.json") if cfg else None,
                            quant_method_of(cfg) if cfg else None)
    tensors, shapes = {}, {}
    for name, (file, meta) in entries.items():
        if name in side:
            continue
        if meta["dtype"] not in LOADABLE_DTYPES and name not in fp8:
            raise Qwen35Error(f"{path}: vision tensor {name!r} is {meta['dtype']}; the tower loads from "
                              f"{', '.join(LOADABLE_DTYPES)} or FP8 only (text prompts still work)")
        key = next(name[len(p):] for p in VISION_PREFIXES if name.startswith(p))
        tensors[key] = (file, name)
        shapes[key] = tuple(meta["shape"])
    vc = None
    if cfg is not None:
        vc = vision_config_from_hf(cfg, str(path / "config.json"))
    if vc is None:
        vc = infer_vision_config(shapes, str(path))
    want = expected_vision_shapes(vc)
    missing = [k for k in want if k not in shapes]
    if missing:
        raise Qwen35Error(f"{path}: {len(missing)} vision-tower weights are missing, e.g. {', '.join(missing[:3])}; "
                          "the checkpoint's vision part is incomplete (text prompts still work)")
    for k, s in want.items():
        if tuple(shapes[k]) != s:
            raise Qwen35Error(f"{path}: vision weight {k} has shape {list(shapes[k])} but the vision config needs "
                              f"{list(s)}; the vision weights do not fit the config")
    if vc.out_hidden_size != text_hidden:
        raise Qwen35Error(f"{path}: the vision tower writes width {vc.out_hidden_size} but the text model's width "
                          f"is {text_hidden}; the vision weights belong to another model size")
    return VisionCheckpoint(vc, tensors, fp8)


def load_vision(ck: VisionCheckpoint, dtype: torch.dtype, device: torch.device) -> VisionTower:
    """The tower with its weights read once, straight onto `device` in `dtype`."""
    tower = VisionTower(ck.config, dtype, device)
    fill_vision(tower, ck)
    return tower


def fill_vision(tower: VisionTower, ck: VisionCheckpoint) -> None:
    """Reads the checkpoint's tower weights into `tower`'s parameters where they are."""
    with WeightReader(ck.fp8) as reader, torch.no_grad():
        for name, param in _targets(tower).items():
            t = reader.get(*ck.tensors[name], param.dtype, param.device)
            param.copy_(t.reshape(param.shape))  # converted on the host by the copy (loader._fill says why)


__all__ = ["VisionConfig", "VisionTower", "VisionPlan", "VisionCheckpoint", "plan", "locate_vision",
           "load_vision", "fill_vision", "vision_config_from_hf", "infer_vision_config", "expected_vision_shapes"]
