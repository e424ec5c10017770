"""Edge cases of IMAGE / VIDEO preprocessing against transformers' Qwen3.5 processors (the oracle): extreme aspect
ratios, sizes around the factor and the pixel limits, grey and RGBA, videos of 2 to thousands of frames at low,
high and non-integer frame rates (ComfyUI's Fraction among them), and the prompt text a video becomes. (A video
of one frame has no oracle: the processor refuses it, ours reads it as a pair, as test_media notes.)"""
import functools
import inspect
import math
import random
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qwen35_fast.runtime.errors import Qwen35Error
from qwen35_fast.runtime.media import (
    Preprocessing,
    preprocess_images,
    preprocess_video,
    preprocess_video_source,
    sample_frames,
    smart_resize,
)

transformers = pytest.importorskip("transformers")


def _outcome(f, *args):
    """f's answer, or "refused" for the ValueError / Qwen35Error it raises (both refuse an aspect ratio over 200)."""
    try:
        return f(*args)
    except (ValueError, Qwen35Error):
        return "refused"


def _sizes():
    """Sides around the factor (1, 31 to 33, 63 to 65), aspect ratios up to and just over 200, and random sizes."""
    sides = [1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 200, 201, 255, 256, 257, 1023, 1024, 1025,
             4000, 6400, 6401]
    sizes = {(a, b) for a in sides for b in sides}
    sizes |= {(h, w) for h in (1, 2, 3, 5, 20, 31, 32) for w in range(200 * h - 2, 200 * h + 34, 3)}
    rng = random.Random(7)
    sizes |= {(rng.randint(1, 5000), rng.randint(1, 5000)) for _ in range(1500)}
    return sorted(sizes | {(w, h) for h, w in sizes})


LIMITS = [(65_536, 16_777_216), (4_096, 1_003_520), (65_536, 131_072), (1_024, 4_096), (100, 100), (1, 1_000_000)]


def test_image_sizes_equal_transformers_at_the_edges():
    """smart_resize (the grid, so the <|image_pad|> count) for sizes around the factor, thin images up to the
    aspect limit, and limits a rounded side lands just over or under (a side clamped to the factor included)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as theirs
    rng = random.Random(3)
    cases = [(h, w, lo, hi) for h, w in _sizes()[::3] for lo, hi in LIMITS]
    for _ in range(3000):  # sides around the square root of the limit: the rounding decides which side it is on
        hi = rng.randint(1_000, 20_000_000)
        side = int(math.sqrt(hi))
        cases.append((side + rng.randint(-40, 40), side + rng.randint(-40, 40), rng.randint(1, hi), hi))
    for h, w, lo, hi in cases:
        assert _outcome(smart_resize, h, w, 32, lo, hi) == _outcome(theirs, h, w, 32, lo, hi), (h, w, lo, hi)


def test_video_sizes_equal_transformers_at_the_edges():
    """The video rule (one budget over all the sampled frames, frames under a block scaled up to one first) for the
    same sizes, frame counts odd and even, and budgets that shrink or grow them."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as theirs
    for h, w in _sizes()[::5]:
        for frames in (2, 3, 5, 768):
            for lo, hi in ((4_096, 25_165_824), (128 * 32 * 32, 32 * 32 * 768), (4_096, 32_768)):
                ours = _outcome(smart_resize, h, w, 32, lo, hi, frames, 2)
                assert ours == _outcome(theirs, frames, h, w, 2, 32, lo, hi), (frames, h, w, lo, hi)


