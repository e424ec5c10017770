"""Prompts with images and video: token layout, vision tower, multimodal positions, one prefill.

Layout of one image in the prompt: <|vision_start|> <|image_pad|> x n <|vision_end|>, n = patches / 4.
A video becomes, for each 2-frame slice, the text `<{t:.1f} seconds>` and then
<|vision_start|> <|video_pad|> x n <|vision_end|>. The prompt names where each goes: `<image>` (the
next image not yet placed), `<image 2>` (the second image, counting from 1), `<video>`. Inputs the
prompt does not name go before its text, images first, as Qwen's chat template places the images
and videos of a message ahead of its text.

The tower runs once over all inputs (in the order they appear in the prompt), its output replaces
the embeddings of the pad tokens, and the text model runs with the positions rope.py lays out.
"""
from __future__ import annotations

import numbers
import re
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .. import kernels
from .chat import chat_layout
from .devices import is_other_accelerator, synchronize
from .errors import Qwen35Error, flag
from .fingerprint import content_hash
from .generate import Prefill, check_vocabulary
from .host import host_logits, on_model_device, upload
from .kv_pool import MediaSpan
from .kv_store import growth_undone_on_failure
from .media import (
    Preprocessing,
    VideoSource,
    VisionInput,
    frame_rate_ok,
    preprocess_images,
    preprocess_video,
    preprocess_video_source,
    read_preprocessing,
)
from .memory import is_out_of_memory, out_of_memory, prefill_bytes, vision_bytes
from .model import Qwen35Model
from .prefix import prefill_reusing, system_end
from .rope import TextRun, VisionSpan, layout_positions
from .tokenizer import check_text, raw_head, user_encoder

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 248053, 248054, 248056, 248057
PLACEHOLDER = re.compile(r"<image(?:\s*(\d+))?>|<video>")


def place_inputs(prompt: str, n_images: int, has_video: bool) -> tuple[list, list[int]]:
    """The prompt cut at its placeholders, [text, input, text, input, ..., text] with input i an index (images
    0..n-1, the video n), the unnamed inputs in front (each after an empty text); and the input indices in order
    of appearance. The text is as given: user_message trims it for a chat turn."""
    used: list[int] = []
    bare: set[int] = set()  # the images a bare <image> took
    next_free = [0]

    def take(match: re.Match) -> int:
        if match.group(0) == "<video>":
            if not has_video:
                raise Qwen35Error("the prompt names <video> but no video is connected; connect one or remove "
                                  "<video> from the prompt")
            i = n_images
        elif match.group(1) is not None:
            k = int(match.group(1))
            if not 1 <= k <= n_images:
                names = "<image 1>" if n_images == 1 else f"one of <image 1> to <image {n_images}>"
                fix = f"name {names} or connect more images" if n_images else \
                    "connect images or remove it from the prompt"
                raise Qwen35Error(f"the prompt names {match.group(0)} but {n_images} image(s) are connected; images "
                                  f"are counted from 1: {fix}")
            i = k - 1
        else:
            while next_free[0] in used:
                next_free[0] += 1
            if next_free[0] >= n_images:
                raise Qwen35Error(f"the prompt has more <image> placeholders than the {n_images} image(s) "
                                  "connected; connect more images or remove the extra <image>")
            i = next_free[0]
            bare.add(i)
        if i in bare and i in used:
            raise Qwen35Error(f"the prompt places image {i + 1} twice: an <image> before {match.group(0)} already took "
                              f"it (<image> is the next image not yet placed); number them all (<image 1>, <image 2>, "
                              "...) or put the numbered one first")
        if i in used:
            name = "<video>" if i == n_images else f"image {i + 1}"
            raise Qwen35Error(f"the prompt places {name} twice; name each image or video once")
        used.append(i)
        return i

    pieces, last = [], 0
    for match in PLACEHOLDER.finditer(prompt):
        pieces += [prompt[last:match.start()], take(match)]
        last = match.end()
    pieces.append(prompt[last:])
    front = [i for i in range(n_images + has_video) if i not in used]
    return [x for i in front for x in ("", i)] + pieces, front + used


