"""Prefix reuse through the paged K/V store (runtime/prefix.py): a prompt that shares its system prompt,
or its system prompt and image, with an earlier one runs only the rest, and gives the logits of a cold
prefill of the same prompt (fp32 on the CPU: 1e-4) and of transformers; images are keyed by content;
snapshots are evicted under the budget; unused pool blocks never reach a result."""
import re

import pytest
import torch
from test_vision_vs_transformers import SMALL, TOWERS, _hf_logits, _image, _make

from qwen35_fast.runtime import Qwen35Error, SamplingParams, generate, prefill, prefill_multimodal
from qwen35_fast.runtime.fingerprint import content_hash
from qwen35_fast.runtime.generate import generation_prompt_ids
from qwen35_fast.runtime.media import preprocess_images, preprocess_video
from qwen35_fast.runtime.multimodal import VIDEO_PAD, VISION_END
from qwen35_fast.runtime.prefix import system_end

from _models import fixed_store, rel

TOL = 1e-4
SYSTEM = "You describe pictures for a painter. Answer in one short sentence, naming colours and shapes."


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("prefix"), TOWERS["d2w32h2"], seed=5)


@pytest.fixture
def model(pair):
    ours = pair[1]
    ours.setup_kv()  # a fresh store: no snapshots of other tests
    return ours


def test_content_hash_is_of_the_values():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(37, 11, generator=g)
    assert content_hash(a) == content_hash(a.clone())
    b = a.clone()
    b[20, 3] = torch.nextafter(b[20, 3], torch.tensor(2.0))  # one ulp of one element
    assert content_hash(b) != content_hash(a)
    assert content_hash(a.view(11, 37)) != content_hash(a)  # the shape is part of it
    assert content_hash(a.double()) != content_hash(a)
    assert content_hash(a[:, 1:]) == content_hash(a[:, 1:].contiguous())  # any strides, odd byte counts
    assert content_hash(torch.zeros(3, dtype=torch.uint8)) != content_hash(torch.zeros(5, dtype=torch.uint8))


def test_the_snapshots_count_in_the_model_size(model):
    """ComfyUI's memory management sees the snapshots' states (on the model's device, beside the pool)."""
    before, held = model.size_bytes(), model.kv.pool.snapshot_bytes
    prefill(model, "Describe a red circle.", system_prompt=SYSTEM)
    assert model.kv.pool.snapshot_bytes > held and model.size_bytes() - before == model.kv.pool.snapshot_bytes - held
    model.kv.pool.clear()
    assert model.size_bytes() == before - held


def test_moving_a_prefills_states_leaves_the_snapshots_where_they_are(model):
    """ManagedModel.park moves a listed prefill's turn to the offload device; the snapshot of the same point
    stays on the model's device (counted there, and resumed from without a copy back). "meta" stands in for
    the offload device on a CPU-only machine."""
    def turn_snapshot(pf):
        (snap,) = [s for s in model.kv.pool.snapshots if s.num_tokens == pf.turn.length]
        return snap

    for _ in range(2):  # saved by the first prefill; resumed from by the second (the same prompt)
        pf = prefill(model, "Describe a red circle.", system_prompt=SYSTEM)
        pf.turn.to("meta")
        assert all(t.is_meta for t in pf.turn.ssm + pf.turn.conv if t is not None)
        snap = turn_snapshot(pf)
        assert all(t.device == model.device for t in snap.states.ssm + snap.states.conv if t is not None)
    assert pf.cached_tokens == pf.turn.length


def test_a_second_question_reuses_the_system_prompt(pair, model):
    hf, _ = pair
    first = prefill(model, "Describe a red circle.", system_prompt=SYSTEM)
    second = prefill(model, "Describe a blue square.", system_prompt=SYSTEM)
    assert first.cached_tokens == 0
    assert second.cached_tokens == system_end(model, second.token_ids) > 10
    cold = prefill(model, "Describe a blue square.", system_prompt=SYSTEM, use_cache=False)
    assert cold.cached_tokens == 0 and cold.token_ids == second.token_ids
    assert rel(second.logits, cold.logits) <= TOL
    assert rel(second.logits, _hf_logits(hf, second)) <= TOL
    assert generate(model, second, max_new_tokens=8).token_ids == generate(model, cold, max_new_tokens=8).token_ids
    # the same prompt again: everything up to its generation prompt comes from the store
    again = prefill(model, "Describe a blue square.", system_prompt=SYSTEM)
    assert again.cached_tokens == second.n_tokens - len(generation_prompt_ids(model, False))
    assert rel(again.logits, cold.logits) <= TOL


