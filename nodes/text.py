"""Qwen35TextPrefill and Qwen35Generate: thin adapters over runtime.prefill and runtime.generate."""
from __future__ import annotations

import logging
import time
from contextlib import ExitStack

import comfy.model_management as mm
import comfy.utils
from comfy_api.latest import io

from .types import (
    ModelPrefill,
    Qwen35Model,
    Qwen35Prefill,
    cancellable,
    linked,
    made,
    running,
    shown_again,
    workflow_id,
)

log = logging.getLogger(__name__)

# The front end (web/qwen35.js) listens for this: {node, display_node, item, prompt_id, delta, n, max, t, thinking},
# and when n is above 0 also `answering` and `closes`, where the runtime's </think> token ends the thinking (not
# the text "</think>", which thinking may spell out of other tokens): `closes` true on the event of that token,
# whose delta ends with the tag's text (the answer starts after it); `answering` true on every event after it.
# n == 0 starts a new answer on that node and says (`thinking`) whether thinking text comes first; item is the
# answer's place in a list of prefills (the one-prompt-per-image mode: the node answers each in turn), so that the
# page keeps the earlier answers of the list while the next one streams. prompt_id names the workflow tab the
# text belongs to: the page writes it into the node of the workflow that queued that prompt, not into the shown
# tab's node of the same id.
STREAM_EVENT = "qwen35.stream"


def _send(event: str, data: dict) -> None:
    try:
        from server import PromptServer
    except ImportError:  # nodes run outside a ComfyUI server (tests, scripts)
        return
    server = getattr(PromptServer, "instance", None)
    # a prompt queued without a client id gets no node events from ComfyUI either: sent to nobody (to every open
    # tab it would stream into whichever node has this id in that tab's workflow)
    if server is not None and getattr(server, "client_id", None) is not None:
        server.send_sync(event, {**data, "prompt_id": getattr(server, "last_prompt_id", None)},
                         server.client_id)


class Qwen35TextPrefill(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Qwen35TextPrefill",
            **shown_again(),
            display_name="Qwen3.5 Text Prefill",
            category="Qwen3.5",
            description="Reads the prompt into the model once. ComfyUI caches the result, so any number of "
                        "Generate nodes can continue from it without reading the prompt again.",
            search_aliases=["qwen", "llm", "prompt", "chat"],
            inputs=[
                Qwen35Model.Input("model", tooltip="The model of a Qwen3.5 Model Loader."),
                io.String.Input("prompt", multiline=True, default="",
                                tooltip="The user message."),
                io.String.Input("system_prompt", multiline=True, default="",
                                tooltip="Optional system message. With use_chat_template off it goes before the "
                                        "prompt, a blank line between them."),
                io.Boolean.Input("thinking", default=False,
                                 tooltip="Let the model think before it answers; the thinking comes out "
                                         "of Generate separately."),
                io.Boolean.Input("use_chat_template", default=True, advanced=True,
                                 tooltip="Off: the system prompt (if any) and the prompt go in as raw text, for "
                                         "completion; thinking is then off."),
                io.Boolean.Input("allow_special_tokens", default=False, advanced=True, optional=True,
                                 tooltip="On: special tokens written in the prompt (<|im_start|>, <think>...) "
                                         "act as such. Off: they stay plain text and cannot open a chat turn."),
            ],
            outputs=[Qwen35Prefill.Output(display_name="prefill")],
            hidden=[io.Hidden.extra_pnginfo],  # the workflow's id (workflow_id); not part of ComfyUI's cache key
        )

    @classmethod
    def execute(cls, model, prompt, system_prompt="", thinking=False, use_chat_template=True,
                allow_special_tokens=False) -> io.NodeOutput:
        from ..runtime import encode_prompt, prefill_ids
        from ..runtime.memory import prefill_bytes

        with linked(model, "model").released_on_error():  # (a bad prompt too: the weights are on the GPU already)
            ids = encode_prompt(model.model, prompt, system_prompt=system_prompt, thinking=thinking,
                                use_chat_template=use_chat_template, allow_special_tokens=allow_special_tokens)

            def run(reuse_at_most=None):
                model.load(memory_required=prefill_bytes(model.model, len(ids)))
                with cancellable():
                    return prefill_ids(model.model, ids, thinking=thinking and use_chat_template,
                                       chat_template=use_chat_template, reuse_at_most=reuse_at_most)
            result = run()
        stats = {"n_tokens": result.n_tokens, "cached_tokens": result.cached_tokens,
                 "new_tokens": result.new_tokens, "ms": round(result.ms, 2),
                 "tokens_per_s": round(result.tokens_per_s, 1), "backend": result.backend,
                 "thinking": result.thinking}
        log.info("Qwen3.5 prefill: %d tokens in %.1f ms (%.0f tok/s, %s)", result.n_tokens, result.ms,
                 result.tokens_per_s, result.backend)
        model.track(result)
        out = ModelPrefill(model, result, remake=run, node=running()[1], workflow=workflow_id(cls.hidden))
        made(out.node, [out], out.workflow)
        return io.NodeOutput(out, ui={"qwen35_prefill": [stats]})


