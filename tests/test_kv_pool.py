"""runtime/kv_pool.py on the CPU: reference counts, the prefix hash chain (tokens and image content),
snapshot matching, copy-on-write forks and admissions, LRU eviction under both budgets, the errors'
numbers, and the block table tensor in the format kernels/paged_attention reads (checked against the
paged-attention reference, so the documented format and the kernels' format cannot drift apart)."""
import random

import pytest
import torch

from qwen35_fast.kernels.paged_attention.reference import gather_kv, paged_attention_ref
from qwen35_fast.runtime.kv_pool import (
    PAD,
    KVPool,
    MediaSpan,
    PoolExhausted,
    PromptTooLong,
    SequenceBlocks,
    block_keys,
    block_table_tensor,
    blocks_for_budget,
    gdn_snapshot_nbytes,
    kv_block_nbytes,
    model_sizes,
    pool_tensors,
    prefix_key,
)


def _admit(pool, ids, media=()):
    """What the K/V store does for a new prompt (KVStore.share / reserve): the longest snapshot's blocks
    forked copy-on-write, fresh blocks for the rest. Returns (seq, snapshot or None, block copies)."""
    snap = pool.match(ids, media)
    if snap is None:
        seq = SequenceBlocks()
        pool.reserve(seq, len(ids), f"a {len(ids)}-token prompt")
        return seq, None, []
    seq, copies = pool.fork(SequenceBlocks(list(snap.blocks[:pool.blocks_for(snap.num_tokens)]), snap.num_tokens))
    try:
        pool.reserve(seq, len(ids), f"a {len(ids)}-token prompt")
    except (PoolExhausted, PromptTooLong):
        pool.free(seq)  # as the store's finalizer would
        raise
    return seq, snap, copies


def _toks(n, seed=0):
    r = random.Random(seed)
    return [r.randrange(248_000) for _ in range(n)]


def _check_refcounts(pool, live):
    """Every block's count equals the live sequences plus snapshots listing it; the rest are free."""
    want = [0] * pool.num_blocks
    for holder in list(live) + pool.snapshots:
        for b in holder.blocks:
            want[b] += 1
    assert pool.refcount == want
    assert pool.num_free == want.count(0)


# ----------------------------------------------------------------------------- hash chain

def test_block_keys_chain_over_everything_before():
    t = _toks(100)
    k = block_keys(t, 16)
    assert len(k) == 6 and len(set(k)) == 6
    assert block_keys(t[:64], 16) == k[:4]  # a prefix has the same keys
    t2 = list(t)
    t2[3] += 1  # a change in block 0 changes every later key
    k2 = block_keys(t2, 16)
    assert all(a != b for a, b in zip(k, k2))
    t3 = list(t)
    t3[40] += 1  # a change in block 2 leaves blocks 0 and 1
    k3 = block_keys(t3, 16)
    assert k3[:2] == k[:2] and all(a != b for a, b in zip(k[2:], k3[2:]))


def test_image_content_is_part_of_the_key():
    t = [7] * 10 + [248056] * 40 + [9] * 14  # an image's pads at positions 10..49
    a = block_keys(t, 16, [MediaSpan(10, 50, "sha-of-image-A")])
    a2 = block_keys(t, 16, [MediaSpan(10, 50, "sha-of-image-A")])
    b = block_keys(t, 16, [MediaSpan(10, 50, "sha-of-image-B")])
    assert a == a2  # same pixels, same keys
    assert all(x != y for x, y in zip(a, b))  # another image never does (block 0 holds its first pads)
    moved = block_keys(t, 16, [MediaSpan(12, 52, "sha-of-image-A")])
    assert moved != a


def test_prefix_key_partial_blocks():
    t = _toks(50)
    full = block_keys(t, 16)
    assert prefix_key(t, 32, 16) == full[1]
    assert prefix_key(t, 40, 16) != prefix_key(t, 41, 16)
    assert prefix_key(t, 40, 16) == prefix_key(t[:40] + [1, 2, 3], 40, 16)
    assert prefix_key(t, 40, 16, full_keys=full) == prefix_key(t, 40, 16)
    assert prefix_key(t, 16, 16) != prefix_key(t, 16, 8)