def test_a_prompt_read_again_from_where_an_earlier_read_started_gives_its_logits(model):
    """reuse_at_most: the same prompt read again from the prefix its first read started from (its cached_tokens)
    gives that read's logits bit for bit, where the longest prefix (the turn end that read left) gives them within
    rounding only: for a prompt first read cold, and for one that reused the system prompt."""
    for prompt in ("Describe a red circle.", "Describe a green cone."):  # the first cold, the second reusing
        first = prefill(model, prompt, system_prompt=SYSTEM)
        assert first.cached_tokens == (0 if prompt.endswith("circle.") else system_end(model, first.token_ids))
        longest = prefill(model, prompt, system_prompt=SYSTEM)
        assert longest.cached_tokens > first.cached_tokens and not torch.equal(longest.logits, first.logits)
        same = prefill(model, prompt, system_prompt=SYSTEM, reuse_at_most=first.cached_tokens)
        assert same.cached_tokens == first.cached_tokens and torch.equal(same.logits, first.logits)


@pytest.mark.parametrize("bound", ["3", -1, 2.5, True])
def test_a_reuse_bound_that_is_no_token_count_is_named(model, bound):
    """reuse_at_most takes a whole number of tokens: text, a negative or a fraction raised TypeError from the
    comparison inside the prefix match (or bounded nothing), now a Qwen35Error naming it, before any work."""
    with pytest.raises(Qwen35Error, match=rf"reuse_at_most={re.escape(repr(bound))}: it takes a whole number"):
        prefill(model, "Describe a red circle.", system_prompt=SYSTEM, reuse_at_most=bound)
    assert prefill(model, "Describe a red circle.", system_prompt=SYSTEM, reuse_at_most=0).cached_tokens == 0


def test_the_system_prompts_snapshot_ends_after_its_newline(model):
    """The system turn as the template writes it, "<|im_start|>system\\n...<|im_end|>\\n", newline included, is
    what a question with another user prompt reuses."""
    tok = model.tokenizer
    system_turn = tok.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n")
    prefill(model, "Name a colour.", system_prompt=SYSTEM)
    second = prefill(model, "Name an animal.", system_prompt=SYSTEM)
    assert list(second.token_ids[:len(system_turn)]) == system_turn
    assert second.cached_tokens == len(system_turn)
    assert tok.decode(list(second.token_ids[:second.cached_tokens])).endswith(f"{SYSTEM}<|im_end|>\n")


def test_another_system_prompt_reuses_nothing(model):
    prefill(model, "Describe a red circle.", system_prompt=SYSTEM)
    other = prefill(model, "Describe a red circle.", system_prompt=SYSTEM + " Be formal.")
    assert other.cached_tokens == 0


def test_questions_about_one_image_read_it_once(pair, model, monkeypatch):
    hf, _ = pair
    image = preprocess_images(_image(64, 96, 7), SMALL)
    runs = []
    real = type(model.vision).forward
    monkeypatch.setattr(type(model.vision), "forward", lambda self, *a, **k: runs.append(1) or real(self, *a, **k))
    first = prefill_multimodal(model, "What colour is it?", images=image, system_prompt=SYSTEM)
    second = prefill_multimodal(model, "How many shapes are there?", images=image, system_prompt=SYSTEM)
    assert len(runs) == 1  # the tower ran for the first prompt only
    image_end = list(second.token_ids).index(VISION_END) + 1
    assert second.cached_tokens == image_end and second.vision.vision_ms == 0.0
    cold = prefill_multimodal(model, "How many shapes are there?", images=image, system_prompt=SYSTEM,
                              use_cache=False)
    assert rel(second.logits, cold.logits) <= TOL
    assert rel(second.logits, _hf_logits(hf, second, image)) <= TOL
    assert first.media and first.media[0].content_hash == second.media[0].content_hash


