"""A growable K/V store giving back what a failed call grew it by (KVStore.shrink_to, KVPool.shrink,
growth_undone_on_failure): the pool's counts and the tensors agree after a shrink and after one stopped
midway, live blocks are never dropped, snapshots past the new count are evicted and those before it kept, and
a prompt or an answer that is cancelled or fails leaves the store the size it found, still giving the tokens
it gave before. A fixed store never changes size."""
import gc
import importlib
import random

import pytest
import torch

from qwen35_fast.runtime import (
    Qwen35Error,
    continue_prefill,
    generate,
    load_model,
    prefill,
    prefill_ids,
    progress,
)
from qwen35_fast.runtime.config import from_hf_dict
from qwen35_fast.runtime.demo_checkpoint import make_checkpoint, tiny_qwen35_config
from qwen35_fast.runtime.kv_pool import KVPool, PromptTooLong, SequenceBlocks
from qwen35_fast.runtime.kv_store import KVStore, growth_undone_on_failure
from qwen35_fast.runtime.multimodal import prefill_multimodal
from qwen35_fast.runtime.sampling import SamplingParams

GREEDY = SamplingParams(do_sample=False)


def _counts_agree(pool: KVPool, live) -> None:
    """Every block's count is the live sequences and snapshots listing it, the free list the rest, and every
    listed block lies inside the pool."""
    want = [0] * pool.num_blocks
    for holder in list(live) + pool.snapshots:
        for b in holder.blocks:
            assert 0 <= b < pool.num_blocks
            want[b] += 1
    assert pool.refcount == want
    assert sorted(pool._free) == [b for b, n in enumerate(want) if n == 0]


def _ids(snapshots) -> set:
    return {id(s) for s in snapshots}


def _seq(pool: KVPool, tokens: int) -> SequenceBlocks:
    seq = SequenceBlocks()
    pool.reserve(seq, tokens)
    seq.num_tokens = tokens
    return seq


# ----------------------------------------------------------------------------- the pool

def test_a_shrink_evicts_the_snapshots_past_it_and_keeps_the_ones_before():
    pool = KVPool(4, 16)
    low = _seq(pool, 40)  # blocks 0-2
    pool.save_snapshot(low, list(range(40)), 20, "low", 1)  # blocks 0-1
    pool.grow(10)
    tail = _seq(pool, 64)  # block 3, then the new ones: 4, 5, 6
    assert max(tail.blocks) >= 4
    pool.save_snapshot(tail, list(range(64)), 60, "tail", 1)
    pool.save_snapshot(tail, list(range(64)), 10, "head", 1)  # its first block only (3): inside 4 blocks
    assert pool.live_end() == 7
    pool.free(tail)
    assert pool.live_end() == 3  # the snapshots' blocks do not count
    pool.shrink(4)
    assert pool.num_blocks == 4 and len(pool.refcount) == 4
    assert sorted(s.states for s in pool.snapshots) == ["head", "low"]
    _counts_agree(pool, [low])
    assert pool.num_free == 0  # block 3 is the "head" snapshot's
    with pytest.raises(PromptTooLong, match="holds 4 blocks"):
        pool.allocate(5)
    pool.grow(6)  # grows again from 4: ids 4, 5 are new and free
    assert pool.allocate(2) == [4, 5]


def test_a_shrink_past_a_block_a_live_sequence_holds_is_refused_with_nothing_changed():
    pool = KVPool(2, 16)
    pool.grow(8)
    seq = _seq(pool, 16 * 6)  # blocks 0-5
    pool.save_snapshot(seq, list(range(96)), 90, "s", 1)
    before = (list(pool.refcount), list(pool._free), pool.snapshots, pool.num_blocks)
    with pytest.raises(RuntimeError, match="live sequence holds block 5"):
        pool.shrink(4)
    with pytest.raises(RuntimeError, match="at least 1"):
        KVPool(3, 16).shrink(0)
    assert (pool.refcount, pool._free, pool.snapshots, pool.num_blocks) == before
    pool.shrink(6)  # down to what the live blocks need: the two free ones go, the snapshot stays
    assert pool.num_blocks == 6 and pool.snapshots[0].states == "s"
    _counts_agree(pool, [seq])


