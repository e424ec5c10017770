"""ComfyUI IMAGE / VIDEO tensors -> the vision tower's input: normalised patches, grids, frame timestamps.

The rules are the ones of the checkpoint's processor (Qwen2-VL image processor and Qwen3-VL video
processor with Qwen3.5's settings), so an image gives the same patch grid and the same number of
tokens as transformers' processor gives for it:
  * RGB: grey is repeated to three channels; alpha is composited over white (as the processor's RGB
    conversion does);
  * size (`smart_resize`): each side rounded to a multiple of 32 (patch 16 x merge 2), then scaled
    down to at most max_pixels or up to at least min_pixels, keeping the aspect ratio;
  * bicubic resampling with antialiasing (PIL's filter, which the processor uses), then
    (x - 0.5) / 0.5 per channel;
  * patches in merge-block order, each [C, T=2, 16, 16] flattened; an image fills both temporal slots.
Video: frames are sampled at `fps` (2) between min_frames and max_frames, one pixel budget is spread
over all frames, frames go in pairs (an odd count repeats the last frame) and each pair becomes one
slice with the timestamp text `<{t:.1f} seconds>` (mean time of its two frames) before it.
Resizing runs in fp32 on the `device` the caller names (the input's own device when it names none).
"""
from __future__ import annotations

import functools
import logging
import math
import numbers
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F

from .. import kernels
from .checkpoint import read_json
from .errors import Qwen35Error, flag, whole_number
from .fingerprint import StreamedHash
from .host import upload

log = logging.getLogger(__name__)

