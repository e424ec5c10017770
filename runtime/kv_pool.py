"""The paged K/V cache's bookkeeping: block pool with reference counts, block tables, the chained prefix
hash, GDN snapshot records, and least-recently-used eviction under a budget. Pure Python (torch only to
build the block-table tensor); the tensors themselves belong to the runtime.

THE BLOCK TABLE FORMAT (documented here once; kernels/paged_attention reads exactly this)
    k_pool, v_pool  [num_blocks, block_size, Hkv, head_dim], bf16, one pair per full-attention layer (one
                    [layers, num_blocks, block_size, Hkv, head_dim] tensor whose [i] is layer i also fits:
                    each [i] is contiguous). Block b holds block_size consecutive token positions.
    block_table     int32 [N, max_blocks], contiguous: row n lists sequence n's blocks in position order;
                    key position p of sequence n is row p % block_size of block block_table[n, p // block_size].
                    Entries past a sequence's last block are PAD (-1) and are never read.
    cache_lens      int32 [N]: positions of sequence n already in the pool (the cached prefix).
    cu_q            int32 [N + 1]: sequence n's new tokens are rows cu_q[n] .. cu_q[n + 1] of the packed
                    q / k / v; new token i goes to position cache_lens[n] + i, so the table must already
                    list a block for every position below cache_lens[n] + (cu_q[n + 1] - cu_q[n]).
    Block sizes: any power of two; 16 and 64 are tested. The kernels never copy a sequence's blocks into a
    contiguous buffer: a block table is all they need, so blocks are shared between sequences freely.

Prefix reuse. A full block is keyed by a hash chained over everything before it: key_i = H(key_{i-1},
token ids of block i, (content hash, offset) of every image / video span overlapping block i), so the same
pixels at the same place give the same key and any earlier difference changes every later key. Cached K
carries its rotary position, which the chain makes safe. The Gated DeltaNet layers keep no per-token
state, so a prefix is reusable only where their recurrent and conv states were saved: a `Snapshot` at
`num_tokens` (any count, not only block-aligned; its key adds the partial block's tokens to the chain).
A snapshot holds references to every block of its prefix, so a hit always finds its K/V; a hit is the
longest prefix of a new prompt that ends at a snapshot. Snapshot size on the 9B model (24 GDN layers):
recurrent state 24 x [32, 128, 128] fp32 = 48 MiB, conv state 24 x [8192, 3] bf16 = 1.1 MiB
(`gdn_snapshot_nbytes`).

Eviction. A block is held by the live sequences (prefills, generations) and snapshots that list it.
Blocks that no live sequence holds are kept only through snapshots, so eviction is by snapshot, least
recently used first (saved or hit): when an allocation finds too few free blocks, or the snapshots'
state bytes exceed their budget. A block nothing holds goes back to the free list at once: without a
GDN state at its end it cannot be reused. A prompt that cannot fit even in an empty pool raises
`PromptTooLong`, one that cannot fit beside the live sequences `PoolExhausted`; both name the numbers.
A shrink (a grown store giving back what a failed prompt grew it by) evicts the snapshots listing a block
past the new count, and is refused where a live sequence holds one.
"""
from __future__ import annotations

import functools
import hashlib
import math
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

PAD = -1  # block-table entries past a sequence's last block
ROOT = b"qwen35-kv-root"  # parent key of a sequence's first block


class PromptTooLong(ValueError):
    """One prompt needs more blocks than the whole pool has."""


class PoolExhausted(RuntimeError):
    """The pool has room for the prompt in principle, but live sequences hold too much of it now."""


@dataclass(frozen=True)
class MediaSpan:
    """An image or video inside a prompt: its placeholder tokens are positions start .. end - 1, and
    content_hash identifies its pixels (multimodal.media_spans: a hash of its source pixels and settings)."""
    start: int
    end: int
    content_hash: str


# ----------------------------------------------------------------------------- prefix hash chain