def test_random_operations_with_shrinks_keep_the_counts_right():
    """Random allocations, forks, snapshots, frees, growths and shrinks: after each, the counts agree, no live
    block lies past the pool, and a shrink keeps every live block and only the snapshots inside it."""
    rng = random.Random(5)
    pool, live, shrinks, refused = KVPool(6, 16), [], 0, 0
    for step in range(600):
        op = rng.random()
        try:
            if op < 0.3:
                live.append(_seq(pool, rng.randint(1, 120)))
            elif op < 0.4 and live:
                child, _ = pool.fork(rng.choice(live), room=rng.randint(1, 160))
                live.append(child)
            elif op < 0.55 and live:
                seq = rng.choice(live)
                pool.save_snapshot(seq, [step] * seq.num_tokens, rng.randint(1, seq.num_tokens), step, 1)
            elif op < 0.75 and live:
                pool.free(live.pop(rng.randrange(len(live))))
            elif op < 0.85:
                pool.grow(pool.num_blocks + rng.randint(1, 6))
            else:
                end = pool.live_end()
                target = rng.randint(1, pool.num_blocks) if rng.random() < 0.5 else \
                    min(max(end, 1) + rng.randint(0, 2), pool.num_blocks)
                kept = [s for s in pool.snapshots if max(s.blocks) < target]
                if target < end:
                    with pytest.raises(RuntimeError):
                        pool.shrink(target)
                    refused += 1
                else:
                    pool.shrink(target)
                    shrinks += 1
                    assert pool.num_blocks == target and pool.snapshots == kept
        except Exception as e:  # the pool's refusals; the counts must agree after them too
            if "K/V blocks" not in str(e):
                raise
        _counts_agree(pool, live)
        assert all(max(s.blocks, default=-1) < pool.num_blocks for s in live)
    assert shrinks > 20 and refused > 5


# ----------------------------------------------------------------------------- the store

class _Owner:
    """What a sequence's blocks go back with (a Cache in the runtime)."""


def _store(growable=True) -> KVStore:
    return KVStore(from_hf_dict(tiny_qwen35_config()), 4 << 20, torch.float32, torch.device("cpu"),
                   growable=growable)


def test_a_store_shrinks_to_what_its_live_blocks_need_and_keeps_their_kv():
    store = _store()
    first, budget, version = store.num_blocks, store.budget_bytes, store.version
    owner = _Owner()
    low = store.sequence(owner, store.block_size * 2)
    store.k.normal_()
    store.v.normal_()
    other = _Owner()
    big = store.sequence(other, store.block_size * (first + 3))  # past the pool: it grows
    assert store.num_blocks > first and store.version == version + 1
    store.k[:, first:].normal_()  # (the new blocks are uninitialised)
    store.v[:, first:].normal_()
    k, v = store.k.clone(), store.v.clone()
    end = store.pool.live_end()
    assert end > first
    assert store.shrink_to(first) == end  # the big sequence's blocks stay
    assert store.k.shape[1] == store.v.shape[1] == store.num_blocks == end and store.version == version + 2
    assert torch.equal(store.k, k[:, :end]) and torch.equal(store.v, v[:, :end])
    assert store.k.is_contiguous() and store.v.is_contiguous()
    assert big.blocks and store.shrink_to(end) == end and store.version == version + 2  # nothing to give back
    del other, big
    gc.collect()
    assert store.shrink_to(first) == first and store.version == version + 3
    assert store.budget_bytes == budget  # grown, then given back: the budget it started with
    assert torch.equal(store.k[:, low.blocks], k[:, low.blocks])
    _counts_agree(store.pool, [low])
    fixed = _store(growable=False)
    assert fixed.shrink_to(1) == fixed.num_blocks and fixed.version == 0


@pytest.mark.parametrize("where", ["tensors", "pool"])
def test_a_shrink_stopped_midway_leaves_tensors_and_pool_agreeing(where, monkeypatch):
    store = _store()
    first = store.num_blocks
    store.grow(first * 2)
    version, k = store.version, store.k

    def stopped(*a, **kw):
        raise torch.OutOfMemoryError("out of memory") if where == "tensors" else KeyboardInterrupt
    if where == "tensors":
        monkeypatch.setattr(torch, "empty", stopped)
    else:
        monkeypatch.setattr(store.pool, "shrink", stopped)
    with pytest.raises(torch.OutOfMemoryError if where == "tensors" else KeyboardInterrupt):
        store.shrink_to(first)
    assert store.k is k and store.k.shape[1] == store.pool.num_blocks == first * 2 and store.version == version
    monkeypatch.undo()
    assert store.shrink_to(first) == first == store.k.shape[1] == store.v.shape[1] == store.pool.num_blocks


