"""Preprocessing of ComfyUI IMAGE / VIDEO tensors against transformers' Qwen2-VL image processor (PIL)."""
import json
import math
import re
import weakref

import numpy as np
import pytest
import torch

from qwen35_fast.runtime.errors import Qwen35Error
from qwen35_fast.runtime.media import (
    Preprocessing,
    _video_layout,
    preprocess_images,
    preprocess_video,
    preprocess_video_source,
    read_preprocessing,
    sample_frames,
    smart_resize,
    to_rgb,
)


def _processor(pp: Preprocessing):
    pytest.importorskip("PIL")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, min_pixels=pp.min_pixels, max_pixels=pp.max_pixels)


@pytest.mark.parametrize("h,w", [(1, 1), (10, 1000), (31, 33), (480, 640), (1023, 767), (1024, 1024), (2000, 80),
                                 (4000, 6000), (7, 1400)])
def test_smart_resize_equals_transformers(h, w):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as theirs
    for lo, hi in ((65_536, 16_777_216), (4096, 1_003_520), (256 * 256, 512 * 512)):
        assert smart_resize(h, w, 32, lo, hi) == theirs(h, w, 32, lo, hi)


@pytest.mark.parametrize("h,w,pixels", [(90, 70, None), (300, 200, None), (256, 256, None), (700, 1200, 512 * 512),
                                        (3000, 2000, 1024 * 1024)])
def test_grid_tokens_and_pixels_match_transformers(h, w, pixels):
    import numpy as np
    pp = Preprocessing(max_pixels=pixels or Preprocessing().max_pixels)
    proc = _processor(pp)
    u8 = (torch.rand(h, w, 3, generator=torch.Generator().manual_seed(h * w)) * 255).round().to(torch.uint8)
    got = proc(images=[np.asarray(u8)], return_tensors="pt")
    mine = preprocess_images(u8[None].float() / 255, pp)[0]
    assert mine.grid == tuple(got["image_grid_thw"][0].tolist())
    assert mine.n_tokens() == int(got["image_grid_thw"][0].prod()) // 4
    assert mine.pixels.shape == got["pixel_values"].shape
    diff = (mine.pixels - got["pixel_values"]).abs()
    # PIL resizes in 8 bits (rounding: 2/255 in the normalised range); no resize at all -> identical
    if (h, w) == (256, 256):
        assert diff.max() < 1e-6
    else:
        assert diff.mean() < 0.02 and diff.max() < 0.25, (diff.mean(), diff.max())
    assert mine.scaled_down == (pixels is not None)  # the cases with a limit are the ones it shrinks


@pytest.mark.parametrize("h,w,scaled", [(1008, 992, True), (1007, 1000, False), (992, 992, False)])
def test_scaled_down_means_max_pixels_made_it_smaller(h, w, scaled):
    """At max_pixels 1,000,000: 1008 x 992 (999,936 pixels) rounds to 1024 x 992, over the limit, and is shrunk
    to 992 x 992; 1007 x 1000 (1,007,000) rounds to 992 x 992, under it, and is not."""
    pp = Preprocessing(max_pixels=1_000_000)
    inp = preprocess_images(torch.rand(1, h, w, 3), pp)[0]
    assert inp.scaled_down == scaled and inp.grid == (1, 62, 62)


def test_grey_and_rgba_become_rgb():
    grey = torch.rand(1, 40, 50, 1)
    assert torch.equal(to_rgb(grey), grey.permute(0, 3, 1, 2).expand(1, 3, 40, 50))
    rgba = torch.rand(1, 40, 50, 4)
    rgba[..., 3] = 0  # fully transparent -> white
    assert torch.allclose(to_rgb(rgba), torch.ones(1, 3, 40, 50))
    rgba[..., 3] = 1
    assert torch.allclose(to_rgb(rgba), rgba[..., :3].permute(0, 3, 1, 2))


@pytest.mark.parametrize("alpha", [0.25, 0.5, 0.75])
def test_alpha_is_composited_over_white(alpha):
    """RGBA and grey + alpha with partial alpha: each colour channel c becomes a * c + (1 - a) * 1 (the image laid
    over a white page), computed here in float64; grey is spread to the three channels first."""
    g = torch.Generator().manual_seed(int(alpha * 100))
    rgba = torch.rand(2, 6, 7, 4, generator=g)
    rgba[..., 3] = alpha
    rgba[1, 2:4, 3:5, 3] = torch.rand(2, 2, generator=g)  # a patch of other alphas in the second image
    a = rgba[..., 3:].double()
    want = (rgba[..., :3].double() * a + (1 - a)).permute(0, 3, 1, 2)
    assert torch.allclose(to_rgb(rgba).double(), want, atol=1e-6, rtol=0)
    grey = rgba[..., [0, 3]]  # grey + alpha
    want = (grey[..., :1].double() * a + (1 - a)).expand(2, 6, 7, 3).permute(0, 3, 1, 2)
    assert torch.allclose(to_rgb(grey).double(), want, atol=1e-6, rtol=0)
    assert not torch.allclose(want, rgba[..., :1].double().expand(2, 6, 7, 3).permute(0, 3, 1, 2), atol=1e-3)