# ----------------------------------------------------------------------------- pool, sequences, snapshots

def test_allocate_release_and_refcounts():
    pool = KVPool(8, 16)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert len(set(a + b)) == 5 and pool.num_free == 3
    pool.retain(a[:1])
    pool.release(a)
    assert pool.refcount[a[0]] == 1 and pool.num_free == 5
    pool.release(a[:1])
    pool.release(b)
    assert pool.num_free == 8
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(b[:1])
    with pytest.raises(RuntimeError, match="not allocated"):
        pool.retain(b[:1])



def test_trim_gives_back_the_room_past_the_tokens():
    """A sequence that reserved more room than its tokens took (a padded prefill's filler) gives back the blocks
    past its last token; a block someone else also holds only loses this sequence's reference."""
    pool = KVPool(10, 16)
    seq = SequenceBlocks()
    pool.reserve(seq, 70)  # 5 blocks
    seq.num_tokens = 20  # 2 blocks written
    other = seq.blocks[4]
    pool.retain([other])  # also held elsewhere
    pool.trim(seq)
    assert len(seq.blocks) == 2 and pool.refcount[other] == 1 and pool.num_free == 10 - 3
    _check_refcounts(pool, [seq, SequenceBlocks([other])])
    pool.trim(seq)  # nothing past its tokens: unchanged
    assert len(seq.blocks) == 2
    seq.num_tokens = 0
    pool.trim(seq)
    assert seq.blocks == [] and pool.num_free == 9


def test_try_reserve_evicts_only_when_that_makes_room():
    """Room a caller can do without (a padded prefill's filler): taken from free blocks or by evicting
    snapshots (never `keep`), but when even evicting every other snapshot leaves too few, nothing is evicted
    and the answer is False."""
    pool = KVPool(8, 16)
    t = _toks(32, 5)
    live = _admit(pool, t)[0]  # 2 blocks, live
    live.num_tokens = 32
    shared = pool.save_snapshot(live, t, 32, "shared", 1)  # its blocks are the live sequence's too
    u = _toks(32, 6)
    gone = _admit(pool, u)[0]
    gone.num_tokens = 32
    only = pool.save_snapshot(gone, u, 32, "only", 1)
    pool.free(gone)  # only the snapshot holds these 2 blocks
    assert pool.num_free == 4
    seq = SequenceBlocks()
    assert not pool.try_reserve(seq, 7 * 16)  # 4 free + 2 reclaimable < 7
    assert seq.blocks == [] and pool.snapshots == [shared, only] and pool.num_free == 4
    assert not pool.try_reserve(seq, 5 * 16, keep=only)  # `only` may not go: 4 free + 0 < 5
    assert pool.snapshots == [shared, only]
    assert pool.try_reserve(seq, 6 * 16)  # 4 free + 2 reclaimable: fits, by eviction
    assert len(seq.blocks) == 6 and only not in pool.snapshots
    _check_refcounts(pool, [live, seq])
    assert pool.try_reserve(seq, 6 * 16)  # already there
    assert len(seq.blocks) == 6


def test_freed_blocks_come_back_in_their_order():
    """A sequence freed and another one allocated in its place gets the same blocks in the same, ascending, order
    (not reversed by the free stack): its K/V stay one consecutive stretch of the pool."""
    pool = KVPool(16, 16)
    first = pool.allocate(5)
    assert first == [0, 1, 2, 3, 4]
    other = pool.allocate(3)
    seq = SequenceBlocks(first, 80)
    pool.free(seq)
    assert pool.allocate(5) == first
    pool.release(other)
    assert pool.allocate(3) == other

def test_errors_name_both_numbers():
    pool = KVPool(10, 16)
    with pytest.raises(PromptTooLong, match=r"a 161-token prompt needs 11 K/V blocks \(176 token positions.*"
                                            r"holds 10 blocks \(160 positions\)"):
        _admit(pool, _toks(161))
    live = _admit(pool, _toks(100, 1))[0]  # 7 blocks held by a live sequence
    with pytest.raises(PoolExhausted, match=r"needs 4 K/V blocks but only 3 of the pool's 10 are free"):
        _admit(pool, _toks(60, 2))
    pool.free(live)
    _admit(pool, _toks(60, 2))



