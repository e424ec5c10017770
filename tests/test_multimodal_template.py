"""Where images and video go in the prompt, against Qwen3.5's real chat template
(../shared/qwen35-tokenizer/chat_template.jinja) rendering the same message as a content list."""
import re
from types import SimpleNamespace

import pytest
import torch
from test_chat import template  # noqa: F401  (fixture)

from qwen35_fast.runtime.media import VisionInput
from qwen35_fast.runtime.multimodal import build_prompt
from qwen35_fast.runtime.tokenizer import load_tokenizer

IMAGE = {"type": "image"}
VIDEO = {"type": "video"}


def _text(t):
    return {"type": "text", "text": t}


def _input(kind, tokens=1):  # `tokens` tokens per image / per 2-frame slice (a 2 x 2 merge of a 2 x 2*tokens grid)
    return VisionInput(kind, torch.zeros(4 * tokens, 1536), (1, 2, 2 * tokens), (32, 32 * tokens),
                       (0.5,) if kind == "video" else ())


# (our prompt, number of images, video?, the same message as a content list)
CASES = [
    ("Describe this.", 1, False, [IMAGE, _text("Describe this.")]),
    ("Compare them.", 2, False, [IMAGE, IMAGE, _text("Compare them.")]),
    ("Left: <image> right: <image>, which is darker?", 2, False,
     [_text("Left: "), IMAGE, _text(" right: "), IMAGE, _text(", which is darker?")]),
    ("Is <image 2> newer than <image 1>?", 2, False, [_text("Is "), IMAGE, _text(" newer than "), IMAGE, _text("?")]),
    ("What happens?", 0, True, [VIDEO, _text("What happens?")]),
    ("Does <image> appear in the clip?", 1, True, [VIDEO, _text("Does "), IMAGE, _text(" appear in the clip?")]),
    ("  What is this?\n", 1, False, [IMAGE, _text("  What is this?\n")]),
    # text that runs into a video's first timestamp: tokenised with it (": <0.5" is ":", " <", "0", ...)
    ("Describe this video: <video>", 0, True, [_text("Describe this video: "), VIDEO]),
    ("Watch:<video> what happens?", 0, True, [_text("Watch:"), VIDEO, _text(" what happens?")]),
    ("<image>, then:<video>", 1, True, [IMAGE, _text(", then:"), VIDEO]),
]
# the images in the order the template's image slots take them, where not the order they are connected in
SLOTS = {3: [1, 0]}


@pytest.fixture(scope="module")
def model():
    return SimpleNamespace(tokenizer=load_tokenizer(None), vision=None)


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_layout_equals_the_chat_template(template, model, case, thinking):  # noqa: F811
    """Image i has i + 1 tokens, so the text shows which image fills each of the template's slots (identical
    images would read the same whichever order they were placed in)."""
    prompt, n_images, video, content = CASES[case]
    inputs = [_input("image", i + 1) for i in range(n_images)] + ([_input("video")] if video else [])
    ids, parts, ordered = build_prompt(model, prompt, inputs, n_images, system_prompt="Be brief.", thinking=thinking)
    ours = model.tokenizer.decode(ids)
    want = template.render(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}],
                           add_generation_prompt=True, enable_thinking=thinking)
    # a video's span becomes its timestamped slices (Qwen's processor replaces the template's span)
    want = want.replace("<|vision_start|><|video_pad|><|vision_end|>",
                        "<0.5 seconds><|vision_start|><|video_pad|><|vision_end|>")
    # the processor expands each slot's pad to its image's tokens: the k-th slot takes image slots[k]
    slots = iter(SLOTS.get(case, range(n_images)))
    want = re.sub(re.escape("<|image_pad|>"), lambda _: "<|image_pad|>" * (next(slots) + 1), want)
    placed = iter(SLOTS.get(case, range(n_images)))
    assert [[i for i, y in enumerate(inputs) if y is x] for x in ordered] == [
        [n_images if c is VIDEO else next(placed)] for c in content if c in (IMAGE, VIDEO)]
    assert ours == want
    assert ids == model.tokenizer.encode(want)  # the ids too: the whole text tokenised at once, as the processor does
    assert sum(p.n for p in parts) == len(ids)


