"""Follow-up turns: a prompt that continues an earlier prefill and runs only its own tokens.

A chat-template prefill keeps the model state at the end of its last user turn (Prefill.turn: the GDN
states there; the K/V of those tokens are in its cache). `continue_prefill` restarts from that point
and reads what comes next, as Qwen3.5's chat template renders a conversation:

    ... <|im_start|>user\\n{parent's prompt}<|im_end|>\\n          (the parent, up to its turn end)
    <|im_start|>assistant\\n{previous answer}<|im_end|>\\n          (only with previous_answer)
    <|im_start|>user\\n{images, prompt}<|im_end|>\\n                (the follow-up turn)
    <|im_start|>assistant\\n<think>\\n...                           (the generation prompt)

The parent's own generation prompt is not part of the conversation: the template writes an earlier
assistant turn without the `<think>` block that generation prompt opened, so the restart is before it.
A Prefill never changes; any number of follow-ups can continue one parent, and a follow-up can be
continued in turn.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from .chat import IM_END, IM_START, THINK_CLOSE, THINK_OPEN
from .devices import synchronize
from .errors import Qwen35Error, flag
from .generate import Prefill, check_vocabulary, generation_prompt_ids
from .host import host_logits, on_model_device
from .kv_store import growth_undone_on_failure
from .memory import is_out_of_memory, out_of_memory, prefill_bytes, vision_bytes
from .model import Qwen35Model
from .multimodal import (
    TowerClock,
    VisionStats,
    _as_inputs,
    _count_pads,
    _merge,
    media_spans,
    user_message,
    vision_features,
)
from .prefix import prefill_reusing
from .rope import TextRun, layout_positions
from .tokenizer import NON_SPECIAL_ADDED_TOKENS, check_text, user_encoder


def earlier_answer(answer: str, keep_thinking: bool = False) -> str:
    """An answer as the chat template writes it in an earlier assistant turn: trimmed, and anything up
    to its last `</think>` left out (the template shows no thinking of a turn before the last user question).
    keep_thinking: the turn comes after the last question (a tool's result follows it), where the template
    writes its thinking, up to its first `</think>`, trimmed, in a `<think>` block (empty for none)."""
    answer = answer.strip()
    content = answer.split(THINK_CLOSE)[-1].lstrip("\n") if THINK_CLOSE in answer else answer
    if not keep_thinking:
        return content
    thought = answer.split(THINK_CLOSE)[0].rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n").strip() \
        if THINK_CLOSE in answer else ""
    return f"{THINK_OPEN}\n{thought}\n{THINK_CLOSE}\n\n{content}"


TOOL_RESPONSE = ("<tool_response>", "</tool_response>")


def tool_result(prompt: str | None) -> bool:
    """Whether a user message is a tool's result (its text wrapped in <tool_response> tags), which the chat
    template does not count as a question."""
    text = (prompt or "").strip()
    return text.startswith(TOOL_RESPONSE[0]) and text.endswith(TOOL_RESPONSE[1])


def follow_up_ids(model: Qwen35Model, prompt: str, inputs: list, n_images: int, previous_answer: str | None,
                  thinking: bool, allow_special_tokens: bool = False):
    """(token ids, rope parts, vision inputs in prompt order, where the generation prompt starts) of a
    follow-up turn: the previous answer as an assistant turn (when given), the user turn with its images
    (placed as the Multimodal Prefill places them), the generation prompt."""
    if prompt is not None and not isinstance(prompt, str):
        raise Qwen35Error(f"the prompt must be text, got {type(prompt).__name__}")
    if previous_answer is not None and not isinstance(previous_answer, str):
        raise Qwen35Error(f"previous_answer must be text (a Generate node's text output), got "
                          f"{type(previous_answer).__name__}")
    check_text(prompt or "", "the follow-up prompt")
    check_text(previous_answer or "", "previous_answer")
    tok = model.tokenizer
    user = user_encoder(tok, allow_special_tokens)
    head: list[int] = []
    if previous_answer is not None:
        # "assistant\n" read with the answer, as in the rendered text: a newline joins the whitespace after it;
        # the answer's own markup (<tool_call>: added tokens that are not special) as the tokens the model wrote
        answer = f"assistant\n{earlier_answer(previous_answer, keep_thinking=not inputs and tool_result(prompt))}"
        head += tok.encode(IM_START) + (user(answer, "previous_answer") if allow_special_tokens else
                                        tok.encode_with(answer, NON_SPECIAL_ADDED_TOKENS)) + tok.encode(f"{IM_END}\n")
    head += tok.encode(f"{IM_START}user\n")
    if inputs:  # the user message's content as the Multimodal Prefill lays it out
        body, body_parts, ordered = user_message(model, prompt, inputs, n_images, trim=True,
                                                 allow_special_tokens=allow_special_tokens)
    else:  # plain text, as the Text Prefill reads it (no placeholders)
        if not (prompt or "").strip():
            raise Qwen35Error("the follow-up prompt is empty; write the next question (or connect an image)")
        # a tool's result: its <tool_response> tags are the added tokens the template's text gives, its content text
        body = tok.encode_with(prompt.strip(), TOOL_RESPONSE) if tool_result(prompt) and not allow_special_tokens \
            else user(prompt.strip())
        body_parts, ordered = [TextRun(len(body))], []
    tail = tok.encode(f"{IM_END}\n")
    gen = generation_prompt_ids(model, thinking)
    ids = head + body + tail + gen
    parts = [TextRun(len(head)), *body_parts, TextRun(len(tail)), TextRun(len(gen))]
    return ids, parts, ordered, len(ids) - len(gen)


@torch.compiler.disable
@on_model_device
def continue_prefill(model: Qwen35Model, parent: Prefill, prompt: str = "", images=None, video=None,
                     previous_answer: str | None = None, thinking: bool = False, max_pixels: int | None = None,
                     allow_special_tokens: bool = False, use_cache: bool = True,
                     reserve: Callable[[int], None] | None = None, reuse_at_most: int | None = None) -> Prefill:
    """A follow-up user turn after `parent` (a chat-template prefill of this model), optionally after
    `previous_answer` as the assistant's turn. Runs only the new tokens, from the parent's state at the
    end of its user turn; the result equals a prefill of the whole conversation in one go.

    images / video: as prefill_multimodal takes them, for this turn (placed with <image>, <video>).
    A snapshot an identical earlier follow-up left reaches further than the parent's turn end and is used
    instead, unless use_cache is off (prefix.py), or reuse_at_most (an earlier read's cached_tokens: read again
    so, the same logits bit for bit where the store still keeps that snapshot) stops short of it; this turn's
    reuse points are kept for later ones.
    reserve(bytes), when given, is called once the turn is laid out and before any device work, with what
    the tower and the new tokens will need (as prefill_multimodal's).
    Returns a Prefill with cached_tokens (taken from the parent), new_tokens and `ms` of the new part
    (the copy of the parent's state, the vision tower and the new tokens). `parent` is unchanged.
    """
    thinking, allow_special_tokens = flag("thinking", thinking), flag("allow_special_tokens", allow_special_tokens)
    use_cache = flag("use_cache", use_cache)
    if not isinstance(parent, Prefill):
        raise Qwen35Error(f"continue_prefill needs a Prefill to continue, got {type(parent).__name__}")
    if parent.model_id != model.serial:
        raise Qwen35Error("this prefill was made by another model (or the same checkpoint loaded again); "
                          "continue a prefill made by this model, or run the first prefill again with it")
    if parent.turn is None:
        raise Qwen35Error("this prefill was made without the chat template (use_chat_template off), so it has "
                          "no chat turn to continue; turn use_chat_template on in the first prefill, or write "
                          "the whole text into one raw prompt")
    if (images is not None or video is not None) and model.vision is None:
        note = getattr(model, "vision_note", "") or "no model.visual.* weights"
        raise Qwen35Error(f"this checkpoint has no usable vision tower ({note}), so it cannot read images or "
                          "video; leave the images input of the follow-up empty")
    inputs, n_images = _as_inputs(model, images, video, max_pixels) if images is not None or video is not None \
        else ([], 0)
    ids, parts, ordered, turn_end = follow_up_ids(model, prompt, inputs, n_images, previous_answer, thinking,
                                                  allow_special_tokens)
    check_vocabulary(model, ids)
    turn = parent.turn
    cached, new = turn.length, len(ids)
    total, limit = cached + new, model.config.max_position_embeddings
    if total >= limit:
        raise Qwen35Error(f"the conversation would have {total:,} tokens ({cached:,} from the earlier turns and "
                          f"{new:,} new) but the model takes at most {limit:,} positions (prompt and answer "
                          "together); start a new conversation from a fresh prefill, or shorten the follow-up")
    needed = prefill_bytes(model, new, total) + vision_bytes(model, [inp.grid for inp in ordered])
    if reserve is not None:
        reserve(needed)
    model.select_backend()
    dev = model.device
    whole = parent.token_ids[:cached] + tuple(ids)  # the conversation: keys of the prefix cache run over all of it
    with growth_undone_on_failure(model.kv, parent.cache.store) as undo_growth:  # a failed turn's growth given back
        try:
            n_vision = _count_pads(ids)
            spans = media_spans(ids, ordered, _merge(model), offset=cached, backend=model.backend)
            media = tuple(sp for sp in parent.media if sp.end <= cached) + tuple(spans)
            positions = delta = None
            if ordered:  # rotary ids of the new tokens continue from the parent's next position
                new_positions, new_delta = layout_positions(parts)
                # only positions past the reused prefix are read, and it reaches at least the parent's turn end
                positions = torch.cat([torch.zeros(3, cached, dtype=new_positions.dtype),
                                       new_positions + (cached + turn.rope_delta)], dim=1)
                delta = turn.rope_delta + new_delta
            clock = TowerClock(dev)
            synchronize(dev)
            t0 = time.perf_counter()
            points = [p for p in (spans[-1].end if spans else None, cached + turn_end) if p]
            run = prefill_reusing(model, whole, points, media, vision_features(model, whole, ordered, spans, clock),
                                  positions, delta, start=turn, start_cache=parent.cache, limit=cached + turn_end,
                                  use_cache=use_cache, needed=[cached + turn_end], at_most=reuse_at_most)
            logits = host_logits(run.logits)
            synchronize(dev)
        except RuntimeError as e:
            if not is_out_of_memory(e):
                raise  # out of memory is reported below, once this frame's tensors and the traceback are gone
        else:
            t2 = time.perf_counter()
            stats = None
            if inputs:
                vision_ms = clock.ms
                stats = VisionStats(n_vision, new - n_vision, vision_ms, (t2 - t0) * 1000 - vision_ms,
                                    sum(i.scaled_down for i in inputs), tuple(i.grid for i in inputs))
            return Prefill(whole, logits, run.cache, (t2 - t0) * 1000, model.backend.name, thinking,
                           model.serial, vision=stats, turn=run.states.get(cached + turn_end),
                           cached_tokens=run.cached_tokens, media=media)
        run = None
        undo_growth()  # before the report, which counts what it gives back as free
        raise out_of_memory(model, f"continuing a prompt of {cached:,} tokens with {new:,} new ones", needed)


__all__ = ["continue_prefill", "follow_up_ids", "earlier_answer", "tool_result"]
