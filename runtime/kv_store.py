"""One model's paged K/V: the pool tensors of its full-attention layers and their bookkeeping.

The tensors follow the layout of kv_pool.py (k, v: [attention layers, num_blocks, block_size, Hkv,
head_dim]); `KVPool` says which blocks belong to which sequence and holds the prefix cache's snapshots.
Every Cache of the model lists its blocks here: a prefill's blocks stay as long as its Cache lives, a
generation forks them (copy-on-write of a partly filled last block, nothing else), a follow-up prompt
shares its parent's. The store moves with the model (Qwen35Model._apply), so a prefill parked in
system RAM while its model is unloaded is still whole when the model comes back.
"""
from __future__ import annotations

import logging
import math
import os
import weakref
from contextlib import contextmanager
from typing import Sequence

import torch

from .config import FULL
from .errors import Qwen35Error
from .host import upload
from .kv_pool import KVPool, PoolExhausted, PromptTooLong, SequenceBlocks, model_sizes, pool_tensors
from .packed import apply_packed

BLOCK_SIZE = 64  # positions per block: bench/results/paged-h200.json has 64 and 16 even (0.95-1.09x, 0.99x on average)
KV_FRACTION = 0.25  # auto budget: at most this share of the device memory free when the store is made
AUTO_TOKENS = 65_536  # and at most what this many tokens need; an auto store grows when a prompt needs more
SNAPSHOT_SHARE = 0.25  # of the budget, for the prefix cache's GDN snapshots; the rest is K/V blocks
CPU_DEFAULT_BYTES = 1 << 30  # the auto budget's cap off CUDA (no free-memory query is used there); QWEN35_CPU_KV_BYTES
GROWTH = 1.5  # an auto store grows to at least this many times its blocks
MIN_SNAPSHOTS = 8  # the snapshots' budget holds at least this many, whatever the budget's share gives
log = logging.getLogger(__name__)