def test_image_patches_are_in_merge_block_order():
    """Patch row k of a 64x64 image (2x2 blocks of 2x2 patches) is the 16x16 square the processor puts there."""
    x = torch.rand(1, 64, 64, 3)
    pp = Preprocessing(min_pixels=64 * 64, max_pixels=64 * 64)
    inp = preprocess_images(x, pp)[0]
    norm = (x[0].permute(2, 0, 1) - 0.5) / 0.5
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3),
             (2, 0), (2, 1), (3, 0), (3, 1), (2, 2), (2, 3), (3, 2), (3, 3)]
    for k, (r, c) in enumerate(order):
        patch = norm[:, r * 16:(r + 1) * 16, c * 16:(c + 1) * 16]
        row = inp.pixels[k].view(3, 2, 16, 16)
        assert torch.allclose(row[:, 0], patch, atol=1e-6) and torch.allclose(row[:, 1], patch, atol=1e-6)


def test_video_frames_timestamps_and_budget():
    pp = Preprocessing()
    assert sample_frames(10 * 30, 30.0, pp) == np.linspace(0, 299, 20).round().astype(int).tolist()
    assert len(sample_frames(3, 30.0, pp)) == 3  # never more frames than the video has
    assert len(sample_frames(30, 30.0, pp)) == 4  # at least min_frames
    v = preprocess_video(torch.rand(9, 48, 64, 3), fps=2.0, pp=pp)  # 4.5 s at 2 fps -> 9 frames -> 10 (pairs)
    assert v.grid[0] == 5 and len(v.timestamps) == 5
    assert v.timestamps[0] == pytest.approx(0.25) and v.timestamps[-1] == pytest.approx(4.0)
    big = preprocess_video(torch.rand(8, 720, 1280, 3), fps=2.0,
                           pp=Preprocessing(video_max_pixels=8 * 200_000))
    t, h, w = big.grid
    assert 2 * t * h * w * 256 <= 8 * 200_000 and big.scaled_down


def test_bad_input_messages():
    with pytest.raises(Qwen35Error, match="0x64 pixels"):
        preprocess_images(torch.rand(1, 64, 0, 3))
    with pytest.raises(Qwen35Error, match="empty"):
        preprocess_images(torch.rand(0, 64, 64, 3))
    with pytest.raises(Qwen35Error, match="0 frames"):
        preprocess_video(torch.rand(0, 64, 64, 3), fps=24.0)
    with pytest.raises(Qwen35Error, match="an image is 400x1 pixels: the aspect ratio"):
        preprocess_images(torch.rand(1, 1, 400, 3))
    with pytest.raises(Qwen35Error, match="a video's frames are 300x1 pixels: the aspect ratio"):
        preprocess_video(torch.rand(4, 1, 300, 3), fps=2.0)


@pytest.mark.parametrize("images, got", [(torch.rand(64, 48), r"\[64, 48\]"), (torch.rand(1, 1, 8, 8, 3), r"\[1, 1, 8, 8, 3\]"),
                                          (torch.rand(8), r"\[8\]")], ids=["mask", "5-d", "1-d"])
def test_an_image_tensor_of_another_rank_is_named(images, got):
    """A [H, W] mask (or any tensor not [batch, H, W, C] or [H, W, C]) wired to an image input: the message says
    what an image is and what came, for images and for a video source's frames."""
    with pytest.raises(Qwen35Error, match=rf"^an image input must be a tensor \[batch, height, width, channels\], "
                                          rf"got {got}$"):
        preprocess_images(images)
    with pytest.raises(Qwen35Error, match=rf"^an image input must be a tensor .*, got {got}$"):
        to_rgb(images)


