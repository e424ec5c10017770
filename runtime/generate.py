"""prefill and generate: the two plain functions everything else (CLI, nodes) calls.

A Prefill is immutable: it keeps the cache as the prompt left it, and every generate() works on
a copy, so one prefill can feed many generations (ComfyUI caches node outputs and reuses them).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .chat import (
    GENERATION_PROMPT_NO_THINKING,
    GENERATION_PROMPT_THINKING,
    THINK_CLOSE,
    THINK_OPEN,
    chat_layout,
)
from .decode_graph import graphed_decode
from .devices import synchronize
from .errors import Qwen35Error, flag, whole_number
from .host import host_logits, on_model_device
from .kv_store import growth_undone_on_failure
from .memory import generate_bytes, is_out_of_memory, out_of_memory, prefill_bytes
from .model import Cache, GDNState, Qwen35Model
from .prefix import prefill_reusing, system_end
from .sampling import SamplingParams, draw_seed, penalty_marks, pick
from .tokenizer import check_text, raw_head, user_encoder


@dataclass(frozen=True)
class Prefill:
    """A prompt run through the model: its ids, the state after it and the next-token logits."""
    token_ids: tuple[int, ...]
    logits: torch.Tensor = field(repr=False)   # [vocab] fp32, in system RAM (holds no VRAM; 1 MB at 248k)
    cache: Cache = field(repr=False)
    ms: float
    backend: str
    thinking: bool = False
    model_id: int = 0  # the serial of the model that made it (Qwen35Model.serial): a prefill only fits that model
    vision: object = None  # multimodal.VisionStats when the prompt (its new part) had images or video
    # the state at the end of the last user turn, before the generation prompt (None without the chat
    # template): a follow-up turn restarts from it (conversation.continue_prefill); its K/V are cache's
    turn: GDNState | None = field(default=None, repr=False)
    cached_tokens: int = 0  # tokens taken from a parent's or a cached prefix's state; `ms` is the time of the rest
    media: tuple = ()  # kv_pool.MediaSpan of every image / video among token_ids (the prefix cache's keys)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def new_tokens(self) -> int:
        """Tokens this prefill ran through the model (all of them unless it continued another)."""
        return self.n_tokens - self.cached_tokens

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / (self.ms / 1000) if self.ms > 0 else 0.0


@dataclass(frozen=True)
class Generation:
    text: str                  # the answer (thinking removed)
    thinking: str              # the thinking text, "" when there was none
    token_ids: tuple[int, ...]
    first_token_ms: float
    decode_tokens_per_s: float
    finish_reason: str         # "stop" (end-of-turn token), "length" (max_new_tokens or positions)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def _token_id(i) -> int:
    """A Python, numpy or 0-d torch integer as an int; a Qwen35Error for floats, booleans and the rest."""
    whole = whole_number(i)
    if whole is None:
        batch = " (a batch: pass its one sequence, ids[0])" if isinstance(i, (list, tuple)) else ""
        raise Qwen35Error(f"token ids must be whole numbers; found {i!r}{batch}")
    return whole


def check_vocabulary(model: Qwen35Model, ids: list[int]) -> None:
    """A Qwen35Error for the first id outside the model's embedding (a tokenizer of another model), before the
    embedding lookup would fail on it (on CUDA a device-side assert that ends the process)."""
    vocab = model.config.vocab_size
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        bad = next(i for i in ids if not 0 <= i < vocab)
        raise Qwen35Error(f"token id {bad} is outside the model's vocabulary of {vocab}; the tokenizer does "
                          "not belong to this model")


def encode_prompt(model: Qwen35Model, prompt: str, system_prompt: str = "", thinking: bool = False,
                  use_chat_template: bool = True, allow_special_tokens: bool = False) -> list[int]:
    """Prompt ids: the chat template's markers as special tokens, the user's text (prompt and system
    prompt) as plain text, so `<|im_start|>` or `</think>` typed in it cannot open a turn. With
    allow_special_tokens the user's text is parsed for special tokens too (for hand-written templates)."""
    thinking, use_chat_template = flag("thinking", thinking), flag("use_chat_template", use_chat_template)
    allow_special_tokens = flag("allow_special_tokens", allow_special_tokens)
    if not isinstance(prompt, str):
        raise Qwen35Error(f"the prompt must be text, got {type(prompt).__name__}")
    if not prompt.strip():
        raise Qwen35Error("the prompt is empty; write a prompt")
    if not isinstance(system_prompt, str):
        raise Qwen35Error(f"the system prompt must be text, got {type(system_prompt).__name__}")
    check_text(prompt, "the prompt")
    check_text(system_prompt, "the system prompt")
    tok = model.tokenizer
    user = user_encoder(tok, allow_special_tokens)
    if not use_chat_template:
        return user(raw_head(tok, system_prompt, allow_special_tokens) + prompt)
    # the text format_chat writes, encoded piece by piece
    ids = []
    for kind, text in chat_layout(system_prompt, thinking):
        ids += tok.encode(text) if kind == "markup" else \
            user(prompt.strip()) if kind == "user" else user(text, "the system prompt")
    return ids