def test_eviction_drops_only_snapshots_that_free_blocks():
    """Snapshots whose blocks a live prefill holds free nothing when dropped: a request that cannot be met
    anyway evicts none of them (a growing store keeps its prefix cache whole), and one that can is met by
    evicting only what frees blocks, least recently used first; snapshots that share blocks held by nothing
    else are evicted together when their blocks are needed."""
    pool = KVPool(4, 16)
    a = _toks(40)
    live = SequenceBlocks()
    pool.reserve(live, 40)  # a live prefill: 3 blocks
    live.num_tokens = 40
    pool.save_snapshot(live, a, 20, "A@20", 1)
    pool.save_snapshot(live, a, 39, "A@39", 1)
    with pytest.raises(PoolExhausted, match=r"needs 2 K/V blocks but only 1 of the pool's 4 are free; the other 3"):
        pool.allocate(2)
    assert [s.states for s in pool.snapshots] == ["A@20", "A@39"] and pool.match(a + [7]).states == "A@39"
    gone = SequenceBlocks()
    pool.reserve(gone, 16)
    gone.num_tokens = 16
    pool.save_snapshot(gone, _toks(16, 1), 15, "B@15", 1)
    pool.free(gone)  # held by its snapshot alone
    _check_refcounts(pool, [live])
    assert pool.allocate(1) and [s.states for s in pool.snapshots] == ["A@20", "A@39"]  # older, but free nothing
    pool.free(live)  # now A@20 and A@39 share blocks 0-1 with nothing else; A@39 alone holds block 2
    with pytest.raises(PoolExhausted, match=r"only 3 of the pool's 4 are free \(3 of them held by the prefix cache "
                                            r"alone, which gives them up\)"):
        pool.allocate(4)
    assert len(pool.snapshots) == 2
    got = pool.allocate(3)
    assert sorted(got) == [0, 1, 2] and pool.snapshots == [] and pool.num_free == 0

def test_snapshot_reuse_shares_blocks_and_copies_the_partial_one():
    pool = KVPool(64, 16)
    system = _toks(200, 1)  # 12 full blocks + 8 tokens
    image = [248056] * 100
    media = [MediaSpan(200, 300, "img-1")]
    q1, q2 = _toks(50, 2), _toks(50, 3)
    p1 = system + image + q1
    seq, snap, copies = _admit(pool, p1, media)
    assert snap is None and copies == []
    seq.num_tokens = len(p1)  # the prefill wrote every position
    s_sys = pool.save_snapshot(seq, p1, 200, states="gdn@200", nbytes=10, media=media)
    s_img = pool.save_snapshot(seq, p1, 300, states="gdn@300", nbytes=10, media=media)
    _check_refcounts(pool, [seq])

    p2 = system + image + q2  # another question about the same image
    seq2, snap2, copies2 = _admit(pool, p2, media)
    assert snap2 is s_img and seq2.num_tokens == 300
    assert seq2.blocks[:18] == seq.blocks[:18]  # 18 full blocks shared
    assert copies2 == [(seq.blocks[18], seq2.blocks[18])]  # block 18 holds 300 % 16 = 12 cached tokens
    assert seq2.blocks[18] != seq.blocks[18]
    _check_refcounts(pool, [seq, seq2])

    other = system + [248056] * 100 + q2  # same system prompt, another image: only the system prompt is reused
    assert _admit(pool, other, [MediaSpan(200, 300, "img-2")])[1] is s_sys
    assert _admit(pool, _toks(30, 9))[1] is None  # nothing in common
    assert pool.match(system[:150]) is None


def test_match_never_takes_the_whole_prompt_and_respects_max_tokens():
    pool = KVPool(16, 16)
    t = _toks(64)
    seq = _admit(pool, t)[0]
    seq.num_tokens = 64
    pool.save_snapshot(seq, t, 64, None, 1)
    pool.save_snapshot(seq, t, 32, None, 1)
    assert pool.match(t).num_tokens == 32  # the last token must run to give logits
    assert pool.match(t + [5]).num_tokens == 64
    assert pool.match(t + [5], max_tokens=40).num_tokens == 32
    for most in (64, 999):  # a bound at or past the prompt's length still leaves its last token to run
        assert pool.match(t, max_tokens=most).num_tokens == 32


