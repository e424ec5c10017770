"""The padded short prefill (runtime/prefill_graph.py, Qwen35Model.forward_prefill_padded): a prompt
padded to its bucket gives what the same prompt gives unpadded (logits, GDN states at the end and at
the cut, K/V), for prompt lengths from 1 to the bucket, on the CPU (fp32: the same math, so 1e-5) with
the pass uncaptured; prefix reuse through it equals a cold prefill and transformers. The captured graph
on CUDA: tests/test_prefill_graph_gpu.py."""
import pytest
import torch
from test_vision_vs_transformers import SMALL, TOWERS, _hf_logits, _image, _make

from qwen35_fast.runtime import generate, prefill, prefill_multimodal
from qwen35_fast.runtime import prefill_graph as prefill_graph_mod
from qwen35_fast.runtime import prefix as prefix_mod
from qwen35_fast.runtime.kv_pool import model_sizes
from qwen35_fast.runtime.media import preprocess_images
from qwen35_fast.runtime.model import Cache
from qwen35_fast.runtime.prefill_graph import BUCKETS, CAPTURE_FAILED, PaddedPrefill, bucket_for, padded_prefill
from qwen35_fast.runtime.prefix import system_end
from qwen35_fast.runtime.sampling import SamplingParams

from _models import rel

SYSTEM = "You describe pictures for a painter. Answer in one short sentence."
GREEDY = SamplingParams(do_sample=False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("padded"), TOWERS["d2w32h2"], seed=9)


@pytest.fixture
def model(pair):
    ours = pair[1]
    ours.setup_kv()
    return ours


@pytest.fixture
def uncaptured(monkeypatch):
    """prefix.prefill_reusing takes the padded pass on the CPU (uncaptured, one per bucket, as on CUDA)."""
    made = {}

    def padded(model, cached, n):
        b = bucket_for(n)
        if b is None or cached == 0:
            return None
        if b not in made or made[b].version != model.kv.version or made[b].store is not model.kv:
            made[b] = PaddedPrefill(model, b, capture=False)
        return made[b]

    monkeypatch.setattr(prefix_mod, "padded_prefill", padded)
    return made


def _count_runs(monkeypatch) -> list:
    """The token counts of the padded passes run from here on (a pass made is not a pass run: it may be made and the
    prompt still run eagerly, where the store has no room for its filler)."""
    runs, real = [], PaddedPrefill.__call__
    monkeypatch.setattr(PaddedPrefill, "__call__", lambda self, cache, ids, *a: runs.append(len(ids)) or
                        real(self, cache, ids, *a))
    return runs


def test_packed_states_lie_in_one_tensor():
    """GDNState.packed: each kind of state as views of one flat tensor (what the padded pass copies in at
    once), the same values; flat_view finds such a run and nothing else."""
    from qwen35_fast.runtime.model import GDNState
    from qwen35_fast.runtime.packed import flat_view, pack_views
    g = torch.Generator().manual_seed(3)
    conv = [torch.randn(2, 5, 3, generator=g), None, torch.randn(2, 5, 3, generator=g)]
    ssm = [torch.randn(2, 4, 4, generator=g), None, torch.randn(2, 4, 4, generator=g)]
    st = GDNState(conv, ssm, 17, 2)
    assert flat_view(conv) is None  # separate tensors
    p = st.packed()
    assert (p.length, p.rope_delta) == (17, 2) and p.conv[1] is None and p.ssm[1] is None
    for a, b in zip(conv + ssm, p.conv + p.ssm):
        assert (a is None and b is None) or torch.equal(a, b)
    flat = flat_view(p.ssm)
    assert flat is not None and torch.equal(flat, torch.cat([ssm[0].reshape(-1), ssm[2].reshape(-1)]))
    assert p.packed() is p
    assert flat_view(list(reversed(p.ssm))) is None  # out of order
    views = pack_views([torch.ones(2, 2), torch.zeros(3)])
    assert flat_view(views[:1]) is not None and flat_view([views[0], views[0]]) is None


