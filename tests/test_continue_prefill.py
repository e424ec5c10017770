"""Follow-up turns (runtime.continue_prefill) against the whole conversation prefilled in one go: the
token ids against Qwen3.5's real chat template, the logits against transformers'
Qwen3_5ForConditionalGeneration (fp32, random weights) and against our own one-shot prefill, with
images in the first turn and / or the follow-up (M-RoPE positions continue), thinking on and off."""
import dataclasses
import re

import pytest
import torch
from test_chat import template  # noqa: F401  (fixture)
from test_vision_vs_transformers import SMALL, TOWERS, _hf_inputs, _hf_logits, _image, _make

from qwen35_fast.runtime import Qwen35Error, continue_prefill, generate, prefill, prefill_ids, prefill_multimodal
from qwen35_fast.runtime.media import preprocess_images
from qwen35_fast.runtime.multimodal import IMAGE_PAD, VISION_END
from qwen35_fast.runtime.prefix import system_end
from qwen35_fast.runtime.sampling import SamplingParams

from _models import rel

TOL = 1e-4
SYSTEM = "Be brief."
IMAGE = {"type": "image"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("conv"), TOWERS["d2w32h2"], seed=21)


def _render(template, messages, thinking):  # noqa: F811
    return template.render(messages=[{"role": "system", "content": SYSTEM}, *messages], add_generation_prompt=True,
                           enable_thinking=thinking)


def _collapse(text):
    """One <|image_pad|> per image, as the template writes it (the processor expands them)."""
    return re.sub(r"(<\|image_pad\|>)+", "<|image_pad|>", text)


def _parent_unchanged(pf, before):
    ids, logits, k = before
    assert pf.token_ids == ids and torch.equal(pf.logits, logits)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(pf.cache.gather_kv(), k))


def _state(pf):
    return pf.token_ids, pf.logits.clone(), pf.cache.gather_kv()