def test_fork_is_copy_on_write():
    pool = KVPool(16, 16)
    seq = _admit(pool, _toks(40))[0]  # 3 blocks, the last partly filled
    seq.num_tokens = 40
    child, copies = pool.fork(seq)
    assert child.blocks[:2] == seq.blocks[:2] and child.blocks[2] != seq.blocks[2]
    assert copies == [(seq.blocks[2], child.blocks[2])] and child.num_tokens == 40
    _check_refcounts(pool, [seq, child])
    seq2 = _admit(pool, _toks(32, 1))[0]
    seq2.num_tokens = 32
    child2, copies2 = pool.fork(seq2)  # block-aligned: nothing copied
    assert child2.blocks == seq2.blocks and copies2 == []
    for s in (seq, child, seq2, child2):
        pool.free(s)
    assert pool.num_free == 16


def test_a_fork_from_a_snapshot_in_a_full_pool_takes_its_partly_filled_block_over():
    """Resuming from a snapshot in a full pool: the fork may not evict that snapshot to find its one block (its
    blocks would be freed when the fork gives up, and a grown store's retry would find them gone); where the
    snapshot alone holds the partly filled block, the child takes it over instead of a copy (the snapshot reads
    only its first tokens, which the child never writes), so a prompt that fits the pool cold is not refused for
    its cached prefix. A second fork, the block now shared with the first, needs its copy: refused in the full
    pool with nothing changed, made once a block is free."""
    pool = KVPool(8, 16)
    t = _toks(40)
    seq = _admit(pool, t)[0]
    seq.num_tokens = 40
    snap = pool.save_snapshot(seq, t, 40, "s", 1)
    pool.free(seq)  # only the snapshot holds its 3 blocks now
    held = pool.allocate(pool.num_free)
    parent = SequenceBlocks(list(snap.blocks), 40)
    child, copies = pool.fork(parent, keep=snap)
    assert child.blocks == snap.blocks and copies == [] and child.num_tokens == 40
    assert pool.snapshots == [snap] and all(pool.refcount[b] == 2 for b in snap.blocks)
    with pytest.raises(PoolExhausted):
        pool.fork(parent, keep=snap)
    assert pool.snapshots == [snap] and all(pool.refcount[b] == 2 for b in snap.blocks)
    pool.release(held[:1])
    second, copies = pool.fork(parent, keep=snap)
    assert second.blocks[:2] == snap.blocks[:2] and copies == [(snap.blocks[2], second.blocks[2])]
    for s in (child, second):
        pool.free(s)
    pool.release(held[1:])
    assert all(pool.refcount[b] == 1 for b in snap.blocks) and pool.num_free == 8 - 3


def test_a_pool_that_cannot_grow_drops_the_snapshots_sharing_a_resumed_prompts_partly_filled_block():
    """Two reuse points in one block (a system prompt's at 40 tokens, a short turn's at 45): a prompt resumed from
    the first writes its tokens from 40 on into that block, over the second's. In a full pool that cannot grow,
    the fork drops the second snapshot (a cold read would evict it) and takes the block over, so the prompt that
    fits the pool cold is not refused; a pool that grows (last_resort False) is refused with nothing changed, and
    grows instead. A block a live sequence holds too is never taken."""
    pool = KVPool(3, 16)
    t = _toks(45)
    seq = _admit(pool, t)[0]
    seq.num_tokens = 45
    at40 = pool.save_snapshot(seq, t, 40, "s40", 1)
    at45 = pool.save_snapshot(seq, t, 45, "s45", 1)
    pool.free(seq)
    assert pool.num_free == 0
    u = t[:40] + _toks(6, 7)
    assert pool.match(u) is at40
    parent = SequenceBlocks(list(at40.blocks), 40)
    with pytest.raises(PoolExhausted):
        pool.fork(parent, keep=at40)
    assert {s.states for s in pool.snapshots} == {"s40", "s45"}
    _check_refcounts(pool, [])
    live = SequenceBlocks(list(at45.blocks), 45)  # a prefill still alive on the turn
    pool.retain(live.blocks)
    with pytest.raises(PoolExhausted):
        pool.fork(parent, keep=at40, last_resort=True)
    assert {s.states for s in pool.snapshots} == {"s40", "s45"}
    pool.free(live)
    child, copies = pool.fork(parent, keep=at40, last_resort=True)
    assert child.blocks == at40.blocks and copies == [] and child.num_tokens == 40
    assert pool.snapshots == [at40]
    pool.reserve(child, len(u))
    _check_refcounts(pool, [child])
    pool.free(child)
    assert pool.match(u) is at40 and pool.num_free == 0