def test_buckets():
    assert [bucket_for(n) for n in (1, BUCKETS[0], BUCKETS[0] + 1, BUCKETS[-1])] == [
        BUCKETS[0], BUCKETS[0], BUCKETS[1], BUCKETS[-1]]
    assert bucket_for(BUCKETS[-1] + 1) is None


def _prefix(model, n: int, seed: int) -> Cache:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=g)
    cache = model.new_cache(1, n)
    model.forward_prefill(ids, cache)
    return cache


def _fork(cache: Cache) -> Cache:
    return cache.clone()


@pytest.mark.parametrize("n,cut", [(1, None), (2, 1), (13, 7), (63, 62), (64, 1), (64, None), (70, 40)])
@pytest.mark.parametrize("start", [5, 64, 100])
def test_padded_equals_unpadded(model, n, cut, start):
    torch.manual_seed(1000 * n + start)
    base = _prefix(model, start, seed=start)
    ids = torch.randint(0, model.config.vocab_size, (n,)).tolist()
    keep = [cut] if cut else []
    eager, padded = _fork(base), _fork(base)
    x = torch.tensor([ids])
    if keep:
        want, want_kept = model.forward_prefill_kept(x, eager, keep)
    else:
        want, want_kept = model.forward_prefill(x, eager), []
    # poison the store's free blocks: the filler's K/V must land only in this sequence's own blocks
    used = {*eager.seq.blocks, *base.seq.blocks, *padded.seq.blocks}
    free = [b for b in range(model.kv.num_blocks) if b not in used]
    model.kv.k[:, free] = float("nan")
    model.kv.v[:, free] = float("nan")
    run = PaddedPrefill(model, bucket_for(n), capture=False)
    got, got_kept = run(padded, ids, None, None, keep)
    assert padded.length == eager.length == start + n
    assert rel(got, want) <= 1e-5
    for a, b in zip(padded.conv + padded.ssm, eager.conv + eager.ssm):
        assert (a is None) == (b is None) and (a is None or rel(a, b) <= 1e-5)
    assert len(got_kept) == len(want_kept)
    for g, w in zip(got_kept, want_kept):
        assert g.length == w.length and g.rope_delta == w.rope_delta
        for a, b in zip(g.conv + g.ssm, w.conv + w.ssm):
            assert (a is None) == (b is None) and (a is None or rel(a, b) <= 1e-5)
    for (ka, va), (kb, vb) in zip(padded.gather_kv(), eager.gather_kv()):
        assert rel(ka, kb) <= 1e-6 and rel(va, vb) <= 1e-6
    # the next tokens overwrite the filler: decoding after both gives the same logits
    for tok in (3, 4):
        a = model.forward_decode(torch.tensor([tok]), padded)
        b = model.forward_decode(torch.tensor([tok]), eager)
        assert torch.isfinite(a).all() and rel(a, b) <= 1e-5


def test_one_pass_serves_many_lengths(model):
    base = _prefix(model, 40, seed=3)
    run = PaddedPrefill(model, BUCKETS[0], capture=False)
    for n in (BUCKETS[0], 3, 17):  # the buffers of a longer call never leak into a shorter one
        ids = list(range(10, 10 + n))
        a, b = _fork(base), _fork(base)
        got, _ = run(a, ids, None, None, [])
        want = model.forward_prefill(torch.tensor([ids]), b)
        assert rel(got, want) <= 1e-5


def test_a_pass_for_an_older_store_refuses(model):
    """A pass reads the store's tensors as they were when it was made: after the store grows it must not run."""
    base = _prefix(model, 8, seed=5)
    run = PaddedPrefill(model, BUCKETS[0], capture=False)
    model.kv.grow(model.kv.num_blocks + 4)
    with pytest.raises(RuntimeError, match="grew or changed"):
        run(_fork(base), [1, 2, 3], None, None, [])