def test_read_preprocessing_from_the_checkpoint(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(
        '{"size": {"longest_edge": 1000000, "shortest_edge": 1024}, "patch_size": 16, "merge_size": 2}')
    (tmp_path / "video_preprocessor_config.json").write_text('{"size": {"longest_edge": 5000, "shortest_edge": 9},'
                                                             ' "fps": 1, "max_frames": 10}')
    pp = read_preprocessing(tmp_path, max_pixels=500_000)
    assert (pp.min_pixels, pp.max_pixels, pp.video_min_pixels, pp.video_max_pixels) == (1024, 500_000, 9, 5000)
    assert (pp.fps, pp.max_frames) == (1, 10)
    assert read_preprocessing(None) == Preprocessing()


def test_a_processor_file_without_pixel_limits_is_named(tmp_path, caplog):
    """A converted checkpoint's processor file without size (or min / max_pixels): Qwen3.5's limits are used, and
    the log says so (transformers' processor would take its class's defaults: a video's tokens could differ ~37x)."""
    (tmp_path / "preprocessor_config.json").write_text('{"patch_size": 16, "merge_size": 2}')
    (tmp_path / "video_preprocessor_config.json").write_text('{"size": {"longest_edge": 5000}, "fps": 2}')
    with caplog.at_level("WARNING", logger="qwen35_fast.runtime.media"):
        pp = read_preprocessing(tmp_path)
    said = [r.getMessage() for r in caplog.records]
    assert (pp.min_pixels, pp.max_pixels, pp.video_max_pixels) == (Preprocessing.min_pixels,
                                                                   Preprocessing.max_pixels, 5000)
    assert len(said) == 2, said
    assert "preprocessor_config.json names no minimum or maximum pixel limit" in said[0]
    assert "min_pixels / max_pixels): Qwen3.5's (65,536 pixels / 16,777,216 pixels) are used" in said[0]
    assert "video_preprocessor_config.json names no minimum pixel limit (size.shortest_edge / longest_edge): " \
        "Qwen3.5's (4,096 pixels) is used" in said[1]


@pytest.mark.parametrize("frames,h,w", [(1, 64, 80), (3, 20, 700), (8, 720, 1280), (32, 720, 1280), (64, 1080, 1920),
                                        (9, 31, 31), (768, 360, 640)])
def test_video_resize_and_sampling_equal_transformers(frames, h, w):
    """The video processor's size rule (one budget over all frames) and its frame sampling."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as theirs
    from transformers.video_utils import VideoMetadata
    pp = Preprocessing()
    if frames >= 2:  # theirs refuses a single frame; ours takes it as a pair
        assert smart_resize(h, w, 32, pp.video_min_pixels, pp.video_max_pixels, frames=frames, temporal_factor=2) == \
            theirs(frames, h, w, 2, 32, pp.video_min_pixels, pp.video_max_pixels)
    proc = Qwen3VLVideoProcessor()
    for fps in (24.0, 30.0, 2.0):
        want = proc.sample_frames(VideoMetadata(total_num_frames=frames, fps=fps), fps=2).tolist()
        assert sample_frames(frames, fps, pp) == want


@pytest.mark.parametrize("frames,h,w,fps", [(60, 1080, 1920, 30.0), (8, 720, 1280, 2.0), (400, 360, 640, 24.0),
                                            (3, 64, 80, 2.0), (2000, 1080, 1920, 30.0)])
def test_a_checkpoints_per_frame_cap_sizes_a_video_as_transformers_does(tmp_path, monkeypatch, frames, h, w, fps):
    """A video_preprocessor_config.json with cap_pixels_per_frame (qwen-vl-utils' rule; transformers' default is
    off) caps each frame's pixels: the size is the one transformers' resize asks for (its torchvision resize stood
    in for by the size it is handed), and the tokens with it (a 1080p clip of 2 s: 4.25x fewer than uncapped)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_processing_utils import BaseVideoProcessor
    from transformers.video_utils import VideoMetadata
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 4096, "longest_edge": 25165824}, "cap_pixels_per_frame": True,
         "max_video_tokens": 512}))
    pp = read_preprocessing(tmp_path)
    assert pp.cap_pixels_per_frame and pp.max_video_tokens == 512
    monkeypatch.setattr(BaseVideoProcessor, "resize", lambda self, image, size, resample=None, **kw: torch.empty(
        *image.shape[:-2], size.height, size.width))
    proc = Qwen3VLVideoProcessor(size={"shortest_edge": 4096, "longest_edge": 25165824}, max_video_tokens=512)
    index = proc.sample_frames(VideoMetadata(total_num_frames=frames, fps=fps), fps=2).tolist()
    assert sample_frames(frames, fps, pp) == index
    for cap in (True, False):
        want = proc.resize(torch.empty(1, len(index), 3, h, w), size=proc.size, resample=None, factor=32,
                           temporal_factor=2, cap_pixels_per_frame=cap).shape[-2:]
        got = _video_layout(h, w, index, fps, pp if cap else Preprocessing())
        assert got.size == tuple(want), cap


