"""format_chat against the real chat template (../shared/qwen35-tokenizer/chat_template.jinja)."""
from pathlib import Path

import pytest

from qwen35_fast.runtime.chat import format_chat

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
