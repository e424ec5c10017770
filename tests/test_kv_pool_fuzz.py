"""runtime/kv_pool.py driven by seeded random operation sequences, as the runtime drives it (KVStore.share /
reserve / _with_room, prefix.prefill_reusing, prefill_graph's filler room, Cache.clone / Cache.restart), with
a shadow model of what every block row holds, checked after every operation.

The operations: admit a prompt (no cached prefix: a sequence reserved for it; else match a snapshot and fork
from it with keep=that snapshot, last_resort True or False and room for the whole prompt, one call as
KVStore.share makes; write the prompt's K/V, maybe take and trim a padded prefill's filler room, save snapshots
inside the prompt, several in one block); save snapshots at random points of live sequences; free a live
sequence; reserve room past a sequence's tokens and trim it; append tokens (a generation: Cache.reserve); fork
a live sequence at its end or at an earlier state with room (a Generate, a follow-up turn writing its prompt
into that room); fill the pool around a snapshot with a partly filled last block and resume a prompt from it;
grow the pool; drop every snapshot; prompts that must be refused (PromptTooLong past the whole pool,
PoolExhausted beside the live sequences).

A fork with room (Fuzz.pool_fork) is predicted: PromptTooLong where the child's blocks exceed the whole pool;
else the parent's full blocks shared and fresh blocks for the rest (a copy of a partly filled last block the
first of them) where the blocks free or held by snapshots alone (never `keep`) suffice; else, where `keep`
lists the partly filled block, no live sequence holds it and no other snapshot does (or last_resort: those
dropped), that block taken over when one block fewer suffices; else PoolExhausted.

The invariants, after every operation:
  * every block's reference count is the number of live sequences plus snapshots listing it; a block with
    count 0 is on the free list, once, and every block on the free list has count 0;
  * snapshot_bytes and the per-length counts match the snapshots; a snapshot lists exactly the blocks its
    num_tokens need and its key is the prefix key of its tokens; the byte budget holds (one snapshot alone over
    it excepted);
  * the K/V every live sequence and snapshot reads (its first num_tokens positions, through its block list)
    are what it wrote or inherited: no write by another sequence, no block freed and reused under it;
  * a block a live sequence may still write (its partly filled last block and any room reserved after it) is
    held by no other live sequence, and any snapshot holding it ends at or before that sequence's tokens, so
    a block a forked child takes over from a snapshot in a full pool holds only snapshots of positions before
    the child's first write;
  * a failed pool call (fork, reserve, try_reserve answering False) changes nothing: counts, free list (order
    too), snapshots (order too), bytes; so a refused share (an admission resumed from a snapshot, a fork of a
    live sequence) leaves the prefix cache as the same prompt refused cold would;
  * an allocation evicts only snapshots that list a block it may have, never `keep`; a take-over drops exactly
    the other snapshots sharing the block (those the allocation evicted already aside);
  * match answers the longest snapshot whose tokens are a prefix of the prompt (never the whole prompt);
  * a prompt with no cached prefix is admitted exactly when its blocks fit beside the live sequences
    (PromptTooLong when they exceed the whole pool, else PoolExhausted); a prompt resumed from a snapshot with
    last_resort True is never refused where it would fit read cold (in particular when no sequence is live and
    blocks_for(len) <= num_blocks); a store that grows never refuses a prompt or a fork.
"""
import random
from collections import Counter

import pytest
from test_kv_pool import _check_refcounts, _toks

from qwen35_fast.runtime.kv_pool import KVPool, PoolExhausted, PromptTooLong, SequenceBlocks, prefix_key
from qwen35_fast.runtime.kv_store import GROWTH  # a growing store takes at least this many times its blocks

VOCAB = 248_000

FILLER = "filler"  # what a padded prefill writes past the prompt (never read)
FIXED, NO_LAST_RESORT, GROWS = "fixed", "no-last-resort", "grows"  # admission modes: see Fuzz.admit


def _chain(tokens, start=None):
    """What each position's K/V stands for: a value that depends on every token up to it (a prefix hash)."""
    out, h = [], start
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


class Live:
    """A live sequence and the tokens whose K/V it has written (len(tokens) == seq.num_tokens)."""

    def __init__(self, seq, tokens, chain, name):
        self.seq, self.tokens, self.chain, self.name = seq, tokens, chain, name