def default_budget_bytes(config, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> int:
    """The auto budget: what AUTO_TOKENS tokens need (with the snapshots' share), at most KV_FRACTION of
    the free device memory on CUDA, elsewhere (CPU, mps, xpu) at most QWEN35_CPU_KV_BYTES bytes (default
    CPU_DEFAULT_BYTES), and at least one block."""
    sizes = model_sizes(config, BLOCK_SIZE, dtype.itemsize)
    tokens = min(AUTO_TOKENS, config.max_position_embeddings)
    want = int(-(-tokens // BLOCK_SIZE) * sizes["kv_block_bytes"] / (1 - SNAPSHOT_SHARE)) + 1
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cap = int(free * KV_FRACTION)
    else:
        cap = _cap_bytes("QWEN35_CPU_KV_BYTES", CPU_DEFAULT_BYTES)
    least = int(sizes["kv_block_bytes"] / (1 - SNAPSHOT_SHARE)) + 1
    return max(min(want, cap), least)


def _cap_bytes(name: str, default: int) -> int:
    """The environment variable `name` as a whole number of bytes above 0 (default when unset or empty)."""
    value = os.environ.get(name, "")
    if not value.strip():
        return default
    try:
        cap = int(value)
    except ValueError:
        cap = 0
    if cap <= 0:
        raise Qwen35Error(f"{name}={value!r} is not a budget: it takes a whole number of bytes above 0 (e.g. "
                          f"{default} for {default / 2**30:g} GiB), or leave it unset for that default")
    return cap


class KVStore:
    """The K/V pool tensors (k, v) and the block bookkeeping (pool) of one model. A growable store (the auto
    budget) takes more blocks when a prompt or an answer needs them, and gives them back when that call fails
    (growth_undone_on_failure); `version` counts the resizes: the tensors move, so a captured graph must be
    captured again. A fixed one says it is full, and never changes size."""

    def __init__(self, config, budget_bytes: int, dtype: torch.dtype, device: torch.device,
                 block_size: int = BLOCK_SIZE, growable: bool = False):
        sizes = model_sizes(config, block_size, dtype.itemsize)
        num_blocks = int(budget_bytes * (1 - SNAPSHOT_SHARE)) // sizes["kv_block_bytes"]
        snapshot_budget = max(int(budget_bytes * SNAPSHOT_SHARE), MIN_SNAPSHOTS * sizes["snapshot_bytes"])
        if num_blocks < 1:
            least_mib = math.ceil(sizes["kv_block_bytes"] / (1 - SNAPSHOT_SHARE) / 2**20)
            raise Qwen35Error(f"a K/V cache budget of {budget_bytes / 2**20:.1f} MiB holds no block of "
                              f"{block_size} tokens ({sizes['kv_block_bytes'] / 2**20:.1f} MiB of K/V with the "
                              f"snapshots' {SNAPSHOT_SHARE:.0%}); raise the loader's cache budget to at least "
                              f"{least_mib} MiB (a prompt takes a block per {block_size} tokens), or 0 to size "
                              "it from the free VRAM")
        self.block_size = block_size
        self.budget_bytes = int(budget_bytes)
        self.k, self.v = pool_tensors(config, num_blocks, block_size, device, dtype)
        self.pool = KVPool(num_blocks, block_size, snapshot_budget)
        self.index = {layer: j for j, layer in enumerate(i for i, t in enumerate(config.layer_types) if t == FULL)}
        self.bytes_copied = 0  # K/V bytes copied between blocks (forks of a partly filled block), for benchmarks
        self.growable = growable
        self.version = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def nbytes(self) -> int:
        """The pool tensors' bytes (the snapshots' states come on top, at most their budget)."""
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def device(self) -> torch.device:
        return self.k.device

    def apply(self, fn) -> None:
        """Applies a tensor function (Module._apply's: a move) to the pools and the snapshots' states."""
        self.k, self.v = fn(self.k), fn(self.v)
        for snap in self.pool.snapshots:
            apply_packed(snap.states.conv, fn)  # packed states (a parked turn's) stay packed: one copy each
            apply_packed(snap.states.ssm, fn)

    # --- sequences ---------------------------------------------------------------------------
    def sequence(self, owner, num_tokens: int, what: str = "") -> SequenceBlocks:
        """A new sequence with blocks for `num_tokens` positions, released when `owner` is collected."""
        seq = SequenceBlocks()
        self.reserve(seq, num_tokens, what)
        weakref.finalize(owner, self.pool.free, seq)
        return seq

    def reserve(self, seq: SequenceBlocks, num_tokens: int, what: str = "") -> None:
        """Blocks in `seq` for positions up to num_tokens (see _with_room when they are not free)."""
        self._with_room(lambda: self.pool.reserve(seq, num_tokens, what),
                        self.pool.blocks_for(num_tokens) - len(seq.blocks))

    def _with_room(self, call, blocks: int):
        """call() (a pool operation that allocates `blocks` blocks); when they are not free, a growable store
        grows and calls again, a fixed one raises an error naming the numbers."""
        try:
            return call()
        except (PromptTooLong, PoolExhausted) as e:
            if not self.growable:
                raise Qwen35Error(f"K/V cache: {e}") from None
            self.grow(self.grown_blocks(blocks))
            return call()

    def grown_blocks(self, blocks: int) -> int:
        """The blocks a growth to take `blocks` more than are free leaves the store with: at least GROWTH times."""
        return max(int(self.num_blocks * GROWTH), self.num_blocks + blocks - self.pool.num_free)

    def grow(self, num_blocks: int) -> None:
        """num_blocks blocks in all (the pools copied into larger tensors; block ids stay)."""
        if num_blocks > self.num_blocks:
            self._resize(num_blocks, self.pool.grow)

    def shrink_to(self, num_blocks: int) -> int:
        """Gives back the blocks from num_blocks on (a growable store; a fixed one keeps its size): it keeps
        num_blocks, or one past the last block a live prefill or generation holds where that is more. Snapshots
        listing a block past that are evicted (a cache); the pools are copied into smaller tensors (block ids
        stay) and `version` moves on. Returns the blocks it has now."""
        old = self.num_blocks
        keep = max(num_blocks, self.pool.live_end(), 1)
        if not self.growable or keep >= old:
            return old
        self._resize(keep, self.pool.shrink)
        return keep

    def _resize(self, num_blocks: int, pool_resize) -> None:
        """The pools copied into tensors of num_blocks blocks (the blocks both hold; ids stay), then
        pool_resize(num_blocks) (the pool's grow or shrink: after the copies, which may run out of memory, so that a
        failure of either leaves tensors and pool agreeing on the old count), then the new tensors in place; the
        budget follows the blocks and `version` moves on."""
        old = self.num_blocks
        both, block_bytes = min(old, num_blocks), self.nbytes // old
        k = torch.empty((self.k.shape[0], num_blocks, *self.k.shape[2:]), dtype=self.k.dtype, device=self.k.device)
        v = torch.empty_like(k)
        k[:, :both], v[:, :both] = self.k[:, :both], self.v[:, :both]
        pool_resize(num_blocks)
        self.k, self.v = k, v
        self.budget_bytes += (num_blocks - old) * block_bytes
        self.version += 1

    def share(self, owner, blocks: Sequence[int], num_tokens: int, capacity: int, what: str = "",
              keep=None) -> SequenceBlocks:
        """A new sequence whose first `num_tokens` positions are those of `blocks` (a copy-on-write fork,
        KVPool.fork: shared, a partly filled last block copied, since the new sequence writes after it),
        with room for `capacity`, released when `owner` is collected; a refusal changes nothing in the pool.
        keep: the snapshot the blocks come from (not evicted to make room for the fork)."""
        parent = SequenceBlocks(list(blocks[:self.pool.blocks_for(num_tokens)]), num_tokens)
        room = max(capacity, num_tokens)
        seq, copies = self._with_room(
            lambda: self.pool.fork(parent, keep, last_resort=not self.growable, room=room, what=what),
            self.pool.blocks_for(room) - num_tokens // self.block_size)
        weakref.finalize(owner, self.pool.free, seq)
        try:
            for src, dst in copies:
                self.copy_block(src, dst)
        except BaseException:  # (out of memory): the fork's blocks go back now, not with `owner`
            self.pool.free(seq)
            raise
        return seq

    def copy_block(self, src: int, dst: int) -> None:
        """Block src's K/V into block dst, in every layer."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        self.bytes_copied += 2 * self.k[:, src].numel() * self.k.element_size()

    def table(self, seq: SequenceBlocks, width: int | None = None, device=None) -> torch.Tensor:
        """seq's int32 [1, width] block table (width default: its blocks; PAD past them)."""
        from .kv_pool import block_table_tensor
        return block_table_tensor([seq], width, device or self.device)

    def slots(self, seq: SequenceBlocks, start: int, end: int) -> torch.Tensor:
        """Rows of the pool seen as [num_blocks * block_size, Hkv, D] for positions start .. end - 1."""
        bs = self.block_size
        pos = torch.arange(start, end)
        blocks = torch.tensor(seq.blocks, dtype=torch.long)
        return upload(blocks[pos // bs] * bs + pos % bs, device=self.device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores k, v [T, Hkv, D] of attention layer `layer` (model index) at pool rows `slots`."""
        j = self.index[layer]
        nb, bs = self.k.shape[1:3]
        self.k[j].view(nb * bs, *self.k.shape[3:]).index_copy_(0, slots, k)
        self.v[j].view(nb * bs, *self.v.shape[3:]).index_copy_(0, slots, v)


@contextmanager
def growth_undone_on_failure(*stores: KVStore):
    """Runs the block; where it raises (an error, out of memory, a cancel), each of `stores` that grew in it
    gives those blocks back: shrink_to its size on entry, or as far as its live blocks let it (the failed call's
    own sequences must be freed by then). A successful block keeps the growth: its prefill holds those blocks.
    A shrink that fails (no memory for the smaller copy) leaves that store grown; the block's exception goes on.
    Yields the undo itself, for a caller to run before it reports the failure (out of memory: what the shrink
    gives back is free then)."""
    sizes = list({id(s): (s, s.num_blocks) for s in stores}.values())

    def undo() -> None:
        for store, before in sizes:
            if store.num_blocks > before:
                try:
                    store.shrink_to(before)
                except (RuntimeError, MemoryError) as e:
                    log.warning("Qwen3.5 K/V cache: the %d blocks a failed call grew it to stay (%s)",
                                store.num_blocks, e)

    try:
        yield undo
    except BaseException:
        undo()
        raise


__all__ = ["KVStore", "BLOCK_SIZE", "default_budget_bytes", "growth_undone_on_failure"]