def _chunk_key(parent: bytes, tokens: Sequence[int], start: int, media: Sequence[MediaSpan]) -> bytes:
    """Key of the tokens at positions start .. start + len(tokens) - 1, chained on `parent`."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<I{len(tokens)}q", len(tokens), *tokens))
    end = start + len(tokens)
    for m in media:
        if m.start < end and m.end > start:  # the span overlaps this chunk: its pixels and where it sits
            h.update(b"\0mm\0" + m.content_hash.encode() + struct.pack("<q", start - m.start))
    return h.digest()


def block_keys(token_ids: Sequence[int], block_size: int, media: Sequence[MediaSpan] = ()) -> list[bytes]:
    """The chained keys of the full blocks of `token_ids` (len(token_ids) // block_size of them)."""
    keys, parent = [], ROOT
    for b in range(len(token_ids) // block_size):
        parent = _chunk_key(parent, token_ids[b * block_size:(b + 1) * block_size], b * block_size, media)
        keys.append(parent)
    return keys


def prefix_key(token_ids: Sequence[int], num_tokens: int, block_size: int, media: Sequence[MediaSpan] = (),
               full_keys: Optional[list[bytes]] = None) -> bytes:
    """Key of the first num_tokens tokens: the chain over their full blocks, plus the partial block's
    tokens when num_tokens is not a multiple of block_size. `full_keys` (block_keys of the same tokens)
    saves recomputing the chain."""
    nfull, rest = divmod(num_tokens, block_size)
    if full_keys is None:
        full_keys = block_keys(token_ids[:nfull * block_size], block_size, media)
    parent = full_keys[nfull - 1] if nfull else ROOT
    if rest == 0:
        return parent
    return _chunk_key(parent + b"partial", token_ids[nfull * block_size:num_tokens], nfull * block_size, media)


# ----------------------------------------------------------------------------- sizes

def kv_block_nbytes(num_attention_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype_bytes: int = 2) -> int:
    """Bytes of one block across all full-attention layers, K and V (9B, block 16: 512 KiB)."""
    return 2 * num_attention_layers * block_size * num_kv_heads * head_dim * dtype_bytes


def gdn_snapshot_nbytes(num_gdn_layers: int, num_v_heads: int, k_head_dim: int, v_head_dim: int,
                        conv_channels: int, conv_kernel: int, state_bytes: int = 4, conv_bytes: int = 2) -> int:
    """Bytes of one GDN snapshot: every GDN layer's recurrent state [Hv, Dk, Dv] and conv state
    [channels, kernel - 1]. 9B: gdn_snapshot_nbytes(24, 32, 128, 128, 8192, 4) = 51,511,296 (49.1 MiB)."""
    per_layer = num_v_heads * k_head_dim * v_head_dim * state_bytes + conv_channels * (conv_kernel - 1) * conv_bytes
    return num_gdn_layers * per_layer


def model_sizes(config, block_size: int = 16, dtype_bytes: int = 2) -> dict:
    """Bytes the cache costs for a runtime.config.TextConfig: one K/V block (all full-attention layers),
    per token, and one GDN snapshot (fp32 recurrent state, conv state in the model dtype)."""
    from .config import FULL
    attn = sum(1 for t in config.layer_types if t == FULL)
    block = kv_block_nbytes(attn, block_size, config.num_key_value_heads, config.head_dim, dtype_bytes)
    snap = gdn_snapshot_nbytes(config.num_hidden_layers - attn, config.linear_num_value_heads,
                               config.linear_key_head_dim, config.linear_value_head_dim, config.conv_dim,
                               config.linear_conv_kernel_dim, conv_bytes=dtype_bytes)
    return {"kv_block_bytes": block, "kv_bytes_per_token": block // block_size, "snapshot_bytes": snap}


def blocks_for_budget(budget_bytes: int, config, block_size: int = 16, dtype_bytes: int = 2) -> int:
    """How many blocks of K/V (all full-attention layers) fit in budget_bytes."""
    return int(budget_bytes) // model_sizes(config, block_size, dtype_bytes)["kv_block_bytes"]


def pool_tensors(config, num_blocks: int, block_size: int, device=None, dtype=None):
    """The K and V pools: two [attention layers, num_blocks, block_size, Hkv, head_dim] tensors (layer i of
    each is the contiguous [num_blocks, block_size, Hkv, head_dim] pool the kernels take). Uninitialised:
    a position is read only after it was written."""
    import torch

    from .config import FULL
    attn = sum(1 for t in config.layer_types if t == FULL)
    shape = (attn, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    dtype = torch.bfloat16 if dtype is None else dtype
    return torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)


# ----------------------------------------------------------------------------- records

@dataclass
class SequenceBlocks:
    """One sequence's blocks, in position order, and how many positions hold K/V (`num_tokens`)."""
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0

    def capacity(self, block_size: int) -> int:
        return len(self.blocks) * block_size


@dataclass
class Snapshot:
    """GDN states after the first `num_tokens` tokens of a prompt (`states`: whatever the runtime saved,
    `nbytes` its size), with references to the blocks holding those tokens' K/V."""
    key: bytes
    num_tokens: int
    blocks: list[int]
    states: Any
    nbytes: int


# ----------------------------------------------------------------------------- the pool

def _locked(method):
    """Runs the method under the pool's lock: a sequence's blocks go back from a finalizer, which the
    garbage collector may run on another thread (ComfyUI's server thread) while a prompt allocates."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


class KVPool:
    """Block bookkeeping for one model's K/V pool of `num_blocks` blocks of `block_size` positions.
    `snapshot_budget_bytes` caps the GDN state bytes the snapshots keep (None: no cap but the blocks)."""

    def __init__(self, num_blocks: int, block_size: int, snapshot_budget_bytes: Optional[int] = None):
        if num_blocks <= 0 or block_size <= 0 or block_size & (block_size - 1):
            raise ValueError(f"KVPool needs num_blocks > 0 and a power-of-two block_size, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.snapshot_budget_bytes = snapshot_budget_bytes
        self.refcount = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low ids first
        self._snapshots: OrderedDict[bytes, Snapshot] = OrderedDict()  # least recently used first
        self._snapshot_lengths: dict[int, int] = {}  # num_tokens -> how many snapshots have it
        self.snapshot_bytes = 0
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ blocks
    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    @_locked
    def grow(self, num_blocks: int) -> None:
        """More blocks (ids num_blocks_before .. num_blocks - 1, free); the caller grows the tensors."""
        if num_blocks <= self.num_blocks:
            return
        new = range(self.num_blocks, num_blocks)
        self.refcount += [0] * len(new)
        self._free = list(reversed(new)) + self._free  # the old free blocks stay on top of the stack
        self.num_blocks = num_blocks

    @_locked
    def live_end(self) -> int:
        """One past the highest block a live sequence (a prefill, a generation) holds, 0 where none holds any:
        the fewest blocks `shrink` can keep. Blocks only snapshots hold do not count: shrink evicts those."""
        cached = [0] * self.num_blocks
        for snap in self._snapshots.values():
            for b in snap.blocks:
                cached[b] += 1
        return next((b + 1 for b in reversed(range(self.num_blocks)) if self.refcount[b] > cached[b]), 0)

    @_locked
    def shrink(self, num_blocks: int) -> None:
        """Fewer blocks: ids num_blocks and up go, and with them every snapshot that lists one (the prefix
        cache gives them up); the caller shrinks the tensors. A RuntimeError, with nothing changed, where a
        live sequence holds one of them (live_end) or num_blocks is below 1."""
        if num_blocks >= self.num_blocks:
            return
        end = self.live_end()
        if num_blocks < 1:
            raise RuntimeError(f"KVPool: cannot shrink to {num_blocks} blocks: a pool keeps at least 1")
        if num_blocks < end:
            raise RuntimeError(f"KVPool: cannot shrink to {num_blocks} blocks: a live sequence holds block {end - 1}")
        for snap in [s for s in self._snapshots.values() if max(s.blocks, default=-1) >= num_blocks]:
            self._drop(snap)  # (each drop leaves the counts right on its own)
        refcount, free = self.refcount[:num_blocks], [b for b in self._free if b < num_blocks]
        self.refcount, self._free, self.num_blocks = refcount, free, num_blocks

    @_locked
    def retain(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.refcount[b] <= 0:
                raise RuntimeError(f"KVPool: block {b} is not allocated; it cannot be shared")
            self.refcount[b] += 1

    @_locked
    def release(self, blocks: Sequence[int]) -> None:
        freed = []
        for b in blocks:
            if self.refcount[b] <= 0:
                raise RuntimeError(f"KVPool: block {b} released more often than it was taken")
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                freed.append(b)
        # last first onto the stack: the next allocation takes them in their order again, so a sequence's
        # blocks stay mostly consecutive (the PyTorch path reads each consecutive stretch in place)
        self._free.extend(reversed(freed))

    def _check_fits(self, n: int, what: str) -> None:
        """PromptTooLong where n blocks are more than the whole pool."""
        if n > self.num_blocks:
            raise PromptTooLong(
                f"{what or 'this request'} needs {n} K/V blocks ({n * self.block_size} token positions at block "
                f"size {self.block_size}) but the whole pool holds {self.num_blocks} blocks "
                f"({self.num_blocks * self.block_size} positions); raise the loader's cache budget or shorten the prompt")

    @_locked
    def allocate(self, n: int, keep: Optional[Snapshot] = None, what: str = "", own: int = 0) -> list[int]:
        """n fresh blocks (reference count 1), evicting snapshots (never `keep`) as needed: least recently
        used first among those whose eviction frees a block, and none at all when evicting every one would
        still leave too few (the prefix cache stays whole for a store that grows instead). Raises
        PromptTooLong / PoolExhausted naming the numbers when the blocks cannot be had; `own`: blocks the
        requesting sequence holds already (not counted as others' in the message)."""
        self._check_fits(n, what)
        if len(self._free) < n:
            cached = self._reclaimable(keep)
            have = len(self._free) + len(cached)
            if have < n:
                note = f" ({len(cached)} of them held by the prefix cache alone, which gives them up)" if cached else ""
                held = self.num_blocks - have
                who = (f": {own} by this sequence itself (its shared prefix included), {held - own} by other "
                       "prefills and generations still alive" if own else " by prefills and generations still alive")
                raise PoolExhausted(
                    f"{what or 'this request'} needs {n} {'more ' if own else ''}K/V blocks but only {have} of the "
                    f"pool's {self.num_blocks} are free{note}; the other {held} are held{who} (in ComfyUI, the "
                    "last output of each prefill node holds its blocks until 'Free model and node cache'). "
                    "Raise the loader's cache budget (0 grows the cache as needed), or use fewer prefill nodes")
            while len(self._free) < n:
                self._drop(self._next_to_evict(keep, cached))
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self.refcount[b] = 1
        return out

    # ------------------------------------------------------------------ sequences
    @_locked
    def reserve(self, seq: SequenceBlocks, num_tokens: int, what: str = "") -> None:
        """Make room in `seq` for positions up to num_tokens (blocks appended; num_tokens itself is the
        caller's to advance once the K/V are written)."""
        total = self.blocks_for(num_tokens)
        self._check_fits(total, what)  # the whole sequence, its shared prefix included
        need = total - len(seq.blocks)
        if need > 0:
            seq.blocks += self.allocate(need, what=what, own=len(seq.blocks))

    @_locked
    def try_reserve(self, seq: SequenceBlocks, num_tokens: int, keep: Optional[Snapshot] = None) -> bool:
        """reserve for room a caller can do without (a padded prefill's filler): True once it is there, taken
        from free blocks or by evicting snapshots (never `keep`) as allocate does; False, with nothing
        evicted, when even evicting every snapshot but `keep` would leave too few blocks."""
        need = self.blocks_for(num_tokens) - len(seq.blocks)
        if need <= 0:
            return True
        if need > len(self._free) + len(self._reclaimable(keep)):
            return False
        seq.blocks += self.allocate(need, keep=keep)
        return True

    @_locked
    def trim(self, seq: SequenceBlocks) -> None:
        """Give back seq's blocks past its last token (room reserved but not written): each loses seq's
        reference."""
        keep = self.blocks_for(seq.num_tokens)
        self.release(seq.blocks[keep:])
        del seq.blocks[keep:]

    @_locked
    def free(self, seq: SequenceBlocks) -> None:
        """Drop a sequence: its blocks lose one reference each (snapshots keep theirs)."""
        self.release(seq.blocks)
        seq.blocks, seq.num_tokens = [], 0

    @_locked
    def fork(self, seq: SequenceBlocks, keep: Optional[Snapshot] = None, last_resort: bool = False, room: int = 0,
             what: str = "") -> tuple[SequenceBlocks, list[tuple[int, int]]]:
        """A copy-on-write child of `seq` (a Generate forked from a Prefill, a prompt resumed from a snapshot) with
        blocks for `room` positions: full blocks shared; a partly filled last block is replaced by a fresh one,
        returned as a (src, dst) copy for the caller to make in every layer before anything else allocates; fresh
        blocks for the rest. All or nothing: a child that cannot have its room changes nothing (no snapshot is
        evicted for a prompt that is then refused). The parent's blocks are held while the fresh ones are
        allocated, so eviction (of a snapshot that alone held them) cannot take them; `keep` (the snapshot `seq`
        comes from) is not evicted for it, so a failed fork leaves its blocks where they were.

        Where the blocks are not to be had and `keep` alone holds the partly filled block, the child takes that
        block over instead of a copy: the snapshot reads only its first tokens, which the child never writes (a
        later fork from the snapshot copies it, as it would any shared block), so a prompt that fits the pool read
        cold is not refused for resuming from its own cached prefix. `last_resort` (a pool that cannot grow): where
        other snapshots share that block with `keep` and no live sequence holds it, they are dropped (the child
        writes over their later tokens, as a cold read would evict them) and the child takes it over; a store that
        grows passes False and grows instead, keeping them. The parent is not changed."""
        nfull, part = divmod(seq.num_tokens, self.block_size)
        held = seq.blocks[:nfull + (1 if part else 0)]
        total = max(self.blocks_for(room), len(held))
        what = what or ("a copy of the prefix's partly filled last block" if total == len(held) else "")
        self._check_fits(total, what)
        self.retain(held)
        try:
            if not part:
                fresh = self.allocate(total - nfull, keep, what, own=len(held))
                return SequenceBlocks(held + fresh, seq.num_tokens), []
            try:
                fresh = self.allocate(total - nfull, keep, what, own=len(held))
            except PoolExhausted as refused:
                last = held[nfull]
                sharers = [s for s in self._snapshots.values() if last in s.blocks]
                alone = any(s is keep for s in sharers) and self.refcount[last] == 1 + len(sharers)  # the fork's too
                if not alone or (len(sharers) > 1 and not last_resort):
                    raise
                try:  # the partly filled block taken over: one block fewer to find
                    fresh = self.allocate(total - nfull - 1, keep, what, own=len(held))
                except PoolExhausted:
                    raise refused from None
                for snap in sharers:  # (those the allocation evicted are gone already)
                    if snap is not keep and self._snapshots.get(snap.key) is snap:
                        self._drop(snap)
                return SequenceBlocks(held + fresh, seq.num_tokens), []
        except BaseException:  # a refusal, a Ctrl+C too: the held blocks go back
            self.release(held)
            raise
        self.release(held[nfull:])  # the partly filled block: only its copy is the child's
        return SequenceBlocks(held[:nfull] + fresh, seq.num_tokens), [(held[nfull], fresh[0])]

    # ------------------------------------------------------------------ prefix cache
    @_locked
    def match(self, token_ids: Sequence[int], media: Sequence[MediaSpan] = (),
              max_tokens: Optional[int] = None) -> Optional[Snapshot]:
        """The snapshot of the longest prefix of token_ids (at most max_tokens, and never the last token, which
        must be run to get logits) that is cached, or None. Marks it recently used."""
        limit = len(token_ids) - 1 if max_tokens is None else min(max_tokens, len(token_ids) - 1)
        lengths = sorted((n for n in self._snapshot_lengths if 0 < n <= limit), reverse=True)
        if not lengths:
            return None
        full = block_keys(token_ids[:lengths[0] // self.block_size * self.block_size], self.block_size, media)
        for n in lengths:
            snap = self._snapshots.get(prefix_key(token_ids, n, self.block_size, media, full))
            if snap is not None:
                self._snapshots.move_to_end(snap.key)
                return snap
        return None

    @_locked
    def save_snapshot(self, seq: SequenceBlocks, token_ids: Sequence[int], num_tokens: int, states: Any,
                      nbytes: int, media: Sequence[MediaSpan] = ()) -> Snapshot:
        """Record the GDN states after the first num_tokens tokens of `seq` (whose K/V must be written).
        The snapshot takes a reference to each block holding those tokens. Replaces an equal-keyed one."""
        if not 0 < num_tokens <= min(seq.num_tokens, len(token_ids)):
            raise ValueError(f"save_snapshot: num_tokens {num_tokens} must be in 1 .. {min(seq.num_tokens, len(token_ids))} "
                             f"(tokens with K/V in the sequence)")
        key = prefix_key(token_ids, num_tokens, self.block_size, media)
        if key in self._snapshots:
            self._drop(self._snapshots[key])
        blocks = list(seq.blocks[:self.blocks_for(num_tokens)])
        self.retain(blocks)
        snap = Snapshot(key, num_tokens, blocks, states, nbytes)
        self._snapshots[key] = snap
        self._snapshot_lengths[num_tokens] = self._snapshot_lengths.get(num_tokens, 0) + 1
        self.snapshot_bytes += nbytes
        while (self.snapshot_budget_bytes is not None and self.snapshot_bytes > self.snapshot_budget_bytes
               and self._evict_one(keep=snap)):
            pass
        return snap

    @property
    def snapshots(self) -> list[Snapshot]:
        """Least recently used first."""
        return list(self._snapshots.values())

    def _drop(self, snap: Snapshot) -> None:
        del self._snapshots[snap.key]
        left = self._snapshot_lengths[snap.num_tokens] - 1
        if left:
            self._snapshot_lengths[snap.num_tokens] = left
        else:
            del self._snapshot_lengths[snap.num_tokens]
        self.snapshot_bytes -= snap.nbytes
        self.release(snap.blocks)

    def _reclaimable(self, keep: Optional[Snapshot]) -> set:
        """The blocks that evicting every snapshot but `keep` would free: held by those snapshots alone."""
        held = {}  # block -> how many snapshots (but keep) list it
        for snap in self._snapshots.values():
            if snap is not keep:
                for b in snap.blocks:
                    held[b] = held.get(b, 0) + 1
        return {b for b, n in held.items() if self.refcount[b] == n}

    def _next_to_evict(self, keep: Optional[Snapshot], cached: set) -> Snapshot:
        """The snapshot allocate evicts next: the least recently used one that frees a block by itself, else
        (blocks shared by snapshots alone) the least recently used one holding such blocks; never one whose
        blocks live sequences hold too, which would free nothing."""
        useful = [s for s in self._snapshots.values() if s is not keep and any(b in cached for b in s.blocks)]
        return next((s for s in useful if any(self.refcount[b] == 1 for b in s.blocks)), useful[0])

    def _evict_one(self, keep: Optional[Snapshot]) -> bool:
        for snap in self._snapshots.values():
            if snap is not keep:
                self._drop(snap)
                return True
        return False

    @_locked
    def clear(self) -> None:
        """Drop every snapshot (the prefix cache starts empty); live sequences keep their blocks."""
        for snap in list(self._snapshots.values()):
            self._drop(snap)


def block_table_tensor(seqs: Sequence[SequenceBlocks], max_blocks: Optional[int] = None, device=None):
    """The int32 [N, max_blocks] block table of `seqs` (PAD after each sequence's last block)."""
    import torch
    width = max([0, *(len(s.blocks) for s in seqs)]) if max_blocks is None else max_blocks  # dynamo takes no default=
    rows = []
    for s in seqs:
        if len(s.blocks) > width:
            raise ValueError(f"block_table_tensor: a sequence has {len(s.blocks)} blocks, more than max_blocks={width}")
        rows.append(s.blocks + [PAD] * (width - len(s.blocks)))
    from .host import upload
    return upload(rows, torch.int32, device).reshape(len(seqs), width)