class Fuzz:
    """One pool, its live sequences, and a shadow of every block's rows (kv[b][row]: the chain value written
    there, None when unwritten or freed)."""

    def __init__(self, seed, num_blocks, block_size, budget=None, modes=(FIXED, NO_LAST_RESORT, GROWS),
                 max_blocks=32):
        self.rng = random.Random(seed)
        self.where = f"seed={seed} num_blocks={num_blocks} block_size={block_size} budget={budget}"
        self.pool = KVPool(num_blocks, block_size, budget)
        self.bs, self.budget, self.modes, self.max_blocks = block_size, budget, modes, max_blocks
        self.kv = [[None] * block_size for _ in range(num_blocks)]
        self.live: list[Live] = []
        self.snap_tokens: dict[bytes, list[int]] = {}  # key -> the tokens of every snapshot ever saved
        self.bases = [_toks((max_blocks + 2) * block_size, seed * 31 + i) for i in range(3)]
        self.names = 0
        self.log: list[str] = []
        self.seen = Counter()  # the paths taken (test_the_random_runs_reach_every_path)

    # ------------------------------------------------------------------ helpers
    def fail(self, what):
        trace = "\n  ".join(self.log[-25:])
        raise AssertionError(f"{what}\n[{self.where}, call {len(self.log)}] last calls:\n  {trace}")

    def fresh(self, n):
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def state(self):
        p = self.pool
        return (p.num_blocks, list(p.refcount), list(p._free), p.snapshot_bytes, dict(p._snapshot_lengths),
                [(s.key, id(s), s.num_tokens, tuple(s.blocks), s.nbytes) for s in p._snapshots.values()])

    def live_held(self):
        return {b for lv in self.live for b in lv.seq.blocks}

    def name(self):
        self.names += 1
        return f"s{self.names}"

    def grow_to(self, n):
        self.log.append(f"grow({n})")
        self.seen["grow"] += 1
        old = self.pool.num_blocks
        self.pool.grow(n)
        self.kv += [[None] * self.bs for _ in range(self.pool.num_blocks - old)]

    def with_room(self, call, blocks, mode):
        """KVStore._with_room: a store that grows takes more blocks when they are not free, a fixed one raises."""
        try:
            return call()
        except (PromptTooLong, PoolExhausted):
            if mode != GROWS:
                raise
            self.grow_to(max(int(self.pool.num_blocks * GROWTH), self.pool.num_blocks + blocks - self.pool.num_free))
            return call()

    def atomic(self, what, call):
        """A pool call that either succeeds or raises PoolExhausted / PromptTooLong having changed nothing."""
        before = self.state()
        try:
            return call()
        except (PoolExhausted, PromptTooLong):
            if self.state() != before:
                self.fail(f"failed {what} changed the pool:\n  before {before}\n  after  {self.state()}")
            raise

    def current(self, keep):
        return keep is not None and any(s is keep for s in self.pool.snapshots)

    def to_be_had(self, keep, extra=None):
        """The blocks an allocation may have, free or by eviction: held by no live sequence (nor `extra`, a
        sequence not yet in self.live) and not listed by `keep`."""
        held = self.live_held() | set(extra.blocks if extra is not None else ())
        if self.current(keep):
            held |= set(keep.blocks)
        return {b for b in range(self.pool.num_blocks) if b not in held}

    def check_evictions(self, before, what, keep, had, dropped_ok=()):
        """Snapshots an allocation dropped: never `keep`, only ones that listed a block to be had."""
        after = {id(s) for s in self.pool.snapshots}
        for s in before:
            if id(s) in after or any(s is d for d in dropped_ok):
                continue
            if s is keep:
                self.fail(f"{what} evicted the snapshot it was told to keep ({s.num_tokens} tokens)")
            if not set(s.blocks) & had:
                self.fail(f"{what} evicted a snapshot of {s.num_tokens} tokens {s.blocks} that freed nothing")

    def pool_fork(self, parent, keep, last_resort, room):
        """pool.fork with room, its outcome predicted: PromptTooLong (nothing changed) where the child's blocks,
        max(blocks_for(room), the parent's), exceed the whole pool; else the parent's full blocks shared and the
        rest fresh (a copy of a partly filled last block among them) where the blocks to be had (never by evicting
        `keep`) suffice; else, for a partly filled last block that `keep` lists, no live sequence holds and no
        other snapshot lists (or last_resort: the others dropped), that block taken over where one block fewer
        suffices; else PoolExhausted with nothing changed."""
        pool, bs = self.pool, self.bs
        nfull, part = divmod(parent.num_tokens, bs)
        total = max(pool.blocks_for(room), len(parent.blocks))
        need = total - nfull  # fresh blocks, the copy included
        had = self.to_be_had(keep, parent)
        snaps = pool.snapshots
        sharers = [s for s in snaps if s is not keep and parent.blocks[nfull] in s.blocks] if part else []
        if total > pool.num_blocks:
            want = PromptTooLong
        elif need <= len(had):
            want = "copy" if part else "share"
        elif (part and self.current(keep) and parent.blocks[nfull] in keep.blocks
              and parent.blocks[nfull] not in self.live_held() and (not sharers or last_resort)):
            want = "take over" if need - 1 <= len(had) else PoolExhausted
            self.seen["fork: take-over one block short"] += want is PoolExhausted
        else:
            want = PoolExhausted
        call = f"fork({parent}, keep {keep is not None}, last_resort {last_resort}, room {room})"
        try:
            child, copies = self.atomic("fork", lambda: pool.fork(parent, keep, last_resort, room=room))
        except (PoolExhausted, PromptTooLong) as e:
            self.seen[f"fork: {type(e).__name__}"] += 1
            self.seen[f"fork: refused{' with room' if total > len(parent.blocks) else ''}"] += 1
            if type(e) is not want:
                self.fail(f"{call}: {e!r}, want {want} ({len(had)} blocks to be had for {need})")
            raise
        got = "copy" if copies else "take over" if part else "share"
        self.seen[f"fork: {got}"] += 1
        self.seen[f"fork: {got} with room"] += total > len(parent.blocks)
        if got != want:
            self.fail(f"{call}: {got}, want {want} ({len(had)} blocks to be had for {need})")
        if child.num_tokens != parent.num_tokens or len(child.blocks) != total:
            self.fail(f"{call}: child {child}, want {total} blocks")
        kept = nfull + (got == "take over")  # the parent's blocks the child lists
        fresh = child.blocks[kept:]
        if child.blocks[:kept] != parent.blocks[:kept] or len(set(child.blocks)) != total or not set(fresh) <= had:
            self.fail(f"{call}: child {child} is not the parent's blocks followed by fresh ones ({sorted(had)})")
        if copies != ([(parent.blocks[nfull], child.blocks[nfull])] if got == "copy" else []):
            self.fail(f"{call}: copies {copies} for child {child}")
        self.check_evictions(snaps, "fork", keep, had, sharers if got == "take over" else ())
        if got == "take over":
            self.seen["fork: took over, dropping other snapshots"] += bool(sharers)
            left = [s for s in sharers if any(s is t for t in pool.snapshots)]
            if left:
                self.fail(f"{call} took the block over but left snapshots sharing it: {[s.num_tokens for s in left]}")
        return child, copies

    def share(self, parent, keep, last_resort, mode, room):
        """KVStore.share: one pool.fork with room for max(capacity, the parent's tokens), inside _with_room (a
        store that grows grows for the blocks past the parent's full ones); the copies made at once."""
        room = max(room, parent.num_tokens)
        self.log.append(f"share({parent.num_tokens} tokens, keep={keep is not None}, last_resort={last_resort}, "
                        f"room={room}, mode={mode})")
        child, copies = self.with_room(lambda: self.pool_fork(parent, keep, last_resort, room),
                                       self.pool.blocks_for(room) - parent.num_tokens // self.bs, mode)
        for src, dst in copies:  # the caller copies at once, before anything else allocates
            self.kv[dst] = list(self.kv[src])
        return child

    def pool_reserve(self, seq, n):
        """pool.reserve with its outcome predicted: PromptTooLong past the whole pool, else room exactly when the
        blocks to be had (evicting any snapshot) suffice, else PoolExhausted with nothing changed."""
        pool = self.pool
        total = pool.blocks_for(n)
        need = total - len(seq.blocks)
        had = self.to_be_had(None, seq)
        snaps, old = pool.snapshots, len(seq.blocks)
        want = PromptTooLong if total > pool.num_blocks else PoolExhausted if need > len(had) else None
        try:
            self.atomic("reserve", lambda: pool.reserve(seq, n))
        except (PoolExhausted, PromptTooLong) as e:
            self.seen[f"reserve: {type(e).__name__}"] += 1
            if type(e) is not want:
                self.fail(f"reserve({seq}, {n}): {e!r}, want {want} ({len(had)} blocks to be had)")
            raise
        if want is not None:
            self.fail(f"reserve({seq}, {n}) succeeded, want {want.__name__} ({len(had)} blocks to be had)")
        if len(seq.blocks) != max(total, old) or len(set(seq.blocks)) != len(seq.blocks):
            self.fail(f"reserve({n}) left {seq}")
        self.check_evictions(snaps, "reserve", None, had)
        self.seen["reserve: evicted"] += len(pool.snapshots) < len(snaps)

    def reserve(self, seq, n, mode):
        self.log.append(f"reserve({seq.num_tokens}-token seq with {len(seq.blocks)} blocks, {n})")
        need = self.pool.blocks_for(n) - len(seq.blocks)
        self.with_room(lambda: self.pool_reserve(seq, n), need, mode)

    def try_reserve(self, lv, n, keep=None):
        """pool.try_reserve with its answer predicted: True exactly when the blocks to be had without evicting
        `keep` suffice; False with nothing changed."""
        pool, seq = self.pool, lv.seq
        self.log.append(f"try_reserve({lv.name}, {n}, keep={keep is not None})")
        need = pool.blocks_for(n) - len(seq.blocks)
        had = self.to_be_had(keep, seq)
        snaps, before = pool.snapshots, self.state()
        got = pool.try_reserve(seq, n, keep=keep)
        self.seen[f"try_reserve: {got}"] += 1
        if got != (need <= len(had)):
            self.fail(f"try_reserve({seq}, {n}) answered {got} with {len(had)} blocks to be had for {need}")
        if not got and self.state() != before:
            self.fail("try_reserve answered False but changed the pool")
        if got and len(seq.blocks) < pool.blocks_for(n):
            self.fail(f"try_reserve({n}) answered True but left {seq}")
        self.check_evictions(snaps, "try_reserve", keep, had)
        return got

    def write(self, lv, upto):
        """lv's sequence writes its K/V of positions num_tokens .. upto - 1 (lv.chain must reach upto)."""
        seq, bs = lv.seq, self.bs
        for p in range(seq.num_tokens, upto):
            self.kv[seq.blocks[p // bs]][p % bs] = lv.chain[p]
        seq.num_tokens = upto

    def add_live(self, seq, tokens, chain):
        lv = Live(seq, tokens, chain, self.name())
        self.live.append(lv)
        return lv

    def expected_match(self, ids, max_tokens=None):
        limit = len(ids) - 1 if max_tokens is None else min(max_tokens, len(ids) - 1)
        best = None
        for s in self.pool.snapshots:
            t = self.snap_tokens[s.key]
            if 0 < s.num_tokens <= limit and ids[:s.num_tokens] == t and (best is None or s.num_tokens > best):
                best = s.num_tokens
        return best

    # ------------------------------------------------------------------ invariants
    def check(self):
        pool, bs = self.pool, self.bs
        n = pool.num_blocks
        if len(pool.refcount) != n or len(self.kv) != n:
            self.fail(f"{len(pool.refcount)} counts, {len(self.kv)} shadow blocks for {n} blocks")
        snaps = pool.snapshots
        want = [0] * n
        for holder in [lv.seq for lv in self.live] + snaps:
            if len(set(holder.blocks)) != len(holder.blocks):
                self.fail(f"a block listed twice by {holder}")
            for b in holder.blocks:
                want[b] += 1
        if pool.refcount != want:
            bad = {b: (pool.refcount[b], want[b]) for b in range(n) if pool.refcount[b] != want[b]}
            self.fail(f"reference counts (count, holders) differ: {bad}")
        free = pool._free
        if len(set(free)) != len(free) or sorted(free) != [b for b in range(n) if want[b] == 0]:
            self.fail(f"free list {free} is not the blocks nothing holds {[b for b in range(n) if want[b] == 0]}")
        if pool.snapshot_bytes != sum(s.nbytes for s in snaps):
            self.fail(f"snapshot_bytes {pool.snapshot_bytes} != {sum(s.nbytes for s in snaps)}")
        if pool._snapshot_lengths != dict(Counter(s.num_tokens for s in snaps)):
            self.fail(f"_snapshot_lengths {pool._snapshot_lengths} != {Counter(s.num_tokens for s in snaps)}")
        if self.budget is not None and pool.snapshot_bytes > self.budget and len(snaps) > 1:
            self.fail(f"snapshots hold {pool.snapshot_bytes} bytes over the budget {self.budget}")
        readers = []  # (what, blocks, num_tokens, chain)
        for s in snaps:
            if len(s.blocks) != pool.blocks_for(s.num_tokens):
                self.fail(f"snapshot of {s.num_tokens} tokens lists {len(s.blocks)} blocks {s.blocks}")
            tokens = self.snap_tokens[s.key]
            if len(tokens) != s.num_tokens or prefix_key(tokens, s.num_tokens, bs) != s.key:
                self.fail(f"snapshot of {s.num_tokens} tokens has the key of other tokens")
            readers.append((f"snapshot@{s.num_tokens} {s.blocks}", s.blocks, s.num_tokens, _chain(tokens)))
        for lv in self.live:
            if len(lv.seq.blocks) < pool.blocks_for(lv.seq.num_tokens) or len(lv.tokens) != lv.seq.num_tokens:
                self.fail(f"live {lv.name} {lv.seq} lacks blocks for its tokens")
            readers.append((f"live {lv.name} {lv.seq}", lv.seq.blocks, lv.seq.num_tokens, lv.chain))
        for b in range(n):  # freed blocks hold nothing anyone may read
            if want[b] == 0:
                self.kv[b] = [None] * bs
        for what, blocks, num, chain in readers:
            for i in range(pool.blocks_for(num)):
                rows = min(bs, num - i * bs)
                if self.kv[blocks[i]][:rows] != chain[i * bs:i * bs + rows]:
                    self.fail(f"{what}: the K/V of positions {i * bs} .. {i * bs + rows - 1} in block {blocks[i]} "
                              "were overwritten or freed under it")
        # blocks a live sequence may write: no other live sequence, no snapshot past its tokens
        holders = {}
        for lv in self.live:
            for i, b in enumerate(lv.seq.blocks):
                holders.setdefault(b, []).append((lv, i))
        for lv in self.live:
            seq = lv.seq
            for i in range(seq.num_tokens // bs, len(seq.blocks)):
                b = seq.blocks[i]
                others = [o.name for o, _ in holders[b] if o is not lv]
                if others:
                    self.fail(f"live {lv.name} {seq} may write block {b}, which live {others} hold too")
                late = [s.num_tokens for s in snaps if b in s.blocks and s.num_tokens > seq.num_tokens]
                if late:
                    self.fail(f"live {lv.name} {seq} may write block {b}, which snapshots of {late} tokens read")

    # ------------------------------------------------------------------ operations
    def prompt(self):
        """Token ids of a new prompt: mostly continuing a snapshot, a live sequence or a shared base text, so
        that matches (and several reuse points in one block) are common; sometimes too long on purpose."""
        r, bs, pool = self.rng, self.bs, self.pool
        keys = [s.key for s in pool.snapshots]
        kind = r.random()
        if kind < 0.45 and keys:
            head = list(self.snap_tokens[r.choice(keys)])
        elif kind < 0.6 and self.live:
            lv = r.choice(self.live)
            head = lv.tokens[:r.randint(0, len(lv.tokens))]
        else:
            base = r.choice(self.bases)
            head = base[:r.choice([r.randint(0, pool.num_blocks * bs), r.randint(0, 2 * bs)])]
        room = pool.num_blocks - len(self.live_held())
        k = r.random()
        if k < 0.1:  # just past the room beside the live sequences, or past the whole pool
            total = r.choice([room + 1, pool.num_blocks + 1]) * bs - r.randrange(bs)
            head = head[:max(0, total - 1)]
            tail = total - len(head)
        else:
            tail = r.choice([1, r.randint(1, bs // 4 + 1), r.randint(1, bs), r.randint(1, 3 * bs)])
        return head + self.fresh(tail)

    def admit(self, ids=None, mode=None, last_resort=None, plain=False):
        """A prompt as KVStore.share / prefix.prefill_reusing take it. mode FIXED: a fixed store (last_resort
        True); NO_LAST_RESORT: the pool called with last_resort False and nothing grows; GROWS: a store that
        grows (last_resort False, grown when refused). plain: no filler room, no snapshots."""
        r, pool, bs = self.rng, self.pool, self.bs
        ids = self.prompt() if ids is None else ids
        mode = r.choice(self.modes) if mode is None else mode
        if last_resort is None:
            last_resort = mode == FIXED
        L = len(ids)
        max_tokens = r.choice([None, None, None, r.randint(0, L)])
        snap = pool.match(ids, max_tokens=max_tokens)
        want = self.expected_match(ids, max_tokens)
        got = None if snap is None else snap.num_tokens
        if got != want or (snap is not None and self.snap_tokens[snap.key] != ids[:got]):
            self.fail(f"match of a {L}-token prompt (max_tokens {max_tokens}) gave {got}, want {want}")
        n = 0 if snap is None else snap.num_tokens
        self.log.append(f"admit({L} tokens, hit {n}, mode {mode}, last_resort {last_resort})")
        live_before = len(self.live)
        cold_fits = pool.blocks_for(L) <= pool.num_blocks - len(self.live_held())
        before = self.state()
        seq = None
        try:
            if snap is None:
                seq = SequenceBlocks()
                self.reserve(seq, L, mode)
            else:  # Cache.resume -> KVStore.share: the snapshot's blocks forked with room for the whole prompt
                seq = self.share(SequenceBlocks(list(snap.blocks[:pool.blocks_for(n)]), n), snap, last_resort,
                                 mode, L)
        except (PoolExhausted, PromptTooLong) as e:
            self.log.append(f"  refused: {type(e).__name__}")
            self.seen[f"admission refused: hit {snap is not None}, last_resort {last_resort}"] += 1
            if mode == GROWS:
                self.fail(f"a store that grows refused a {L}-token prompt: {e}")
            if snap is None:
                if cold_fits:
                    self.fail(f"a {L}-token prompt that fits beside the live sequences was refused: {e}")
                too_long = pool.blocks_for(L) > pool.num_blocks
                if isinstance(e, PromptTooLong) != too_long:
                    self.fail(f"a {L}-token prompt ({pool.blocks_for(L)} blocks of {pool.num_blocks}): {e!r}")
            elif last_resort and cold_fits:
                self.fail(f"a {L}-token prompt resumed at {n} with last_resort, which fits read cold "
                          f"({'no' if not live_before else live_before} live sequences), was refused: {e}")
            if self.state() != before:
                self.fail(f"a refused {L}-token prompt (hit {n}) changed the pool:\n  before {before}\n  "
                          f"after  {self.state()}")
            return None
        if snap is None and not cold_fits and mode != GROWS:
            self.fail(f"a {L}-token prompt that does not fit beside the live sequences was admitted")
        lv = self.add_live(seq, list(ids[:n]), _chain(ids))
        self.log.append(f"  -> {lv.name} {seq}")
        self.write(lv, L)
        lv.tokens = list(ids)
        if plain:
            return lv
        if r.random() < 0.3:  # a padded prefill: filler room past the prompt, written, then given back
            bucket = r.choice([1, bs // 2, bs, 3 * bs])
            if self.try_reserve(lv, L + bucket, keep=snap):
                for p in range(L, L + bucket):
                    self.kv[seq.blocks[p // bs]][p % bs] = FILLER
                self.log.append(f"trim({lv.name})")
                pool.trim(seq)
        points = self.points(n + 1, L) if L > n + 1 else []
        for p in points:
            self.save(lv, p, ids)
        return lv

    def points(self, lo, hi):
        """Up to three snapshot points in lo .. hi - 1, often several in one block."""
        r, bs = self.rng, self.bs
        if lo >= hi:
            return []
        first = r.randrange(lo, hi)
        if r.random() < 0.15 and (hi - 1) // bs * bs >= lo:  # at a block's end: a fork from it copies nothing
            first = r.randint(-(-lo // bs), (hi - 1) // bs) * bs
        out = {first}
        for _ in range(r.randint(0, 2)):
            p = first + r.randint(-bs // 4 - 1, bs // 4 + 1) if r.random() < 0.7 else r.randrange(lo, hi)
            if lo <= p < hi:
                out.add(p)
        return sorted(out)

    def save(self, lv, p, ids=None):
        ids = lv.tokens if ids is None else ids
        self.log.append(f"save_snapshot({lv.name}, {p})")
        snap = self.pool.save_snapshot(lv.seq, ids, p, f"{lv.name}@{p}", self.rng.randint(1, 10))
        self.snap_tokens[snap.key] = list(ids[:p])

    def op_snapshot(self):
        cands = [lv for lv in self.live if lv.seq.num_tokens]
        if cands:
            lv = self.rng.choice(cands)
            for p in self.points(1, lv.seq.num_tokens + 1):
                self.save(lv, p)

    def op_free(self):
        if self.live:
            lv = self.live.pop(self.rng.randrange(len(self.live)))
            self.log.append(f"free({lv.name})")
            self.pool.free(lv.seq)

    def op_trim(self):
        """Room past a sequence's tokens (reserved, or taken by try_reserve), given back by trim."""
        if not self.live:
            return
        r, lv = self.rng, self.rng.choice(self.live)
        extra = r.randint(1, 2 * self.bs)
        try:
            if r.random() < 0.5:
                self.reserve(lv.seq, lv.seq.num_tokens + extra, FIXED)
            else:
                self.try_reserve(lv, lv.seq.num_tokens + extra)
        except (PoolExhausted, PromptTooLong):
            pass
        if r.random() < 0.7:
            self.log.append(f"trim({lv.name})")
            self.pool.trim(lv.seq)

    def op_append(self):
        """A generation's tokens: room reserved (a fixed or growing store), then written."""
        if not self.live:
            return
        r, lv = self.rng, self.rng.choice(self.live)
        k = r.choice([1, r.randint(1, self.bs), r.randint(1, 2 * self.bs)])
        mode = r.choice([FIXED, GROWS]) if GROWS in self.modes else FIXED
        try:
            self.reserve(lv.seq, lv.seq.num_tokens + k, mode)
        except (PoolExhausted, PromptTooLong):
            return
        new = self.fresh(k)
        lv.chain = lv.chain + _chain(new, lv.chain[-1] if lv.chain else None)
        self.write(lv, lv.seq.num_tokens + k)
        lv.tokens = lv.tokens + new

    def op_fork_live(self):
        """A Generate (Cache.clone) or a follow-up turn (Cache.restart) forked from a live sequence at its end or
        an earlier state: one KVStore.share, keep None, room for max(capacity, tokens); a refusal changes nothing.
        A follow-up turn then writes its prompt into that room."""
        cands = [lv for lv in self.live if lv.seq.num_tokens]
        if not cands:
            return
        r, pool, bs = self.rng, self.pool, self.bs
        lv = r.choice(cands)
        n = lv.seq.num_tokens if r.random() < 0.6 else r.randint(1, lv.seq.num_tokens)
        mode = r.choice(self.modes)
        parent = SequenceBlocks(list(lv.seq.blocks[:pool.blocks_for(n)]), n)
        capacity = r.choice([0, n, n + r.randint(1, 2 * bs), n + r.randint(1, 6 * bs),
                             (pool.num_blocks - len(self.live_held()) + r.randint(0, 1)) * bs + r.randrange(bs)])
        before = self.state()
        try:
            child = self.share(parent, None, mode == FIXED, mode, capacity)
        except (PoolExhausted, PromptTooLong):
            self.seen[f"share of a live sequence refused, mode {mode}"] += 1
            if mode == GROWS:
                self.fail(f"a store that grows refused a fork of live {lv.name} at {n} with room {capacity}")
            if self.state() != before:
                self.fail(f"a refused fork of live {lv.name} changed the pool:\n  before {before}\n  "
                          f"after  {self.state()}")
            return
        if n % bs and child.blocks[n // bs] == parent.blocks[-1]:
            self.fail(f"a fork of live {lv.name} at {n} shares its partly filled block: {child}")
        ch = self.add_live(child, list(lv.tokens[:n]), list(lv.chain[:n]))
        self.log.append(f"  -> {ch.name} {child}")
        if r.random() < 0.5 and child.capacity(bs) > n:  # a follow-up turn's prompt, written into the room
            new = self.fresh(r.randint(1, child.capacity(bs) - n))
            ch.chain = ch.chain + _chain(new, ch.chain[-1] if ch.chain else None)
            self.write(ch, n + len(new))
            ch.tokens = ch.tokens + new

    def op_fill(self):
        """A prompt resumed from a snapshot whose last block is partly filled, in a full pool: the live sequences
        holding that block freed, a fresh prefill taking every free block but `leave` (0 to 2), its padded filler
        room (try_reserve, keep=the snapshot) every block the other snapshots alone hold but those; the resumed
        prompt (often exactly one or two blocks more than the `leave` blocks past the snapshot's full blocks) then
        finds too few blocks for a copy and its room, and takes the snapshot's block over or is refused."""
        r, bs = self.rng, self.bs
        partial = [s for s in self.pool.snapshots if s.num_tokens % bs]
        if not partial:
            return
        s = r.choice(partial)
        for lv in [lv for lv in self.live if s.blocks[-1] in lv.seq.blocks]:
            self.live.remove(lv)
            self.log.append(f"free({lv.name})")
            self.pool.free(lv.seq)
        tokens = self.snap_tokens[s.key]
        free, leave = self.pool.num_free, r.choice([0, 0, 1, 2])
        fill = None
        if free > leave:
            fill = self.admit(self.fresh((free - leave) * bs - r.randrange(bs)), FIXED, plain=True)
        more = len(self.to_be_had(s)) - leave
        if fill is not None and more > 0:
            self.try_reserve(fill, (len(fill.seq.blocks) + more) * bs, keep=s)
        self.check()
        nfull = s.num_tokens // bs
        tail = r.choice([1, r.randint(1, bs - s.num_tokens % bs), r.randint(1, 2 * bs),
                         (nfull + leave + 1) * bs - r.randrange(bs) - s.num_tokens,
                         (nfull + leave + 2) * bs - r.randrange(bs) - s.num_tokens])
        self.admit(tokens + self.fresh(max(1, tail)), FIXED if r.random() < 0.6 else None)

    def op_grow(self):
        if self.pool.num_blocks < self.max_blocks:
            self.grow_to(self.pool.num_blocks + self.rng.randint(1, 3))

    def op_clear(self):
        self.log.append("clear()")
        self.pool.clear()

    def step(self):
        r = self.rng.random()
        if r < 0.38:
            self.admit()
        elif r < 0.48:
            self.op_snapshot()
        elif r < 0.66:
            self.op_free()
        elif r < 0.72:
            self.op_trim()
        elif r < 0.82:
            self.op_append()
        elif r < 0.92:
            self.op_fork_live()
        elif r < 0.97:
            self.op_fill()
        elif r < 0.99 and GROWS in self.modes:
            self.op_grow()
        else:
            self.op_clear()
        self.check()
        if self.pool.num_blocks > self.max_blocks:  # a store that grew a lot: start a smaller one
            seen = self.seen
            self.__init__(self.rng.randrange(1 << 30), self.rng.randint(1, 12), self.bs, self.budget, self.modes,
                          self.max_blocks)
            self.seen = seen

    def run(self, steps):
        for _ in range(steps):
            self.step()
        for lv in list(self.live):  # everything back: the pool holds the snapshots' blocks only
            self.live.remove(lv)
            self.pool.free(lv.seq)
        self.check()
        self.pool.clear()
        self.check()
        assert self.pool.num_free == self.pool.num_blocks and not any(self.pool.refcount)


# ----------------------------------------------------------------------------- the fuzz runs

CONFIGS = [(bs, nb) for bs in (16, 64) for nb in range(1, 13)]


def test_the_random_runs_reach_every_path():
    """The random runs are worth their time only if they reach the paths the invariants are about: forks with and
    without room (copies, take-overs, dropping other snapshots too, a take-over one block short, both refusals),
    both refusals of a reserve, try_reserve's False, growth, refused prompts resumed from a snapshot with and
    without last_resort, refused forks of live sequences, evictions."""
    seen = Counter()
    for bs in (16, 64):
        for nb in (1, 2, 3, 4, 6, 8, 12):
            fz = Fuzz(1000 * nb + 7 * bs, nb, bs)
            fz.run(120)
            seen += fz.seen
    for path in ("fork: copy", "fork: copy with room", "fork: take over", "fork: take over with room",
                 "fork: share", "fork: share with room", "fork: took over, dropping other snapshots",
                 "fork: take-over one block short", "fork: PromptTooLong", "fork: PoolExhausted",
                 "fork: refused with room", "reserve: PromptTooLong", "reserve: PoolExhausted", "reserve: evicted",
                 "try_reserve: True", "try_reserve: False", "grow",
                 "admission refused: hit True, last_resort True", "admission refused: hit True, last_resort False",
                 "admission refused: hit False, last_resort True", "share of a live sequence refused, mode fixed",
                 "share of a live sequence refused, mode no-last-resort"):
        assert seen[path] >= 3, (path, dict(seen))


@pytest.mark.parametrize("block_size,num_blocks", CONFIGS)
def test_random_operations_keep_the_books(block_size, num_blocks):
    """Random runs (3 seeds, with and without a snapshot byte budget) on pools of 1..12 blocks of 16 and 64."""
    for seed in range(3):
        budget = None if seed % 2 == 0 else 25
        Fuzz(1000 * num_blocks + 7 * block_size + seed, num_blocks, block_size, budget).run(120)


@pytest.mark.parametrize("block_size", [16, 64])
def test_a_fixed_pool_never_refuses_a_prompt_that_fits_it_cold(block_size):
    """A fixed pool (last_resort True), no live sequence left between prompts: every prompt whose blocks fit the
    whole pool is admitted, whatever snapshots (several in one block) the earlier prompts left."""
    for seed in range(40):
        fz = Fuzz(seed, 1 + seed % 12, block_size, modes=(FIXED,))
        r = fz.rng
        for _ in range(25):
            ids = fz.prompt()
            if fz.pool.blocks_for(len(ids)) > fz.pool.num_blocks:
                ids = ids[:fz.pool.num_blocks * block_size]
            lv = fz.admit(ids, FIXED)
            fz.check()
            if lv is None:
                fz.fail(f"a {len(ids)}-token prompt was refused by an idle pool of {fz.pool.num_blocks} blocks")
            if r.random() < 0.3:
                fz.op_snapshot()
            fz.op_free()
            fz.check()


# ----------------------------------------------------------------------------- shares refused and taken over

def _admit(pool, ids, last_resort=True):
    """What a KVStore does for a prompt (prefix.prefill_reusing): no cached prefix, a new sequence reserved for it;
    else the longest snapshot's blocks forked with keep=that snapshot and room for the whole prompt, in one call
    (last_resort: the store cannot grow). Returns (seq, snapshot or None)."""
    snap = pool.match(ids)
    if snap is None:
        seq = SequenceBlocks()
        pool.reserve(seq, len(ids))
        return seq, None
    parent = SequenceBlocks(list(snap.blocks), snap.num_tokens)
    seq, _ = pool.fork(parent, keep=snap, last_resort=last_resort, room=len(ids))
    return seq, snap


def _cached(pool, ids, *points):
    """A prompt read and snapshotted at `points`, its sequence then freed: only the snapshots hold its blocks."""
    seq = SequenceBlocks()
    pool.reserve(seq, len(ids))
    seq.num_tokens = len(ids)
    snaps = [pool.save_snapshot(seq, ids, p, f"@{p}", 1) for p in points]
    pool.free(seq)
    return snaps


def _books(pool):
    return list(pool.refcount), list(pool._free), [(s.states, tuple(s.blocks)) for s in pool.snapshots]


@pytest.mark.parametrize("case", ["resumed, longer than the pool", "resumed, longer than the room beside a live one",
                                  "follow-up turn on a live prefill, longer than the pool",
                                  "follow-up turn on a live prefill, longer than the room beside it"])
def test_a_refused_share_evicts_nothing(case):
    """A sequence sharing a prefix (a prompt resumed from a snapshot: keep=the snapshot; a follow-up turn restarted
    from a live prefill: keep None) that is refused its room leaves the pool as it was, as the same prompt refused
    cold does: no snapshot evicted for the copy of the partly filled block, none dropped for a take-over."""
    pool = KVPool(5, 16)
    live = SequenceBlocks()
    pool.reserve(live, 20)  # a live prefill: blocks 0, 1 (1 partly filled)
    live.num_tokens = 20
    t = _toks(20, 1)
    (a20,) = _cached(pool, t, 20)  # blocks 2, 3 (3 partly filled), the prefix cache's alone
    (b16,) = _cached(pool, _toks(16, 2), 16)  # block 4, the prefix cache's alone
    assert pool.num_free == 0
    long = "pool" in case
    if case.startswith("resumed"):
        prompt = t + _toks(120 if long else 40, 3)  # 9 blocks > 5, or 4 blocks > 3 beside the live one
        assert pool.match(prompt) is a20
        before = _books(pool)
        with pytest.raises(PromptTooLong if long else PoolExhausted):
            _admit(pool, prompt)
    else:  # Cache.restart: the follow-up prompt, 8 blocks > 5, or 5 blocks: 4 past block 0 > the 3 to be had
        before = _books(pool)
        with pytest.raises(PromptTooLong if long else PoolExhausted):
            pool.fork(SequenceBlocks(list(live.blocks), 20), last_resort=True, room=120 if long else 80)
    assert _books(pool) == before
    assert pool.snapshots == ([b16, a20] if case.startswith("resumed") else [a20, b16])
    _check_refcounts(pool, [live])


@pytest.mark.parametrize("tail,last_resort,want", [(30, True, PromptTooLong), (24, True, PoolExhausted),
                                                   (8, True, "take over"), (8, False, PoolExhausted),
                                                   (1, True, "take over"), (1, False, PoolExhausted)])
def test_a_resumed_prompt_takes_its_block_over_only_when_it_then_fits(tail, last_resort, want):
    """Two reuse points in one block (40 and 45 tokens), a live prefill in the pool's first block, no block free:
    a prompt resumed at 40 that fits the pool only with the snapshot's partly filled block taken over (with
    last_resort, the snapshot at 45 dropped) is admitted that way; one longer than the whole pool (PromptTooLong),
    or longer than the room beside the live prefill even with the block taken over (PoolExhausted), or one whose
    take-over would drop the other snapshot without last_resort, is refused with both snapshots and every count as
    they were."""
    pool = KVPool(4, 16)
    live = SequenceBlocks()
    pool.reserve(live, 16)  # block 0
    live.num_tokens = 16
    t = _toks(45)
    at40, at45 = _cached(pool, t, 40, 45)  # blocks 1, 2, 3 (3 partly filled: 32 .. 44)
    assert pool.num_free == 0
    prompt = t[:40] + _toks(tail, 7)  # 70 tokens: 5 blocks; 64: 4 (2 past the 2 full); 48 or 41: 3 (1 past them)
    assert pool.match(prompt) is at40
    before = _books(pool)
    if want == "take over":
        seq, snap = _admit(pool, prompt, last_resort)
        assert snap is at40 and seq.blocks == at40.blocks == [1, 2, 3] and pool.snapshots == [at40]
        _check_refcounts(pool, [live, seq])
    else:
        with pytest.raises(want):
            _admit(pool, prompt, last_resort)
        assert _books(pool) == before and {s.states for s in pool.snapshots} == {"@40", "@45"}
        _check_refcounts(pool, [live])


def test_a_fork_with_room_takes_every_block_at_once():
    """A fork with room for more than its parent: the full blocks shared, the partly filled one copied, fresh
    blocks for the rest, in one call, evicting the least recently used snapshot only as far as needed; with room
    for no more than the parent, a copy and nothing else."""
    pool = KVPool(6, 16)
    (old,) = _cached(pool, _toks(16, 4), 16)  # block 0
    (new,) = _cached(pool, _toks(16, 5), 16)  # block 1
    parent = SequenceBlocks()
    pool.reserve(parent, 40)  # blocks 2, 3, 4 (4 partly filled)
    parent.num_tokens = 40
    child, copies = pool.fork(parent, room=60)  # 4 blocks: 2 shared, a copy, 1 fresh (block 5, and 0 evicted)
    assert child.blocks[:2] == [2, 3] and copies == [(4, child.blocks[2])] and len(child.blocks) == 4
    assert set(child.blocks[2:]) == {5, 0} and pool.snapshots == [new]
    _check_refcounts(pool, [parent, child])
    pool.free(child)
    child, copies = pool.fork(parent, room=20)  # room below the parent's tokens: the copy only
    assert child.blocks[:2] == [2, 3] and len(child.blocks) == 3 and copies == [(4, child.blocks[2])]
    _check_refcounts(pool, [parent, child])


@pytest.mark.parametrize("block_size", [16, 64])
def test_random_refused_shares_change_nothing(block_size):
    """Random runs on pools that cannot grow (a fixed store, and the pool called without last_resort), where
    shares are refused often: every refused share (a prompt resumed from a snapshot, a fork of a live sequence
    with room) leaves counts, free list and snapshots exactly as they were (Fuzz.admit and Fuzz.op_fork_live
    fail otherwise), and the runs reach such refusals with and without a snapshot hit."""
    seen = Counter()
    for num_blocks in range(1, 13):
        fz = Fuzz(5000 + 1000 * num_blocks + 7 * block_size, num_blocks, block_size, modes=(FIXED, NO_LAST_RESORT))
        fz.run(100)
        seen += fz.seen
    for path in ("admission refused: hit True, last_resort True", "admission refused: hit True, last_resort False",
                 "share of a live sequence refused, mode fixed",
                 "share of a live sequence refused, mode no-last-resort",
                 "fork: PromptTooLong", "fork: PoolExhausted", "fork: refused with room"):
        assert seen[path] >= 3, (path, dict(seen))