def test_a_fork_refused_its_room_changes_nothing():
    """A fork takes the child's whole room at once (KVStore.share: a resumed prompt, an answer), all or nothing: a
    prompt refused for want of room evicts no snapshot to copy its prefix's partly filled block, nor drops the
    snapshots sharing a block it would take over (a fork, then a refused reserve, left the prefix cache short)."""
    pool = KVPool(5, 16)
    live = SequenceBlocks()
    pool.reserve(live, 20)  # a live prefill: blocks 0, 1
    live.num_tokens = 20
    t = _toks(20, 1)
    seq = _admit(pool, t)[0]
    seq.num_tokens = 20
    at20 = pool.save_snapshot(seq, t, 20, "s20", 1)
    pool.free(seq)
    u = _toks(16, 2)
    seq = _admit(pool, u)[0]
    seq.num_tokens = 16
    pool.save_snapshot(seq, u, 16, "s16", 1)
    pool.free(seq)
    assert pool.num_free == 0

    def unchanged(call, error):
        before = (list(pool.refcount), pool.num_free, [s.states for s in pool.snapshots])
        with pytest.raises(error):
            call()
        assert (list(pool.refcount), pool.num_free, [s.states for s in pool.snapshots]) == before

    parent = SequenceBlocks(list(at20.blocks), 20)
    unchanged(lambda: pool.fork(parent, keep=at20, last_resort=True, room=140), PromptTooLong)  # 9 blocks > 5
    unchanged(lambda: pool.fork(parent, keep=at20, last_resort=True, room=60), PoolExhausted)  # 4 blocks: 3 to be had
    unchanged(lambda: pool.fork(live, last_resort=True, room=120), PromptTooLong)  # a follow-up turn
    child, copies = pool.fork(parent, keep=at20, last_resort=True, room=32)  # 2 blocks: the copy evicts s16
    assert child.blocks[0] == at20.blocks[0] and copies == [(at20.blocks[1], child.blocks[1])]
    assert [s.states for s in pool.snapshots] == ["s20"]
    _check_refcounts(pool, [live, child])
    pool.free(child)
    pool.save_snapshot(SequenceBlocks([pool.allocate(1)[0]], 16), u, 16, "s16", 1)
    pool.release(pool.snapshots[-1].blocks)  # (the snapshot alone holds it)
    child, copies = pool.fork(parent, keep=at20, last_resort=True, room=48)  # 3 blocks: one to be had
    assert child.blocks[:2] == at20.blocks and copies == []  # the partly filled block taken over
    assert [s.states for s in pool.snapshots] == ["s20"]
    _check_refcounts(pool, [live, child])

    pool = KVPool(3, 16)  # two snapshots in one block, a prompt resumed from the first
    t = _toks(45)
    seq = _admit(pool, t)[0]
    seq.num_tokens = 45
    at40 = pool.save_snapshot(seq, t, 40, "s40", 1)
    pool.save_snapshot(seq, t, 45, "s45", 1)
    pool.free(seq)
    parent = SequenceBlocks(list(at40.blocks), 40)
    unchanged(lambda: pool.fork(parent, keep=at40, last_resort=True, room=70), PromptTooLong)
    child, copies = pool.fork(parent, keep=at40, last_resort=True, room=48)
    assert child.blocks == at40.blocks and copies == [] and [s.states for s in pool.snapshots] == ["s40"]
    _check_refcounts(pool, [child])


