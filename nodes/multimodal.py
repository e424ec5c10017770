"""Qwen35MultimodalPrefill: images and / or video with a prompt -> QWEN35_PREFILL (a thin adapter over
runtime.prefill_multimodal; media preprocessing and the vision tower live in the runtime)."""
from __future__ import annotations

import functools
import logging

import comfy.model_management as mm
import comfy.utils
import torch
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
from .video import video_clip

log = logging.getLogger(__name__)

ALL_IN_ONE = "all images in one prompt"
PER_IMAGE = "one prompt per image"


def _stats(pf, scaled_note: str) -> dict:
    v = pf.vision
    return {"n_tokens": pf.n_tokens, "cached_tokens": pf.cached_tokens, "new_tokens": pf.new_tokens,
            "ms": round(pf.ms, 2), "tokens_per_s": round(pf.tokens_per_s, 1),
            "backend": pf.backend, "thinking": pf.thinking,
            "vision_tokens": v.vision_tokens if v else 0, "text_tokens": v.text_tokens if v else pf.n_tokens,
            "vision_ms": round(v.vision_ms, 2) if v else 0.0, "prefill_ms": round(v.prefill_ms, 2) if v else pf.ms,
            "note": scaled_note}


def _per_image(images, prompt: str) -> list:
    """The batches of 'one prompt per image', an image each, once the prompt is checked to name no image after the
    first (each prompt holds one image of the batch). One [H, W, C] image, as the runtime takes it, is one batch."""
    from ..runtime import Qwen35Error
    from ..runtime.multimodal import PLACEHOLDER

    if images is None:
        raise Qwen35Error("mode 'one prompt per image' needs images; connect an IMAGE batch")
    batches = []
    for part in images if isinstance(images, (list, tuple)) else [images]:  # (a list: through a node of any type)
        if not isinstance(part, torch.Tensor):
            raise Qwen35Error(f"the images input holds a {type(part).__name__}, not an IMAGE; connect an IMAGE batch")
        part = part[None] if part.dim() == 3 else part
        batches += [part[i:i + 1] for i in range(part.shape[0])]
    if not batches:
        raise Qwen35Error("the image batch is empty (0 images); connect an image")
    placed = 0
    for m in PLACEHOLDER.finditer(prompt or ""):
        if m.group(1) is not None and int(m.group(1)) != 1:
            raise Qwen35Error(f"the prompt names <image {m.group(1)}>, but in mode 'one prompt per image' each prompt "
                              "holds one image of the batch; write <image> where it goes, or choose 'all images in "
                              "one prompt' to compare them")
        placed += m.group(0).startswith("<image")
        if placed > 1:
            raise Qwen35Error("the prompt places an image twice (<image> or <image 1>), but in mode 'one prompt per "
                              f"image' each prompt holds one image of the batch ({len(batches)} prompts); write "
                              "<image> once, or choose 'all images in one prompt' to compare them")
    return batches


def _frames_note(model, clip) -> str:
    """range_note of a video given as frames (the frames input, or a VIDEO held in memory), over the frames the
    runtime samples: as for images, a video the prefix cache answered is not read in the runtime, and frames in
    0..255 read as white. A file's frames are decoded into 0..1 (clip is then a FileVideo)."""
    from ..runtime.media import check_finite, frames_range_note, read_preprocessing, sample_frames

    if not isinstance(clip, tuple):
        return ""
    frames, fps = clip
    index = sample_frames(frames.shape[0], fps, read_preprocessing(getattr(model, "path", None)))
    note = frames_range_note(check_finite(frames[i]) for i in index)
    return f"the video's {note}" if note else ""


def _per_image_limit(model, max_pixels: int) -> str:
    """The scaled-down note's limit for images: max_pixels as given, and where it is below the smallest image the
    tower takes (one merged patch: 32 x 32 pixels in Qwen3.5), that the images were made that small and no smaller."""
    if not max_pixels:
        return "the checkpoint's max_pixels"
    from ..runtime.media import read_preprocessing

    side = read_preprocessing(getattr(model, "path", None)).factor
    if max_pixels < side * side:
        return f"max_pixels {max_pixels:,} (an image is at least {side} x {side} = {side * side:,} pixels)"
    return f"max_pixels {max_pixels:,} an image"