class Qwen35Generate(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Qwen35Generate",
            display_name="Qwen3.5 Generate",
            category="Qwen3.5",
            description="Generates text from a prefill; the answer streams onto the node. The same seed "
                        "gives the same text, and the prefill is left as it was.",
            search_aliases=["qwen", "llm", "generate text", "prompt enhancer"],
            inputs=[
                Qwen35Prefill.Input("prefill", tooltip="The prompt as a Qwen3.5 Text, Multimodal or Continue node "
                                                       "read it; a list of them (one prompt per image) is answered "
                                                       "one after the other."),
                io.Int.Input("max_new_tokens", default=256, min=1, max=32768,
                             tooltip="Stops after this many tokens if the model has not finished."),
                io.Boolean.Input("sampling", default=True, label_on="sample", label_off="greedy",
                                 tooltip="Off: always the most likely token after the repetition and presence "
                                         "penalties (temperature, top_k, top_p and min_p are ignored)."),
                io.Float.Input("temperature", default=0.7, min=0.01, max=2.0, step=0.01,
                               tooltip="Lower: closer to greedy; ignored when sampling is off."),
                io.Int.Input("top_k", default=20, min=0, max=1000, tooltip="0: no limit."),
                io.Float.Input("top_p", default=0.8, min=0.01, max=1.0, step=0.01,
                               tooltip="Keep the most likely tokens up to this much probability; 1: off."),
                io.Float.Input("min_p", default=0.0, min=0.0, max=0.99, step=0.01,
                               tooltip="Drop tokens less likely than this times the top one; 0: off."),
                io.Float.Input("repetition_penalty", default=1.0, min=0.01, max=5.0, step=0.01, advanced=True,
                               tooltip="Above 1 discourages tokens already in the prompt or answer; 1: off."),
                io.Float.Input("presence_penalty", default=0.0, min=0.0, max=5.0, step=0.01, advanced=True,
                               tooltip="Subtracted from the logit of every token already in the answer; 0: off. "
                                       "1.5 helps where answers loop."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                             tooltip="The sampling's seed: the same prefill, settings and seed give the same text "
                                     "on the same machine."),
            ],
            outputs=[
                io.String.Output(display_name="text", is_output_list=True),
                io.String.Output(display_name="thinking", is_output_list=True),
            ],
            hidden=[io.Hidden.unique_id, io.Hidden.dynprompt],
            is_output_node=True,
            # a list of prefills (one prompt per image) comes in one call, which answers each in turn: with
            # keep_loaded off the VRAM goes back once, after the last answer (run once per item, as ComfyUI runs
            # other nodes, the node could not tell the last item and gave it back and took it again per item)
            is_input_list=True,
        )

    @classmethod
    def execute(cls, prefill, max_new_tokens=(256,), sampling=(True,), temperature=(0.7,), top_k=(20,),
                top_p=(0.8,), min_p=(0.0,), repetition_penalty=(1.0,), presence_penalty=(0.0,),
                seed=(0,)) -> io.NodeOutput:
        """Every input is a list (is_input_list). There are as many answers as the longest list has items; answer
        i takes each list's item i, or its last where the list is shorter (ComfyUI's rule for a node it runs once
        per item)."""
        settings = {"max_new_tokens": max_new_tokens, "sampling": sampling, "temperature": temperature,
                    "top_k": top_k, "top_p": top_p, "min_p": min_p, "repetition_penalty": repetition_penalty,
                    "presence_penalty": presence_penalty, "seed": seed}
        lists = [prefill, *settings.values()]
        if any(len(values) == 0 for values in lists):  # an empty list upstream: nothing to answer
            return io.NodeOutput([], [], ui={"text": [], "thinking": [], "qwen35_generate": []})
        hidden = cls.hidden  # None when execute is called outside a ComfyUI run (tests, scripts)
        node_id = hidden.unique_id if hidden else None
        display_node = node_id
        if hidden and hidden.dynprompt is not None and node_id is not None:
            display_node = hidden.dynprompt.get_display_node_id(node_id)
        handles = []  # the models of these prefills, each once (a list can join the prefills of two loaders)
        for item in prefill:
            if all(linked(item, "prefill").model is not h for h in handles):
                handles.append(item.model)
        texts, thinkings, shown = [], [], []
        with ExitStack() as released:
            for handle in handles:
                released.enter_context(handle.released_on_error())
            for i in range(max(len(values) for values in lists)):
                pf = prefill[min(i, len(prefill) - 1)]
                result, stats = _answer(pf, i, node_id, display_node,
                                        **{k: v[min(i, len(v) - 1)] for k, v in settings.items()})
                texts.append(result.text)
                thinkings.append(result.thinking)
                shown.append(stats)
        for handle in handles:
            if not handle.keep_loaded:
                handle.release()
        return io.NodeOutput(texts, thinkings, ui={"text": texts, "thinking": thinkings, "qwen35_generate": shown})