def _vision_tokens(inp: VisionInput, tokenizer, merge: int, lead: str = "",
                   encode=None) -> tuple[list[int], list]:
    """Token ids and rope parts of one input. A video's first timestamp is text that runs on from the text before
    it (`lead`, encoded with `encode`): the processor tokenises them as one string (": <0.5" is ":", " <", ...)."""
    t, h, w = inp.grid
    hm, wm = h // merge, w // merge
    slices = 1 if inp.kind == "image" else len(inp.timestamps)
    if t < 1 or t != slices or h < merge or w < merge or h % merge or w % merge:  # (pads that are not its tokens)
        raise Qwen35Error(f"{inp.kind} grid {tuple(inp.grid)} is not one the tower reads: h and w must be whole "
                          f"numbers of {merge}x{merge} patch blocks and t {max(slices, 1)} (an image: 1; a video: "
                          "one per timestamp, at least one); make the input with media.preprocess_images / "
                          "preprocess_video")
    if inp.kind == "image":
        return [VISION_START] + [IMAGE_PAD] * (t * hm * wm) + [VISION_END], [TextRun(1), VisionSpan(hm, wm),
                                                                           TextRun(1)]
    ids, parts = [], []
    for i, stamp in enumerate(inp.timestamps):
        stamp = f"<{stamp:.1f} seconds>"
        text = encode(lead + stamp) if i == 0 and lead else tokenizer.encode(stamp)
        ids += text + [VISION_START] + [VIDEO_PAD] * (hm * wm) + [VISION_END]
        parts += [TextRun(len(text) + 1), VisionSpan(hm, wm), TextRun(1)]
    return ids, parts


def user_message(model: Qwen35Model, prompt: str, inputs: list[VisionInput], n_images: int, trim: bool,
                 allow_special_tokens: bool = False, head: str = ""):
    """(token ids, rope parts, inputs in the order the prompt places them) of the prompt with its images and
    video in place. trim: strip the whole (images and text together) as the chat template strips a message's
    content; a raw prompt is taken as given. head: text before the prompt's, encoded with its first text (a raw
    prompt's system prompt: one string, as the text path encodes it)."""
    if prompt is not None and not isinstance(prompt, str):
        raise Qwen35Error(f"the prompt must be text, got {type(prompt).__name__}")
    check_text(prompt or "", "the prompt")
    pieces, order = place_inputs(prompt or "", n_images, len(inputs) > n_images)
    if not order and not pieces[0].strip():
        raise Qwen35Error("the prompt is empty and no image or video is connected; write a prompt")
    if trim:  # the whole message's ends: the first text's start, the last text's end (one text: both)
        pieces[0] = pieces[0].lstrip()
        pieces[-1] = pieces[-1].rstrip()
    pieces[0] = head + pieces[0]
    tok, merge = model.tokenizer, _merge(model)
    user = user_encoder(tok, allow_special_tokens)
    ids, parts = [], []
    for k, piece in enumerate(pieces):  # text, input index, text, input index, ..., text
        if k % 2 == 1:
            lead = pieces[k - 1] if inputs[piece].kind == "video" else ""  # encoded with its first timestamp
            more_ids, more_parts = _vision_tokens(inputs[piece], tok, merge, lead, user)
        elif piece and not (k + 1 < len(pieces) and inputs[pieces[k + 1]].kind == "video"):
            more_ids = user(piece)
            more_parts = [TextRun(len(more_ids))]
        else:
            continue
        ids.extend(more_ids)
        parts.extend(more_parts)
    return ids, parts, [inputs[i] for i in order]


def build_prompt(model: Qwen35Model, prompt: str, inputs: list[VisionInput], n_images: int,
                 system_prompt: str = "", thinking: bool = False, use_chat_template: bool = True,
                 allow_special_tokens: bool = False):
    """(token ids, rope parts, inputs in the order the prompt places them).

    The chat template's markers are special tokens; the user's text (prompt and system prompt) is
    plain text unless allow_special_tokens, as for text prompts (generate.encode_prompt). Without the
    chat template the text is taken as given (generate.encode_prompt's raw mode).
    """
    if not isinstance(system_prompt, str):
        raise Qwen35Error(f"the system prompt must be text, got {type(system_prompt).__name__}")
    check_text(system_prompt, "the system prompt")
    # raw: the system prompt and the prompt's first text one string (blank: none, as with the template)
    head = raw_head(model.tokenizer, system_prompt, allow_special_tokens) if not use_chat_template else ""
    message_ids, message_parts, ordered = user_message(model, prompt, inputs, n_images, use_chat_template,
                                                       allow_special_tokens, head)
    tok = model.tokenizer
    user = user_encoder(tok, allow_special_tokens)
    ids, parts = [], []

    def add(text: str, encode) -> None:
        if text:
            enc = encode(text)
            ids.extend(enc)
            parts.append(TextRun(len(enc)))

    if not use_chat_template:
        ids.extend(message_ids)
        parts.extend(message_parts)
    else:  # the text format_chat writes, with the vision spans in the user message
        for kind, text in chat_layout(system_prompt, thinking):
            if kind == "user":
                ids.extend(message_ids)
                parts.extend(message_parts)
            else:
                add(text, tok.encode if kind == "markup" else lambda t: user(t, "the system prompt"))
    return ids, parts, ordered