def test_reuse_after_the_store_grows(pair, model, uncaptured):
    """Making room for the bucket may grow the store: the prompt then runs on a pass for the grown store."""
    prefill(model, "Describe a red circle.", system_prompt=SYSTEM)
    held = model.kv.pool.allocate(model.kv.pool.num_free)  # a full pool: the next prompt's blocks grow it
    version = model.kv.version
    second = prefill(model, "Describe a blue square.", system_prompt=SYSTEM)
    assert model.kv.version > version and uncaptured[BUCKETS[0]].version == model.kv.version
    model.kv.pool.release(held)
    cold = prefill(model, "Describe a blue square.", system_prompt=SYSTEM, use_cache=False)
    assert second.cached_tokens > 0 and rel(second.logits, cold.logits) <= 1e-4


def test_a_kept_pass_counts_in_the_model_size(model):
    """Its buffers (on CUDA also its graph's memory) are part of what ComfyUI's memory management sees."""
    base = _prefix(model, 8, seed=6)
    before = model.size_bytes()
    run = model.graphs["test"] = PaddedPrefill(model, BUCKETS[0], capture=False)
    run(_fork(base), [1, 2, 3], None, None, [])
    states = sum(t.numel() * t.element_size() for t in base.conv + base.ssm if t is not None)
    assert model.size_bytes() - before == run.nbytes >= states
    model.to("cpu")  # a move drops the passes (they read the weights' addresses)
    assert not model.graphs and model.size_bytes() == before


def test_a_padded_prefill_keeps_only_the_blocks_its_tokens_need(model, uncaptured):
    """The filler's room (up to the bucket's end) goes back after the pass: a cached prefill holds the blocks
    of its tokens, as the eager pass leaves it, not those of its bucket."""
    prefill(model, "Describe a red circle.", system_prompt=SYSTEM * 2)
    second = prefill(model, "Describe a blue square.", system_prompt=SYSTEM * 2)
    pool = model.kv.pool
    assert second.cached_tokens > 0 and uncaptured[BUCKETS[0]].conv is not None  # the padded pass ran
    assert pool.blocks_for(second.cached_tokens + BUCKETS[0]) > pool.blocks_for(second.n_tokens)  # filler past it
    assert len(second.cache.seq.blocks) == pool.blocks_for(second.n_tokens)
    cold = prefill(model, "Describe a blue square.", system_prompt=SYSTEM * 2, use_cache=False)
    assert rel(second.logits, cold.logits) <= 1e-4


def test_a_prompt_without_room_for_the_filler_runs_eagerly(model, uncaptured):
    """On a fixed budget a reused prompt that fits as it is, but not with its bucket's filler, runs eagerly
    instead of being refused, and evicts no snapshot for it."""
    prompt, system = "Describe a blue square.", SYSTEM * 5  # a cached system prompt of 64+ tokens
    cold = prefill(model, prompt, system_prompt=system, use_cache=False)
    block = model_sizes(model.config, 64, model.dtype.itemsize)["kv_block_bytes"]
    store = model.setup_kv(int(3 * block / 0.75) + 10)  # three blocks of 64 positions
    assert store.num_blocks == 3 and not store.growable
    first = prefill(model, "Describe a red circle.", system_prompt=system)
    assert 64 < first.n_tokens <= 2 * 64 and store.pool.num_free == 1
    head = store.pool.match(first.token_ids, max_tokens=system_end(model, first.token_ids))
    states = [t.clone() for t in head.states.conv + head.states.ssm if t is not None]
    second = prefill(model, prompt, system_prompt=system)
    assert 0 < second.cached_tokens and store.pool.blocks_for(second.cached_tokens + BUCKETS[0]) == 3
    assert uncaptured[BUCKETS[0]].conv is None and rel(second.logits, cold.logits) <= 1e-4  # the eager pass ran
    # the system prompt's snapshot (the one the hit came from) was not evicted looking for the filler's room, nor
    # changed by the eager pass, which ran on its states uncopied (the graphed pass would have copied them)
    assert store.pool.match(cold.token_ids, max_tokens=second.cached_tokens) is head
    assert second.cached_tokens == head.num_tokens
    assert all(torch.equal(a, b) for a, b in zip(states, [t for t in head.states.conv + head.states.ssm if t is not None]))