@pytest.mark.parametrize("answer", [None, "Red, green and blue."], ids=["no-answer", "answer"])
@pytest.mark.parametrize("parent_thinking,thinking", [(False, False), (True, True), (True, False), (False, True)])
def test_text_follow_up_equals_the_whole_conversation(template, pair, answer, parent_thinking,  # noqa: F811
                                                      thinking):
    hf, ours = pair
    ours.kv.pool.clear()  # no snapshots of the other cases: the follow-up restarts at its parent's turn end
    parent = prefill(ours, "Name three colours.", system_prompt=SYSTEM, thinking=parent_thinking)
    before = _state(parent)
    child = continue_prefill(ours, parent, "And three animals?", previous_answer=answer, thinking=thinking)
    messages = [{"role": "user", "content": "Name three colours."}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": "And three animals?"})
    want = _render(template, messages, thinking)
    tok = ours.tokenizer
    assert tok.decode(child.token_ids) == want
    assert list(child.token_ids) == tok.encode(want)  # tokenised as the whole rendered text is
    # the parent's generation prompt is not part of the conversation: the restart is before it
    gen = len(tok.encode("<|im_start|>assistant\n<think>\n" + ("" if parent_thinking else "\n</think>\n\n")))
    assert child.cached_tokens == parent.n_tokens - gen
    assert child.new_tokens == child.n_tokens - child.cached_tokens > 0 and child.ms > 0
    assert child.token_ids[:child.cached_tokens] == parent.token_ids[:child.cached_tokens]
    err_hf = rel(child.logits, _hf_logits(hf, child))
    one_go = prefill_ids(ours, list(child.token_ids), use_cache=False)  # cold: not the child's own snapshot
    err_own = rel(child.logits, one_go.logits)
    assert one_go.cached_tokens == 0
    assert err_hf <= TOL and err_own <= TOL, (err_hf, err_own)
    _parent_unchanged(parent, before)


def test_fresh_prefills_report_no_reuse(pair):
    _, ours = pair
    pf = prefill(ours, "Hello.")
    assert pf.cached_tokens == 0 and pf.new_tokens == pf.n_tokens and pf.turn is not None
    assert pf.turn.length == pf.n_tokens - len(ours.tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n"))
    raw = prefill(ours, "Hello.", use_chat_template=False)
    assert raw.turn is None and raw.cached_tokens == 0


def test_raw_text_with_an_image_opens_no_thinking_block(pair):
    """Without the chat template nothing opens <think>: thinking on leaves the whole output the answer, as
    for a text prompt."""
    _, ours = pair
    pf = prefill_multimodal(ours, "Describe <image>.", images=_image(64, 64, 0), thinking=True,
                            use_chat_template=False)
    assert not pf.thinking and pf.vision.vision_tokens > 0
    out = generate(ours, pf, max_new_tokens=4, sampling=SamplingParams(do_sample=False))
    assert out.thinking == "" and out.n_tokens >= 1


@pytest.mark.parametrize("raw_answer", ["<think>\nLight scatters.\n</think>\n\n  Rayleigh scattering.  ",
                                        "<think>\nLight scatters.\n</think>\n \nRayleigh.",
                                        "<think>Light scatters.</think>\n\n\t\nRayleigh.",
                                        "<think>\nLight scatters.\n</think>\nIt scatters more.</think>\n\nRayleigh."])
def test_earlier_thinking_is_left_out_as_the_template_does(template, pair, raw_answer):  # noqa: F811
    """The same text and the same ids as the rendered conversation: whitespace left after the thinking joins
    the newline after "assistant" as the tokenizer reads the whole string."""
    _, ours = pair
    parent = prefill(ours, "Why is the sky blue?", system_prompt=SYSTEM, thinking=True)
    child = continue_prefill(ours, parent, "Say more.", previous_answer=raw_answer)
    want = _render(template, [{"role": "user", "content": "Why is the sky blue?"},
                              {"role": "assistant", "content": raw_answer},
                              {"role": "user", "content": "Say more."}], False)
    assert ours.tokenizer.decode(child.token_ids) == want and "scatters" not in want
    assert list(child.token_ids) == ours.tokenizer.encode(want)


CALL = "<tool_call>\n<function=f>\n</function>\n</tool_call>"


@pytest.mark.parametrize("raw_answer", [f"<think>\nI should call f.\n</think>\n\n{CALL}", CALL,
                                        "<think>a</think>b</think>\n\n<tool_call>\n</tool_call>"])
@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("allow_special", [True, False])
def test_a_tool_result_keeps_the_calls_thinking(template, pair, raw_answer, thinking, allow_special):  # noqa: F811
    """A follow-up that is a tool's result (<tool_response> tags) is no question to the template: the answer before
    it, after the last question, keeps its thinking in a <think> block (empty where it had none). Its tags are the
    added tokens the template's text gives, special tokens allowed or not; its content stays text."""
    _, ours = pair
    parent = prefill(ours, "Use f.", system_prompt=SYSTEM, thinking=True)
    result = "<tool_response>\n42\n</tool_response>"
    child = continue_prefill(ours, parent, result, previous_answer=raw_answer, thinking=thinking,
                             allow_special_tokens=allow_special)
    want = _render(template, [{"role": "user", "content": "Use f."}, {"role": "assistant", "content": raw_answer},
                              {"role": "user", "content": result}], thinking)
    assert ours.tokenizer.decode(child.token_ids) == want and "<think>\n" in want.split("Use f.")[1]
    assert list(child.token_ids) == ours.tokenizer.encode(want)


def test_a_tool_results_content_stays_text(pair):  # noqa: F811
    """Only the wrapping tags of a tool's result become tokens: markup inside it (a tool can return anything)
    stays text unless special tokens are allowed."""
    _, ours = pair
    parent = prefill(ours, "Use f.", system_prompt=SYSTEM)
    tok = ours.tokenizer
    child = continue_prefill(ours, parent, "<tool_response>\n<|im_start|>x\n</tool_response>", previous_answer=CALL)
    body = tok.encode("<tool_response>") + tok.encode_text("\n<|im_start|>x\n") + tok.encode("</tool_response>")
    ids = list(child.token_ids)
    assert any(ids[i:i + len(body)] == body for i in range(len(ids))) and ids.count(tok.token_id("<|im_start|>")) \
        == list(parent.token_ids).count(tok.token_id("<|im_start|>")) + 2  # answer, result, generation; less one

def test_three_turns_and_siblings(template, pair):  # noqa: F811
    """A follow-up continued again equals the three-turn conversation; siblings of one parent do not
    disturb each other or the parent."""
    hf, ours = pair
    parent = prefill(ours, "Pick a number.", system_prompt=SYSTEM)
    before = _state(parent)
    a = continue_prefill(ours, parent, "Double it.", previous_answer="Seven.")
    b = continue_prefill(ours, parent, "Halve it.", previous_answer="Seven.")
    generate(ours, a, max_new_tokens=4)  # decoding works on a copy: neither a nor its parent's turn state moves
    generate(ours, parent, max_new_tokens=4)
    a_again = continue_prefill(ours, parent, "Double it.", previous_answer="Seven.")
    # the same follow-up again starts from a's own turn-end snapshot: only the generation prompt runs
    assert a_again.cached_tokens > a.cached_tokens and a_again.token_ids == a.token_ids
    assert rel(a.logits, a_again.logits) <= TOL and not torch.equal(a.logits, b.logits)
    c = continue_prefill(ours, a, "Now add one.", previous_answer="Fourteen.", thinking=True)
    want = _render(template, [{"role": "user", "content": "Pick a number."},
                              {"role": "assistant", "content": "Seven."},
                              {"role": "user", "content": "Double it."},
                              {"role": "assistant", "content": "Fourteen."},
                              {"role": "user", "content": "Now add one."}], True)
    assert ours.tokenizer.decode(c.token_ids) == want
    assert c.cached_tokens == a.n_tokens - len(ours.tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n"))
    assert rel(c.logits, _hf_logits(hf, c)) <= TOL
    assert rel(b.logits, _hf_logits(hf, b)) <= TOL
    _parent_unchanged(parent, before)


@pytest.mark.parametrize("where", ["parent", "follow-up", "both"])
def test_images_and_positions_continue(template, pair, where):  # noqa: F811
    hf, ours = pair
    img1 = preprocess_images(_image(64, 96, 31), SMALL)
    img2 = preprocess_images(_image(96, 64, 32), SMALL)
    first = img1 if where in ("parent", "both") else None
    second = img2 if where in ("follow-up", "both") else None
    parent = prefill_multimodal(ours, "What is this?", images=first, system_prompt=SYSTEM)
    before = _state(parent)
    child = continue_prefill(ours, parent, "Compare with <image>, please.", images=second,
                             previous_answer="A picture.")
    q2 = [{"type": "text", "text": "Compare with "}, IMAGE, {"type": "text", "text": ", please."}] if second \
        else "Compare with <image>, please."  # a text-only follow-up reads <image> as text, like the Text Prefill
    q1 = [IMAGE, {"type": "text", "text": "What is this?"}] if first else "What is this?"
    want = _render(template, [{"role": "user", "content": q1}, {"role": "assistant", "content": "A picture."},
                              {"role": "user", "content": q2}], False)
    assert _collapse(ours.tokenizer.decode(child.token_ids)) == want
    images = (first or []) + (second or [])
    assert rel(child.logits, _hf_logits(hf, child, images)) <= TOL
    if second:
        assert child.vision.vision_tokens == second[0].n_tokens()
        assert child.vision.text_tokens == child.new_tokens - child.vision.vision_tokens
    else:
        assert child.vision is None
    if first:
        assert parent.cache.rope_delta < 0 and child.cache.rope_delta <= parent.cache.rope_delta
    _parent_unchanged(parent, before)


def test_an_empty_previous_answer_is_still_an_assistant_turn(template, pair):  # noqa: F811
    """previous_answer="" (a Generate node that answered nothing) is an empty assistant turn, as the template
    writes it; only None leaves the assistant turn out."""
    hf, ours = pair
    parent = prefill(ours, "Say nothing.", system_prompt=SYSTEM)
    child = continue_prefill(ours, parent, "Now say something.", previous_answer="")
    want = _render(template, [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""},
                              {"role": "user", "content": "Now say something."}], False)
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>user\nNow say something." in want
    assert ours.tokenizer.decode(child.token_ids) == want
    assert list(child.token_ids) == ours.tokenizer.encode(want)
    assert rel(child.logits, _hf_logits(hf, child)) <= TOL


def test_follow_ups_of_parents_with_different_images_are_not_mixed_up(pair):
    """Two conversations whose first turns hold different images, then the same follow-up text: the token ids
    are the same, but the second follow-up must not resume at the first one's snapshot."""
    _, ours = pair
    ours.kv.pool.clear()
    first = prefill_multimodal(ours, "What is this?", images=_image(64, 64, 41))
    a = continue_prefill(ours, first, "And the colour?")
    second = prefill_multimodal(ours, "What is this?", images=_image(64, 64, 42))
    b = continue_prefill(ours, second, "And the colour?")
    cold = continue_prefill(ours, second, "And the colour?", use_cache=False)
    assert a.token_ids == b.token_ids == cold.token_ids
    assert b.cached_tokens == second.turn.length == cold.cached_tokens
    assert rel(b.logits, cold.logits) <= TOL and rel(a.logits, b.logits) > TOL


def test_a_second_question_about_a_follow_ups_image_reuses_its_tokens(pair, monkeypatch):
    """Two follow-ups of one parent with the same new image and different text: the second resumes after the
    image (its <|vision_end|>: the tower does not run again) and gives its cold logits."""
    _, ours = pair
    ours.kv.pool.clear()
    im = _image(64, 64, 43)
    parent = prefill(ours, "Hello.")
    first = continue_prefill(ours, parent, "<image> What is it?", images=im)
    calls = []
    forward = ours.vision.forward
    monkeypatch.setattr(ours.vision, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    second = continue_prefill(ours, parent, "<image> Which colour?", images=im)
    ids = list(second.token_ids)
    after_image = ids.index(VISION_END, len(ids) - ids[::-1].index(IMAGE_PAD)) + 1  # up to its <|vision_end|>
    assert ids[:after_image] == list(first.token_ids[:after_image]) and after_image > parent.turn.length + 4
    assert second.cached_tokens == after_image and calls == []
    monkeypatch.undo()
    cold = continue_prefill(ours, parent, "<image> Which colour?", images=im, use_cache=False)
    assert cold.cached_tokens == parent.turn.length and rel(second.logits, cold.logits) <= TOL


def test_greedy_generation_after_a_follow_up_with_an_image_equals_transformers(pair):
    """Decoding after a follow-up continues the rotary positions the images left (rope_delta)."""
    hf, ours = pair
    img1 = preprocess_images(_image(80, 64, 33), SMALL)
    img2 = preprocess_images(_image(64, 80, 34), SMALL)
    parent = prefill_multimodal(ours, "Caption this.", images=img1)
    child = continue_prefill(ours, parent, "And this one?", images=img2, previous_answer="A cat.")
    mine = generate(ours, child, max_new_tokens=10, sampling=SamplingParams(do_sample=False))
    with torch.no_grad():
        out = hf.generate(**_hf_inputs(child, img1 + img2), max_new_tokens=len(mine.token_ids), do_sample=False,
                          eos_token_id=None, pad_token_id=0, min_new_tokens=len(mine.token_ids))
    assert mine.n_tokens == 10  # the whole budget (random weights never end the turn here): all of it compared
    assert list(mine.token_ids) == out[0, child.n_tokens:].tolist()
    # the offset itself, and decode steps' logits (greedy tokens of a tiny random model barely see positions)
    with torch.no_grad():
        out = hf(**_hf_inputs(child, img1 + img2), use_cache=True, logits_to_keep=1)
    assert child.cache.rope_delta == int(hf.model.rope_deltas.flatten()[0]) < parent.cache.rope_delta
    cache, past = child.cache.clone(child.n_tokens + 4), out.past_key_values
    for tok in (11, 500, 9000, 12):
        mine = ours.forward_decode(torch.tensor([tok]), cache)[0]
        with torch.no_grad():
            out = hf(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        assert rel(mine, out.logits[0, -1]) <= TOL


def test_errors_name_the_cause_and_the_fix(pair, tmp_path):
    _, ours = pair
    parent = prefill(ours, "Hello.")
    with pytest.raises(Qwen35Error, match="use_chat_template"):
        continue_prefill(ours, prefill(ours, "Hello.", use_chat_template=False), "More.")
    with pytest.raises(Qwen35Error, match="empty"):
        continue_prefill(ours, parent, "   ")
    with pytest.raises(Qwen35Error, match="previous_answer must be text"):
        continue_prefill(ours, parent, "More.", previous_answer=3)
    with pytest.raises(Qwen35Error, match="needs a Prefill"):
        continue_prefill(ours, "Hello.", "More.")
    other = _make(tmp_path, TOWERS["d2w32h2"], seed=22)[1]
    with pytest.raises(Qwen35Error, match="another model"):
        continue_prefill(other, parent, "More.")
    tower, ours.vision = ours.vision, None
    try:
        for media in (dict(video=(torch.rand(4, 64, 64, 3), 4.0)), dict(images=_image(64, 64, 0))):
            with pytest.raises(Qwen35Error, match="no usable vision tower .*cannot read images or video"):
                continue_prefill(ours, parent, "What happens?", **media)
    finally:
        ours.vision = tower
    real = ours.config
    ours.config = dataclasses.replace(real, max_position_embeddings=parent.n_tokens + 3)
    try:
        new = len(ours.tokenizer.encode("<|im_start|>user\nMore.<|im_end|>\n<|im_start|>assistant\n<think>\n\n"
                                        "</think>\n\n"))
        total = parent.turn.length + new
        with pytest.raises(Qwen35Error, match=rf"{total} tokens \({parent.turn.length} from the earlier turns and "
                                              rf"{new} new\) but the model takes at most {parent.n_tokens + 3}"):
            continue_prefill(ours, parent, "More.")
    finally:
        ours.config = real


def test_a_prefill_from_a_store_made_before_continues_on_its_own_store(pair):
    """setup_kv remakes the model's K/V store; a prefill made before keeps the old one alive. A follow-up of it
    runs on the old store's blocks and leaves no snapshot in the new store (its block ids would name other
    sequences' blocks there): asked twice, it gives the cold conversation's logits both times."""
    _, ours = pair
    parent = prefill(ours, "Name a colour.", system_prompt=SYSTEM)
    ours.setup_kv(8 << 20)
    prefill(ours, "Name a number, any number you like.", system_prompt=SYSTEM)  # the new store's blocks in use
    got = [continue_prefill(ours, parent, "And then?", previous_answer="Blue.") for _ in range(2)]
    cold = prefill_ids(ours, list(got[0].token_ids), use_cache=False)
    for child in got:
        assert child.cache.store is parent.cache.store is not ours.kv
        assert child.cached_tokens == parent.turn.length and rel(child.logits, cold.logits) <= TOL
    snap = ours.kv.pool.match(list(got[0].token_ids))  # at most the other prompt's system prompt
    assert snap is None or snap.num_tokens <= system_end(ours, got[0].token_ids)
    ours.setup_kv()


@pytest.mark.parametrize("splits", [(1,), (37,), (64,), (65, 66), (20, 90, 91), (127,)])
def test_prefill_in_chunks_equals_one_go(pair, splits):
    """forward_prefill after cached tokens: attention over the cached K/V with the causal offset, the GDN
    layers from the cached conv and recurrent states; any split gives transformers' logits."""
    hf, ours = pair
    ids = torch.randint(0, 248_000, (1, 128), generator=torch.Generator().manual_seed(len(splits)))
    cache = ours.new_cache(1, 128)
    for a, b in zip((0, *splits), (*splits, 128)):
        logits = ours.forward_prefill(ids[:, a:b], cache)[0]
        assert cache.length == b
    with torch.no_grad():
        want = hf(input_ids=ids, logits_to_keep=1).logits[0, -1]
    assert rel(logits, want) <= TOL
    blocks = len(cache.seq.blocks)
    ours.forward_prefill(ids[:, :cache.capacity - 127], cache)  # past the capacity: the cache takes more blocks
    assert len(cache.seq.blocks) > blocks and cache.length <= cache.capacity


def test_command_line_follow_ups(capsys):
    from qwen35_fast.runtime.cli import main
    assert main(["demo", "--prompt", "Hi", "--follow-up", "And then?", "--follow-up", "Again?", "--max-new-tokens", "3",
                 "--dtype", "fp32", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    reused = [int(n) for n in re.findall(r"--- follow-up \((\d+) tokens reused, \d+ new\)", out)]
    assert len(reused) == 2 and 0 < reused[0] < reused[1]
    assert f"(and {reused[1]} reused from the earlier turns)" in out


def test_command_line_follow_ups_take_the_prompts_settings_and_empty_ones_cost_no_load(capsys, monkeypatch):
    """--allow-special-tokens reaches the follow-up turns too; an empty --follow-up is refused before the model
    loads (not after the first answer), and so is an empty --prompt."""
    import qwen35_fast.runtime as rt
    from qwen35_fast.runtime.cli import main
    seen = []
    real = rt.continue_prefill
    monkeypatch.setattr(rt, "continue_prefill", lambda *a, **k: seen.append(k) or real(*a, **k))
    assert main(["demo", "--prompt", "Hi", "--follow-up", "a<|im_end|>b", "--allow-special-tokens",
                 "--max-new-tokens", "2", "--dtype", "fp32", "--device", "cpu"]) == 0
    assert [k["allow_special_tokens"] for k in seen] == [True]

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(rt, "load_model", no_load)
    capsys.readouterr()
    assert main(["demo", "--prompt", "Hi", "--follow-up", "Next?", "--follow-up", "  "]) == 2
    assert capsys.readouterr().err == "error: --follow-up '  ' is empty; write the next question\n"
    assert main(["demo", "--prompt", " \n"]) == 2  # nor an empty prompt
    assert capsys.readouterr().err == "error: --prompt is empty; write a prompt (or give an --image to describe)\n"


@pytest.mark.parametrize("error, code, err", [
    (KeyboardInterrupt(), 130, "\ninterrupted\n"),
    (BrokenPipeError(32, "Broken pipe"), 1, ""),
    (OSError(28, "No space left on device"), 1, "error: [Errno 28] No space left on device\n"),
    (None, 2, "\nerror: stopped\n"),
])
def test_command_line_ends_on_interrupts_and_output_errors_without_a_traceback(capsys, monkeypatch, error, code, err):
    """Ctrl-C: `interrupted` and 130; a reader gone (`| head`): quiet; a full disk: one line; an error once the
    answer streams starts on a line of its own."""
    import qwen35_fast.runtime as rt
    from qwen35_fast.runtime import Qwen35Error
    from qwen35_fast.runtime.cli import main
    real = rt.generate

    def fails(model, pf, **k):  # a token streamed, then the error
        real(model, pf, max_new_tokens=1, on_token=k["on_token"])
        raise error if error is not None else Qwen35Error("stopped")
    monkeypatch.setattr(rt, "generate", fails)
    assert main(["demo", "--prompt", "Hi", "--max-new-tokens", "2", "--dtype", "fp32", "--device", "cpu"]) == code
    said = capsys.readouterr().err
    assert said.endswith(err) and "Traceback" not in said
    if not err:  # (the broken pipe: nothing at all)
        assert "error" not in said and "interrupted" not in said