def test_a_cached_image_is_keyed_by_its_pixels_and_never_patched_again(model):
    """The second prompt gets the same pixels in a new tensor: the key comes from the source pixels and the
    settings, so it hits, and its patches are never made (nor resized). Other settings (a smaller
    max_pixels) or a changed pixel give another key."""
    raw = _image(64, 96, 7)
    first = prefill_multimodal(model, "What colour is it?", images=preprocess_images(raw, SMALL), system_prompt=SYSTEM)
    again = preprocess_images(raw.clone(), SMALL)
    assert again[0].content_key(content_hash) == first.media[0].content_hash
    second = prefill_multimodal(model, "How many shapes are there?", images=again, system_prompt=SYSTEM)
    assert second.cached_tokens == list(second.token_ids).index(VISION_END) + 1
    assert "pixels" not in vars(again[0])  # the patches were never made
    changed = raw.clone()
    changed[0, 5, 7, 1] += 0.25
    smaller = SMALL.__class__(**{**vars(SMALL), "max_pixels": 32 * 64})
    keys = {first.media[0].content_hash, preprocess_images(changed, SMALL)[0].content_key(content_hash),
            preprocess_images(raw, smaller)[0].content_key(content_hash)}
    assert len(keys) == 3
    # a VisionInput made from patches alone (no source) is keyed by its patches
    bare = again[0].__class__("image", again[0].pixels, again[0].grid, again[0].source_size)
    assert bare.content_key(content_hash) not in keys and "pixels" in vars(again[0])


def test_an_image_tensor_seen_before_is_not_read_again(model, monkeypatch):
    """ComfyUI hands the same IMAGE object to each question about one image: its fingerprint is remembered by
    identity, so the second prompt neither moves its pixels nor hashes them; a change in place through torch
    reads it again (and misses); an inference tensor (what ComfyUI's nodes make) is remembered too."""
    from qwen35_fast.runtime import multimodal
    hashed = []
    monkeypatch.setattr(multimodal, "content_hash", lambda t, backend=None: hashed.append(1) or content_hash(t))
    raw = _image(64, 96, 7)
    first = prefill_multimodal(model, "What colour is it?", images=raw, system_prompt=SYSTEM, max_pixels=SMALL.max_pixels)
    second = prefill_multimodal(model, "How many shapes?", images=raw, system_prompt=SYSTEM, max_pixels=SMALL.max_pixels)
    assert len(hashed) == 1 and second.media[0].content_hash == first.media[0].content_hash
    assert second.cached_tokens == list(second.token_ids).index(VISION_END) + 1
    raw[0, 5, 7, 1] += 0.25  # its version counter moves
    changed = prefill_multimodal(model, "How many shapes?", images=raw, system_prompt=SYSTEM,
                                 max_pixels=SMALL.max_pixels)
    assert len(hashed) == 2 and changed.cached_tokens == system_end(model, changed.token_ids)
    from qwen35_fast.runtime import media
    moved = []
    real_moved = media._moved
    monkeypatch.setattr(media, "_moved", lambda x, device: moved.append(tuple(x.shape)) or real_moved(x, device))
    with torch.inference_mode():
        frozen = torch.cat([_image(64, 96, 8), _image(64, 96, 9), _image(64, 96, 10)])
    keys = [preprocess_images(frozen, SMALL)[1] for _ in range(2)]
    assert keys[0].content_key(content_hash) == keys[1].content_key(content_hash)
    assert moved == [(1, 64, 96, 3)]  # read once, and only that image of the batch (not all of it, for good)
    keys[0].pixels
    assert moved == [(1, 64, 96, 3)] * 4  # the patches: an image at a time
    # a video's sampled frames likewise (hashed a frame at a time); another frame rate samples other frames:
    # another part, hashed
    digests = []

    class Counted(media.StreamedHash):
        def digest(self, shape, dtype):
            digests.append(shape)
            return super().digest(shape, dtype)
    monkeypatch.setattr(media, "StreamedHash", Counted)
    frames = torch.rand(8, 64, 80, 3, generator=torch.Generator().manual_seed(6))
    videos = [preprocess_video(frames, fps, SMALL) for fps in (2.0, 2.0, 4.0)]
    keys = [multimodal.media_spans([VIDEO_PAD] * v.n_tokens() + [VISION_END], [v], 2)[0].content_hash
            for v in videos]
    assert len(digests) == 2 and keys[0] == keys[1] != keys[2]


