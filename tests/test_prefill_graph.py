"""The padded short prefill (runtime/prefill_graph.py, Qwen35Model.forward_prefill_padded): a prompt
padded to its bucket gives what the same prompt gives unpadded (logits, GDN states at the end and at
the cut, K/V), for prompt lengths from 1 to the bucket, on the CPU (fp32: the same math, so 1e-5) with
the pass uncaptured; prefix reuse through it equals a cold prefill and transformers. The captured graph
on CUDA: tests/test_prefill_graph_gpu.py."""
import pytest
import torch
from test_vision_vs_transformers import SMALL, TOWERS, _hf_logits, _image, _make

from qwen35_fast.runtime import generate, prefill, prefill_multimodal
from qwen35_fast.runtime import prefix as prefix_mod
from qwen35_fast.runtime.media import preprocess_images
from qwen35_fast.runtime.model import Cache
from qwen35_fast.runtime.prefill_graph import BUCKETS, PaddedPrefill, bucket_for
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


def test_packed_states_lie_in_one_tensor():
    """GDNState.packed: each kind of state as views of one flat tensor (what the padded pass copies in at
    once), the same values; flat_view finds such a run and nothing else."""
    from qwen35_fast.runtime.model import GDNState, flat_view, pack_views
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


def test_prefill_refuses_what_does_not_fit(model):
    base = _prefix(model, 8, seed=4)
    run = PaddedPrefill(model, BUCKETS[0], capture=False)
    with pytest.raises(ValueError, match="do not fit a bucket"):
        run(_fork(base), list(range(BUCKETS[0] + 1)), None, None, [])
    with pytest.raises(ValueError, match="do not fit a bucket"):
        run(_fork(base), [1, 2, 3], None, None, [1, 2])


def test_reused_system_prompt_through_the_padded_pass(pair, model, uncaptured):
    hf, _ = pair
    prefill(model, "Describe a red circle.", system_prompt=SYSTEM)
    assert not uncaptured  # the first prompt reads everything: nothing cached before it
    second = prefill(model, "Describe a blue square.", system_prompt=SYSTEM)
    assert second.cached_tokens > 0 and set(uncaptured) == {BUCKETS[0]}
    cold = prefill(model, "Describe a blue square.", system_prompt=SYSTEM, use_cache=False)
    assert rel(second.logits, cold.logits) <= 1e-4
    assert rel(second.logits, _hf_logits(hf, second)) <= 1e-4
    assert (generate(model, second, max_new_tokens=8, sampling=GREEDY).token_ids
            == generate(model, cold, max_new_tokens=8, sampling=GREEDY).token_ids)
    # the user turn kept by the padded pass (its cut) serves the same prompt again
    again = prefill(model, "Describe a blue square.", system_prompt=SYSTEM)
    assert again.cached_tokens == second.turn.length
    assert rel(again.logits, cold.logits) <= 1e-4


def test_question_after_a_cached_image_through_the_padded_pass(pair, model, uncaptured):
    hf, _ = pair
    image = preprocess_images(_image(64, 96, 7), SMALL)
    prefill_multimodal(model, "What colour is it?", images=image, system_prompt=SYSTEM)
    second = prefill_multimodal(model, "And what shape?", images=image, system_prompt=SYSTEM)
    assert second.cached_tokens > second.vision.vision_tokens and uncaptured
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
