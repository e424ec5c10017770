"""Qwen35ContinuePrefill ("Qwen3.5 Continue"): a prefill plus a follow-up turn -> a new QWEN35_PREFILL that
runs only the new tokens (a thin adapter over runtime.continue_prefill)."""
from __future__ import annotations

import logging

from comfy_api.latest import io

from .types import ModelPrefill, Qwen35Prefill, cancellable, linked, made, running, shown_again, workflow_id

log = logging.getLogger(__name__)


def _stats(pf, images=None) -> dict:
    """What a prefill node shows: tokens (reused from a parent and new), time, and the vision part."""
    from ..runtime.media import check_finite, range_note

    v = pf.vision
    stats = {"n_tokens": pf.n_tokens, "cached_tokens": pf.cached_tokens, "new_tokens": pf.new_tokens,
             "ms": round(pf.ms, 2), "tokens_per_s": round(pf.tokens_per_s, 1), "backend": pf.backend,
             "thinking": pf.thinking}
    if v is not None:  # this turn had images
        notes = [f"{v.scaled_down} input(s) scaled down to fit their pixel limit" if v.scaled_down else ""]
        # read here as in the Multimodal Prefill (the runtime only warns in the log, and not at all where the
        # prefix cache answered the image): pixels outside 0..1 belong on this run's panel
        if images is not None:
            notes.append(range_note(*check_finite(images)))
        stats.update(vision_tokens=v.vision_tokens, text_tokens=v.text_tokens, vision_ms=round(v.vision_ms, 2),
                     prefill_ms=round(v.prefill_ms, 2), note="; ".join(n for n in notes if n))
    return stats


class Qwen35ContinuePrefill(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Qwen35ContinuePrefill",
            **shown_again(),
            display_name="Qwen3.5 Continue",
            category="Qwen3.5",
            description="Adds a follow-up turn to a prefill: optionally the previous answer (a Generate node's "
                        "text) as the assistant's turn, then a new user message with optional images. Only the "
                        "new tokens are read; the earlier turns (system prompt, images, questions) are reused "
                        "from the prefill it continues, which stays as it was. Several Continue nodes can branch "
                        "from one prefill: one image read once, many questions about it.",
            search_aliases=["qwen", "follow-up", "multi-turn", "chat", "conversation", "ask again", "reuse prefill"],
            inputs=[
                Qwen35Prefill.Input("prefill", tooltip="The conversation so far (a Text, Multimodal or Continue "
                                                       "prefill made with the chat template)."),
                io.String.Input("prompt", multiline=True, default="",
                                tooltip="The next user message; <image>, <image 2> place this turn's images."),
                io.Image.Input("images", optional=True, tooltip="Images for this turn (read only here)."),
                io.String.Input("previous_answer", optional=True, force_input=True, multiline=True,
                                tooltip="The assistant's answer to the prefill (a Generate node's text); it goes "
                                        "in as the assistant's turn before the new message. Unconnected: the new "
                                        "message follows the previous one directly."),
                io.Boolean.Input("thinking", default=False,
                                 tooltip="Let the model think before it answers this turn."),
                io.Int.Input("max_pixels", default=0, min=0, max=16_777_216, step=1024, advanced=True,
                             tooltip="Largest image (width x height) the tower sees for this turn's images; 0: "
                                     "the checkpoint's setting."),
            ],
            outputs=[Qwen35Prefill.Output(display_name="prefill")],
            hidden=[io.Hidden.extra_pnginfo],  # the workflow's id (workflow_id); not part of ComfyUI's cache key
        )

    @classmethod
    def execute(cls, prefill, prompt="", images=None, previous_answer=None, thinking=False,
                max_pixels=0) -> io.NodeOutput:
        from ..runtime import Qwen35Error, continue_prefill

        model = linked(prefill, "prefill").model
        with model.released_on_error():  # (bad input too: the weights may be on the GPU already)
            if images is not None and "<video>" in (prompt or ""):  # with images the prompt's placeholders are read
                raise Qwen35Error("the prompt names <video>, but this node takes images only; remove <video> from "
                                  "the prompt, or read the video in a Qwen3.5 Multimodal Prefill and continue from it")

            def run(reuse_at_most=None):
                parent = prefill.prefill  # (made again first where it was let go)
                model.load()
                # room for the new turn (its tokens and images), made once the turn is laid out
                with cancellable():
                    return continue_prefill(model.model, parent, prompt, images=images,
                                            previous_answer=previous_answer, thinking=thinking,
                                            max_pixels=max_pixels or None,
                                            reserve=lambda needed: model.load(memory_required=needed),
                                            reuse_at_most=reuse_at_most)
            pf = run()
        log.info("Qwen3.5 continue: %d tokens reused, %d new in %.1f ms (%s)", pf.cached_tokens, pf.new_tokens,
                 pf.ms, pf.backend)
        model.track(pf)
        if prefill.items > 1:  # one of a list: its states wait off the GPU, as its parent's (ManagedModel.park)
            model.park(pf)
        out = ModelPrefill(model, pf, prefill.item, prefill.items, remake=run, node=running()[1],
                           workflow=workflow_id(cls.hidden))
        made(out.node, [out], out.workflow)
        return io.NodeOutput(out, ui={"qwen35_prefill": [_stats(pf, images)]})