def test_seen_tensors_are_a_bounded_memo_by_identity():
    from qwen35_fast.runtime.media import SeenTensors
    seen, calls = SeenTensors(size=2), []
    a, b, c = (torch.full((3,), float(i)) for i in range(3))
    for t in (a, b, a, c, a, b):  # b is the least recently used when c comes
        seen.get(t, 0, lambda t=t: calls.append(t) or str(float(t[0])))
    assert [float(t[0]) for t in calls] == [0.0, 1.0, 2.0, 1.0]
    assert seen.get(a, 1, lambda: "other part") == "other part"  # another part of the same tensor


def test_another_image_is_not_reused(model):
    a = preprocess_images(_image(64, 96, 7), SMALL)
    b = preprocess_images(_image(64, 96, 8), SMALL)  # same size, other pixels
    prefill_multimodal(model, "What colour is it?", images=a, system_prompt=SYSTEM)
    other = prefill_multimodal(model, "What colour is it?", images=b, system_prompt=SYSTEM)
    assert other.cached_tokens == system_end(model, other.token_ids)  # the system prompt only
    cold = prefill_multimodal(model, "What colour is it?", images=b, system_prompt=SYSTEM, use_cache=False)
    assert rel(other.logits, cold.logits) <= TOL


def test_unused_blocks_never_reach_a_result(model):
    """Every pool block no sequence holds is NaN: a reused prefix, a generation after it and a follow-up
    read only their own blocks."""
    first = prefill(model, "Describe a red circle.", system_prompt=SYSTEM)
    held = {b for b in range(model.kv.num_blocks) if model.kv.pool.refcount[b] > 0}
    free = torch.tensor([b for b in range(model.kv.num_blocks) if b not in held], dtype=torch.long)
    model.kv.k[:, free] = float("nan")
    model.kv.v[:, free] = float("nan")
    second = prefill(model, "Describe a blue square.", system_prompt=SYSTEM)
    assert second.cached_tokens > 0 and torch.isfinite(second.logits).all()
    out = generate(model, second, max_new_tokens=70)  # past a block boundary (64)
    assert out.n_tokens == 70 or out.finish_reason == "stop"
    assert torch.isfinite(first.logits).all()
    # the tokens are those after a cold prefill of the same prompt (NaN read anywhere would change them)
    cold = prefill(model, "Describe a blue square.", system_prompt=SYSTEM, use_cache=False)
    assert cold.cached_tokens == 0 and rel(second.logits, cold.logits) <= TOL
    assert out.token_ids == generate(model, cold, max_new_tokens=70).token_ids


def test_snapshots_are_evicted_under_the_budget_and_a_huge_prompt_is_named(model):
    from qwen35_fast.runtime.kv_pool import model_sizes
    from qwen35_fast.runtime.memory import state_bytes
    kv_block = model_sizes(model.config, model.kv.block_size, model.dtype.itemsize)["kv_block_bytes"]
    model.setup_kv(int(16 * kv_block / 0.75) + 1)  # 16 blocks of K/V
    store = model.kv
    store.pool.snapshot_budget_bytes = int(2.5 * state_bytes(model))  # and two snapshots
    assert store.num_blocks == 16
    firsts = []
    for i in range(6):
        pf = prefill(model, f"Question number {i}: describe shape {i}.", system_prompt=SYSTEM + f" ({i})")
        assert pf.cached_tokens == 0
        assert store.pool.snapshot_bytes <= store.pool.snapshot_budget_bytes and len(store.pool.snapshots) <= 2
        firsts.append(pf.token_ids)
    # the latest prompt's snapshots stayed, the first one's went
    keys = {s.num_tokens for s in store.pool.snapshots}
    assert store.pool.match(firsts[-1]) is not None and store.pool.match(firsts[0]) is None and keys
    del pf
    with pytest.raises(Qwen35Error, match=r"K/V cache: .* needs \d+ K/V blocks .* the whole pool holds 16 blocks"):
        prefill(model, "word " * (16 * store.block_size + 10))
    assert prefill(model, "Describe a red circle.").n_tokens > 0  # still works after the error


