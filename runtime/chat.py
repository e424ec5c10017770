"""Qwen3.5 chat prompts: the single-turn prompt text, and splitting an answer into thinking and reply.

`format_chat` writes the same text that Qwen3.5's chat template (chat_template.jinja in a
checkpoint) renders for an optional system message and one user message, with
add_generation_prompt=True, so no template file is needed at run time:

    <|im_start|>system\\n{system}<|im_end|>\\n        (only when the system prompt is not blank)
    <|im_start|>user\\n{prompt}<|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n                 (thinking on: the model writes its reasoning)
    <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n  (thinking off: an empty, closed thinking block)

Both messages are stripped of surrounding whitespace, as the template's `trim` filter does.
"""
from __future__ import annotations

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

GENERATION_PROMPT_THINKING = f"{IM_START}assistant\n{THINK_OPEN}\n"
GENERATION_PROMPT_NO_THINKING = f"{IM_START}assistant\n{THINK_OPEN}\n\n{THINK_CLOSE}\n\n"


def format_chat(prompt: str, system_prompt: str = "", thinking: bool = False) -> str:
    """The prompt text for one user turn, ending where the assistant's answer begins.

    A system prompt that is empty or only whitespace adds no system message.
    With `thinking=True` the prompt ends inside an open `<think>` block, so the generated text
    starts with the model's reasoning and contains `</think>` before the answer (see
    `split_thinking`).
    """
    parts = []
    system = system_prompt.strip()
    if system:
        parts.append(f"{IM_START}system\n{system}{IM_END}\n")
    parts.append(f"{IM_START}user\n{prompt.strip()}{IM_END}\n")
    parts.append(GENERATION_PROMPT_THINKING if thinking else GENERATION_PROMPT_NO_THINKING)
    return "".join(parts)


def split_thinking(text: str, *, started_in_thinking: bool = False) -> tuple[str, str]:
    """Splits generated text into (thinking, answer), both stripped of surrounding whitespace.

    Handles:
      * `<think>reasoning</think>answer`: the model opened and closed its own thinking block;
      * `reasoning</think>answer`: the prompt had already opened `<think>` (format_chat with
        thinking=True), so the generation holds only the closing tag;
      * `<think>reasoning` with no closing tag: generation stopped mid-thought; all of it is
        thinking and the answer is "";
      * no tags at all: all of it is the answer, unless `started_in_thinking=True` (the prompt
        opened `<think>` and generation stopped before `</think>`), when all of it is thinking.
    End-of-turn markers left at the end of the text (`<|im_end|>`, `<|endoftext|>`) are dropped.
    """
    text = _drop_trailing_end_markers(text)
    if THINK_CLOSE in text:
        thinking, _, answer = text.partition(THINK_CLOSE)
        if THINK_OPEN in thinking:
            thinking = thinking.rpartition(THINK_OPEN)[2]
        return thinking.strip(), answer.strip()
    if THINK_OPEN in text:
        before, _, thinking = text.partition(THINK_OPEN)
        if before.strip():
            # An answer that opens a thinking block half-way: keep the words written before it.
            return thinking.strip(), before.strip()
        return thinking.strip(), ""
    if started_in_thinking:
        return text.strip(), ""
    return "", text.strip()


def _drop_trailing_end_markers(text: str) -> str:
    stripped = text.rstrip()
    while stripped.endswith((IM_END, END_OF_TEXT)):
        marker = IM_END if stripped.endswith(IM_END) else END_OF_TEXT
        stripped = stripped[: -len(marker)].rstrip()
    return stripped