def _resize_device(model: Qwen35Model) -> torch.device:
    """Where inputs are resized: the model's GPU; on another accelerator (mps, xpu, ...) the CPU, whose
    resampling is the one tested against the processor's and is there in every PyTorch."""
    return torch.device("cpu") if is_other_accelerator(model.device) else model.device


def read_video(model: Qwen35Model, video, pp: Preprocessing | None = None) -> VisionInput:
    """A video as prefill_multimodal takes it ((frames, fps), a media.VideoSource or a VisionInput) -> its
    VisionInput for this model: a file is decoded here, once, so that prompts sharing the video (one prompt per
    image) read the result instead of the file again. pp: the checkpoint's settings where the caller read them."""
    if isinstance(video, VisionInput):
        if video.kind != "video":
            raise Qwen35Error(f"video must be a video; got a VisionInput of kind {video.kind!r} (pass images as images)")
        return video
    pp = pp or read_preprocessing(getattr(model, "path", None))  # (max_pixels sets images only)
    if isinstance(video, VideoSource):
        return preprocess_video_source(video, pp, _resize_device(model), model.select_backend())  # hashes on its kernel
    frames, fps = _video_pair(video)
    return preprocess_video(frames, fps, pp, _resize_device(model), model.select_backend())


def _as_inputs(model: Qwen35Model, images, video, max_pixels: int | None) -> tuple[list[VisionInput], int]:
    pp = read_preprocessing(getattr(model, "path", None), max_pixels=max_pixels)
    where = _resize_device(model)
    out: list[VisionInput] = []
    if images is not None:
        if isinstance(images, torch.Tensor):
            out += preprocess_images(images, pp, where)
        else:
            for item in images if isinstance(images, (list, tuple)) else [images]:
                if isinstance(item, torch.Tensor):
                    out += preprocess_images(item, pp, where)
                elif isinstance(item, VisionInput) and item.kind == "image":
                    out.append(item)
                else:
                    raise Qwen35Error(f"images must be an IMAGE tensor [batch, height, width, channels], a list of "
                                      f"them, or images from media.preprocess_images; got {_what(item)}")
    n_images = len(out)
    if video is not None:
        out.append(read_video(model, video, pp))
    return out, n_images


def _what(x) -> str:
    """A bad input named for a message: its shape where it has one, else its type."""
    shape = getattr(x, "shape", None)
    return f"a {type(x).__name__} of shape {list(shape)}" if shape is not None else type(x).__name__


def _video_pair(video) -> tuple[torch.Tensor, float]:
    """(frames, fps) of a video given as that pair; a Qwen35Error for a bare frames tensor (which unpacking
    would read as two frames, or fail on) or anything else."""
    pair = isinstance(video, (tuple, list)) and len(video) == 2
    if pair and isinstance(video[0], torch.Tensor) and isinstance(video[1], numbers.Real) \
            and not isinstance(video[1], bool):
        return video[0], float(video[1]) if frame_rate_ok(video[1]) else video[1]  # (a bad one: sample_frames says)
    got = f"a tensor {list(video.shape)}" if isinstance(video, torch.Tensor) else \
        f"({', '.join(type(v).__name__ for v in video)})" if isinstance(video, (tuple, list)) else type(video).__name__
    raise Qwen35Error(f"a video must be (frames [count, height, width, channels], fps), a media.VideoSource or a "
                      f"VisionInput from media.preprocess_video, got {got}; pass the frames with their frame rate, "
                      "e.g. video=(frames, 24.0)")


def _fewer_tokens(inputs: list[VisionInput]) -> str:
    """What lowers the image / video tokens of these inputs: max_pixels sets images only; a video is held to its
    own pixel budget over all its frames, so only a shorter or smaller clip needs fewer."""
    ways = []
    if any(inp.kind == "image" for inp in inputs):
        ways.append("lower max_pixels or use fewer images")
    if any(inp.kind == "video" for inp in inputs):
        ways.append("use a shorter or lower-resolution video")
    return ", or ".join(ways) or "shorten the prompt"