def test_a_prompt_longer_than_the_pool_is_named_so_with_its_prefix_cached(model):
    """A prompt that cannot fit the whole pool says so, also once its system prompt is cached: it was blamed on
    prefills still alive (there were none; the block it counted was the prompt's own copy of its prefix's last
    block) with the advice to free ComfyUI's node cache, and its need under-counted."""
    store = fixed_store(model, 8)
    import gc
    pf = prefill(model, "Hello there.", system_prompt=SYSTEM)
    del pf
    gc.collect()
    assert store.pool.snapshots  # the system prompt is cached
    blocks = -(-len(prefill_ids_of(model, "word " * (8 * store.block_size), SYSTEM)) // store.block_size)
    with pytest.raises(Qwen35Error, match=rf"needs {blocks} K/V blocks .* the whole pool holds 8 blocks") as e:
        prefill(model, "word " * (8 * store.block_size), system_prompt=SYSTEM)
    assert "alive" not in str(e.value)
    assert store.pool.num_free + sum(1 for r in store.pool.refcount if r) == 8  # nothing lost
    assert prefill(model, "Describe a red circle.", system_prompt=SYSTEM).cached_tokens > 0  # and reuse works


def test_a_question_after_a_cached_system_prompt_fits_a_full_one_block_store(model):
    """A short system prompt and a question fit one block: the system prompt's reuse point and the prompt's own
    end lie in it. The next question resumes from the first and writes over the second's tokens; in a full store
    of one block that cannot grow it was refused ("forking a sequence needs 1 K/V blocks but only 0 ... are
    free") though it fits read cold. The turn's snapshot goes (as a cold read would evict it), the block is taken
    over, and the logits are a cold read's."""
    import gc
    store = fixed_store(model, 1)
    cold = prefill(model, "Name a colour.", system_prompt="Be brief.", use_cache=False).logits
    gc.collect()
    first = prefill(model, "Name an animal.", system_prompt="Be brief.")
    assert first.n_tokens < store.block_size and len(store.pool.snapshots) >= 2
    del first
    gc.collect()
    second = prefill(model, "Name a colour.", system_prompt="Be brief.")
    assert second.cached_tokens > 0
    assert rel(second.logits, cold) < 1e-5


def prefill_ids_of(model, prompt, system_prompt):
    from qwen35_fast.runtime import encode_prompt
    return encode_prompt(model, prompt, system_prompt=system_prompt)


def test_an_answer_that_fits_a_fixed_pool_is_not_refused_for_the_rounded_room(model, monkeypatch):
    """generate reserves room in steps of KV_STEP positions, capped at max_new_tokens; on a fixed pool short of
    a whole step it takes the one block the next token needs (a long max_new_tokens failed an answer that fit:
    an error at the first block boundary instead of the answer)."""
    import dataclasses
    monkeypatch.setattr(model, "config", dataclasses.replace(model.config, eos_token_ids=()))  # answers run on
    monkeypatch.setattr(model.tokenizer, "eos_token_ids", ())
    store = fixed_store(model, 4)
    pf = prefill(model, "Describe a lighthouse at dusk.", use_chat_template=False, use_cache=False)
    # positions the pool has for the answer: the prefill's full blocks shared, its partly filled one copied, the
    # free ones (the last token's K/V is never written: room + 1 tokens fit)
    room = (pf.n_tokens // store.block_size + store.pool.num_free) * store.block_size - pf.n_tokens
    assert room > 64
    greedy = SamplingParams(do_sample=False)
    fits = generate(model, pf, max_new_tokens=room + 1, sampling=greedy)
    assert fits.n_tokens == room + 1
    seen = []
    with pytest.raises(Qwen35Error, match=rf"K/V cache: .*The answer had {room + 1} tokens"):
        generate(model, pf, max_new_tokens=room + 400, sampling=greedy, on_token=lambda t, n, m: seen.append(n))
    assert len(seen) == room + 1  # refused only where the pool ends: the same tokens streamed first


def test_a_store_that_grows_keeps_its_prefix_cache(model, monkeypatch):
    """An auto store too small for a prompt grows; the snapshots of live prefills' system prompt, which could
    free no block, are kept, so the next question with that system prompt still reuses it."""
    from qwen35_fast.runtime.kv_pool import model_sizes
    block = model_sizes(model.config, 64, model.dtype.itemsize)["kv_block_bytes"]
    monkeypatch.setenv("QWEN35_CPU_KV_BYTES", str(int(4 * block / 0.75) + 1))  # an auto store of 4 blocks
    store = model.setup_kv()
    a = prefill(model, "Describe a red circle.", system_prompt=SYSTEM)
    b = prefill(model, "Describe a blue square.", system_prompt=SYSTEM)
    assert store.num_blocks == 4 and b.cached_tokens > 0
    big = prefill(model, "Describe, in order, " + ", ".join(f"shape {i}" for i in range(30)) + ".", use_cache=False)
    assert store.num_blocks > 4 and store.pool.blocks_for(big.n_tokens) > store.pool.num_free
    c = prefill(model, "Describe a green triangle.", system_prompt=SYSTEM)
    assert c.cached_tokens == b.cached_tokens and a.n_tokens > 0

@pytest.mark.parametrize("value", ["1G", "-5", "0", "2.5e9"])
def test_a_bad_cpu_kv_budget_names_the_variable(model, monkeypatch, value):
    """QWEN35_CPU_KV_BYTES caps the auto budget off CUDA: a value that is no whole number of bytes above 0 is
    an error naming the variable, the value and what it takes; empty is unset."""
    from qwen35_fast.runtime.kv_store import default_budget_bytes
    monkeypatch.setenv("QWEN35_CPU_KV_BYTES", value)
    with pytest.raises(Qwen35Error, match=rf"QWEN35_CPU_KV_BYTES='{value}'.*whole number of bytes above 0"):
        default_budget_bytes(model.config, torch.device("cpu"))
    monkeypatch.setenv("QWEN35_CPU_KV_BYTES", str(10 ** 15))
    want = default_budget_bytes(model.config, torch.device("cpu"))  # what AUTO_TOKENS need: no cap
    monkeypatch.setenv("QWEN35_CPU_KV_BYTES", f" {want // 2} ")
    assert default_budget_bytes(model.config, torch.device("cpu")) == want // 2
    monkeypatch.setenv("QWEN35_CPU_KV_BYTES", "")  # empty: the default cap
    monkeypatch.setattr("qwen35_fast.runtime.kv_store.CPU_DEFAULT_BYTES", want // 3)
    assert default_budget_bytes(model.config, torch.device("cpu")) == want // 3


def test_the_auto_store_grows_for_a_long_prompt_and_answer(model, monkeypatch):
    """The auto budget starts small here (a few blocks) and grows when a prompt or an answer needs more:
    block ids stay, so prefills made before keep their K/V; a fixed budget names the shortage instead."""
    from qwen35_fast.runtime.kv_pool import model_sizes
    block = model_sizes(model.config, 64, model.dtype.itemsize)["kv_block_bytes"]
    monkeypatch.setenv("QWEN35_CPU_KV_BYTES", str(int(3 * block / 0.75) + 1))
    store = model.setup_kv()
    assert store.growable and store.num_blocks == 3
    short = prefill(model, "Describe a red circle.", system_prompt=SYSTEM)
    kv_before = [t.clone() for pair in short.cache.gather_kv() for t in pair]
    long_prompt = "Describe, in order, " + ", ".join(f"shape {i}" for i in range(120)) + "."
    grown = prefill(model, long_prompt, use_cache=False)
    assert store.version >= 1 and store.num_blocks * 64 >= grown.n_tokens + short.n_tokens
    assert all(torch.equal(a, b) for a, b in zip(kv_before, [t for p in short.cache.gather_kv() for t in p]))
    out = generate(model, grown, max_new_tokens=150)
    fixed = model.setup_kv(1 << 26)  # room for all of it, fixed
    assert not fixed.growable
    cold = prefill(model, long_prompt, use_cache=False)
    assert rel(grown.logits, cold.logits) <= TOL
    assert generate(model, cold, max_new_tokens=150).token_ids == out.token_ids