def test_only_a_failed_block_gives_the_growth_back_and_its_own_error_goes_on(monkeypatch):
    store = _store()
    first = store.num_blocks
    with growth_undone_on_failure(store, store):
        store.grow(first * 2)
    assert store.num_blocks == first * 2  # a call that worked keeps what it grew by
    with pytest.raises(KeyError):
        with growth_undone_on_failure(store):
            store.grow(first * 3)
            raise KeyError("the call's own")
    assert store.num_blocks == first * 2

    def no_memory(*a, **kw):
        raise torch.OutOfMemoryError("out of memory")
    with pytest.raises(KeyError):  # a shrink that fails leaves the store grown and the call's error as it was
        with growth_undone_on_failure(store):
            store.grow(first * 3)
            monkeypatch.setattr(torch, "empty", no_memory)
            raise KeyError("the call's own")
    assert store.num_blocks == store.k.shape[1] == first * 3


# ----------------------------------------------------------------------------- the entry points

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ck"), with_tokenizer=True)


@pytest.fixture
def model(folder, monkeypatch):
    """The tiny model with an auto-budget store of 24 blocks (1,536 positions) on the CPU, reading prompts in
    pieces of 256 tokens (so that a cancel lands inside a prompt)."""
    monkeypatch.setenv("QWEN35_CPU_KV_BYTES", str(2 << 20))
    monkeypatch.setattr("qwen35_fast.runtime.model.PREFILL_PIECE", 256)
    m = load_model(folder, dtype="fp32", device="cpu", backend="torch")
    assert m.kv.growable and m.kv.num_blocks == 24
    return m


class Cancel(Exception):
    """What ComfyUI's interrupt raises inside a run (from the progress hook or the token callback)."""


def _cancel_once_grown(store, seen: list):
    def hook(stage, done, total):
        seen.append(store.num_blocks)
        raise Cancel
    return hook


LONG = list(range(10, 2010))  # 2,000 tokens: 32 blocks, more than the store's 24


def test_a_cancelled_prompt_gives_back_the_growth_and_the_store_still_answers_the_same(model):
    store = model.kv
    pf = prefill(model, "Say something.", system_prompt="You are terse.")
    want = generate(model, pf, max_new_tokens=12, sampling=GREEDY).token_ids
    snaps, blocks, version, seen = store.pool.snapshots, store.num_blocks, store.version, []
    with pytest.raises(Cancel), progress.reporting(_cancel_once_grown(store, seen)):
        prefill_ids(model, LONG)
    assert seen and seen[0] > blocks  # it had grown for the prompt when the cancel came
    assert store.num_blocks == store.k.shape[1] == blocks and store.version == version + 2
    assert _ids(store.pool.snapshots) == _ids(snaps) and store.pool.live_end() <= blocks
    assert generate(model, pf, max_new_tokens=12, sampling=GREEDY).token_ids == want
    again = prefill(model, "Say something.", system_prompt="You are terse.", use_cache=False)
    assert generate(model, again, max_new_tokens=12, sampling=GREEDY).token_ids == want
    long = prefill_ids(model, LONG)  # the same prompt, not cancelled: it grows and keeps the size
    assert store.num_blocks > blocks and long.n_tokens == len(LONG)
    grown = store.num_blocks
    del long
    gc.collect()
    assert store.num_blocks == grown


def test_a_prompt_that_fails_after_its_snapshots_were_saved_evicts_those_past_the_old_size(model, monkeypatch):
    store = model.kv
    system = "You are terse."
    first = prefill(model, "Hi.", system_prompt=system)
    snaps, blocks, past = store.pool.snapshots, store.num_blocks, []

    def no_room(*a, **kw):  # the prompt has been read and its snapshots saved: copying its logits fails
        past.extend(s for s in store.pool.snapshots if max(s.blocks) >= blocks)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
    with monkeypatch.context() as patch, pytest.raises(Qwen35Error, match="out of memory"):
        patch.setattr(importlib.import_module("qwen35_fast.runtime.generate"), "host_logits", no_room)
        prefill(model, "word " * 1800, system_prompt=system)
    assert past and store.num_blocks == blocks == store.k.shape[1]
    assert _ids(store.pool.snapshots) == _ids(snaps)  # the failed prompt's own are gone, the earlier ones stay
    _counts_agree(store.pool, [first.cache.seq])
    again = prefill(model, "Hello there.", system_prompt=system)
    assert again.cached_tokens > 0  # the system prompt's snapshot still serves