class Qwen35MultimodalPrefill(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="Qwen35MultimodalPrefill",
            **shown_again(),
            display_name="Qwen3.5 Multimodal Prefill",
            category="Qwen3.5",
            description="Reads images and / or a video with the prompt into the model once (the vision tower of the "
                        "checkpoint, then the text model). Name where each goes in the prompt with <image>, "
                        "<image 2> or <video>; unnamed ones go before the text. Generate continues from the "
                        "prefill as from a text prefill. 'one prompt per image' makes one prefill per image of "
                        "the batch, so one Generate node captions each image on its own.",
            search_aliases=["qwen", "vl", "vision", "caption", "image to text", "describe image", "video"],
            inputs=[
                Qwen35Model.Input("model", tooltip="The model of a Qwen3.5 Model Loader (a checkpoint with its "
                                                   "vision tower, for images and video)."),
                io.String.Input("prompt", multiline=True, default="Describe this image.",
                                tooltip="The user message; <image>, <image 2>, <video> place the inputs."),
                io.Image.Input("images", optional=True,
                               tooltip="One or more images (a batch is several images in one prompt)."),
                io.Video.Input("video", optional=True, tooltip="A video; frames are sampled at 2 per second."),
                io.Image.Input("frames", optional=True,
                               tooltip="A video given as an IMAGE batch of frames (with frame_rate)."),
                io.Float.Input("frame_rate", default=24.0, min=0.01, max=1000.0, step=0.01,
                               tooltip="Frames per second of the 'frames' input."),
                io.Combo.Input("mode", options=[ALL_IN_ONE, PER_IMAGE], default=ALL_IN_ONE,
                               tooltip="One prompt per image: a list of prefills, one per image of the batch."),
                io.String.Input("system_prompt", multiline=True, default="",
                                tooltip="Optional system message."),
                io.Boolean.Input("thinking", default=False,
                                 tooltip="Let the model think before it answers."),
                io.Int.Input("max_pixels", default=0, min=0, max=16_777_216, step=1024, advanced=True,
                             tooltip="Largest image (width x height) the tower sees; bigger ones are scaled "
                                     "down. 0: the checkpoint's setting (16.7 MP). Fewer pixels, fewer tokens."),
            ],
            outputs=[Qwen35Prefill.Output(display_name="prefill", is_output_list=True)],
            hidden=[io.Hidden.extra_pnginfo],  # the workflow's id (workflow_id); not part of ComfyUI's cache key
        )

    @classmethod
    def execute(cls, model, prompt="", images=None, video=None, frames=None, frame_rate=24.0, mode=ALL_IN_ONE,
                system_prompt="", thinking=False, max_pixels=0) -> io.NodeOutput:
        from ..runtime import Qwen35Error, prefill_multimodal, read_video
        from ..runtime.media import check_finite, range_note

        with linked(model, "model").released_on_error():  # (bad input too: the loader put the weights on the GPU)
            if video is not None and frames is not None:
                raise Qwen35Error("both a video and frames are connected; connect one of them")
            clip = video_clip(video) if video is not None else (frames, frame_rate) if frames is not None else None
            batches = _per_image(images, prompt) if mode == PER_IMAGE else [images]
            model.load()
            out, stats = [], []
            node, workflow = running()[1], workflow_id(cls.hidden)
            bar = comfy.utils.ProgressBar(len(batches)) if len(batches) > 1 else None

            def run(batch, video=clip, bar: bool = True, reuse_at_most=None):
                # (a prefill made again later, after ComfyUI let it go: the weights back first, so that its images
                # are resized where the first one's were, on the model's device, and the backend is that device's)
                model.load()
                with cancellable(bar=bar):
                    return prefill_multimodal(model.model, prompt, images=batch, video=video,
                                              system_prompt=system_prompt, thinking=thinking,
                                              max_pixels=max_pixels or None,
                                              reserve=lambda needed: model.load(memory_required=needed),
                                              reuse_at_most=reuse_at_most)
            shared = clip
            if clip is not None and len(batches) > 1:
                with cancellable(bar=False):  # the video read once for all the prompts (a file decoded once); a
                    shared = read_video(model.model, clip)  # prefill made again later reads `clip` itself
            video_note = None  # (read once the first prefill has checked the clip)
            for i, batch in enumerate(batches):
                mm.throw_exception_if_processing_interrupted()  # Cancel between the prompts of a batch
                pf = run(batch, shared, bar=bar is None)
                notes = []
                if pf.vision is not None and pf.vision.scaled_down:
                    per_image = _per_image_limit(model.model, max_pixels)
                    limits = ([per_image] if batch is not None else []) \
                        + (["the checkpoint's pixel budget over a video's frames"] if clip is not None else [])
                    notes.append(f"{pf.vision.scaled_down} input(s) scaled down to fit {' / '.join(limits)} "
                                 f"(grids {', '.join('x'.join(map(str, g)) for g in pf.vision.grids)})")
                    log.info("Qwen3.5 multimodal prefill: %s", notes[-1])
                # read here as well as in the runtime (which warns in the log as it reads them): an image the
                # prefix cache answered is not read there, and its note belongs on this run's panel too
                if batch is not None:
                    notes.append(range_note(*check_finite(batch)))
                if video_note is None:
                    video_note = _frames_note(model.model, clip)
                notes.append(video_note)
                note = "; ".join(n for n in notes if n)
                v = pf.vision
                log.info("Qwen3.5 multimodal prefill: %d vision + %d text tokens; vision %.1f ms, prefill %.1f ms",
                         v.vision_tokens if v else 0, v.text_tokens if v else pf.n_tokens,
                         v.vision_ms if v else 0.0, v.prefill_ms if v else pf.ms)
                model.track(pf)
                if len(batches) > 1:  # (all of the list's states would wait in VRAM for their Generate)
                    model.park(pf)
                out.append(ModelPrefill(model, pf, item=i, items=len(batches),
                                        remake=functools.partial(run, batch), node=node, workflow=workflow))
                stats.append(_stats(pf, note))
                if bar is not None:
                    bar.update(1)
        made(node, out, workflow)
        return io.NodeOutput(out, ui={"qwen35_prefill": stats})