def test_frame_sampling_equals_transformers_on_ties_and_long_clips():
    """The processor samples with numpy's float64 linspace: clips whose float32 spacing lands on a .5 tie or
    drifts (225 / 236 frames, 1,384 at 24 fps, an hour at 30 fps) pick the same frames as it does."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata
    proc, pp = Qwen3VLVideoProcessor(), Preprocessing()
    for frames, fps in [(226, 2.0), (236, 29.97), (1384, 24.0), (108_000, 30.0), (3_000, 25.0)]:
        want = proc.sample_frames(VideoMetadata(total_num_frames=frames, fps=fps), fps=2).tolist()
        assert sample_frames(frames, fps, pp) == want, (frames, fps)


@pytest.mark.parametrize("frames,fps", [(8, 2.0), (9, 2.0), (30, 30.0), (121, 24.0), (5, 1.0), (236, 29.97)])
def test_video_timestamps_equal_transformers(frames, fps):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    pp = Preprocessing()
    v = preprocess_video(torch.rand(frames, 32, 32, 3), fps=fps, pp=pp)
    want = Qwen3VLProcessor._calculate_timestamps(None, sample_frames(frames, fps, pp), fps, 2)
    assert [f"<{t:.1f} seconds>" for t in v.timestamps] == [f"<{t:.1f} seconds>" for t in want]
    assert v.timestamps == pytest.approx(want)


@pytest.mark.parametrize("max_pixels,scaled", [(16_384, False), (4_096, True)])
def test_a_max_pixels_below_the_checkpoints_min_pixels_never_makes_an_image_bigger_than_it(max_pixels, scaled):
    """The checkpoint's min_pixels (65,536) gives way to a smaller max_pixels: a 100 x 100 image is not scaled up
    past the limit the user set (to 128 x 128 at 16,384; down to 64 x 64 at 4,096)."""
    pp = read_preprocessing(None, max_pixels=max_pixels)
    assert pp.min_pixels == max_pixels
    inp = preprocess_images(torch.rand(1, 100, 100, 3), pp)[0]
    assert inp.grid[1] * inp.grid[2] * 16 * 16 == max_pixels and inp.scaled_down == scaled
    video = read_preprocessing(None, video_max_pixels=2_048)
    assert video.video_min_pixels == 2_048 and video.min_pixels == Preprocessing().min_pixels
    assert read_preprocessing(None, max_pixels=1_000_000).min_pixels == Preprocessing().min_pixels


def test_min_pixels_above_max_pixels_is_refused():
    with pytest.raises(Qwen35Error, match="min_pixels 5000 is above max_pixels 4096"):
        read_preprocessing(None, min_pixels=5000, max_pixels=4096)


@pytest.mark.parametrize("value", [0, -1, 1.5, 1e6, "1000", True])
def test_pixel_limits_must_be_positive_whole_numbers(value):
    with pytest.raises(Qwen35Error, match=rf"max_pixels must be a whole number of pixels above 0, got {value!r}"):
        read_preprocessing(None, max_pixels=value)
    with pytest.raises(Qwen35Error, match=r"video_max_pixels must be"):
        read_preprocessing(None, video_max_pixels=value)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.bool])
def test_integer_pixels_are_refused_not_clamped_to_white(dtype):
    pixels = torch.full((1, 32, 32, 3), 1 if dtype == torch.bool else 100, dtype=dtype)
    with pytest.raises(Qwen35Error, match=rf"dtype {dtype}.*float in 0\.\.1.*\.float\(\) / 255"):
        preprocess_images(pixels)
    with pytest.raises(Qwen35Error, match=rf"dtype {dtype}"):
        preprocess_video(pixels.expand(4, -1, -1, -1), fps=2.0)
    assert preprocess_images(pixels.float() / 255)[0].grid == (1, 16, 16)  # what the message says works


def test_channel_and_video_shape_messages_say_what_is_taken_and_what_came():
    two = to_rgb(torch.rand(1, 8, 8, 2))  # grey + alpha is taken ...
    assert two.shape == (1, 3, 8, 8)
    with pytest.raises(Qwen35Error, match=r"5 channels; expected 1 \(grey\), 2 \(grey \+ alpha\), 3 \(RGB\) or 4"):
        preprocess_images(torch.rand(1, 8, 8, 5))  # ... and the message says so
    with pytest.raises(Qwen35Error, match=r"an image has 48 channels.*a MASK \[batch, height, width\] is no IMAGE: "
                                          r"convert it with ComfyUI's Convert Mask to Image node"):
        preprocess_images(torch.rand(1, 64, 48))  # a MASK where an IMAGE goes: read as one [H, W, C] image
    with pytest.raises(Qwen35Error, match=r"\[count, height, width, channels\], got \[64, 64, 3\]"):
        preprocess_video(torch.rand(64, 64, 3), fps=2.0)
    with pytest.raises(Qwen35Error, match=r"got list"):
        preprocess_video([torch.rand(64, 64, 3)], fps=2.0)


class TensorSource:
    """A VideoSource over frames already in memory: what a file decoder hands the runtime, the indices it was asked
    for (to check that only those frames are read), and how many frames it gave were alive at once at most (each
    frame is a fresh copy, as a decoder's is, dropped after keep: one that the runtime kept would stay alive)."""

    def __init__(self, frames: torch.Tensor, fps: float):
        self.frames, self.fps, self.asked = frames, fps, []
        self.alive = self.most_alive = 0

    def read(self, choose, keep):
        index = choose(self.frames.shape[0])
        self.asked.append(index)
        for i in index:
            frame = self.frames[i].clone()
            self.alive += 1
            self.most_alive = max(self.most_alive, self.alive)
            weakref.finalize(frame, self._released)
            keep(frame)
            del frame

    def _released(self):
        self.alive -= 1


VIDEOS = [(1, 24.0, 40, 56, 3), (3, 30.0, 40, 56, 3), (5, 1.0, 40, 56, 3), (7, 0.5, 40, 56, 3), (9, 2.0, 40, 56, 3),
          (90, 30.0, 40, 56, 3), (121, 24.0, 40, 56, 3), (301, 29.97, 40, 56, 3), (40, 3.0, 40, 56, 3),
          (9, 2.0, 33, 47, 3), (5, 1.0, 31, 17, 1), (7, 1.0, 48, 64, 4), (9, 2.0, 21, 90, 2), (3, 1.0, 64, 64, 3),
          (13, 2.0, 181, 323, 3), (11, 1.0, 720, 1280, 3), (9, 1.0, 1080, 1920, 4)]


@pytest.mark.parametrize("frames,fps,h,w,c", VIDEOS)
def test_a_video_source_gives_what_the_whole_tensor_gives(frames, fps, h, w, c):
    """preprocess_video_source reads only the sampled frames, one at a time (none kept at source size: each is
    resized as it comes), and gives the same patches (bit for bit), grid, timestamps and content key as
    preprocess_video over all of them: fps below 2, odd counts (the pair's fill), min_frames, sizes the budget
    shrinks or leaves, odd byte counts (the streamed hash's carry), grey, grey + alpha, RGBA."""
    from qwen35_fast.runtime.fingerprint import content_hash
    pp = Preprocessing(video_max_pixels=4_000_000) if h >= 720 else Preprocessing()  # (resized, not kept whole)
    video = torch.rand(frames, h, w, c, generator=torch.Generator().manual_seed(frames * h + c))
    want = preprocess_video(video, fps, pp)
    source = TensorSource(video, fps)
    got = preprocess_video_source(source, pp)
    assert source.asked == [sample_frames(frames, fps, pp)] and source.most_alive == 1
    assert torch.equal(got.pixels, want.pixels)
    assert (got.kind, got.grid, got.timestamps, got.source_size, got.scaled_down, got.recipe) == \
        (want.kind, want.grid, want.timestamps, want.source_size, want.scaled_down, want.recipe)
    assert got.content_key(content_hash) == want.content_key(content_hash)
    other = video.clone()
    other[sample_frames(frames, fps, pp)[-1], -1, -1, -1] += 0.5
    assert preprocess_video_source(TensorSource(other, fps), pp).content_key(content_hash) != \
        want.content_key(content_hash)


def test_a_streamed_video_lets_its_resized_frames_go_once_its_patches_are_made(monkeypatch):
    """A video read once (read_video) and asked about in several prompts keeps its patches, not the resized
    frames they were made from as well (a second copy of the pixel budget: ~300 MB at the default)."""
    import gc

    from qwen35_fast.runtime import media
    seen = []
    real = media._normalise
    monkeypatch.setattr(media, "_normalise", lambda x, pp: seen.append(weakref.ref(x)) or real(x, pp))
    got = preprocess_video_source(TensorSource(torch.rand(6, 64, 96, 3), 2.0), Preprocessing())
    assert got.pixels.shape[0] == got.n_patches
    gc.collect()
    assert len(seen) == 1 and seen[0]() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("h, w, max_pixels", [(2048, 2048, 1024), (3000, 4000, 4096), (4000, 6000, 16384)])
def test_a_reduction_too_large_for_cudas_resize_is_made_on_the_cpu(h, w, max_pixels):
    """CUDA's antialiased bicubic refuses factors around 60 (its filter taps outgrow 48 KB of shared memory):
    such an image is resized on the CPU, and its patches come back to the GPU."""
    pp = read_preprocessing(None, max_pixels=max_pixels)
    image = torch.rand(1, h, w, 3, generator=torch.Generator().manual_seed(h))
    (got,) = preprocess_images(image.cuda(), pp, "cuda")
    (want,) = preprocess_images(image, pp)
    assert got.pixels.is_cuda and got.grid == want.grid
    assert (got.pixels.cpu() - want.pixels).abs().max() < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("frames,fps,h,w,c", VIDEOS[::3] + VIDEOS[-2:])
def test_a_video_source_resized_on_the_gpu_gives_what_the_whole_tensor_gives(frames, fps, h, w, c):
    """The model's device resizes: frame by frame there equals the batch bit for bit too (the patches, the key,
    with the frames hashed by the torch expression or by the CUDA backend's kernel)."""
    from qwen35_fast import kernels
    from qwen35_fast.runtime.fingerprint import content_hash
    pp = Preprocessing(video_max_pixels=4_000_000) if h >= 720 else Preprocessing()
    video = torch.rand(frames, h, w, c, generator=torch.Generator().manual_seed(frames * h + c))
    want = preprocess_video(video, fps, pp, "cuda")
    got = preprocess_video_source(TensorSource(video, fps), pp, "cuda")
    assert got.pixels.is_cuda and torch.equal(got.pixels, want.pixels) and got.grid == want.grid
    assert got.content_key(content_hash) == want.content_key(content_hash)
    cuda = kernels.select_backend("cuda", "cuda", torch.bfloat16)  # (the frames stay fp32: it hashes bytes)
    hashed = preprocess_video_source(TensorSource(video, fps), pp, "cuda", cuda)
    assert hashed.content_key(content_hash) == want.content_key(content_hash)


def test_each_frame_is_resized_before_the_next_is_read(monkeypatch):
    """keep resizes the frame it is given at once: the reader's k-th frame has been resized when it gives the next,
    so only the small frames pile up (to the pixel budget), never the source-size ones."""
    from qwen35_fast.runtime import media
    resized = []
    real = media._resize
    monkeypatch.setattr(media, "_resize", lambda x, size: resized.append(tuple(x.shape)) or real(x, size))

    class Checked(TensorSource):
        def read(self, choose, keep):
            for k, i in enumerate(choose(self.frames.shape[0])):
                assert len(resized) == k
                keep(self.frames[i].clone())
    video = torch.rand(60, 270, 480, 3)
    got = preprocess_video_source(Checked(video, 6.0), Preprocessing(video_max_pixels=1_000_000))  # 20 frames
    assert resized == [(1, 3, 270, 480)] * 20 and got.grid == (10, 10, 18)  # 20 x 160 x 288 pixels


@pytest.mark.parametrize("shape,dtype", [((4, 6, 10, 3), torch.float32), ((5, 3, 7, 3), torch.float32),
                                         ((3, 5, 5, 1), torch.float16), ((6, 3, 3, 3), torch.bfloat16),
                                         ((2, 1, 1, 1), torch.float16), ((3, 9, 11, 2), torch.float64)])
def test_the_streamed_hash_is_content_hash_of_the_frames_stacked(shape, dtype):
    """Frames whose bytes end inside a 64-bit word (the carry), views that start inside a word."""
    from qwen35_fast.runtime.fingerprint import StreamedHash, content_hash
    for skip in (0, 1):
        frames = torch.rand(math.prod(shape) + skip).to(dtype)[skip:].view(shape)
        stream = StreamedHash()
        for frame in frames:
            stream.add(frame)
        assert stream.digest(tuple(shape), dtype) == content_hash(frames)


def test_a_video_source_keeps_the_runtime_messages():
    with pytest.raises(Qwen35Error, match="0 frames"):
        preprocess_video_source(TensorSource(torch.rand(0, 64, 64, 3), 24.0))
    with pytest.raises(Qwen35Error, match="frame rate is 0.0"):
        preprocess_video_source(TensorSource(torch.rand(4, 64, 64, 3), 0.0))
    with pytest.raises(Qwen35Error, match=r"the video's frame rate is -24.0; it must be a number of frames per second "
                                          r"above 0"):
        preprocess_video(torch.rand(4, 64, 64, 3), -24.0)
    for fps in ("24", None, True):  # not a number: named, not a TypeError / ValueError from the arithmetic
        with pytest.raises(Qwen35Error, match=rf"frame rate is {re.escape(repr(fps))}"):
            preprocess_video(torch.rand(4, 64, 64, 3), fps)
        with pytest.raises(Qwen35Error, match=rf"frame rate is {re.escape(repr(fps))} \(TensorSource.fps\)"):
            preprocess_video_source(TensorSource(torch.rand(4, 64, 64, 3), fps))
    # a frame rate so small that the clip lasts longer than a float holds: every frame, to max_frames
    assert sample_frames(10, 1e-310, Preprocessing()) == list(range(10))
    assert len(sample_frames(10_000, 1e-310, Preprocessing())) == Preprocessing().max_frames
    for read in (lambda x: preprocess_video_source(TensorSource(x, 2.0)), lambda x: preprocess_video(x, 2.0)):
        with pytest.raises(Qwen35Error, match=r"^a video frame tensor has dtype torch.uint8"):  # (not "an image")
            read(torch.zeros(4, 64, 64, 3, dtype=torch.uint8))

    class Short(TensorSource):  # a reader that gives fewer frames than it was asked for
        def read(self, choose, keep):
            for i in choose(self.frames.shape[0])[:-1]:
                keep(self.frames[i])
    with pytest.raises(Qwen35Error, match=r"\(Short\) kept 3 frames for 4 frame indices"):
        preprocess_video_source(Short(torch.rand(4, 64, 64, 3), 2.0))

    class Growing(TensorSource):  # frames that change size
        def read(self, choose, keep):
            for i in choose(self.frames.shape[0]):
                keep(self.frames[i, :32 + i])
    with pytest.raises(Qwen35Error, match=r"changes from \[32, 64, 3\] torch.float32 frames to \[33, 64, 3\]"):
        preprocess_video_source(Growing(torch.rand(4, 64, 64, 3), 2.0))

    class Silent(TensorSource):  # never asks
        def read(self, choose, keep):
            pass
    with pytest.raises(Qwen35Error, match=r"\(Silent\) asked for no frames"):
        preprocess_video_source(Silent(torch.rand(4, 64, 64, 3), 2.0))


class KeepFirst(TensorSource):
    """A reader that calls keep before it has asked which frames (choose)."""
    def read(self, choose, keep):
        keep(self.frames[0])


class KeepTwice(TensorSource):
    """A reader that keeps each frame it was asked for twice."""
    def read(self, choose, keep):
        for i in choose(self.frames.shape[0]):
            keep(self.frames[i])
            keep(self.frames[i])


class KeepBatch(TensorSource):
    """A reader that hands keep the frames it was asked for as one batch [F, H, W, C]."""
    def read(self, choose, keep):
        keep(self.frames[choose(self.frames.shape[0])])


class KeepArray(TensorSource):
    """A reader that hands keep a numpy frame."""
    def read(self, choose, keep):
        for i in choose(self.frames.shape[0]):
            keep(self.frames[i].numpy())


@pytest.mark.parametrize("reader, message", [
    (KeepFirst, r"^a video reader called keep before asking for frames \(choose\); it must call keep once per "
                r"index, in order$"),
    (KeepTwice, r"^a video reader called keep more often than the 4 frame indices it asked for; it must call keep "
                r"once per index, in order$"),
    (KeepBatch, r"^a video reader gave a frame \[4, 32, 40, 3\]; keep takes one frame \[height, width, channels\]$"),
    (KeepArray, r"^a video reader gave a frame ndarray; keep takes one frame \[height, width, channels\]$"),
])
def test_a_video_reader_that_calls_keep_wrongly_is_named(reader, message):
    """A VideoSource (a file decoder of a node pack) that breaks the choose-then-keep contract: the message names
    the call it made and the contract; a reader that keeps it reads the same clip (4 frames sampled of 4)."""
    frames = torch.rand(4, 32, 40, 3, generator=torch.Generator().manual_seed(2))
    with pytest.raises(Qwen35Error, match=message):
        preprocess_video_source(reader(frames, 2.0))
    assert preprocess_video_source(TensorSource(frames, 2.0)).grid == preprocess_video(frames, 2.0).grid


def test_choosing_again_starts_over():
    """A reader whose first frame count was wrong chooses again: what it kept before is dropped."""
    video = torch.rand(30, 40, 56, 3)

    class Miscounted(TensorSource):
        def read(self, choose, keep):
            for i in choose(20):
                keep(self.frames[i].clone())
            super().read(choose, keep)
    assert torch.equal(preprocess_video_source(Miscounted(video, 10.0)).pixels, preprocess_video(video, 10.0).pixels)


class _SaysGpu(torch.Tensor):
    """CPU pixels that say they lie on a GPU (the path of an IMAGE batch a node left there), counting the gathers
    of frames by index."""
    gathers: list = []

    @property
    def device(self):
        return torch.device("cuda", 0)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and isinstance(args[1], list):
            cls.gathers.append(list(args[1]))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_gpu_videos_sampled_frames_are_checked_at_once_and_never_gathered():
    """A video on the GPU has its sampled frames checked (NaN / inf) before any GPU work is queued, one frame at a
    time, not gathered (a copy of every sampled frame at source size; the key's and the patches' passes read one
    frame at a time as well: the next test)."""
    frames = torch.rand(40, 32, 48, 3, generator=torch.Generator().manual_seed(3))
    _SaysGpu.gathers = []
    v = preprocess_video(frames.as_subclass(_SaysGpu), 10.0)
    assert _SaysGpu.gathers == [] and v.grid == preprocess_video(frames, 10.0).grid
    bad = frames.clone()
    bad[sample_frames(40, 10.0, Preprocessing())[2], 1, 1, 0] = float("nan")
    with pytest.raises(Qwen35Error, match="holds 1 NaN or infinite values"):
        preprocess_video(bad.as_subclass(_SaysGpu), 10.0)  # at once, not when the patches are made


def test_a_videos_frames_move_to_the_resizing_device_one_at_a_time(monkeypatch):
    """preprocess_video's device (the tower's): each sampled frame, checked where it is, moves there alone to be
    hashed or resized, so the device never holds the sampled frames at source size (3 copies of them, one kept
    through the prefill, before: 4 GB for 120 frames of 720p); the patches and key are the whole batch's."""
    from qwen35_fast.runtime import media
    from qwen35_fast.runtime.fingerprint import content_hash
    frames = torch.rand(9, 32, 48, 3, generator=torch.Generator().manual_seed(4))
    moved, to = [], torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda x, *a, **k: moved.append(tuple(x.shape)) or to(x, *a, **k))
    v = media.preprocess_video(frames, 10.0, device="cpu")
    key, pixels = v.content_key(content_hash), v.pixels
    n = len(sample_frames(9, 10.0, Preprocessing()))
    assert [m for m in moved if m[1:] == (32, 48, 3)] == [(1, 32, 48, 3)] * (2 * n)  # the key's pass, the patches'
    monkeypatch.undo()
    assert torch.equal(pixels, preprocess_video(frames, 10.0).pixels) and key == v.content_key(content_hash)


