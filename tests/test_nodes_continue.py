"""Qwen3.5 Continue through its V3 `execute` (ComfyUI importable from COMFYUI_DIR; skipped otherwise), on the
CPU with the demo's tiny checkpoint: follow-up turns after text and image prefills, reuse counts on the
node, the parent left as it was, and the errors a user can cause."""
# ruff: noqa: F811  (the fixtures imported from test_nodes are parameters of the tests)
import dataclasses

import pytest
import torch
from test_nodes import _generate, _prefill, comfy, interrupt_at, loaded, memory_asked, models_dir, pack  # noqa: F401  (fixtures)

from _models import rel

pytestmark = pytest.mark.comfyui


def _continue(pack, pf, prompt="And three animals?", **kw):
    args = dict(prefill=pf, prompt=prompt, images=None, previous_answer=None, thinking=False, max_pixels=0)
    args.update(kw)
    return pack.Qwen35ContinuePrefill.execute(**args)


def _turn_end(pf):
    return pf.prefill.turn.length


def test_schema_and_registration(pack):
    node = pack.Qwen35ContinuePrefill
    assert node in pack.NODES
    schema = node.GET_SCHEMA()
    assert schema.display_name == "Qwen3.5 Continue" and schema.node_id == "Qwen35ContinuePrefill"
    inputs = node.INPUT_TYPES()
    assert set(inputs["required"]) == {"prefill", "prompt", "thinking", "max_pixels"}
    assert set(inputs["optional"]) == {"images", "previous_answer"}
    assert inputs["optional"]["previous_answer"][1]["forceInput"] is True  # a socket for a Generate's text
    assert inputs["required"]["prefill"][0] == "QWEN35_PREFILL"
    assert [o for o in node.RETURN_TYPES] == ["QWEN35_PREFILL"]


def test_two_turn_chat_reads_only_the_new_turn(pack, loaded):
    from qwen35_fast.runtime import prefill_ids
    first = pack.Qwen35TextPrefill.execute(model=loaded, prompt="Name three colours.", system_prompt="Be brief.",
                                           thinking=True, use_chat_template=True)
    s0 = first.ui["qwen35_prefill"][0]
    assert s0["cached_tokens"] == 0 and s0["new_tokens"] == s0["n_tokens"]  # a fresh prefill reuses nothing
    pf = first[0]
    logits_before = pf.prefill.logits.clone()
    answer = _generate(pack, pf, seed=3, max_new_tokens=8)[0][0]
    out = _continue(pack, pf, previous_answer=answer, thinking=False)
    child = out[0]
    s = out.ui["qwen35_prefill"][0]
    assert s["cached_tokens"] == _turn_end(pf) == child.prefill.cached_tokens
    assert s["new_tokens"] == child.prefill.n_tokens - _turn_end(pf) and s["ms"] > 0 and s["backend"] == "torch"
    assert child.model is pf.model and torch.equal(pf.prefill.logits, logits_before)
    one_go = prefill_ids(loaded.model, list(child.prefill.token_ids), use_cache=False)  # cold, not the child's snapshot
    assert one_go.cached_tokens == 0 and rel(child.prefill.logits, one_go.logits) <= 1e-4
    text = loaded.model.tokenizer.decode(child.prefill.token_ids)
    assert text.endswith(f"<|im_start|>assistant\n{answer.strip()}<|im_end|>\n<|im_start|>user\nAnd three animals?"
                         "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert isinstance(_generate(pack, child, seed=3, max_new_tokens=4)[0][0], str)


def test_three_questions_about_one_image(pack, loaded):
    image = torch.rand(1, 96, 128, 3, generator=torch.Generator().manual_seed(4))
    pf = pack.Qwen35MultimodalPrefill.execute(model=loaded, prompt="", images=image, video=None, frames=None,
                                              frame_rate=24.0, mode="all images in one prompt", system_prompt="",
                                              thinking=False, max_pixels=0)[0][0]
    vision_tokens = pf.prefill.vision.vision_tokens
    children = [_continue(pack, pf, prompt=q) for q in ("What colour is it?", "Is it dark?", "Describe it.")]
    for out in children:
        s = out.ui["qwen35_prefill"][0]
        assert s["cached_tokens"] == _turn_end(pf) > vision_tokens  # the image is read once, by the parent
        assert "vision_tokens" not in s  # this turn had no images
    a, b, _ = (c[0].prefill for c in children)
    assert not torch.equal(a.logits, b.logits)
    again = _continue(pack, pf, prompt="What colour is it?")[0].prefill
    # siblings do not change the parent; the same question again starts from its own turn-end snapshot
    assert again.cached_tokens > a.cached_tokens and again.token_ids == a.token_ids
    assert float((again.logits - a.logits).norm() / a.logits.norm()) < 1e-4


def test_follow_up_with_its_own_image(pack, loaded):
    pf = _prefill(pack, loaded, prompt="I will show you a picture next.")
    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(5))
    out = _continue(pack, pf, prompt="Here it is: <image> What is it?", images=image, previous_answer="Ready.")
    s = out.ui["qwen35_prefill"][0]
    assert s["vision_tokens"] > 0 and s["text_tokens"] + s["vision_tokens"] == s["new_tokens"]
    assert s["cached_tokens"] == _turn_end(pf) and s["vision_ms"] > 0
    assert out[0].prefill.cache.rope_delta < 0  # the image's tokens share positions