def generation_prompt_ids(model: Qwen35Model, thinking: bool) -> list[int]:
    """The ids of the chat template's generation prompt (`<|im_start|>assistant\n<think>...`)."""
    return model.tokenizer.encode(GENERATION_PROMPT_THINKING if thinking else GENERATION_PROMPT_NO_THINKING)


@torch.compiler.disable
@on_model_device
def prefill_ids(model: Qwen35Model, ids: list[int], thinking: bool = False, chat_template: bool = False,
                use_cache: bool = True, reuse_at_most: int | None = None) -> Prefill:
    """Run token ids through the model. Returns the Prefill (logits of the last position only).

    chat_template: the ids end with the chat template's generation prompt (for `thinking`); the state
    before it is kept in Prefill.turn, so a follow-up turn can continue (conversation.continue_prefill).
    The longest prefix an earlier prompt left in the model's K/V store (the system prompt, the whole user
    turn) is reused and only the rest runs (Prefill.cached_tokens; prefix.py), unless use_cache is off;
    this prompt's reuse points are kept for later ones. reuse_at_most: reuse at most this many tokens (an
    earlier read's cached_tokens: read again so, the same logits bit for bit where the store still keeps that
    snapshot).
    """
    thinking, chat_template = flag("thinking", thinking), flag("chat_template", chat_template)
    use_cache = flag("use_cache", use_cache)
    limit = model.config.max_position_embeddings
    shape = getattr(ids, "shape", None)
    if shape is not None and len(shape) != 1:  # a batch [1, T] as transformers takes it, say
        raise Qwen35Error(f"token ids must be one sequence (1-D), got a {type(ids).__name__} of shape "
                          f"{list(shape)}; pass ids[0] for a batch of one")
    ids = list(ids)  # a list, tuple, 1-D tensor or array
    if not ids:
        raise Qwen35Error("the prompt is empty; write a prompt")
    if len(ids) >= limit:
        raise Qwen35Error(f"the prompt has {len(ids)} tokens but the model takes at most {limit} positions "
                          f"(prompt and answer together); shorten the prompt")
    ids = [_token_id(i) for i in ids]
    check_vocabulary(model, ids)
    turn_end = None
    if chat_template:
        tail = generation_prompt_ids(model, thinking)
        if list(ids[len(ids) - len(tail):]) != tail or len(ids) <= len(tail):
            raise Qwen35Error("prefill_ids(chat_template=True): the ids do not end with the generation prompt "
                              f"for thinking={thinking}; pass chat_template=False for ids without the chat template, "
                              "or encode the prompt with encode_prompt")
        turn_end = len(ids) - len(tail)
    model.select_backend()
    points = [p for p in (system_end(model, ids) if chat_template else None, turn_end) if p]
    with growth_undone_on_failure(model.kv) as undo_growth:  # a failed prompt's growth given back
        try:
            synchronize(model.device)
            t0 = time.perf_counter()
            run = prefill_reusing(model, ids, points, limit=turn_end, use_cache=use_cache,
                                  needed=[turn_end] if turn_end else [], at_most=reuse_at_most)
            logits = host_logits(run.logits)
            synchronize(model.device)
        except RuntimeError as e:
            if not is_out_of_memory(e):
                raise  # out of memory is reported below, once this frame's tensors and the traceback are gone
        else:
            ms = (time.perf_counter() - t0) * 1000
            return Prefill(tuple(ids), logits, run.cache, ms, model.backend.name, thinking, model.serial,
                           turn=run.states.get(turn_end), cached_tokens=run.cached_tokens)
        run = None
        undo_growth()  # before the report, which counts what it gives back as free
        raise out_of_memory(model, f"reading a prompt of {len(ids):,} tokens",
                            prefill_bytes(model, len(ids)))