def test_nan_or_infinite_pixels_are_named_where_they_are_read():
    """NaN / inf pixels (a VAE decode in fp16 can make them) are refused, counted, where the pixels are first read:
    an image when its patches are made, a video's sampled frames (an unsampled frame is never read), a streamed
    video's frame as its reader gives it."""
    from qwen35_fast.runtime.media import check_finite
    image = torch.rand(2, 32, 32, 3)
    image[1, 3, 5, 1], image[1, 7, 9, 0] = float("nan"), float("-inf")
    with pytest.raises(Qwen35Error, match=r"^an image \(or video frame\) holds 2 NaN or infinite values of its "
                                          r"6,144; the node that made it produced them"):
        check_finite(image)
    first, second = preprocess_images(image)
    with pytest.raises(Qwen35Error, match="holds 2 NaN or infinite values of its 3,072"):
        second.pixels  # noqa: B018  (the batch's patches are made at once, an image at a time, when one is read)
    check_finite(image[:1])
    pp = read_preprocessing(None)
    frames = torch.rand(8, 32, 32, 3)
    index = sample_frames(8, 4.0, pp)
    unsampled = next(i for i in range(8) if i not in index)
    frames[unsampled, 0, 0, 0] = float("nan")
    preprocess_video(frames, 4.0, pp).pixels  # noqa: B018
    frames[index[1], 0, 0, 0] = float("inf")
    with pytest.raises(Qwen35Error, match="holds 1 NaN or infinite values of its"):
        preprocess_video(frames, 4.0, pp).pixels  # noqa: B018
    with pytest.raises(Qwen35Error, match="holds 1 NaN or infinite values of its 3,072"):
        preprocess_video_source(TensorSource(frames, 4.0), pp)