def test_stale_passes_are_dropped_when_a_pass_is_looked_up(model):
    """A pass made for an older store (before it grew, or another store) can never run again: looking up any
    pass drops every such one, so its buffers are freed and no longer counted in the model's size."""
    base = _prefix(model, 8, seed=7)
    before = model.size_bytes()
    old = model.graphs[("prefill", BUCKETS[1])] = PaddedPrefill(model, BUCKETS[1], capture=False)
    old(_fork(base), [1, 2, 3], None, None, [])
    assert model.size_bytes() - before == old.nbytes > 0
    model.kv.grow(model.kv.num_blocks + 4)
    grown = model.size_bytes()
    current = model.graphs[("prefill", BUCKETS[0])] = PaddedPrefill(model, BUCKETS[0], capture=False)
    current(_fork(base), [1, 2, 3], None, None, [])
    padded_prefill(model, 8, 3)  # the lookup of another bucket (on the CPU it answers None)
    assert model.graphs == {("prefill", BUCKETS[0]): current}
    assert model.size_bytes() == grown - old.nbytes + current.nbytes
    model.setup_kv()  # a new store: the rest goes too
    padded_prefill(model, 8, 3)
    assert not model.graphs


def test_a_prompt_that_takes_no_padded_pass_drops_the_stale_ones_too(model):
    """A cold chat prompt with a system prompt (two reuse points) or an image never looks a pass up: the passes of
    a store that grew since go all the same, at the start of every prompt."""
    model.graphs[("prefill", BUCKETS[1])] = PaddedPrefill(model, BUCKETS[1], capture=False)
    model.kv.grow(model.kv.num_blocks + 4)
    prefill(model, "Question: " + "word " * 40, system_prompt=SYSTEM)
    assert ("prefill", BUCKETS[1]) not in model.graphs


def test_a_move_that_fails_part_way_leaves_no_graph_over_the_weights(pair):
    """The kept graphs read the weights where they are: they go before a move, so one that fails part-way (out of
    RAM, some weights moved and freed, the model still reporting its device) leaves none to replay."""
    _, ours = pair
    ours.graphs[("prefill", 64)] = "kept graph"
    ours.vision._graph = "tower graph"
    calls = []

    def fails_at_the_fifth(t):
        calls.append(1)
        if len(calls) == 5:
            raise torch.OutOfMemoryError("out of memory part-way through the move")
        return t
    with pytest.raises(torch.OutOfMemoryError):
        ours._apply(fails_at_the_fifth)
    assert ours.graphs == {} and ours.vision._graph is None


def test_a_failed_capture_keeps_only_a_marker(model, monkeypatch):
    """A capture that fails (not for memory) leaves the pass to finish this call uncaptured, and in
    model.graphs only a marker that the bucket failed: no buffers kept or counted; a later lookup keeps it."""
    def fail(dev, run):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(prefill_graph_mod, "capture_graph", fail)
    monkeypatch.setattr(prefill_graph_mod, "_warned", True)  # no warning in the log
    base = _prefix(model, 8, seed=8)
    before = model.size_bytes()
    key = ("prefill", BUCKETS[0])
    run = model.graphs[key] = PaddedPrefill(model, BUCKETS[0], capture=True)
    ids = [5, 6, 7, 8]
    got, _ = run(_fork(base), ids, None, None, [])
    want = model.forward_prefill(torch.tensor([ids]), _fork(base))
    assert rel(got, want) <= 1e-5
    assert model.graphs == {key: CAPTURE_FAILED} and model.size_bytes() == before
    model.kv.grow(model.kv.num_blocks + 2)
    padded_prefill(model, 8, 3)
    assert model.graphs == {key: CAPTURE_FAILED}