def test_frame_sampling_equals_transformers_at_the_edges():
    """1 to 5 frames (below min_frames: every frame), the 768-frame cap and around it, frame rates far below and
    above the 2 per second sampled, and the non-integer NTSC rates."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata
    proc, pp = Qwen3VLVideoProcessor(), Preprocessing()
    for total in (1, 2, 3, 4, 5, 9, 383, 384, 385, 767, 768, 769, 1537, 23_017, 200_000):
        for fps in (0.01, 0.3, 1.0, 7.5, 23.976, 29.97, 30000 / 1001, 59.94, 240.0, 10_000.0):
            want = proc.sample_frames(VideoMetadata(total_num_frames=total, fps=fps), fps=2).tolist()
            assert sample_frames(total, fps, pp) == want, (total, fps)


class _Frames:
    """A VideoSource over a frames tensor (a file reader's contract) with the frame rate it is given."""

    def __init__(self, frames, fps):
        self.frames, self.fps = frames, fps

    def read(self, choose, keep):
        for i in choose(self.frames.shape[0]):
            keep(self.frames[i])


@pytest.mark.parametrize("fps", [Fraction(30000, 1001), Fraction(25, 3), np.float32(29.97), np.int64(24)],
                         ids=["ntsc-fraction", "fraction", "float32", "int64"])
def test_a_frame_rate_of_any_real_type_reads_as_its_float(fps):
    """ComfyUI's VideoComponents.frame_rate is a Fraction: preprocess_video read it as given, so the timestamps
    were Fractions, which the prompt's `<{t:.1f} seconds>` cannot format on Python 3.11 (a TypeError in the
    prefill), and a Fraction or a numpy float32 sampled other frames than its float does (925 frames at 25/3 fps:
    222 frames counted exactly, 221 by the processor). Now it is the frame rate's float throughout: the frames,
    timestamps and patches of the float, of a VideoSource with that frame rate, and of the processor's sampling."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata
    pp = Preprocessing()
    frames = torch.rand(37, 24, 40, 3, generator=torch.Generator().manual_seed(1))
    got, want = preprocess_video(frames, fps, pp), preprocess_video(frames, float(fps), pp)
    assert all(isinstance(t, float) for t in got.timestamps)
    assert [f"<{t:.1f} seconds>" for t in got.timestamps] == [f"<{t:.1f} seconds>" for t in want.timestamps]
    assert got.grid == want.grid and got.timestamps == want.timestamps and torch.equal(got.pixels, want.pixels)
    streamed = preprocess_video_source(_Frames(frames, fps), pp)
    assert streamed.grid == got.grid and streamed.timestamps == got.timestamps
    proc = Qwen3VLVideoProcessor()
    for total in (925, 73, 1_000, 3_001):
        theirs = proc.sample_frames(VideoMetadata(total_num_frames=total, fps=float(fps)), fps=2).tolist()
        assert sample_frames(total, fps, pp) == theirs, total


def _pil_processor(pp: Preprocessing):
    pytest.importorskip("PIL")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, min_pixels=pp.min_pixels, max_pixels=pp.max_pixels)


def _composites_over_white(processor) -> bool:
    """Whether this transformers' processor reads a transparent black pixel as white (its RGBA rule since 5.2x)."""
    from PIL import Image
    clear = Image.fromarray(torch.zeros(32, 32, 4, dtype=torch.uint8).numpy(), "RGBA")
    return bool((processor(images=[clear], return_tensors="pt")["pixel_values"] > 0.99).all())


@pytest.mark.parametrize("h,w,c", [(1, 1, 3), (33, 33, 3), (32, 4000, 3), (4000, 32, 3), (20, 3999, 3), (1, 200, 3),
                                   (64, 64, 1), (300, 200, 1), (2, 2, 4), (300, 200, 4)])
def test_image_patches_at_the_edges_equal_transformers(h, w, c):
    """Grid and pixels against the processor given the same 8-bit picture as a PIL image (grey as mode L, RGBA
    composited over white): identical where nothing is resized (a 32 x 4000 strip, a 1 x 1 pixel scaled to one
    colour), else within the 8-bit resize noise test_media documents (PIL rounds each pass to 8 bits)."""
    from PIL import Image
    pp = Preprocessing()
    g = torch.Generator().manual_seed(h * 7 + w + c)
    u8 = (torch.rand(h, w, c, generator=g) * 255).round().to(torch.uint8)
    if c == 4:
        u8[..., 3] = torch.where(torch.rand(h, w, generator=g) < 0.5, 255, u8[..., 3])
    picture = Image.fromarray(u8[..., 0].numpy() if c == 1 else u8.numpy(), {1: "L", 3: "RGB", 4: "RGBA"}[c])
    processor = _pil_processor(pp)
    if c == 4 and not _composites_over_white(processor):
        pytest.skip(f"transformers {transformers.__version__} drops alpha instead of compositing over white (later "
                    "versions, and this pack, composite)")
    want = processor(images=[picture], return_tensors="pt")
    mine = preprocess_images(u8[None].float() / 255, pp)[0]
    assert mine.grid == tuple(want["image_grid_thw"][0].tolist())
    assert mine.pixels.shape == want["pixel_values"].shape
    diff = (mine.pixels - want["pixel_values"]).abs()
    if (h, w) in ((1, 1), (32, 4000), (4000, 32)):
        assert diff.max() < 1e-6
    else:
        assert diff.mean() < 0.02 and diff.max() < 0.25, (diff.mean(), diff.max())


@pytest.fixture
def video_processor(monkeypatch):
    """transformers' Qwen3-VL video processor, its torchvision resize stood in for by the float bicubic it runs
    (without the uint8 rounding), and its normalisation by the formula (torchvision may be absent)."""
    from transformers.image_processing_backends import TorchvisionBackend
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_processing_utils import BaseVideoProcessor

    def resize(self, image, size, resample=None, **kwargs):
        flat = image.reshape(-1, *image.shape[-3:]).float()
        out = F.interpolate(flat, size=(size.height, size.width), mode="bicubic", antialias=True, align_corners=False)
        return out.clamp(0, 255).reshape(*image.shape[:-2], size.height, size.width)

    def normalize(self, image, mean, std, inplace=False, **kwargs):
        return (image - torch.as_tensor(mean).view(-1, 1, 1)) / torch.as_tensor(std).view(-1, 1, 1)
    monkeypatch.setattr(BaseVideoProcessor, "resize", resize)
    monkeypatch.setattr(TorchvisionBackend, "normalize", normalize)
    return Qwen3VLVideoProcessor(size={"shortest_edge": 4_096, "longest_edge": 25_165_824}, image_mean=[0.5] * 3,
                                 image_std=[0.5] * 3, cap_pixels_per_frame=False)


@pytest.mark.parametrize("frames,fps,h,w,c", [(2, 2.0, 16, 16, 3), (3, 30.0, 100, 33, 3), (9, 2.0, 48, 64, 3),
                                              (5, 1.0, 20, 3999, 3), (31, 29.97, 64, 96, 1), (1600, 30.0, 36, 64, 3)])
def test_video_patches_at_the_edges_equal_transformers(video_processor, frames, fps, h, w, c):
    """The processor's pixel_values_videos and video_grid_thw for the same sampled frames: 2 frames (one slice), 3
    (under min_frames, odd: the last repeated), a thin clip, grey, a long clip; equal to fp32 rounding."""
    from transformers.image_utils import SizeDict
    pp = Preprocessing()
    clip = torch.rand(frames, h, w, c, generator=torch.Generator().manual_seed(frames + h))
    index = sample_frames(frames, fps, pp)
    sampled = (clip[index] * 255).permute(0, 3, 1, 2).expand(-1, 3, -1, -1)
    settings = dict(do_resize=True, size=SizeDict(shortest_edge=4_096, longest_edge=25_165_824), resample=None,
                    do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=(0.5,) * 3,
                    image_std=(0.5,) * 3, patch_size=16, temporal_patch_size=2, merge_size=2,
                    cap_pixels_per_frame=False, return_tensors="pt")
    if "do_convert_rgb" in inspect.signature(video_processor._preprocess).parameters:  # (asked for before 5.2x)
        settings["do_convert_rgb"] = False  # the frames are RGB already
    want = video_processor._preprocess([sampled], **settings)
    mine = preprocess_video(clip, fps, pp)
    assert mine.grid == tuple(want["video_grid_thw"][0].tolist())
    assert (mine.pixels - want["pixel_values_videos"]).abs().max() < 1e-5


@pytest.fixture(scope="module")
def tokenizer():
    from qwen35_fast.runtime.tokenizer import load_tokenizer
    return load_tokenizer(None)


@pytest.mark.parametrize("frames,fps,h,w", [(9, 2.0, 48, 64), (31, 29.97, 64, 96), (100, 23.976, 40, 40),
                                            (7, 7.5, 32, 32), (3, 0.3, 32, 32), (240, 59.94, 180, 320),
                                            (45, Fraction(30000, 1001), 32, 48)])
def test_a_videos_prompt_equals_the_processors(tokenizer, frames, fps, h, w):
    """The raw prompt's ids against the processor's: its own placeholder (replace_video_token: the timestamp text
    before each 2-frame slice, rounded as it rounds them, and the <|video_pad|> count from its grid) put where
    <video> is, the whole text tokenised at once."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as theirs
    from transformers.video_utils import VideoMetadata

    from qwen35_fast.runtime.multimodal import build_prompt
    pp, tok = Preprocessing(), tokenizer
    video_processor = Qwen3VLVideoProcessor()
    metadata = VideoMetadata(total_num_frames=frames, fps=float(fps))
    metadata.frames_indices = video_processor.sample_frames(metadata, fps=2)
    n = len(metadata.frames_indices)
    rh, rw = theirs(n, h, w, 2, 32, pp.video_min_pixels, pp.video_max_pixels)
    grid = torch.tensor([[-(-n // 2), rh // 16, rw // 16]])
    processor = SimpleNamespace(video_processor=video_processor, vision_start_token="<|vision_start|>",
                                video_token="<|video_pad|>", vision_end_token="<|vision_end|>",
                                _calculate_timestamps=functools.partial(Qwen3VLProcessor._calculate_timestamps, None))
    placeholder = Qwen3VLProcessor.replace_video_token(processor, {"video_grid_thw": grid,
                                                                   "video_metadata": [metadata]}, 0)
    video = preprocess_video(torch.rand(frames, h, w, 3, generator=torch.Generator().manual_seed(frames)), fps, pp)
    ids, parts, _ = build_prompt(SimpleNamespace(tokenizer=tok, vision=None), "Clip:<video> what?", [video], 0,
                                 use_chat_template=False)
    text = "Clip:" + placeholder + " what?"
    assert tok.decode(ids) == text and ids == tok.encode(text)
    assert sum(p.n for p in parts) == len(ids)