@on_model_device
def prefill(model: Qwen35Model, prompt: str, system_prompt: str = "", thinking: bool = False,
            use_chat_template: bool = True, allow_special_tokens: bool = False, use_cache: bool = True,
            reuse_at_most: int | None = None) -> Prefill:
    """Tokenise `prompt` (through the chat template unless use_chat_template is False) and prefill it,
    reusing a cached prefix unless use_cache is off (prefill_ids, as is reuse_at_most). Special-token text in
    the prompt stays text unless allow_special_tokens (see encode_prompt)."""
    ids = encode_prompt(model, prompt, system_prompt, thinking, use_chat_template, allow_special_tokens)
    # raw text opens no thinking block
    return prefill_ids(model, ids, thinking and use_chat_template, chat_template=use_chat_template,
                       use_cache=use_cache, reuse_at_most=reuse_at_most)


OnToken = Callable[[str, int, int], None]
KV_STEP = 256  # a generation reserves K/V room in multiples of this many positions (four 64-position store blocks)


def kv_capacity(needed: int, current: int, most: int) -> int:
    """Positions to reserve for `needed` tokens when `current` are full: multiples of KV_STEP, a quarter more than
    `current` at least (so a long answer re-allocates a few times, not per block), never above `most`.
    generate reserves for the tokens it has, not for max_new_tokens: a short answer costs a short cache."""
    want = max(needed, current + current // 4)
    return min(-(-want // KV_STEP) * KV_STEP, most)


class _HostTokens:
    """Token ids on their way to the host in queue order: push queues a copy of a device id (into pinned
    memory behind the work before it, on CUDA), pop waits for the oldest and returns it. Two in flight at
    most (the decode loop's one step ahead)."""

    def __init__(self, dev: torch.device):
        self.dev, self.cuda = dev, dev.type == "cuda"
        self.slots = [torch.empty(1, dtype=torch.long, pin_memory=self.cuda) for _ in range(2)]
        self.done = [torch.cuda.Event() for _ in range(2)] if self.cuda else []
        self.pushed = self.popped = 0

    def push(self, tok: torch.Tensor) -> None:
        i = self.pushed % 2
        self.slots[i].copy_(tok.view(1), non_blocking=self.cuda)
        if self.cuda:
            self.done[i].record(torch.cuda.current_stream(self.dev))  # the model's device, not the current one
        self.pushed += 1

    def drain(self) -> None:
        """Wait for everything queued so far (before a decode step is captured again)."""
        if self.cuda:
            torch.cuda.current_stream(self.dev).synchronize()

    def pop(self) -> int:
        i = self.popped % 2
        if self.cuda:
            self.done[i].synchronize()
        self.popped += 1
        return int(self.slots[i][0])


def _split_answer(model: Qwen35Model, out: list[int], thinking: bool, ended: bool) -> tuple[str, str]:
    """(thinking, answer) text. Only with thinking on does the first `</think>` token end the thinking;
    with it off the prompt already closed the block, so all of the output is the answer, a literal
    `</think>` in it included. A turn that `ended` (an end-of-turn token) without closing the block is the
    answer, as Qwen's own parsing reads it (a length cut there is thinking with no answer yet)."""
    tok = model.tokenizer
    if thinking:
        if out and out[0] == tok.token_id(THINK_OPEN):  # the prompt opened the block; a model may open it again
            out = out[1:]
        close = tok.token_id(THINK_CLOSE)
        if close in out:
            cut = out.index(close)
            return tok.decode(out[:cut]).strip(), tok.decode(out[cut + 1:]).strip()
        if not ended:
            return tok.decode(out).strip(), ""
    return "", tok.decode(out).strip()  # (generate stops before an end-of-turn token: `out` holds none)


def not_finite(model: Qwen35Model, where: str) -> Qwen35Error:
    """The error for logits that hold NaN or inf (`where`: whose logits), with the likely cause: in fp16 the
    activations leaving its range (the residual stream of some checkpoints passes 65,504), else the weights."""
    cause = ("the model's activations left fp16's range (65,504 at most); load the model as bf16 (or fp32)"
             if model.dtype == torch.float16 else
             "the weights hold NaN or inf values; download the checkpoint again")
    return Qwen35Error(f"the model's logits {where} are not finite numbers (NaN or inf): {cause}")


@torch.compiler.disable
@on_model_device
def generate(model: Qwen35Model, pf: Prefill, max_new_tokens: int = 256, sampling: SamplingParams | None = None,
             seed: int = 0, on_token: OnToken | None = None,
             on_thinking_end: Callable[[], None] | None = None) -> Generation:
    """Generate up to `max_new_tokens` after a prefill; stops at an end-of-turn token.

    on_token(delta_text, n_done, max_new_tokens) runs after every token; raising from it cancels.
    on_thinking_end() runs once, with thinking on, when the token that ends the thinking comes (the first
    `</think>` token, as Generation splits thinking and answer), before on_token gets its text: a stream's
    reader learns the boundary from the token, not from the text "</think>" (which the thinking may spell).
    The same prefill, settings and seed give the same text. Out of device memory, it raises a
    Qwen35Error that says what was needed and free; the model and the prefill stay as they were (a K/V
    store grown for the answer gives those blocks back when it fails or is cancelled).
    """
    with growth_undone_on_failure(*([pf.cache.store] if isinstance(pf, Prefill) else [])) as undo_growth:
        try:
            return _generate(model, pf, max_new_tokens, sampling, seed, on_token, on_thinking_end)
        except RuntimeError as e:
            if not is_out_of_memory(e):
                raise  # out of memory is reported below, once the run's tensors and the traceback are gone
        undo_growth()  # before the report, which counts what it gives back as free
        raise out_of_memory(model, f"generating after a prompt of {pf.n_tokens:,} tokens (max_new_tokens "
                                   f"{max_new_tokens})", generate_bytes(model, pf.n_tokens, max_new_tokens))


def checked_settings(max_new_tokens, sampling: SamplingParams | None, seed) -> tuple[int, SamplingParams, int]:
    """A generation's settings checked, before any work (a caller may check them before loading the weights):
    max_new_tokens as an int, the sampling parameters, the seed's 64 draw bits (draw_seed)."""
    sampling = SamplingParams() if sampling is None else sampling
    if not isinstance(sampling, SamplingParams):
        raise Qwen35Error(f"sampling is a {type(sampling).__name__}; pass SamplingParams(...) (e.g. "
                          "SamplingParams(do_sample=True, temperature=0.7)) or None for greedy decoding")
    sampling.check()
    whole = whole_number(max_new_tokens)
    if whole is None or whole < 1:
        raise Qwen35Error(f"max_new_tokens is {max_new_tokens!r}; it must be a whole number, at least 1")
    return whole, sampling, draw_seed(seed)


def _generate(model: Qwen35Model, pf: Prefill, max_new_tokens: int, sampling: SamplingParams | None,
              seed: int, on_token: OnToken | None, on_thinking_end: Callable[[], None] | None) -> Generation:
    max_new_tokens, sampling, seed = checked_settings(max_new_tokens, sampling, seed)
    if not isinstance(pf, Prefill):
        raise Qwen35Error(f"generate needs the Prefill that prefill() returned, got a {type(pf).__name__}; run "
                          "pf = prefill(model, prompt) first")
    if pf.model_id != model.serial:
        raise Qwen35Error("this prefill was made by another model; run the prefill again with this model")
    if not bool(torch.isfinite(pf.logits).all()):  # (on the host: a prefill's logits are copied there)
        raise not_finite(model, f"after the prompt of {pf.n_tokens:,} tokens")
    model.select_backend()
    # shares the prefill's K/V blocks (one block copied: the prefill's last, partly filled one); when even that
    # is not free, the store's message says why (the answer's length plays no part in it)
    cache = pf.cache.clone(pf.n_tokens + 1, device=model.device)
    try:
        return _answer(model, pf, cache, max_new_tokens, sampling, seed, on_token, on_thinking_end)
    except BaseException:  # a cancel, out of memory: the answer's blocks go back now, not with the traceback that
        cache.store.pool.free(cache.seq)  # holds its frames, so that a store grown for them can shrink back
        raise


def _answer(model: Qwen35Model, pf: Prefill, cache: Cache, max_new_tokens: int, sampling: SamplingParams,
            seed: int, on_token: OnToken | None, on_thinking_end: Callable[[], None] | None) -> Generation:
    """generate's decode loop, into `cache` (the fork of pf's)."""
    limit = model.config.max_position_embeddings
    budget = min(max_new_tokens, limit - pf.n_tokens)
    dev = model.device
    most = pf.n_tokens + budget  # the cache never needs more positions than this
    def no_room(e: Qwen35Error) -> Qwen35Error:
        return Qwen35Error(f"{e}. The answer had {len(out):,} tokens after a prompt of {pf.n_tokens:,}: lower "
                           f"max_new_tokens ({max_new_tokens:,}) or raise the K/V cache budget")

    out: list[int] = []
    step = graphed_decode(model, cache, most) if budget > 2 else None
    eos = set(model.config.eos_token_ids) | set(model.tokenizer.eos_token_ids)
    marks = penalty_marks(pf.token_ids, sampling, pf.logits.numel(), dev)  # ids the penalties see
    stream = model.tokenizer.stream_decoder()
    # the token that ends the thinking (_split_answer's rule), watched for while on_thinking_end waits for it
    close = model.tokenizer.token_id(THINK_CLOSE) if pf.thinking and on_thinking_end is not None else None
    finish = "length"
    t0 = time.perf_counter()
    first_ms = t_decode = 0.0
    host = _HostTokens(dev)

    def next_token(logits: torch.Tensor, n: int) -> torch.Tensor:
        """Answer token n from the logits before it, picked on the device (and marked for the penalties); its id
        is queued for the host (host.pop)."""
        tok = pick(logits, sampling, seed, n, model.backend, marks)
        host.push(tok)
        return tok

    # On CUDA the loop runs one step ahead: step n + 1 and token n + 1 are queued behind token n before the
    # host reads it, so the GPU computes the next token while the host checks this one and streams its text
    # (after an end-of-turn token the step queued behind it is left unread; the cache is this generation's
    # own). On a CPU each op runs as it is called: nothing would overlap, and the step after the end of the
    # turn would cost its whole time, so the next step comes after the host has read the token.
    ahead = host.cuda

    # the newest logits queued and the ones before them (NaN or inf once an overflow reaches the cache or the GDN
    # state): the end-of-answer check reads those of the last token the host read
    before = last = pf.logits

    def room() -> bool:
        """More blocks where the cache is full (the graph's table has room for `most`): whether it took any. The
        store's Qwen35Error where a fixed one lacks even the one block the next token needs."""
        if cache.length < cache.capacity:
            return False
        try:
            cache.reserve(kv_capacity(cache.length + 1, cache.capacity, most))
        except Qwen35Error:  # a fixed store short of the rounded room: the one block the next token needs
            cache.reserve(cache.length + 1)
        return True

    def queue_step(n: int, grown: bool | None = None) -> None:
        """Decode the token before answer token n into the cache and pick token n (tok); grown: room() ran."""
        nonlocal step, tok, before, last
        if grown is None:
            try:
                grown = room()
            except Qwen35Error as e:
                raise no_room(e) from None
        if grown and step is not None and step.version != cache.store.version:  # the store grew: new tensors
            step = None  # the old graph goes before the new one is captured
            host.drain()  # and nothing of it is in flight
            step = graphed_decode(model, cache, most)
        elif grown and step is not None:
            step.slot.set_blocks(cache.seq.blocks)
        before, last = last, (step(tok) if step is not None else model.forward_decode(tok, cache))[0]
        tok = next_token(last, n)

    # ahead of the host, the room the step after token n needs is taken before token n is read: where there is
    # none (a fixed store full, or no memory to grow one), that is an error only if token n does not end the answer
    short = None
    tok = next_token(pf.logits.to(dev), 0)
    for n in range(budget):
        if ahead and n + 1 < budget:
            try:
                grown = room()
            except (Qwen35Error, RuntimeError) as e:
                if not isinstance(e, Qwen35Error) and not is_out_of_memory(e):
                    raise
                short = e.with_traceback(None)  # kept without its frames (this one's tensors among them)
                short.__context__ = None
            else:
                queue_step(n + 1, grown)
        done = host.pop()
        if n == 0:
            first_ms = (time.perf_counter() - t0) * 1000 + pf.ms
            t_decode = time.perf_counter()
        if done in eos:
            finish = "stop"
            break
        out.append(done)
        if done == close:
            close = None
            on_thinking_end()
        if on_token is not None:
            on_token(stream.feed(done), n + 1, max_new_tokens)
        if short is not None:
            raise no_room(short) if isinstance(short, Qwen35Error) else short
        if not ahead and n + 1 < budget:
            queue_step(n + 1)
    decode_s = time.perf_counter() - t_decode
    # checked once at the end (an overflow poisons every later step through the cache and the GDN state): the
    # answer is an error, not a run of one repeated token; no step waits for the check. Ahead of the host, a step
    # was queued behind the end-of-turn token (len(out) + 1 < budget): it is no part of the answer, so the logits
    # before it are read, where they are still there (a captured step writes every output into one buffer, and a
    # poisoned run does not reach an end-of-turn token: NaN logits pick id 0, or one id again and again)
    read = last
    if ahead and finish == "stop" and len(out) + 1 < budget and short is None:
        read = before if before.data_ptr() != last.data_ptr() else None
    if read is not None and not bool(torch.isfinite(read).all()):
        raise not_finite(model, f"while answering (found after {len(out):,} tokens)")
    rest = stream.flush()  # the end of a character the length limit cut (U+FFFD, as the answer's text has it)
    if rest and on_token is not None:
        on_token(rest, len(out), max_new_tokens)
    thinking, answer = _split_answer(model, out, pf.thinking, finish == "stop")
    steps = len(out) + (finish == "stop") - 1  # the tokens decoded after the first, an end-of-turn token too
    return Generation(answer, thinking, tuple(out), first_ms, steps / decode_s if steps > 0 and decode_s > 0 else 0.0,
                      finish)