def test_pixels_outside_0_to_1_are_clamped_and_named(caplog):
    """An IMAGE holds 0..1: pixels far outside it (a picture in 0..255, or in -1..1) are clamped as before and
    named, with the fix, in the log where they are read; a resize's small overshoot is not. check_finite returns the
    range it read."""
    from qwen35_fast.runtime.media import check_finite, range_note
    image = torch.rand(1, 32, 32, 3)
    image[0, 0, 0] = torch.tensor([0.0, 1.0, 0.5])
    assert check_finite(image) == (0.0, 1.0) and range_note(0.0, 1.0) == ""
    assert range_note(-0.04, 1.06) == ""  # a bicubic resize's overshoot
    assert check_finite(torch.empty(0, 4, 4, 3)) == (0.0, 0.0)
    note = range_note(0.0, 255.0)
    assert note.startswith("pixel values run from 0 to 255, but an IMAGE holds 0..1: they were clamped to it")
    assert "divide it by 255" in note and "(x + 1) / 2" in range_note(-1.0, 1.0)
    with caplog.at_level("WARNING", logger="qwen35_fast.runtime.media"):
        caplog.clear()
        preprocess_images(image)[0].pixels  # noqa: B018
        assert not caplog.records
        wide = image * 255
        got = preprocess_images(wide)[0].pixels
        assert [r.getMessage() for r in caplog.records] == [f"qwen35: {range_note(0.0, 255.0)}"]
        assert torch.equal(got, preprocess_images(wide.clamp(0, 1))[0].pixels)  # clamped, as it always was
        caplog.clear()
        frames = torch.rand(8, 32, 32, 3) * 2 - 1
        preprocess_video(frames, 4.0, read_preprocessing(None)).pixels  # noqa: B018
        assert len(caplog.records) == 1 and "(x + 1) / 2" in caplog.records[0].getMessage()
        caplog.clear()  # a reader streaming the same frames: named once for the video, as the tensor's are
        preprocess_video_source(TensorSource(frames, 4.0), read_preprocessing(None))
        assert len(caplog.records) == 1 and "(x + 1) / 2" in caplog.records[0].getMessage()
        caplog.clear()
        preprocess_video_source(TensorSource(frames.clamp(0, 1), 4.0), read_preprocessing(None))
        assert not caplog.records


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pixels_are_named_with_the_conversion(dtype):
    """fp8 pixels passed the float check and met NotImplementedError from the finite check's min / max; they are
    named with the conversion, in an image batch and in a video's frames."""
    pixels = torch.rand(2, 64, 64, 3).to(dtype)
    with pytest.raises(Qwen35Error, match=rf"^an image tensor has dtype {dtype}.*\.float\(\)"):
        preprocess_images(pixels)[0].pixels
    with pytest.raises(Qwen35Error, match=rf"^a video frame tensor has dtype {dtype}"):
        preprocess_video(pixels.repeat(2, 1, 1, 1), 2.0)


def test_an_image_batch_is_converted_an_image_at_a_time(monkeypatch):
    """An IMAGE batch's full-size fp32 copies (the conversion to RGB, channels first) are made for one image at a
    time, not for the whole batch (8 frames of 2000 x 1500 RGBA took 2.8x the batch's bytes on top of it), and
    the patches are those of the batch converted at once."""
    import qwen35_fast.runtime.media as media
    images = torch.rand(3, 96, 64, 4, generator=torch.Generator().manual_seed(3))
    pp = Preprocessing()
    size = smart_resize(96, 64, pp.factor, pp.min_pixels, pp.max_pixels)
    whole = media._normalise(media._resize(media.to_rgb(images), size), pp)
    seen, real = [], media.to_rgb
    monkeypatch.setattr(media, "to_rgb", lambda x: seen.append(x.shape[0]) or real(x))
    inputs = preprocess_images(images)
    patches = [i.pixels for i in inputs]
    assert seen == [1, 1, 1]
    for k in range(3):
        want = media._patchify(whole[k][None].expand(pp.temporal_patch_size, -1, -1, -1), pp)[0]
        assert torch.equal(patches[k], want)
