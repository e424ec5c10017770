"""Prefix reuse: a prompt that starts like an earlier one (the same system prompt, the same image) starts
from the earlier one's saved state and runs only the rest.

Every prefill keeps the GDN states at its reuse points, taken from the same pass (the recurrence is cut
there): the end of the system prompt, the end of its last image or video, the end of its user turn
(before the generation prompt). Each goes into the model's K/V store as a kv_pool.Snapshot, keyed by the
token ids before it and the content hashes of the images / video among them, holding the blocks of
that prefix. A later prompt takes the longest prefix that ends at a snapshot: it shares those blocks
(copy-on-write of a partly filled last block), copies the states, and skips the vision tower for the
images inside the prefix. Snapshots are evicted least recently used first (docs/kv-cache.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .chat import IM_END, IM_START
from .errors import Qwen35Error, whole_number
from .host import upload
from .kv_pool import MediaSpan
from .model import Cache, GDNState, Qwen35Model
from .prefill_graph import PaddedPrefill, drop_stale, padded_prefill


def system_end(model: Qwen35Model, ids: Sequence[int]) -> int | None:
    """Tokens up to and including the system turn's `<|im_end|>\\n`, when the chat-template ids open with
    one; else None."""
    tok = model.tokenizer
    head = tok.encode(f"{IM_START}system\n")
    if list(ids[:len(head)]) != head:
        return None
    end, nl = tok.token_id(IM_END), tok.encode("\n")
    for i in range(len(head), len(ids)):
        if ids[i] == end:
            return i + 1 + len(nl) if list(ids[i + 1:i + 1 + len(nl)]) == nl else None
    return None


@dataclass(frozen=True)
class Reuse:
    """What prefill_reusing did: the cache after all the ids, the last position's logits [vocab] (fp32, on
    the device), the states at `points` (by token count: kept in this pass, or the one it started from),
    and how many tokens came from a snapshot or the given start."""
    cache: Cache
    logits: torch.Tensor
    states: dict[int, GDNState]
    cached_tokens: int


def prefill_reusing(model: Qwen35Model, ids: Sequence[int], points: Sequence[int], media: Sequence[MediaSpan] = (),
                    vision: Callable[[int], tuple | None] | None = None, positions: torch.Tensor | None = None,
                    rope_delta: int | None = None, start: GDNState | None = None, start_cache: Cache | None = None,
                    limit: int | None = None, use_cache: bool = True, needed: Sequence[int] = (),
                    at_most: int | None = None) -> Reuse:
    """Prefill `ids` from the longest cached prefix (a snapshot in the model's store), keeping the states
    at `points` (token counts; those inside the cached prefix are skipped) as snapshots for later prompts.
    With use_cache off no snapshot is looked up or saved: only a given `start` is continued from, and only
    the states at `needed` (e.g. the turn end) are kept.

    vision(n): the (slot index, features) of the vision tokens at or after token n, indices counted from
    n, or None (the tower runs only for images past the reused prefix). positions [3, len(ids)]: rotary
    ids of all the tokens (default: text). start / start_cache: a known state after the first
    start.length ids (a follow-up turn's parent), whose K/V are start_cache's; used when no snapshot
    reaches further. limit: reuse at most this many tokens (default: all but the last); at_most, the caller's
    bound on it: a prompt read again as an earlier read of it did (its cached_tokens) starts from the same
    snapshot where the store still keeps it, and so gives the same logits bit for bit, where the longest
    prefix (a snapshot that read left further on) would give them computed another way. A short rest after
    a cached prefix (at most 256 tokens, no image among them) runs as one CUDA-graph launch on CUDA
    (prefill_graph.py), the same computation as the eager pass; the cache keeps the blocks of its tokens
    either way.
    """
    if at_most is not None:
        bound = whole_number(at_most)
        if bound is None or bound < 0:
            raise Qwen35Error(f"reuse_at_most={at_most!r}: it takes a whole number of tokens (0 or more), or None to "
                              "reuse all a cached prefix offers")
        limit = bound if limit is None else min(limit, bound)
    store = model.kv
    drop_stale(model)  # passes of a store that grew since (whatever path this prompt takes: they never run again)
    snap = store.pool.match(ids, media, max_tokens=limit) if use_cache else None
    n = snap.num_tokens if snap is not None else 0
    if start is not None and start.length >= n:
        n, origin = start.length, start
    else:
        origin = snap.states if snap is not None else None
    # a parent made before setup_kv remade the store: it continues on its own (older) store, eagerly, and its
    # states are no snapshots of this store (their block ids would name other sequences' blocks here)
    foreign = origin is start and start is not None and start_cache.store is not store
    pos = positions[:, n:] if positions is not None else None
    feats = vision(n) if vision is not None else None
    keep = sorted({p for p in (*points, *needed) if n < p < len(ids)} if use_cache
                  else {p for p in needed if n < p < len(ids)})
    # a short prompt after a cached prefix: one graph launch (prefill_graph.py), which copies the states in
    # itself (a prefill only reads the incoming states, so the eager pass may run on them uncopied too)
    graphed = padded_prefill(model, n, len(ids) - n) if feats is None and len(keep) <= 1 and not foreign else None
    copy = graphed is None
    # what the prefill returns holds the states in lists of its own: moving them (ManagedModel.park) must not move
    # the snapshot they came from or are kept as
    states = {n: origin.own()} if origin is not None else {}
    cache = None
    try:
        if origin is None:
            cache = model.new_cache(1, len(ids))
        elif origin is start:
            cache = start_cache.restart(start, len(ids), device=model.device, copy=copy)
        else:
            cache = Cache.resume(store, snap.blocks, snap.states, len(ids), model.device, copy=copy, snapshot=snap)
        if graphed is not None:  # (None where the store has no room for the bucket's filler: the eager pass)
            graphed = _with_filler_room(model, cache, graphed, snap if origin is not start else None)
        if graphed is not None:
            logits, kept = graphed(cache, ids[n:], pos, rope_delta, [p - n for p in keep])
        else:
            x = upload([list(ids[n:])], torch.long, model.device)
            if keep:
                logits, kept = model.forward_prefill_kept(x, cache, [p - n for p in keep], feats, pos, rope_delta)
            else:
                logits, kept = model.forward_prefill(x, cache, feats, pos, rope_delta), []
    except BaseException:  # a cancel between pieces (progress.py), out of memory, a full fixed cache: the blocks
        if cache is not None:  # go back now, not when the traceback that holds this frame is collected
            cache.store.pool.free(cache.seq)
        raise
    kept = [k.packed() for k in kept]  # a later graphed prefill from a snapshot copies it in at once
    states.update((p, k.own()) for p, k in zip(keep, kept))
    if use_cache and not foreign:
        for p, state in zip(keep, kept):
            if p in points:
                store.pool.save_snapshot(cache.seq, ids, p, state, state.nbytes, media)
    return Reuse(cache, logits[0], states, n)


def _with_filler_room(model: Qwen35Model, cache: Cache, graphed: PaddedPrefill, keep) -> PaddedPrefill | None:
    """The graphed pass to run once `cache` has room for its bucket (the filler's K/V go after the prompt's
    until the pass gives that room back), or None (the eager pass) where the store cannot give it: not
    free, and not to be had by evicting snapshots (never `keep`, the one this prompt resumes from). The
    store does not grow for it, but room for the prompt itself may have grown it (its tensors moved):
    then the pass for the grown store."""
    if not cache.store.pool.try_reserve(cache.seq, cache.length + graphed.bucket, keep):
        return None
    if graphed.version != model.kv.version:
        return padded_prefill(model, cache.length, graphed.bucket)
    return graphed


__all__ = ["system_end", "prefill_reusing", "Reuse"]