def test_a_cancelled_answer_gives_back_the_growth(model):
    store = model.kv
    pf = prefill_ids(model, list(range(10, 1310)))  # 1,300 tokens: 21 of the 24 blocks
    want = generate(model, pf, max_new_tokens=40, sampling=GREEDY).token_ids
    blocks, version, seen = store.num_blocks, store.version, []
    assert blocks == 24

    def on_token(text, n, most):
        if n == 300:  # past the store's 1,536 positions
            seen.append(store.num_blocks)
            raise Cancel
    with pytest.raises(Cancel):
        generate(model, pf, max_new_tokens=400, sampling=GREEDY, on_token=on_token)
    assert seen and seen[0] > blocks
    assert store.num_blocks == blocks and store.version == version + 2
    gc.collect()
    _counts_agree(store.pool, [pf.cache.seq])
    assert generate(model, pf, max_new_tokens=40, sampling=GREEDY).token_ids == want


def test_a_failed_call_shrinks_to_its_size_on_entry_and_never_past_a_live_prefill(model):
    store = model.kv
    pf = prefill_ids(model, LONG)
    want = generate(model, pf, max_new_tokens=4, sampling=GREEDY).token_ids
    blocks = store.num_blocks
    assert blocks > 24 and store.pool.live_end() > 24

    def on_token(text, n, most):
        if n == 2:
            raise Cancel
    store.grow(blocks * 2)  # as if the answer had grown it
    with pytest.raises(Cancel), growth_undone_on_failure(store):
        store.grow(blocks * 3)
        generate(model, pf, max_new_tokens=8, sampling=GREEDY, on_token=on_token)
    assert store.num_blocks == blocks * 2  # back to the size on entry, no further
    assert store.shrink_to(1) == store.pool.live_end() > 24  # the prefill's blocks stay
    assert generate(model, pf, max_new_tokens=4, sampling=GREEDY).token_ids == want


@pytest.mark.parametrize("entry", ["continue_prefill", "prefill_multimodal"])
def test_the_other_prompt_entry_points_give_back_a_cancelled_prompts_growth(model, entry):
    store = model.kv
    parent = prefill(model, "Hi.", system_prompt="You are terse.")
    blocks, seen = store.num_blocks, []
    text = "word " * 1800
    with pytest.raises(Cancel), progress.reporting(_cancel_once_grown(store, seen)):
        if entry == "continue_prefill":
            continue_prefill(model, parent, text)
        else:
            prefill_multimodal(model, text)
    assert seen and seen[0] > blocks
    assert store.num_blocks == blocks == store.k.shape[1]
    gc.collect()
    _counts_agree(store.pool, [parent.cache.seq])


def test_a_fixed_store_keeps_its_size_after_a_failed_prompt(model):
    store = model.setup_kv(4 << 20)
    blocks = store.num_blocks
    with pytest.raises(Cancel), progress.reporting(_cancel_once_grown(store, [])):
        prefill_ids(model, LONG)
    assert store.num_blocks == blocks and store.version == 0


@pytest.mark.gpu
def test_graphs_are_captured_again_after_a_shrink_and_give_the_same_tokens(tmp_path, monkeypatch):
    """On CUDA with the kernels: a short prompt after a cached prefix (a graphed prefill) and its answer (a graphed
    decode) give the same tokens after a cancelled long prompt grew the store and gave the growth back; the passes
    made for the larger store are not used again."""
    from qwen35_fast.runtime.prefill_graph import PaddedPrefill

    from _models import kernels_model
    model = kernels_model(tmp_path, seed=3)
    model.setup_kv()
    store = model.kv
    system = "You answer in one word. " * 8

    def ask(at_most=None):  # (read again from the snapshot the first read started from, not its own)
        pf = prefill(model, "Name a colour.", system_prompt=system, reuse_at_most=at_most)
        return pf.cached_tokens, generate(model, pf, max_new_tokens=16, sampling=GREEDY).token_ids

    prefill(model, "Name a fruit.", system_prompt=system)  # the system prompt's snapshot
    cached, want = ask()
    assert cached > 0 and any(isinstance(g, PaddedPrefill) for g in model.graphs.values())
    blocks, seen = store.num_blocks, []
    monkeypatch.setattr("qwen35_fast.runtime.model.PREFILL_PIECE", 1024)
    huge = store.num_blocks * store.block_size + 2048  # past the store: it grows
    with pytest.raises(Cancel), progress.reporting(_cancel_once_grown(store, seen)):
        prefill_ids(model, [i % 1000 + 10 for i in range(huge)])
    assert seen[0] > blocks and store.num_blocks == blocks
    assert ask(cached) == (cached, want)
    assert all(g.version == store.version for g in model.graphs.values() if isinstance(g, PaddedPrefill))