@torch.compiler.disable
@on_model_device
def prefill_multimodal(model: Qwen35Model, prompt: str, images=None, video=None, system_prompt: str = "",
                       thinking: bool = False, use_chat_template: bool = True,
                       max_pixels: int | None = None, allow_special_tokens: bool = False,
                       reserve: Callable[[int], None] | None = None, use_cache: bool = True,
                       reuse_at_most: int | None = None) -> Prefill:
    """Prefill a prompt with images and / or a video.

    images: a ComfyUI IMAGE tensor [B, H, W, C] (each image of the batch is one image of the prompt),
      a list of such tensors, or VisionInputs from media.preprocess_images; video: (frames [F, H, W, C],
      fps), a media.VideoSource (a file decoded for its sampled frames only) or a VisionInput from
      media.preprocess_video. max_pixels overrides the checkpoint's limit
      per image (images only: a video is held to the checkpoint's pixel budget over all its frames).
      reserve(bytes), when given, is called once the prompt is laid out and before any device
      work, with what the tower and the prefill will need beyond the weights (runtime.memory), so that a
      caller can make room (the nodes ask ComfyUI's model management). A prefix an earlier prompt left in the
      K/V store (the same system prompt and images) is reused, the tower skipping its images, unless
      use_cache is off (prefix.py); reuse_at_most bounds it (an earlier read's cached_tokens: read again so,
      the same logits bit for bit where the store still keeps that snapshot). Returns a Prefill; generate()
      continues from it as from a text prefill. Running out of memory ends in a Qwen35Error that says what
      was needed and free; the model is unchanged.
    """
    thinking, use_chat_template = flag("thinking", thinking), flag("use_chat_template", use_chat_template)
    allow_special_tokens, use_cache = flag("allow_special_tokens", allow_special_tokens), flag("use_cache", use_cache)
    has_vision = images is not None or video is not None
    if has_vision and model.vision is None:
        note = getattr(model, "vision_note", "")
        raise Qwen35Error(f"this checkpoint has no usable vision tower ({note or 'no model.visual.* weights'}), so "
                          "it cannot read images or video; text prompts still work (leave the image and video "
                          "inputs empty, or load a full Qwen3.5 checkpoint that includes the vision weights)")
    inputs, n_images = _as_inputs(model, images, video, max_pixels)
    ids, parts, ordered = build_prompt(model, prompt, inputs, n_images, system_prompt, thinking, use_chat_template,
                                       allow_special_tokens)
    check_vocabulary(model, ids)
    limit = model.config.max_position_embeddings
    n_vision = _count_pads(ids)
    if len(ids) >= limit:
        raise Qwen35Error(f"the prompt has {len(ids)} tokens, {n_vision} of them image / video tokens, but the model "
                          f"takes at most {limit} positions; {_fewer_tokens(inputs)}")
    needed = prefill_bytes(model, len(ids)) + vision_bytes(model, [inp.grid for inp in ordered])
    if reserve is not None:
        reserve(needed)
    model.select_backend()
    with growth_undone_on_failure(model.kv) as undo_growth:  # a failed prompt's growth given back
        try:
            positions, delta = layout_positions(parts)
            spans = media_spans(ids, ordered, _merge(model), backend=model.backend)
            clock = TowerClock(model.device)
            synchronize(model.device)
            t0 = time.perf_counter()
            system = system_end(model, ids) if use_chat_template else None
            turn_end = len(ids) - parts[-1].n if use_chat_template else None  # the generation prompt is the last part
            points = [p for p in (system, spans[-1].end if spans else None, turn_end) if p]
            run = prefill_reusing(model, ids, points, spans, vision_features(model, ids, ordered, spans, clock),
                                  positions, delta, limit=turn_end, use_cache=use_cache,
                                  needed=[turn_end] if turn_end else [], at_most=reuse_at_most)
            logits = host_logits(run.logits)
            synchronize(model.device)
            t2 = time.perf_counter()
        except RuntimeError as e:
            if not is_out_of_memory(e):
                raise
            oom = True  # reported below, once this frame's tensors and the traceback are gone
        else:
            oom = False
        if oom:
            run = None
            undo_growth()  # before the report, which counts what it gives back as free
            raise out_of_memory(model, f"reading a prompt of {len(ids):,} tokens ({n_vision:,} of them image / video "
                                       f"tokens; {_fewer_tokens(inputs)} to need less)", needed)
    vision_ms = clock.ms
    stats = VisionStats(n_vision, len(ids) - n_vision, vision_ms, (t2 - t0) * 1000 - vision_ms,
                        sum(i.scaled_down for i in inputs), tuple(i.grid for i in inputs))
    # (raw text opens no thinking block)
    return Prefill(tuple(ids), logits, run.cache, (t2 - t0) * 1000, model.backend.name,
                   thinking and use_chat_template, model.serial, vision=stats, turn=run.states.get(turn_end),
                   cached_tokens=run.cached_tokens, media=tuple(spans))