def test_bad_input_names_the_cause_and_the_fix(pack, loaded, models_dir):
    from qwen35_fast.nodes.types import ModelPrefill
    from qwen35_fast.runtime import Qwen35Error
    raw = pack.Qwen35TextPrefill.execute(model=loaded, prompt="Once upon a time", system_prompt="",
                                         thinking=False, use_chat_template=False)[0]
    with pytest.raises(Qwen35Error, match="use_chat_template"):
        _continue(pack, raw)
    pf = _prefill(pack, loaded)
    with pytest.raises(Qwen35Error, match="empty"):
        _continue(pack, pf, prompt="  ")
    image = torch.rand(1, 64, 64, 3)
    with pytest.raises(Qwen35Error, match=r"names <video>, but this node takes images only; remove <video> .*"
                                          r"Multimodal Prefill"):  # (the node has no video input to connect)
        _continue(pack, pf, prompt="Is this <image> the frame the <video> tag shows?", images=image)
    s = _continue(pack, pf, prompt="What does a <video> tag do?").ui["qwen35_prefill"][0]  # no images: plain text
    assert "vision_tokens" not in s and s["new_tokens"] > 0
    # another loader with the same settings shares the model: another backend setting makes another one
    other = pack.Qwen35ModelLoader.execute(model="qwen35-demo", dtype="fp32", device="cpu", backend="auto",
                                           keep_loaded=True)[0]
    try:
        assert other.model is not loaded.model
        with pytest.raises(Qwen35Error, match="another model"):
            _continue(pack, ModelPrefill(other, pf.prefill))
    finally:
        other.release()
    real = loaded.model.config
    limit = pf.prefill.n_tokens + 2
    loaded.model.config = dataclasses.replace(real, max_position_embeddings=limit)
    try:
        with pytest.raises(Qwen35Error, match=rf"\({_turn_end(pf)} from the earlier turns and \d+ new\) but the "
                                              rf"model takes at most {limit} positions"):
            _continue(pack, pf)
    finally:
        loaded.model.config = real


def test_turn_states_are_parked_with_the_weights(pack, loaded):
    """The state a follow-up restarts from is tracked like the prefill's cache (moved to RAM on unload)."""
    pf = _prefill(pack, loaded)
    child = _continue(pack, pf, previous_answer="Red.")[0]
    tracked = list(loaded.managed._prefill_caches)
    for p in (pf.prefill, child.prefill):
        assert any(t is p.turn for t in tracked) and any(t is p.cache for t in tracked)


