"""format_chat against the real chat template (../shared/qwen35-tokenizer/chat_template.jinja), and split_thinking."""
from pathlib import Path

import pytest

from qwen35_fast.runtime.chat import format_chat, split_thinking

TEMPLATE = Path(__file__).resolve().parents[2] / "shared" / "qwen35-tokenizer" / "chat_template.jinja"

PROMPTS = [
    "Hello!",
    "Write a haiku about the sea.\nMake it sad.\n\nThen explain it.",
    "  padded with spaces and newlines \n\n",
    "",
    "Code:\n```python\ndef f():\n    return 1\n```",
    "中文提问：今天天气怎么样？ 😀",
    "Already has <|im_start|> and </think> inside",
]
SYSTEMS = ["", "You are a helpful assistant.", "  Multi-line\nsystem prompt.\n\n", "   "]


@pytest.fixture(scope="module")
def template():
    if not TEMPLATE.is_file():
        pytest.skip("../shared/qwen35-tokenizer is absent")
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    # The environment transformers renders chat templates in.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(TEMPLATE.read_text(encoding="utf-8"))


def _render(template, prompt, system, thinking):
    messages = []
    if system.strip():
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    return template.render(messages=messages, add_generation_prompt=True, enable_thinking=thinking)


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_format_chat_matches_real_template(template, prompt, system, thinking):
    assert format_chat(prompt, system_prompt=system, thinking=thinking) == _render(template, prompt, system, thinking)


def test_format_chat_literal():
    assert format_chat("Hi") == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert format_chat(" Hi\n", system_prompt="Be brief.", thinking=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize("text, expected", [
    # the prompt opened <think>; the generation holds only the closing tag
    ("Let me think.\nOK.\n</think>\n\nThe answer is 4.", ("Let me think.\nOK.", "The answer is 4.")),
    # the model opened and closed its own block
    ("<think>\nreasoning here\n</think>\n\nFinal.", ("reasoning here", "Final.")),
    # thinking off: the prompt closed an empty block; nothing but the answer
    ("Just the answer.\n", ("", "Just the answer.")),
    # unterminated thinking (ran out of tokens)
    ("<think>\nstill thinking about", ("still thinking about", "")),
    # empty thinking block
    ("<think>\n\n</think>\n\nHi there", ("", "Hi there")),
    # end-of-turn markers left in the text
    ("hm</think>\n\nDone.<|im_end|>\n", ("hm", "Done.")),
    ("Answer only<|im_end|><|endoftext|>", ("", "Answer only")),
    # a later </think> belongs to the answer
    ("a</think>b</think>c", ("a", "b</think>c")),
    ("", ("", "")),
    ("</think>", ("", "")),
])
def test_split_thinking(text, expected):
    assert split_thinking(text) == expected


def test_split_thinking_started_in_thinking():
    assert split_thinking("reasoning cut off", started_in_thinking=True) == ("reasoning cut off", "")
    assert split_thinking("r</think>a", started_in_thinking=True) == ("r", "a")
    assert split_thinking("reasoning cut off") == ("", "reasoning cut off")


def test_format_then_split_round_trip():
    prompt = format_chat("What is 2+2?", thinking=True)
    generated = "2 plus 2 is 4.\n</think>\n\n4<|im_end|>"
    assert prompt.endswith("<think>\n")
    assert split_thinking(generated) == ("2 plus 2 is 4.", "4")