def _count_pads(ids) -> int:
    """Image and video pad tokens among ids (a list or tuple: counted at C speed)."""
    ids = ids if isinstance(ids, (list, tuple)) else list(ids)
    return ids.count(IMAGE_PAD) + ids.count(VIDEO_PAD)


def _pad_positions(ids) -> np.ndarray:
    """Positions of the image and video pad tokens among ids, in order (numpy: a 1,300-token prompt costs
    ~0.3 ms in a Python loop)."""
    arr = np.fromiter(ids, dtype=np.int64, count=len(ids))
    return np.flatnonzero((arr == IMAGE_PAD) | (arr == VIDEO_PAD))


def _merge(model: Qwen35Model) -> int:
    return model.vision.config.spatial_merge_size if model.vision is not None else 2


def media_spans(ids, ordered: list[VisionInput], merge: int, offset: int = 0,
                backend: kernels.Backend | None = None) -> list[MediaSpan]:
    """Where each input's tokens are (its first pad token to its <|vision_end|>, shifted by `offset`) and
    its content key (VisionInput.content_key: a hash of its pixels, its grid and settings): the prefix
    cache's keys for the blocks it covers. Makes no patches."""
    pads = _pad_positions(ids)
    out, k = [], 0
    for inp in ordered:
        n = inp.n_tokens(merge)
        out.append(MediaSpan(offset + int(pads[k]), offset + int(pads[k + n - 1]) + 2,
                             inp.content_key(lambda t: content_hash(t, backend))))
        k += n
    return out


class TowerClock:
    """The vision tower's time in one prefill: CUDA events around its launches on a GPU, read once the
    prefill is done (so that timing it holds nothing up: the text layers queue while the tower runs),
    the host clock on the CPU, and on other accelerators (mps, xpu, ...) the host clock read after
    waiting for the device (their work is queued too: without the wait it would time the queueing)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.spans: list = []
        self._begin = None

    def start(self) -> None:
        self._begin = self._now()

    def stop(self) -> None:
        self.spans.append((self._begin, self._now()))

    def _now(self):
        if self.stream is None:
            if is_other_accelerator(self.device):
                synchronize(self.device)
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record(self.stream)
        return e

    @property
    def ms(self) -> float:
        """Milliseconds in the tower; on a GPU, call it after the prefill has synchronised."""
        if self.stream is None:
            return sum(b - a for a, b in self.spans) * 1000
        return sum(a.elapsed_time(b) for a, b in self.spans)


def vision_features(model: Qwen35Model, ids, ordered: list[VisionInput], spans: list[MediaSpan], clock: TowerClock):
    """The `vision(n)` of prefix.prefill_reusing: the tower over the inputs at or after token n (the others
    are inside the reused prefix), as (pad slots counted from n, features), timed by `clock`. Nothing in it
    waits for the GPU."""
    def run(n: int):
        todo = [inp for inp, sp in zip(ordered, spans) if sp.start >= n]
        if not todo:
            return None
        dev = model.device
        clock.start()
        pixels = [inp.pixels.to(dev) for inp in todo]  # the tower takes them in turn: no copy of them all
        features = model.vision.run(pixels, [inp.grid for inp in todo], backend=model.backend)
        clock.stop()
        slots = upload(torch.from_numpy(_pad_positions(ids[n:])), torch.long, dev)
        return slots, features
    return run


@dataclass(frozen=True)
class VisionStats:
    """What a multimodal prefill did."""
    vision_tokens: int
    text_tokens: int
    vision_ms: float  # the tower (TowerClock: GPU time on a GPU)
    prefill_ms: float  # the rest of the prefill's wall time
    scaled_down: int  # inputs resized below their own size: images to fit max_pixels, a video its pixel budget
    grids: tuple[tuple[int, int, int], ...]


__all__ = ["prefill_multimodal", "read_video", "build_prompt", "user_message", "place_inputs", "media_spans", "vision_features",
           "TowerClock", "VisionStats", "VISION_START", "VISION_END", "IMAGE_PAD", "VIDEO_PAD"]