def test_lru_eviction_frees_blocks_for_new_prompts():
    pool = KVPool(12, 16)
    snaps = []
    for i in range(3):  # three 64-token prompts, each snapshotted, then dropped by their sequences
        t = _toks(64, 10 + i)
        seq = _admit(pool, t)[0]
        seq.num_tokens = 64
        snaps.append((t, pool.save_snapshot(seq, t, 64, f"s{i}", 5)))
        pool.free(seq)
    assert pool.num_free == 0
    pool.match(snaps[0][0] + [1])  # touch the first: now the second is least recently used
    new = _admit(pool, _toks(60, 99))[0]  # needs 4 blocks: evicts exactly one snapshot
    left = [s.states for s in pool.snapshots]
    assert left == ["s2", "s0"]
    _check_refcounts(pool, [new])


def test_snapshot_byte_budget():
    pool = KVPool(64, 16, snapshot_budget_bytes=25)
    t = _toks(160)
    seq = _admit(pool, t)[0]
    seq.num_tokens = 160
    for n in (16, 32, 48, 64):
        pool.save_snapshot(seq, t, n, n, 10)
    assert [s.num_tokens for s in pool.snapshots] == [48, 64] and pool.snapshot_bytes == 20
    pool.save_snapshot(seq, t, 64, "again", 10)  # same key: replaced, not added
    assert [s.states for s in pool.snapshots] == [48, "again"]
    _check_refcounts(pool, [seq])
    big = pool.save_snapshot(seq, t, 80, "big", 30)  # alone over the budget: the older ones go, never the new one
    assert pool.snapshots == [big] and pool.snapshot_bytes == 30 and pool.match(t).states == "big"
    _check_refcounts(pool, [seq])
    pool.clear()
    pool.free(seq)
    assert pool.num_free == 64 and pool.snapshot_bytes == 0


def test_random_workload_keeps_refcounts_consistent():
    r = random.Random(5)
    pool = KVPool(40, 16, snapshot_budget_bytes=60)
    live, base = [], _toks(120, 77)
    for step in range(300):
        op = r.random()
        try:
            if op < 0.4:
                n = r.randrange(1, 200)
                t = base[:r.randrange(0, 120)] + _toks(n, step)
                seq = _admit(pool, t)[0]
                seq.num_tokens = len(t)
                live.append((seq, t))
                if r.random() < 0.7:
                    pool.save_snapshot(seq, t, r.randrange(1, len(t) + 1), step, r.randrange(1, 30))
            elif op < 0.6 and live:
                s, t = live[r.randrange(len(live))]
                child, _ = pool.fork(s)
                live.append((child, t))
            elif live:
                s, _ = live.pop(r.randrange(len(live)))
                pool.free(s)
        except (PoolExhausted, PromptTooLong):
            pass
        _check_refcounts(pool, [s for s, _ in live])
        assert pool.snapshot_bytes <= 60


def test_sizes():
    assert kv_block_nbytes(8, 16, 4, 256) == 512 * 1024  # 9B: 8 full-attention layers
    assert gdn_snapshot_nbytes(24, 32, 128, 128, 8192, 4) == 51_511_296
    from qwen35_fast.runtime.config import FULL, LINEAR, TextConfig
    nine_b = TextConfig(vocab_size=248_320, hidden_size=4096, intermediate_size=12_288,
                        layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(32)),
                        num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128)
    assert model_sizes(nine_b, 16) == {"kv_block_bytes": 524_288, "kv_bytes_per_token": 32_768,
                                       "snapshot_bytes": 51_511_296}
    assert blocks_for_budget(2 << 30, nine_b, 16) == 4096  # 2 GiB: 65,536 tokens
    k, v = pool_tensors(nine_b, 3, 16, dtype=torch.float16)
    assert k.shape == v.shape == (8, 3, 16, 4, 256) and k.dtype == torch.float16 and k[5].is_contiguous()


# ----------------------------------------------------------------------------- the block table the kernels read