def test_prefill_refuses_what_does_not_fit(model):
    base = _prefix(model, 8, seed=4)
    run = PaddedPrefill(model, BUCKETS[0], capture=False)
    with pytest.raises(ValueError, match="do not fit a bucket"):
        run(_fork(base), list(range(BUCKETS[0] + 1)), None, None, [])
    with pytest.raises(ValueError, match="do not fit a bucket"):
        run(_fork(base), [1, 2, 3], None, None, [1, 2])


def test_reused_system_prompt_through_the_padded_pass(pair, model, uncaptured, monkeypatch):
    hf, _ = pair
    runs = _count_runs(monkeypatch)
    prefill(model, "Describe a red circle.", system_prompt=SYSTEM)
    assert not uncaptured and not runs  # the first prompt reads everything: nothing cached before it
    second = prefill(model, "Describe a blue square.", system_prompt=SYSTEM)
    assert second.cached_tokens > 0 and set(uncaptured) == {BUCKETS[0]}
    assert runs == [second.n_tokens - second.cached_tokens]  # the rest of the prompt ran in the padded pass
    cold = prefill(model, "Describe a blue square.", system_prompt=SYSTEM, use_cache=False)
    assert rel(second.logits, cold.logits) <= 1e-4
    assert rel(second.logits, _hf_logits(hf, second)) <= 1e-4
    assert (generate(model, second, max_new_tokens=8, sampling=GREEDY).token_ids
            == generate(model, cold, max_new_tokens=8, sampling=GREEDY).token_ids)
    # the user turn kept by the padded pass (its cut) serves the same prompt again
    again = prefill(model, "Describe a blue square.", system_prompt=SYSTEM)
    assert again.cached_tokens == second.turn.length
    assert rel(again.logits, cold.logits) <= 1e-4


def test_question_after_a_cached_image_through_the_padded_pass(pair, model, uncaptured, monkeypatch):
    hf, _ = pair
    image = preprocess_images(_image(64, 96, 7), SMALL)
    prefill_multimodal(model, "What colour is it?", images=image, system_prompt=SYSTEM)
    runs = _count_runs(monkeypatch)
    second = prefill_multimodal(model, "And what shape?", images=image, system_prompt=SYSTEM)
    assert second.cached_tokens > second.vision.vision_tokens and uncaptured
    assert runs == [second.n_tokens - second.cached_tokens]  # the question ran in the padded pass
    cold = prefill_multimodal(model, "And what shape?", images=image, system_prompt=SYSTEM, use_cache=False)
    assert rel(second.logits, cold.logits) <= 1e-4  # rotary positions after the image continue
    assert rel(second.logits, _hf_logits(hf, second, [image[0]])) <= 1e-4
    assert (generate(model, second, max_new_tokens=6, sampling=GREEDY).token_ids
            == generate(model, cold, max_new_tokens=6, sampling=GREEDY).token_ids)


def test_a_kept_pass_does_not_keep_the_model_alive(tmp_path):
    """model.graphs holds its passes; a pass pointing back at the model strongly made a cycle, and a dropped
    model (weights, K/V store) stayed in memory until Python's next full collection (ComfyUI logs that as a
    potential memory leak)."""
    import gc
    import weakref

    from qwen35_fast.runtime import load_model

    from _models import make_hf_model
    make_hf_model(tmp_path, seed=3)
    model = load_model(tmp_path, dtype="fp32", device="cpu")
    base = _prefix(model, 8, seed=6)
    model.graphs["test"] = PaddedPrefill(model, BUCKETS[0], capture=False)
    model.graphs["test"](_fork(base), [1, 2, 3], None, None, [])
    gone = weakref.ref(model)
    gc.disable()
    try:
        del model, base
        assert gone() is None
    finally:
        gc.enable()