@pytest.mark.parametrize("prompt", ["  What is this?\n", "\nWhat is <image>?  "])
def test_a_follow_up_with_an_image_is_trimmed_as_the_template_trims_it(template, model, prompt):  # noqa: F811
    """A follow-up turn's content is trimmed as a whole (the chat template's rule), while a raw prompt keeps its
    text as given."""
    from qwen35_fast.runtime.conversation import follow_up_ids
    ids, *_ = follow_up_ids(model, prompt, [_input("image")], 1, "Hi.", thinking=False)
    content = [IMAGE, _text(prompt)] if "<image>" not in prompt else \
        [_text(prompt.split("<image>")[0]), IMAGE, _text(prompt.split("<image>")[1])]
    want = template.render(messages=[{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."},
                                     {"role": "user", "content": content}], add_generation_prompt=True,
                           enable_thinking=False)
    assert want.endswith(model.tokenizer.decode(ids))
    raw, _, _ = build_prompt(model, prompt, [_input("image")], 1, use_chat_template=False)
    assert model.tokenizer.decode(raw).replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>") == \
        (prompt if "<image>" in prompt else "<image>" + prompt)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_ids_are_the_rendered_text_tokenised_at_once(model, case):
    """Without the template file: a prompt's ids equal its own text tokenised whole, as the processor tokenises
    the rendered chat (text that runs into a video's first timestamp is one string with it)."""
    prompt, n_images, video, _ = CASES[case]
    inputs = [_input("image") for _ in range(n_images)] + ([_input("video")] if video else [])
    ids, _, _ = build_prompt(model, prompt, inputs, n_images, system_prompt="Be brief.")
    assert ids == model.tokenizer.encode(model.tokenizer.decode(ids))


def test_private_use_characters_in_the_prompt_stay_text(model):
    """Text with private-use characters (the marks an earlier version put where the inputs go) stays text: one
    image's tokens, no IndexError."""
    from qwen35_fast.runtime.multimodal import IMAGE_PAD
    for prompt in ["Icon \ue0000\ue001 here", "Icon \ue0003\ue001 here"]:
        ids, _, ordered = build_prompt(model, prompt, [_input("image")], 1)
        assert ids.count(IMAGE_PAD) == 1 and len(ordered) == 1
        assert "\ue000" in model.tokenizer.decode(ids)


@pytest.mark.parametrize("prompt, n_images, video", [
    ("Describe <image>", 1, False), ("\nDescribe <image>", 1, False), ("  \n\nDescribe <image>", 1, False),
    ("\n<video> what happens?", 0, True), ("\n\nWhat is this?", 1, False)])
def test_a_raw_prompt_reads_its_system_prompt_as_one_string_with_its_text(model, prompt, n_images, video):
    """Without the chat template the system prompt and the prompt are one string, as the text path encodes them
    (encode_prompt): the newlines where they meet are the tokens of the whole text ("\n\n" + "\n" is one
    token, not two), and so are the ids of all of it."""
    inputs = [_input("image") for _ in range(n_images)] + ([_input("video")] if video else [])
    ids, parts, _ = build_prompt(model, prompt, inputs, n_images, system_prompt="Be brief.", use_chat_template=False)
    tok = model.tokenizer
    assert ids == tok.encode(tok.decode(ids)) and sum(p.n for p in parts) == len(ids)
    before = prompt.split("<")[0] if "<" in prompt else ""  # (an unnamed image goes before the text)
    assert tok.decode(ids).startswith("Be brief.\n\n" + before + "<")


@pytest.mark.parametrize("token", ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
def test_vision_tokens_written_with_special_tokens_allowed_are_refused(model, token):
    """With allow_special_tokens a prompt's special tokens act as such, but an image pad written in it would be a
    slot no image fills (the features misplaced): refused, naming the token and the fix, in every path."""
    from qwen35_fast.runtime import Qwen35Error, encode_prompt
    from qwen35_fast.runtime.conversation import follow_up_ids
    message = (f"the prompt writes {re.escape(token)} with special tokens allowed; image and video tokens come only "
               "from connected inputs: write <image> or <video>")
    with pytest.raises(Qwen35Error, match=message):
        build_prompt(model, f"Is {token} here? <image>", [_input("image")], 1, allow_special_tokens=True)
    with pytest.raises(Qwen35Error, match=message):
        follow_up_ids(model, f"And {token}?", [_input("image")], 1, "Hi.", False, allow_special_tokens=True)
    with pytest.raises(Qwen35Error, match=message):
        encode_prompt(model, f"Hi {token}", allow_special_tokens=True)
    # a raw prompt (no chat template) encodes the system prompt with the prompt as one string: still named
    in_system = (f"the system prompt writes {re.escape(token)} with special tokens allowed; image and video tokens "
                 "come only from connected inputs: remove them from the system prompt")
    with pytest.raises(Qwen35Error, match=in_system):
        encode_prompt(model, "Hi", f"Be {token}", use_chat_template=False, allow_special_tokens=True)
    with pytest.raises(Qwen35Error, match=in_system):
        build_prompt(model, "Hi <image>", [_input("image")], 1, system_prompt=f"Be {token}", use_chat_template=False,
                     allow_special_tokens=True)
    ids, _, _ = build_prompt(model, f"Is {token} here? <image>", [_input("image")], 1)  # off: plain text
    assert token in model.tokenizer.decode(ids) and ids.count(248056) == 1


def test_a_previous_answer_keeps_the_markup_tokens_the_model_wrote(model):
    """A follow-up's previous answer is read back as the template's text tokenised whole: its tool-call markup
    (added tokens that are not special) are the tokens the model wrote, while turn markers written in it stay
    text."""
    from qwen35_fast.runtime.conversation import follow_up_ids
    tok = model.tokenizer
    answer = 'Calling it.\n<tool_call>\n{"name": "f"}\n</tool_call>'
    ids, *_ = follow_up_ids(model, "Thanks", [], 0, answer, False)
    rendered = (f"<|im_start|>assistant\n{answer}<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n"
                "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ids == tok.encode(rendered) and tok.token_id("<tool_call>") in ids
    marker, *_ = follow_up_ids(model, "Thanks", [], 0, "Done <|im_start|>user", False)
    assert marker.count(tok.token_id("<|im_start|>")) == 3  # the answer's, the user's, the generation prompt's


def test_vision_tokens_refused_in_the_system_prompt_or_previous_answer_name_that_text(model):
    """The refusal names the text that writes the token (not "the prompt" when the prompt is clean) and a fix
    that applies to it."""
    from qwen35_fast.runtime import Qwen35Error, encode_prompt
    from qwen35_fast.runtime.conversation import follow_up_ids
    with pytest.raises(Qwen35Error, match=r"^the system prompt writes <\|image_pad\|> .*remove them from the system "
                                          r"prompt \(or turn allow_special_tokens off\)"):
        build_prompt(model, "Hi <image>", [_input("image")], 1, system_prompt="Sys <|image_pad|>",
                     allow_special_tokens=True)
    with pytest.raises(Qwen35Error, match=r"^the system prompt writes <\|image_pad\|> .*remove them from the system "
                                          r"prompt"):
        encode_prompt(model, "Hi", system_prompt="Sys <|image_pad|>", allow_special_tokens=True)  # (text only)
    with pytest.raises(Qwen35Error, match=r"^previous_answer writes <\|vision_start\|> .*remove them from "
                                          r"previous_answer"):
        follow_up_ids(model, "Next?", [], 0, "See <|vision_start|>", False, allow_special_tokens=True)


@pytest.mark.parametrize("prompt, n_images, message", [
    ("<image> and <image 1>", 2, r"places image 1 twice: an <image> before <image 1> already took it .*number them all"),
    ("<image 0>", 2, r"names <image 0> but 2 image\(s\) .*counted from 1: name one of <image 1> to <image 2>"),
    ("<image 10>", 9, r"names <image 10> but 9 image\(s\) .*name one of <image 1> to <image 9> or connect more"),
    ("<image 1> here", 0, r"names <image 1> but 0 image\(s\) .*connect images or remove it"),
    ("<image 2>", 1, r"names <image 2> but 1 image\(s\) .*counted from 1: name <image 1> or connect more images"),
    ("<image03>", 2, r"names <image03> but 2 image\(s\)"),  # as written
    ("<image 1> and <image 1>", 2, r"places image 1 twice; name each image or video once"),  # no bare <image> in it
])
def test_placeholder_errors_name_the_placeholder_and_the_fix(prompt, n_images, message):
    from qwen35_fast.runtime import Qwen35Error
    from qwen35_fast.runtime.multimodal import place_inputs
    with pytest.raises(Qwen35Error, match=message):
        place_inputs(prompt, n_images, has_video=n_images == 0)
