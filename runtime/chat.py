"""Qwen3.5 chat prompts: the single-turn prompt text the chat template renders.

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
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

GENERATION_PROMPT_THINKING = f"{IM_START}assistant\n{THINK_OPEN}\n"
GENERATION_PROMPT_NO_THINKING = f"{IM_START}assistant\n{THINK_OPEN}\n\n{THINK_CLOSE}\n\n"


def chat_layout(system_prompt: str, thinking: bool) -> list[tuple[str, str]]:
    """The template's prompt for one user turn as pieces in order: ("markup", text) for its own text (special
    tokens), ("system", text) for the stripped system prompt, ("user", "") where the user's message goes
    (stripped by its writer: the text, or the text with its images). The one place the template's layout is
    written: format_chat, generate.encode_prompt and multimodal.build_prompt fill it in."""
    pieces = []
    system = system_prompt.strip()
    if system:
        pieces += [("markup", f"{IM_START}system\n"), ("system", system), ("markup", f"{IM_END}\n")]
    pieces += [("markup", f"{IM_START}user\n"), ("user", ""), ("markup", f"{IM_END}\n"),
               ("markup", GENERATION_PROMPT_THINKING if thinking else GENERATION_PROMPT_NO_THINKING)]
    return pieces


def format_chat(prompt: str, system_prompt: str = "", thinking: bool = False) -> str:
    """The prompt text for one user turn, ending where the assistant's answer begins.

    A system prompt that is empty or only whitespace adds no system message.
    With `thinking=True` the prompt ends inside an open `<think>` block, so the generated text
    starts with the model's reasoning and contains `</think>` before the answer (generate splits the
    answer there, at the `</think>` token).
    """
    return "".join(prompt.strip() if kind == "user" else text for kind, text in chat_layout(system_prompt, thinking))