def _answer(pf: ModelPrefill, item: int, node_id, display_node, *, max_new_tokens, sampling, temperature, top_k,
            top_p, min_p, repetition_penalty, presence_penalty, seed):
    """One answer of Generate's list: the runtime's generate with the stream sent to the page and the node's
    progress bar; returns the runtime's result and the stats the node shows."""
    from ..runtime import SamplingParams, generate
    from ..runtime.chat import THINK_CLOSE
    from ..runtime.generate import checked_settings
    from ..runtime.memory import generate_bytes

    model = pf.model
    params = SamplingParams(do_sample=sampling, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty)
    checked_settings(max_new_tokens, params, seed)  # before the weights are moved back to the GPU for nothing
    bar = comfy.utils.ProgressBar(max_new_tokens, node_id=node_id)
    event = {"node": node_id, "display_node": display_node, "item": item}
    thinking = pf.prefill.thinking
    # where the thinking ends, as the runtime splits it: at the </think> token (text that spells "</think>" out of
    # other tokens is thinking). closes: this token ends it; answering: it ended before this token
    boundary = {"closes": False, "answering": False}

    def thinking_ends():
        boundary["closes"] = True

    def on_token(delta: str, n_done: int, total: int):
        mm.throw_exception_if_processing_interrupted()  # a cancel lands within one token
        bar.update_absolute(n_done, total)
        # t: when the token passed the cancel check (the server's clock, seconds since the epoch)
        # (all three in every event: a page reloaded mid-answer lays the answer out from any of them, and an event
        # with `closes` tells the page that the boundary comes from the token: it never cuts at the text then)
        _send(STREAM_EVENT, {**event, "delta": delta, "n": n_done, "max": total, "t": time.time(),
                              "thinking": thinking, "answering": boundary["answering"], "closes": boundary["closes"]})
        boundary["answering"] = boundary["answering"] or boundary["closes"]
        boundary["closes"] = False

    _send(STREAM_EVENT, {**event, "delta": "", "n": 0, "max": max_new_tokens, "t": time.time(),
                          "thinking": thinking})
    model.load(memory_required=generate_bytes(model.model, pf.prefill.n_tokens, max_new_tokens))
    result = generate(model.model, pf.prefill, max_new_tokens=max_new_tokens, sampling=params, seed=seed,
                      on_token=on_token, on_thinking_end=thinking_ends)
    bar.update_absolute(max_new_tokens, max_new_tokens)
    # the first token's latency counts the prompt's time where the prompt was read in this run, in the first answer
    # from it (of this node or another Generate's); a prefill ComfyUI took from its cache, or answered before in
    # this run, cost this answer nothing
    read_here = pf.made_in == running()[0] and not pf.read_time_shown
    pf.read_time_shown = pf.read_time_shown or read_here
    first_ms = result.first_token_ms - (0.0 if read_here else pf.prefill.ms)
    stats = {"n_tokens": result.n_tokens, "first_token_ms": round(first_ms, 2),
             "decode_tokens_per_s": round(result.decode_tokens_per_s, 1), "finish_reason": result.finish_reason}
    full = (f"the prompt and the answer filled the model's {model.model.config.max_position_embeddings:,} positions; "
            "shorten the prompt")
    # (no </think>: generate's answer is empty, all of it thinking)
    # (the page's summary of a list of answers counts these two flags)
    stats["no_answer"] = result.finish_reason == "length" and pf.prefill.thinking \
        and model.model.tokenizer.token_id(THINK_CLOSE) not in result.token_ids
    stats["positions_ran_out"] = result.finish_reason == "length" and result.n_tokens < max_new_tokens
    if stats["no_answer"]:
        fix = full if stats["positions_ran_out"] else "raise max_new_tokens (or turn thinking off)"
        stats["note"] = f"stopped while thinking, after {result.n_tokens} tokens: no answer yet; {fix}"
    elif stats["positions_ran_out"]:  # cut short of max_new_tokens
        stats["note"] = f"the answer stopped after {result.n_tokens} of max_new_tokens {max_new_tokens}: {full}"
    if "note" in stats:
        log.warning("Qwen3.5 generate: %s", stats["note"])
    log.info("Qwen3.5 generate: %d tokens, first after %.1f ms, %.1f tok/s decode (%s)", result.n_tokens,
             first_ms, result.decode_tokens_per_s, result.finish_reason)
    return result, stats