# Qwen3.5 checkpoints' preprocessor_config.json / video_preprocessor_config.json
IMAGE_MIN_PIXELS = 65_536
IMAGE_MAX_PIXELS = 16_777_216
VIDEO_MIN_PIXELS = 4_096
VIDEO_MAX_PIXELS = 25_165_824
VIDEO_FPS = 2.0
VIDEO_MIN_FRAMES = 4
VIDEO_MAX_FRAMES = 768
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)
MAX_ASPECT = 200
PIXEL_LIMITS = (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels"))  # (lower, upper)


@dataclass(frozen=True)
class Preprocessing:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = IMAGE_MIN_PIXELS
    max_pixels: int = IMAGE_MAX_PIXELS
    video_min_pixels: int = VIDEO_MIN_PIXELS
    video_max_pixels: int = VIDEO_MAX_PIXELS
    fps: float = VIDEO_FPS
    min_frames: int = VIDEO_MIN_FRAMES
    max_frames: int = VIDEO_MAX_FRAMES
    mean: tuple[float, ...] = MEAN
    std: tuple[float, ...] = STD
    # qwen-vl-utils' per-frame cap, where a checkpoint's video processor asks for it (transformers'
    # cap_pixels_per_frame, off by default): a frame's pixels at most max_video_tokens patches of factor^2 or the
    # budget's even share, at least 1.05 x video_min_pixels, so that a short clip is not read at full size
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def _pixel_limit(name: str, value) -> int:
    """A pixel limit the caller gave, as an int; a Qwen35Error for 0, negatives, fractions and the rest."""
    count = whole_number(value)
    if count is None or count < 1:
        raise Qwen35Error(f"{name} must be a whole number of pixels above 0, got {value!r}; leave it unset (None) for "
                          "the checkpoint's setting")
    return count


def _read_json(file: Path):
    """A JSON file's content (checkpoint.read_json), None where it is absent."""
    return read_json(file) if file.is_file() else None


def _count(file, key: str, value) -> int:
    """A count a processor file gives (pixels, patch sides, frames, tokens): a whole number of at least 1, as an
    int (JSON may write it as 2.0); else a Qwen35Error naming the file, the key and the value."""
    count = int(value) if isinstance(value, float) and value.is_integer() else whole_number(value)
    if count is not None and count >= 1:
        return count
    raise Qwen35Error(f"{file}: {key} is {value!r}, which is not a whole number above 0; fix the file or "
                      "re-download it (without the file Qwen3.5's defaults apply)")


def _rate(file, key: str, value) -> float:
    """A rate a processor file gives (fps): a finite number above 0 (frame_rate_ok), as a float."""
    if frame_rate_ok(value):
        return float(value)
    raise Qwen35Error(f"{file}: {key} is {value!r}, which is not a number above 0; fix the file or re-download it "
                      "(without the file Qwen3.5's defaults apply)")


def _per_channel(file, key: str, value, nonzero: bool) -> tuple[float, ...]:
    """image_mean / image_std: three numbers, or one for every channel (as transformers' processors take it)."""
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        value = [value] * 3
    ok = isinstance(value, (list, tuple)) and len(value) == 3 and all(
        not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and (x != 0 or not nonzero)
        for x in value)
    if not ok:
        raise Qwen35Error(f"{file}: {key} is {value!r}, which is not three {'non-zero ' if nonzero else ''}numbers "
                          "(one per RGB channel); fix the file or re-download it")
    return tuple(float(x) for x in value)


def read_preprocessing(folder: str | Path | None, **overrides) -> Preprocessing:
    """Preprocessing settings from a checkpoint folder's processor_config.json (transformers 5 nests the image and
    video processors' settings there, and reads them first), else its preprocessor_config.json and
    video_preprocessor_config.json, where present, else Qwen3.5's defaults; `overrides` win. A value in a file
    that the processor could not use (a size of 0, text for a number) is a Qwen35Error naming the file and key.

    A max_pixels (video_max_pixels) given below the checkpoint's min_pixels (video_min_pixels) lowers that too:
    otherwise smart_resize would scale small inputs up to the minimum, past the limit the caller set."""
    values = {}
    folder = Path(folder) if folder else None
    nested = _read_json(folder / "processor_config.json") if folder is not None else None
    nested = nested if isinstance(nested, dict) else {}
    for name, key, prefix in (("preprocessor_config.json", "image_processor", ""),
                              ("video_preprocessor_config.json", "video_processor", "video_")):
        if isinstance(nested.get(key), dict):
            cfg, file = nested[key], f"{folder / 'processor_config.json'} ({key})"
        else:
            cfg, file = (_read_json(folder / name) if folder is not None else None), folder and folder / name
        if not isinstance(cfg, dict):
            continue
        size = cfg.get("size") or {}
        if not isinstance(size, dict):
            raise Qwen35Error(f"{file}: size is {size!r}, not an object with shortest_edge / longest_edge (pixel "
                              "counts); fix the file or re-download it")
        lo, hi = ("size.shortest_edge", size.get("shortest_edge")), ("size.longest_edge", size.get("longest_edge"))
        if not prefix:  # the image processor lets min_pixels / max_pixels override size; the video processor
            # (Qwen3-VL's) reads size alone
            lo = ("min_pixels", cfg["min_pixels"]) if cfg.get("min_pixels") is not None else lo
            hi = ("max_pixels", cfg["max_pixels"]) if cfg.get("max_pixels") is not None else hi
        if lo[1] is not None:
            values[prefix + "min_pixels"] = _count(file, *lo)
        if hi[1] is not None:
            values[prefix + "max_pixels"] = _count(file, *hi)
        missing = [what for what, (_, v) in (("minimum", lo), ("maximum", hi)) if v is None]
        if missing:  # a converted checkpoint's partial file: transformers' processor would take its class's own
            # defaults there (for a video, far fewer pixels a frame), not Qwen3.5's
            log.warning("%s names no %s pixel limit (size.shortest_edge / longest_edge%s): Qwen3.5's (%s) %s used; "
                        "transformers' processor would take its own defaults for this file, so the %s tokens may "
                        "differ from its", file, " or ".join(missing), "" if prefix else ", min_pixels / max_pixels",
                        " / ".join(f"{getattr(Preprocessing, prefix + what[:3] + '_pixels'):,} pixels"
                                   for what in missing), "is" if len(missing) == 1 else "are",
                        "video" if prefix else "image")
        for key in ("patch_size", "temporal_patch_size", "merge_size"):
            if key in cfg and not prefix:
                values[key] = _count(file, key, cfg[key])
        if prefix:
            for key in ("min_frames", "max_frames", "max_video_tokens"):
                if cfg.get(key) is not None:
                    values[key] = _count(file, key, cfg[key])
            if cfg.get("fps") is not None:
                values["fps"] = _rate(file, "fps", cfg["fps"])
            if cfg.get("cap_pixels_per_frame") is not None:
                values["cap_pixels_per_frame"] = flag(f"{file}: cap_pixels_per_frame", cfg["cap_pixels_per_frame"])
            if values.get("min_frames", VIDEO_MIN_FRAMES) > values.get("max_frames", VIDEO_MAX_FRAMES):
                raise Qwen35Error(f"{file}: min_frames {values.get('min_frames', VIDEO_MIN_FRAMES)} is above "
                                  f"max_frames {values.get('max_frames', VIDEO_MAX_FRAMES)}; fix the file or "
                                  "re-download it")
        elif cfg.get("image_mean") and cfg.get("image_std"):
            values["mean"] = _per_channel(file, "image_mean", cfg["image_mean"], nonzero=False)
            values["std"] = _per_channel(file, "image_std", cfg["image_std"], nonzero=True)
    given = {k: _pixel_limit(k, v) if any(k in pair for pair in PIXEL_LIMITS) else v
             for k, v in overrides.items() if v is not None}
    for lo, hi in PIXEL_LIMITS:
        if hi in given and lo not in given:
            given[lo] = min(values.get(lo, getattr(Preprocessing, lo)), given[hi])
    values.update(given)
    pp = Preprocessing(**values)
    for lo, hi in PIXEL_LIMITS:
        if (lo in given or hi in given) and getattr(pp, lo) > getattr(pp, hi):
            raise Qwen35Error(f"{lo} {getattr(pp, lo)} is above {hi} {getattr(pp, hi)}; give a {lo} at most {hi}")
    return pp


def smart_resize(height: int, width: int, factor: int = 32, min_pixels: int = IMAGE_MIN_PIXELS,
                 max_pixels: int = IMAGE_MAX_PIXELS, frames: int = 1, temporal_factor: int = 1) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, pixel count (times the frames, rounded to
    `temporal_factor`) within [min_pixels, max_pixels], aspect ratio kept as well as that allows. A side
    clamped to `factor` can leave a long, thin image above max_pixels, as in Qwen's processor."""
    what = "a video's frames are" if temporal_factor > 1 else "an image is"
    if height <= 0 or width <= 0:
        raise Qwen35Error(f"{what} {width}x{height} pixels; both sides must be at least 1")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise Qwen35Error(f"{what} {width}x{height} pixels: the aspect ratio is over {MAX_ASPECT}, which Qwen3.5 "
                          "does not take; crop it")
    if temporal_factor > 1:  # video frames smaller than one block are first scaled up to one
        if frames < temporal_factor:
            frames = temporal_factor
        if height < factor or width < factor:
            up = max(factor / height, factor / width)
            height, width = int(height * up), int(width * up)
    t = round(frames / temporal_factor) * temporal_factor if temporal_factor > 1 else 1
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if t * h * w > max_pixels:
        scale = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif t * h * w < min_pixels:
        scale = math.sqrt(min_pixels / (frames * height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def limited_by_max(height: int, width: int, size: tuple[int, int], factor: int, min_pixels: int, frames: int = 1,
                   temporal_factor: int = 1) -> bool:
    """Whether max_pixels made `size` (smart_resize's answer for these arguments) smaller than it would be
    without a limit (the sides' rounding to `factor` alone can take a size past the limit, or keep it under)."""
    return size != smart_resize(height, width, factor, min_pixels, math.inf, frames, temporal_factor)


def _check_images(images, what: str = "an image") -> tuple[int, int, int, int]:
    """(batch, height, width, channels) of a ComfyUI IMAGE [B, H, W, C] (or one [H, W, C]), or a Qwen35Error
    that names what is wrong with it (`what`: "an image", or "a video frame")."""
    if not isinstance(images, torch.Tensor) or images.dim() not in (3, 4):
        shape = list(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise Qwen35Error(f"an image input must be a tensor [batch, height, width, channels], got {shape}")
    b, h, w, c = images.shape if images.dim() == 4 else (1, *images.shape)
    if b == 0:
        raise Qwen35Error("the image batch is empty (0 images); connect an image or leave the input empty")
    if h == 0 or w == 0:
        raise Qwen35Error(f"{what} input is {w}x{h} pixels (width x height); both sides must be at least 1: "
                          "check the node that made it (a crop or resize to 0 pixels)")
    if c not in (1, 2, 3, 4):
        raise Qwen35Error(f"{what} has {c} channels; expected 1 (grey), 2 (grey + alpha), 3 (RGB) or 4 (RGBA) "
                          "(a MASK [batch, height, width] is no IMAGE: convert it with ComfyUI's Convert Mask to "
                          "Image node)")
    if not images.is_floating_point():  # 0..255 or a 0/1 mask: the scale is not guessed (clamped, 0..255 was white)
        raise Qwen35Error(f"{what} tensor has dtype {images.dtype}; ComfyUI IMAGE tensors are float in 0..1: "
                          "convert 8-bit pixels (0..255) with .float() / 255")
    if images.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):  # fp8: no min / max op
        raise Qwen35Error(f"{what} tensor has dtype {images.dtype}; ComfyUI IMAGE tensors are float32 (fp16 / "
                          "bf16 also do): convert it with .float()")
    return b, h, w, c


def check_finite(images: torch.Tensor | Sequence[torch.Tensor]) -> tuple[float, float]:
    """Refuses NaN and infinite pixels, naming how many (to_rgb's clamp would keep NaN, and make inf a white or black
    pixel); returns the pixels' (lowest, highest), from the same one pass (NaN and inf reach its minimum or maximum).
    Its answer is read on the host: the callers check the pixels where they were given, before moving them to the
    device (on the CPU, ComfyUI's place for an IMAGE, that waits for nothing; an input already on a GPU is checked
    before any of the prompt's GPU work is queued, not in the middle of it). A list of tensors (the runtime takes
    one for images of different sizes): the range over all of them."""
    if isinstance(images, (list, tuple)):
        ranges = [check_finite(x) for x in images if x.numel()]
        return (min(r[0] for r in ranges), max(r[1] for r in ranges)) if ranges else (0.0, 0.0)
    if images.numel() == 0:
        return 0.0, 0.0
    lo, hi = (float(v) for v in torch.aminmax(images))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        bad = int((~torch.isfinite(images)).sum())
        raise Qwen35Error(f"an image (or video frame) holds {bad:,} NaN or infinite values of its "
                          f"{images.numel():,}; the node that made it produced them (a VAE decode in fp16 can): fix "
                          "that node's output")
    return lo, hi


# A ComfyUI IMAGE holds 0..1, and resizes with bicubic or Lanczos filters overshoot it a little; pixels further
# out than RANGE_SLACK are named (all are clamped to 0..1, as ComfyUI's Save Image clamps them)
RANGE_SLACK = 0.5


def range_note(lo: float, hi: float) -> str:
    """"" for pixels from lo to hi within 0..1 (give or take RANGE_SLACK); else what the clamp did to them, and the
    fix."""
    if lo >= -RANGE_SLACK and hi <= 1 + RANGE_SLACK:
        return ""
    return (f"pixel values run from {lo:.4g} to {hi:.4g}, but an IMAGE holds 0..1: they were clamped to it, so a "
            "picture in 0..255 reads as white (divide it by 255) and one in -1..1 loses its dark half (use "
            "(x + 1) / 2)")


def _checked(x: torch.Tensor) -> None:
    """check_finite, and a warning in the log where the pixels lie outside 0..1 (range_note)."""
    note = range_note(*check_finite(x))
    if note:
        log.warning("qwen35: %s", note)


def _moved(x: torch.Tensor, device) -> torch.Tensor:
    """x on `device` (None: where it is); pixels on the CPU are checked first (_checked), there."""
    if x.device.type == "cpu":
        _checked(x)
    return x if device is None else x.to(device)


def to_rgb(images: torch.Tensor) -> torch.Tensor:
    """ComfyUI IMAGE [B, H, W, C] in 0..1 (C = 1 grey, 2 grey + alpha, 3 RGB, 4 RGBA) -> [B, 3, H, W] fp32 (the
    pixels finite: check_finite)."""
    b, h, w, c = _check_images(images)
    x = images.reshape(b, h, w, c).float().clamp(0, 1)
    color, alpha = (x[..., :c - 1], x[..., c - 1:]) if c in (2, 4) else (x, None)
    if color.shape[-1] == 1:
        color = color.expand(b, h, w, 3)
    if alpha is not None:
        color = color * alpha + (1 - alpha)  # over white
    return color.permute(0, 3, 1, 2).contiguous()


def _resize(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """[B, 3, H, W] fp32 -> [B, 3, h, w]: bicubic with antialiasing, clamped to 0..1 as 8-bit images are."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    try:
        return F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False).clamp_(0, 1)
    except RuntimeError as e:
        # CUDA's antialiased resize keeps a source row's filter taps in 48 KB of shared memory and refuses
        # large reductions (a 2048 x 2048 image to a max_pixels of 1024: a factor of 64), checked before its
        # launch: the CPU's has no such limit
        if x.device.type == "cpu" or "shared memory" not in str(e):
            raise
        return _resize(x.cpu(), size).to(x.device)


def _patchify(frames: torch.Tensor, pp: Preprocessing) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """frames [F, 3, H, W] normalised, F a multiple of the temporal patch -> patches [N, 3*T*P*P], grid."""
    f, c, h, w = frames.shape
    p, m, tp = pp.patch_size, pp.merge_size, pp.temporal_patch_size
    gt, gh, gw = f // tp, h // p, w // p
    x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    # -> (time, block row, block col, row in block, col in block, channel, frame in pair, py, px)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * tp * p * p), (gt, gh, gw)


@functools.lru_cache(maxsize=16)
def _channel_values(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[1, C, 1, 1] on `device`, made once per (values, dtype, device): not an upload every image."""
    return upload(values, dtype, device).view(1, -1, 1, 1)


def _normalise(x: torch.Tensor, pp: Preprocessing) -> torch.Tensor:
    return (x - _channel_values(tuple(pp.mean), x.dtype, x.device)) / _channel_values(tuple(pp.std), x.dtype, x.device)


@dataclass(frozen=True, eq=False)
class VisionInput:
    """One image or one video ready for the tower: its patches [N, C*T*P*P] fp32 (`pixels`) and grid (t, h, w)
    in patches; for a video, the timestamp (seconds) of each of its t slices.

    `patches` is the tensor, or a function that makes it, called once on the first read of `pixels`: a
    prompt whose images are all inside a cached prefix never resizes or patches them. `source` is then what
    the patches are made from (the input's own pixels on the model's device, or a function that puts them
    there, called once) and `recipe` the settings that make them (size, normalisation), so that the prefix
    cache's key of the input can come from its source (content_key), the same for the same pixels and
    settings, without making the patches. `origin` (the caller's tensor and which part of it the input is)
    lets a tensor seen before skip even that (SeenTensors). `source_hash` stands for the source's fingerprint
    where the source is not kept: a video's sampled frames hashed one by one (fingerprint.content_hash of them
    stacked, so the key is the one their tensor would have), as a VideoSource's were read, or a function that
    hashes a tensor's so when the key is first asked."""
    kind: str  # "image" | "video"
    patches: torch.Tensor | Callable[[], torch.Tensor]
    grid: tuple[int, int, int]
    source_size: tuple[int, int]  # (height, width) before resizing
    timestamps: tuple[float, ...] = ()
    # resized below its own size to fit its limit: max_pixels for an image, the pixel budget over all its
    # sampled frames (video_max_pixels) for a video
    scaled_down: bool = False
    source: torch.Tensor | Callable[[], torch.Tensor] | None = None
    recipe: str = ""
    origin: tuple[torch.Tensor, object] | None = None
    source_hash: str | Callable[[], str] = ""

    @functools.cached_property
    def pixels(self) -> torch.Tensor:
        return self.patches() if callable(self.patches) else self.patches

    @property
    def source_pixels(self) -> torch.Tensor | None:
        """The source's pixels: a function's made anew at each ask (an image's copy on the model's device, held
        only while it is hashed, not for as long as the prompt runs)."""
        return self.source() if callable(self.source) else self.source

    @property
    def n_patches(self) -> int:
        t, h, w = self.grid
        return t * h * w

    def n_tokens(self, merge_size: int = 2) -> int:
        return self.n_patches // merge_size ** 2

    def content_key(self, fingerprint: Callable[[torch.Tensor], str]) -> str:
        """What the prefix cache knows this input by: its kind, grid and `fingerprint` (a content hash) of its
        source (or its source_hash) and recipe, or of its patches when it came without a source."""
        grid = "x".join(map(str, self.grid))
        if callable(self.source_hash):  # hashed when first asked, once a tensor and part (SEEN)
            digest = self.source_hash if self.origin is None else \
                functools.partial(SEEN.get, *self.origin, self.source_hash)
            return f"{self.kind}:{grid}:{self.recipe}:{digest()}"
        if self.source_hash:
            return f"{self.kind}:{grid}:{self.recipe}:{self.source_hash}"
        if self.source is None:
            return f"{self.kind}:{grid}:{fingerprint(self.pixels)}"
        if self.origin is None:
            return f"{self.kind}:{grid}:{self.recipe}:{fingerprint(self.source_pixels)}"
        tensor, part = self.origin
        return f"{self.kind}:{grid}:{self.recipe}:{SEEN.get(tensor, part, lambda: fingerprint(self.source_pixels))}"


class SeenTensors:
    """Fingerprints of the caller's tensors hashed before, by identity (a weak reference, so a tensor that is
    gone never matches a new one at its address) and part (an image of a batch, a video's sampled frames).
    ComfyUI hands the same IMAGE object to each run of a node that reads one LoadImage output and treats node
    outputs as immutable (its own cache reuses them), so a second question about an image neither copies it
    to the GPU nor reads it again. A tensor changed in place through torch moves its version counter and is
    hashed again (inference tensors, what ComfyUI's nodes make, have no counter: theirs are taken as
    ComfyUI takes them, unchanged)."""

    def __init__(self, size: int = 256):
        self.size = size
        self._seen: OrderedDict = OrderedDict()

    def get(self, tensor: torch.Tensor, part, compute: Callable[[], str]) -> str:
        version = None if tensor.is_inference() else tensor._version
        key = (id(tensor), part)
        hit = self._seen.get(key)
        if hit is not None and hit[0]() is tensor and hit[1] == version:
            self._seen.move_to_end(key)
            return hit[2]
        value = compute()
        self._seen[key] = (weakref.ref(tensor), version, value)
        self._seen.move_to_end(key)
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)
        return value


SEEN = SeenTensors()


def _recipe(size: tuple[int, int], pp: Preprocessing) -> str:
    """The settings that turn source pixels into patches, as text (part of an input's content key)."""
    return (f"{size[0]}x{size[1]}/p{pp.patch_size}t{pp.temporal_patch_size}m{pp.merge_size}"
            f"/mean{','.join(map(str, pp.mean))}/std{','.join(map(str, pp.std))}")


def preprocess_images(images: torch.Tensor, pp: Preprocessing | None = None, device=None) -> list[VisionInput]:
    """Each image of a ComfyUI IMAGE batch [B, H, W, C] -> a VisionInput (one tower input per image), its
    patches made when first read (the whole batch, an image at a time). device: where to resize (the model's GPU:
    much faster than the CPU for large images)."""
    pp = pp or Preprocessing()
    b, h, w, c = _check_images(images)
    given = images
    size = smart_resize(h, w, pp.factor, pp.min_pixels, pp.max_pixels)
    scaled = limited_by_max(h, w, size, pp.factor, pp.min_pixels)

    if given.device.type != "cpu":
        _checked(given)  # now, before the tower's work is queued (on the CPU: when first read, in _moved)

    def on_device(k: int) -> torch.Tensor:  # image k, moved when needed and held only while used: never the batch
        return _moved(given[k:k + 1] if given.dim() == 4 else given, device).reshape(h, w, c)

    @functools.cache
    def batch() -> list[torch.Tensor]:  # an image at a time: full-size fp32 copies of one image, not of the batch
        out = []
        for k in range(b):
            x = _normalise(_resize(to_rgb(on_device(k)[None]), size), pp)
            out.append(_patchify(x.expand(pp.temporal_patch_size, -1, -1, -1), pp)[0])
        return out

    grid = (1, size[0] // pp.patch_size, size[1] // pp.patch_size)
    recipe = _recipe(size, pp)
    return [VisionInput("image", functools.partial(lambda k: batch()[k], k), grid, (h, w), (), scaled,
                        functools.partial(on_device, k), recipe, (given, k)) for k in range(b)]


def frame_rate_ok(fps) -> bool:
    """Whether fps is a number of frames per second above 0 (not a bool, a string or None; an integer past
    float's range is not finite)."""
    if not isinstance(fps, numbers.Real) or isinstance(fps, bool):
        return False
    try:
        fps = float(fps)
    except OverflowError:
        return False
    return math.isfinite(fps) and fps > 0


def sample_frames(total: int, source_fps: float, pp: Preprocessing) -> list[int]:
    """Indices of the frames to keep: `pp.fps` per second of video, within [min_frames, max_frames]
    and at most every frame; spread evenly from the first frame to the last."""
    if total <= 0:
        raise Qwen35Error("the video has 0 frames; connect a video with at least one frame")
    if not frame_rate_ok(source_fps):
        raise Qwen35Error(f"the video's frame rate is {source_fps!r}; it must be a number of frames per second above 0")
    # in float64, as the processor counts with its float metadata fps: a Fraction (ComfyUI's frame_rate) would count
    # exactly and a numpy float32 in float32, each picking other frames at some lengths (925 frames at 25/3 fps:
    # 222 exactly, where the processor and a VideoSource, whose fps is a float, take 221)
    source_fps = float(source_fps)
    n = int(min(total / source_fps * pp.fps, pp.max_frames))  # (a tiny frame rate makes it inf)
    n = min(max(n, pp.min_frames), pp.max_frames, total)
    # in float64, as the processor's numpy: torch's float32 linspace rounds some indices (and .5 ties) otherwise
    return [round(x) for x in np.linspace(0, total - 1, n).round().tolist()]


def preprocess_video(frames: torch.Tensor, fps: float, pp: Preprocessing | None = None, device=None,
                     backend: kernels.Backend | None = None) -> VisionInput:
    """A video as ComfyUI frames [F, H, W, C] in 0..1 at `fps` frames per second -> one VisionInput: the same
    patches, grid, timestamps and content key as preprocess_video_source gives for a reader of these frames.
    device: where to resize; backend: the one that hashes the frames where they lie (content_key).

    Only the sampled frames are read, one at a time, in each of the two passes made when needed: the content
    key's hash (none for a tensor hashed before: SEEN) and the patches (none for a video inside a cached prefix).
    Each pass moves one frame at a time to `device`, so that holds one source frame and the resized frames, which
    the pixel budget bounds, never the sampled frames at source size (768 frames of 1080p are 19 GB in fp32)."""
    pp = pp or Preprocessing()
    if isinstance(frames, torch.Tensor) and frames.dim() == 4 and frames.shape[0] == 0:
        raise Qwen35Error("the video has 0 frames; connect a video with at least one frame")
    if not isinstance(frames, torch.Tensor) or frames.dim() != 4:
        got = list(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
        raise Qwen35Error(f"a video must be frames [count, height, width, channels], got {got}")
    index = sample_frames(frames.shape[0], fps, pp)
    # (checked there) a float from here on, as preprocess_video_source's: a Fraction's timestamps could not be
    # formatted as the prompt's `<{t:.1f} seconds>` (a TypeError on Python 3.11)
    fps = float(fps)
    _check_images(frames, "a video frame")
    h, w = frames.shape[1:3]
    layout = _video_layout(h, w, index, fps, pp)
    checked = frames.device.type != "cpu"
    if checked:  # now, as for images (preprocess_images): before the tower's work is queued
        _checked_range(check_finite(frames[i]) for i in index)

    def sampled():
        """Each sampled frame [1, H, W, C] on `device`; on the CPU checked there, the first time through."""
        nonlocal checked
        seen = []
        for i in index:
            x = frames[i:i + 1]
            if not checked:
                seen.append(check_finite(x))
            yield x if device is None else x.to(device)
        if not checked:
            checked = True
            _checked_range(seen)

    def digest() -> str:  # content_hash of the sampled frames stacked, as a reader's stream of them gives it
        hashed = StreamedHash(backend)
        for x in sampled():
            hashed.add(x)
        return hashed.digest((len(index), *frames.shape[1:]), frames.dtype)

    def patches() -> torch.Tensor:
        stack = _FrameStack(layout, len(index))
        for x in sampled():
            stack.add(x)
        return _patchify(_normalise(stack.filled(), pp), pp)[0]

    return VisionInput("video", patches, layout.grid, (h, w), layout.timestamps, layout.scaled_down,
                       recipe=_recipe(layout.size, pp), origin=(frames, tuple(index)), source_hash=digest)


def frames_range_note(ranges) -> str:
    """range_note over frames' (lowest, highest) pixels (check_finite's answers), once for them all."""
    lo, hi = math.inf, -math.inf
    for a, b in ranges:
        lo, hi = min(lo, a), max(hi, b)
    return range_note(lo, hi) if lo <= hi else ""


def _checked_range(ranges) -> None:
    """frames_range_note's warning in the log."""
    note = frames_range_note(ranges)
    if note:
        log.warning("qwen35: %s", note)


@runtime_checkable
class VideoSource(Protocol):
    """A video that decodes only the frames asked of it (a file), so that a long clip is never in memory whole.

    fps: its frame rate. read(choose, keep): choose(frame count) returns the indices wanted (sample_frames' rule,
    ascending); read then calls keep(frame) with each of those frames [H, W, C] in 0..1, in that order, and drops
    the frame: keep resizes it and stores what the runtime needs. A reader whose frame count, known up front
    (container metadata), proves wrong once decoded calls choose again with the true count, which starts over,
    so that the frames are the ones the whole video's tensor would give."""
    fps: float

    def read(self, choose: Callable[[int], list[int]], keep: Callable[[torch.Tensor], None]) -> None: ...


def preprocess_video_source(source: VideoSource, pp: Preprocessing | None = None, device=None,
                            backend: kernels.Backend | None = None) -> VisionInput:
    """A VideoSource -> the VisionInput preprocess_video gives for all of its frames (the same patches, grid,
    timestamps and content key), with only the sampled frames ever read, each resized as it comes.

    Memory: one source frame at a time (as the reader gives it, its copy on `device` and to_rgb's temporaries
    of its size), plus the resized frames on `device`, which the pixel budget bounds whatever the clip's length
    or resolution: video_max_pixels (25,165,824) x 3 fp32, about 300 MB, and one frame more for an odd count.
    (Before the frames were resized one by one, the sampled frames were held at source size: 25 MB each at
    1080p, up to 19 GB at the 768-frame cap.) `backend`: the one that hashes the frames where they lie (one
    kernel a frame on the CUDA backend; the torch expression without one), the same key either way."""
    pp = pp or Preprocessing()
    fps = getattr(source, "fps", None)
    if not frame_rate_ok(fps):
        raise Qwen35Error(f"the video's frame rate is {fps!r} ({type(source).__name__}.fps); it must be a number of "
                          "frames per second above 0")
    frames = _StreamedFrames(float(source.fps), pp, device, backend)
    source.read(frames.choose, frames.keep)
    return frames.finish(type(source).__name__)


class _VideoLayout(NamedTuple):
    """How a video's sampled frames become patches: the size each is resized to, how many copies of the last
    fill the final pair, the grid, each slice's timestamp, and whether the pixel budget scaled it down."""
    size: tuple[int, int]
    fill: int
    grid: tuple[int, int, int]
    timestamps: tuple[float, ...]
    scaled_down: bool


def _video_layout(h: int, w: int, index: list[int], fps: float, pp: Preprocessing) -> _VideoLayout:
    """The layout of a video of h x w frames sampled at `index`: one pixel budget over all the sampled frames
    (with a checkpoint's per-frame cap: Preprocessing.cap_pixels_per_frame), frames in pairs (an odd count
    repeats the last), a slice's timestamp the mean time of its two frames."""
    tp, sampled = pp.temporal_patch_size, len(index)
    fill = -sampled % tp
    index = index + [index[-1]] * fill
    budget = pp.video_max_pixels
    if pp.cap_pixels_per_frame:
        per_frame = min(pp.max_video_tokens * pp.factor ** 2, pp.video_max_pixels // sampled)
        budget = max(per_frame, int(pp.video_min_pixels * 1.05)) * sampled
    size = smart_resize(h, w, pp.factor, pp.video_min_pixels, budget, frames=sampled, temporal_factor=tp)
    grid = (len(index) // tp, size[0] // pp.patch_size, size[1] // pp.patch_size)
    times = [i / fps for i in index]
    stamps = tuple((times[g] + times[g + tp - 1]) / 2 for g in range(0, len(times), tp))
    scaled = limited_by_max(h, w, size, pp.factor, pp.video_min_pixels, sampled, tp)
    return _VideoLayout(size, fill, grid, stamps, scaled)


class _FrameStack:
    """A video's sampled frames resized one at a time, in order, into [F, 3, h, w], F with the odd count's fill
    (copies of the last). to_rgb and _resize act on each frame of a batch by itself, so the result is the batch's
    bit for bit (tests/test_media.py checks it over sizes, channels and counts)."""

    def __init__(self, layout: _VideoLayout, count: int):
        self.layout, self.count, self.frames, self.kept = layout, count, None, 0

    def add(self, x: torch.Tensor) -> None:
        """The next frame [1, H, W, C], on the device it is resized on."""
        small = _resize(to_rgb(x), self.layout.size)[0]
        if self.frames is None:
            self.frames = small.new_empty(self.count + self.layout.fill, *small.shape)
        self.frames[self.kept] = small
        self.kept += 1

    def filled(self) -> torch.Tensor:
        """The frames, the fill copied from the last one added."""
        self.frames[self.kept:] = self.frames[self.kept - 1]
        return self.frames


class _StreamedFrames:
    """The choose and keep preprocess_video_source reads a VideoSource with. choose(count) samples the indices and
    starts over; keep(frame) adds the source frame to the content hash and stores it converted to RGB and resized
    on `device` (_FrameStack), to the size set at the first frame (from its size and the number of frames
    sampled)."""

    def __init__(self, fps: float, pp: Preprocessing, device, backend: kernels.Backend | None = None):
        self.fps, self.pp, self.device, self.backend = fps, pp, device, backend
        self.index: list[int] | None = None

    def choose(self, total: int) -> list[int]:
        self.index = sample_frames(total, self.fps, self.pp)
        self.hash, self.layout, self.stack = StreamedHash(self.backend), None, None
        self.ranges = []  # each kept frame's (lowest, highest) pixel (range_note)
        return list(self.index)

    @property
    def kept(self) -> int:
        return self.stack.kept if self.stack is not None else 0

    def keep(self, frame: torch.Tensor) -> None:
        if self.index is None or self.kept == len(self.index):
            asked = "before asking for frames (choose)" if self.index is None else \
                f"more often than the {len(self.index)} frame indices it asked for"
            raise Qwen35Error(f"a video reader called keep {asked}; it must call keep once per index, in order")
        if not isinstance(frame, torch.Tensor) or frame.dim() != 3:
            got = list(frame.shape) if isinstance(frame, torch.Tensor) else type(frame).__name__
            raise Qwen35Error(f"a video reader gave a frame {got}; keep takes one frame [height, width, channels]")
        _check_images(frame, "a video frame")
        if self.layout is None:
            self.shape, self.dtype = tuple(frame.shape), frame.dtype
            self.layout = _video_layout(frame.shape[0], frame.shape[1], self.index, self.fps, self.pp)
            self.stack = _FrameStack(self.layout, len(self.index))
        elif (tuple(frame.shape), frame.dtype) != (self.shape, self.dtype):
            raise Qwen35Error(f"a video changes from {list(self.shape)} {self.dtype} frames to {list(frame.shape)} "
                              f"{frame.dtype} at its sampled frame {self.kept}; re-encode it at one size")
        self.ranges.append(check_finite(frame))  # (a frame as the reader gave it, before it moves)
        x = frame.to(self.device) if self.device is not None else frame
        self.hash.add(x)
        self.stack.add(x[None])

    def finish(self, reader: str) -> VisionInput:
        """The VisionInput of the frames kept (after the reader's last choose)."""
        if self.index is None or self.kept != len(self.index):
            got = "asked for no frames" if self.index is None else \
                f"kept {self.kept} frames for {len(self.index)} frame indices"
            raise Qwen35Error(f"a video reader ({reader}) {got}; it must call choose, then keep once per index")
        held, layout, pp = [self.stack.filled()], self.layout, self.pp
        _checked_range(self.ranges)  # (once a video, as preprocess_video's frames are checked)

        def patches() -> torch.Tensor:  # once (VisionInput.pixels keeps them): the resized frames let go after
            out = _patchify(_normalise(held[0], pp), pp)[0]
            held.clear()
            return out

        return VisionInput("video", patches, layout.grid, self.shape[:2], layout.timestamps, layout.scaled_down,
                           recipe=_recipe(layout.size, pp),
                           source_hash=self.hash.digest((self.kept, *self.shape), self.dtype))


__all__ = ["Preprocessing", "read_preprocessing", "smart_resize", "check_finite", "range_note", "frames_range_note",
           "to_rgb", "VisionInput", "preprocess_images", "preprocess_video", "VideoSource", "preprocess_video_source",
           "sample_frames"]