def test_block_table_tensor_is_what_paged_attention_reads():
    pool = KVPool(32, 16)
    t1, t2 = _toks(37, 1), _toks(70, 2)
    s1, s2 = _admit(pool, t1)[0], _admit(pool, t2)[0]
    table = block_table_tensor([s1, s2])
    assert table.dtype == torch.int32 and table.shape == (2, 5) and table.is_contiguous()
    assert table.tolist() == [s1.blocks + [PAD, PAD], s2.blocks]  # each row: the blocks in position order
    assert block_table_tensor([s1], max_blocks=8).shape == (1, 8)
    with pytest.raises(ValueError, match="more than max_blocks"):
        block_table_tensor([s2], max_blocks=2)
    # write two prompts' K/V through the reference (as a prefill would), read them back by the table
    g = torch.Generator().manual_seed(0)
    Hkv, D = 2, 32
    k_pool = torch.full((32, 16, Hkv, D), float("nan"), dtype=torch.bfloat16)
    v_pool = k_pool.clone()
    k_new = torch.randn(107, Hkv, D, generator=g).to(torch.bfloat16)
    v_new = torch.randn(107, Hkv, D, generator=g).to(torch.bfloat16)
    q = torch.randn(107, 4, D, generator=g).to(torch.bfloat16)
    zero = torch.zeros(2, dtype=torch.int32)
    cu = torch.tensor([0, 37, 107], dtype=torch.int32)
    out = paged_attention_ref(q, k_new, v_new, k_pool, v_pool, table, zero, cu)
    assert torch.isfinite(out).all()
    assert torch.equal(gather_kv(k_pool, table[1], 70), k_new[37:])
    assert torch.equal(gather_kv(v_pool, table[0], 37), v_new[:37])
    # the documented format read directly (not through the reference that wrote it): position p of sequence n
    # is row p % block_size of block table[n, p // block_size]
    for n, (start, length) in enumerate(((0, 37), (37, 70))):
        for p in range(length):
            block = int(table[n, p // 16])
            assert torch.equal(k_pool[block, p % 16], k_new[start + p]), (n, p)
            assert torch.equal(v_pool[block, p % 16], v_new[start + p]), (n, p)
    # a forked child sees the same K/V through its own table once the copy-on-write copy is made
    s1.num_tokens = 37
    child, copies = pool.fork(s1)
    for src, dst in copies:
        k_pool[dst] = k_pool[src]
    assert copies and block_table_tensor([child]).tolist() == [child.blocks]
    assert torch.equal(gather_kv(k_pool, block_table_tensor([child])[0], 37), k_new[:37])


def test_blocks_given_back_from_another_thread():
    """A Cache's blocks go back from a finalizer, which the garbage collector may run on another thread
    (ComfyUI's server) while the prompt thread allocates: the pool's lock keeps its books whole."""
    import queue
    import threading
    pool = KVPool(256, 16)
    handed: queue.Queue = queue.Queue(maxsize=8)  # the prompt thread waits when the other falls behind

    def give_back():
        while (seq := handed.get()) is not None:
            pool.free(seq)

    other = threading.Thread(target=give_back)
    other.start()
    for i in range(3000):
        seq = SequenceBlocks()
        n = 16 * (1 + i % 7) - i % 3  # every third time or so a partly filled last block: the fork copies it
        pool.reserve(seq, n)
        seq.num_tokens = n  # written: the fork shares its full blocks (a fork of an empty sequence shares none)
        shared, copies = pool.fork(seq)
        assert shared.blocks[:n // 16] == seq.blocks[:n // 16] and len(copies) == (1 if n % 16 else 0)
        handed.put(seq)
        handed.put(shared)
    handed.put(None)
    other.join()
    assert pool.num_free == pool.num_blocks and sorted(pool._free) == list(range(pool.num_blocks))
    assert all(r == 0 for r in pool.refcount)
    # the books are kept by the lock: a free from another thread waits while it is held here, then goes through
    seq = SequenceBlocks()
    pool.reserve(seq, 64)
    done = threading.Event()
    late = threading.Thread(target=lambda: (pool.free(seq), done.set()))
    with pool._lock:
        late.start()
        assert not done.wait(0.2) and pool.num_free == pool.num_blocks - 4
    late.join()
    assert done.is_set() and pool.num_free == pool.num_blocks


@pytest.mark.parametrize("stop", [RuntimeError("no room"), KeyboardInterrupt()])
def test_a_fork_stopped_while_it_allocates_holds_nothing(stop, monkeypatch):
    """The parent's blocks held for the fork go back whatever stops it (a Ctrl+C too)."""
    pool = KVPool(8, 16)
    parent = SequenceBlocks(pool.allocate(2), 20)  # a partly filled last block: the fork allocates its copy

    def fail(*a, **k):
        raise stop
    monkeypatch.setattr(pool, "allocate", fail)
    with pytest.raises(type(stop)):
        pool.fork(parent)
    assert pool.refcount[:2] == [1, 1]
    pool.release(parent.blocks)
    assert pool.num_free == 8


def test_a_growth_stopped_in_the_pool_leaves_tensors_and_pool_agreeing(monkeypatch):
    from qwen35_fast.runtime.config import from_hf_dict
    from qwen35_fast.runtime.demo_checkpoint import tiny_qwen35_config
    from qwen35_fast.runtime.kv_store import KVStore
    store = KVStore(from_hf_dict(tiny_qwen35_config()), 4 << 20, torch.float32, torch.device("cpu"), growable=True)
    before = store.num_blocks
    real = store.pool.grow

    def stopped(n):
        raise KeyboardInterrupt
    monkeypatch.setattr(store.pool, "grow", stopped)
    with pytest.raises(KeyboardInterrupt):
        store.grow(2 * before)
    assert store.k.shape[1] == store.pool.num_blocks == before
    monkeypatch.setattr(store.pool, "grow", real)
    store.grow(2 * before)
    assert store.k.shape[1] == store.v.shape[1] == store.pool.num_blocks == 2 * before


def test_a_growing_sequence_short_of_blocks_counts_its_own_apart():
    """A sequence that holds blocks and asks for more: the error says how many more, and tells its own blocks
    from those of other live sequences and of the prefix cache; one longer than the whole pool is counted whole."""
    pool = KVPool(5, 16)
    other = SequenceBlocks()
    pool.reserve(other, 16)  # 1 block another live sequence holds
    other.num_tokens = 16
    gone = SequenceBlocks()
    pool.reserve(gone, 16)
    gone.num_tokens = 16
    pool.save_snapshot(gone, list(range(16)), 15, "S", 1)
    pool.free(gone)  # 1 block held by the prefix cache alone
    seq = SequenceBlocks()
    pool.reserve(seq, 32)  # 2 blocks of its own
    seq.num_tokens = 32
    with pytest.raises(PoolExhausted) as e:
        pool.reserve(seq, 80, "room for 80 tokens")  # 5 blocks in all: 3 more, 2 to be had
    assert ("room for 80 tokens needs 3 more K/V blocks but only 2 of the pool's 5 are free (1 of them held by "
            "the prefix cache alone, which gives them up); the other 3 are held: 2 by this sequence itself (its "
            "shared prefix included), 1 by other prefills and generations still alive") in str(e.value), str(e.value)
    with pytest.raises(PromptTooLong, match=r"needs 6 K/V blocks"):  # the whole sequence counted
        pool.reserve(seq, 96)


def test_a_fork_short_of_its_copy_block_counts_the_prefix_it_shares_as_its_own():
    """A fork (an answer from a prefill) in a full pool needs one block, the copy of the prefix's partly filled last
    one: the error says so, and counts the prefix's blocks the fork shares as its own, not as blocks other live
    prefills hold (it read "forking a sequence needs 1 K/V blocks ... held by prefills and generations still
    alive", all of them)."""
    pool = KVPool(4, 16)
    parent = SequenceBlocks()
    pool.reserve(parent, 40)  # 3 blocks, the last partly filled
    parent.num_tokens = 40
    other = SequenceBlocks()
    pool.reserve(other, 16)
    with pytest.raises(PoolExhausted) as e:
        pool.fork(parent)
    assert ("a copy of the prefix's partly filled last block needs 1 more K/V blocks but only 0 of the pool's 4 are "
            "free; the other 4 are held: 3 by this sequence itself (its shared prefix included), 1 by other "
            "prefills and generations still alive") in str(e.value), str(e.value)
    _check_refcounts(pool, [parent, other])


def test_cache_reserve_names_the_room_it_asks_for():
    """Cache.reserve's errors speak of the positions asked for (a generation's room), not of a sequence's tokens."""
    from qwen35_fast.runtime.model import Cache
    seen = []

    class Store:
        block_size = 16

        def reserve(self, seq, n, what):
            seen.append((n, what))

    Cache([], [], Store(), SequenceBlocks()).reserve(1234)
    assert seen == [(1234, "room for 1,234 tokens")]