@pytest.mark.gpu
def test_continue_after_unload_models_on_the_gpu(pack, models_dir, comfy):
    model = pack.Qwen35ModelLoader.execute(model="qwen35-demo", dtype="bf16", device="cuda", backend="auto",
                                           keep_loaded=True)[0]
    try:
        pf = _prefill(pack, model)
        before = _continue(pack, pf, previous_answer="Red.")[0].prefill.logits
        comfy.mm.unload_all_models()  # "Unload models": the weights and the parked states go to RAM
        turn = pf.prefill.turn
        assert all(t is None or t.device.type == "cpu" for t in turn.conv + turn.ssm)
        model.model.kv.pool.clear()  # else `before`'s own turn-end snapshot serves it (another split of the work)
        after = _continue(pack, pf, previous_answer="Red.")[0]  # loads the weights back by itself
        assert model.managed.current_loaded_device().type == "cuda"
        assert rel(after.prefill.logits, before) < 1e-3
    finally:
        model.release()


def test_every_input_reaches_the_runtime(pack, loaded, monkeypatch):
    import qwen35_fast.runtime as rt
    seen = {}
    real = rt.continue_prefill

    def spy(model, parent, prompt, **kw):
        seen.update(prompt=prompt, **{k: v for k, v in kw.items() if k != "reserve"})
        return real(model, parent, prompt, **kw)
    monkeypatch.setattr(rt, "continue_prefill", spy)
    image = torch.rand(1, 40, 48, 3, generator=torch.Generator().manual_seed(3))
    out = _continue(pack, _prefill(pack, loaded), "And <image>?", images=image, previous_answer="Red.",
                    thinking=True, max_pixels=4096)
    assert seen["prompt"] == "And <image>?" and seen["images"] is image and seen["previous_answer"] == "Red."
    assert seen["thinking"] is True and seen["max_pixels"] == 4096
    assert out[0].prefill.thinking and loaded.model.tokenizer.decode(out[0].prefill.token_ids).endswith("<think>\n")


def test_a_follow_up_with_an_image_asks_model_management_for_its_memory(pack, loaded, memory_asked):
    from qwen35_fast.runtime.memory import prefill_bytes, vision_bytes
    image = torch.rand(1, 64, 96, 3, generator=torch.Generator().manual_seed(6))
    parent = _prefill(pack, loaded)
    memory_asked.clear()
    child = _continue(pack, parent, "And <image>?", images=image)[0].prefill
    assert max(memory_asked) >= (prefill_bytes(loaded.model, child.new_tokens)
                                 + vision_bytes(loaded.model, child.vision.grids))


def test_a_long_follow_up_is_cancelled_between_its_pieces(pack, loaded, comfy, monkeypatch):
    """A follow-up turn read in pieces (8 tokens here): Cancel lands between them, the parent stays as it was and
    the stopped turn leaves no blocks behind; the next run gives the uninterrupted logits."""
    import gc

    from qwen35_fast.runtime import model as model_mod
    parent = _prefill(pack, loaded)
    monkeypatch.setattr(model_mod, "PREFILL_PIECE", 8)
    question = "And three animals, three cities and three rivers, each with one word about it?"
    want = _continue(pack, parent, question)[0].prefill
    assert want.new_tokens > 16
    loaded.model.kv.pool.clear()
    gc.collect()
    free = loaded.model.kv.pool.num_free
    real = comfy.mm.throw_exception_if_processing_interrupted
    checks = interrupt_at(comfy, monkeypatch, 2)  # the second piece's
    with pytest.raises(comfy.mm.InterruptProcessingException):
        _continue(pack, parent, question)
    assert checks["n"] == 2 and loaded.model.kv.pool.num_free == free
    monkeypatch.setattr(comfy.mm, "throw_exception_if_processing_interrupted", real)
    again = _continue(pack, parent, question)[0].prefill
    assert rel(again.logits, want.logits) < 1e-5
