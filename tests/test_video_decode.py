"""A VIDEO from a file reaches the prefill with only its sampled frames decoded to tensors, and gives what the full
decode (ComfyUI's get_components, every frame) gave: the same pixels, grid, timestamps, token ids and cache key.

Needs ComfyUI (COMFYUI_DIR) and PyAV, a ComfyUI dependency; skipped otherwise. The videos are made here: frame i
writes i in binary as black and white blocks along its top, over a grey that grows with i.
"""
# ruff: noqa: F811  (the fixtures imported from test_nodes are parameters of the tests)
import io
from fractions import Fraction

import numpy as np
import pytest
import torch
from test_nodes import comfy, loaded, models_dir, pack  # noqa: F401  (fixtures)

av = pytest.importorskip("av")
pytestmark = pytest.mark.comfyui


def write_video(path, count: int, fps: int, width: int = 64, height: int = 48, codec: str = "h264",
                pix_fmt: str = "yuv420p"):
    """`count` frames; frame i: a grey of level 40 + 2 i, and i in binary as 8 x 8 blocks (white for a 1) in
    the top row, lowest bit first."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        for i in range(count):
            img = np.full((height, width, 3), 40 + 2 * i, np.uint8)
            for bit in range(width // 8):
                img[:8, 8 * bit:8 * bit + 8] = 255 if i >> bit & 1 else 0
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def _number(frame: torch.Tensor) -> int:
    """Which frame of write_video this is, read from its blocks."""
    blocks = frame[:8, :frame.shape[1] // 8 * 8].mean(dim=(0, 2)).view(-1, 8).mean(dim=1)
    return sum(1 << bit for bit, level in enumerate(blocks.tolist()) if level > 0.5)


def _run(pack, model, **kw):
    args = dict(model=model, prompt="<video> What changes?", images=None, video=None, frames=None, frame_rate=24.0,
                mode="all images in one prompt", system_prompt="", thinking=False, max_pixels=0)
    args.update(kw)
    return pack.Qwen35MultimodalPrefill.execute(**args)[0][0].prefill


@pytest.fixture
def videos(comfy, tmp_path):
    from comfy_api.latest import InputImpl
    made = {
        "64x48 30 fps": write_video(tmp_path / "a.mp4", 90, 30),
        "80x48 24 fps (width not a multiple of 32)": write_video(tmp_path / "b.mp4", 37, 24, width=80),
        "mjpeg 1 fps (full-range 8-bit)": write_video(tmp_path / "c.avi", 7, 1, codec="mjpeg", pix_fmt="yuvj420p"),
    }
    out = {name: InputImpl.VideoFromFile(str(path)) for name, path in made.items()}
    out["bytes"] = InputImpl.VideoFromFile(io.BytesIO(made["64x48 30 fps"].read_bytes()))
    out["trimmed"] = InputImpl.VideoFromFile(str(made["64x48 30 fps"]), start_time=0.5, duration=1.7)
    return out


def test_the_sampled_frames_equal_those_of_the_full_decode(videos):
    from qwen35_fast.nodes.video import video_clip
    from qwen35_fast.runtime.fingerprint import content_hash
    from qwen35_fast.runtime.media import Preprocessing, preprocess_video, preprocess_video_source, sample_frames
    pp = Preprocessing()
    for name, video in videos.items():
        parts = video.get_components()
        want = preprocess_video(parts.images, float(parts.frame_rate), pp)
        got = preprocess_video_source(video_clip(video), pp)
        assert torch.equal(got.pixels, want.pixels), name
        assert (got.grid, got.timestamps, got.scaled_down) == (want.grid, want.timestamps, want.scaled_down), name
        assert got.content_key(content_hash) == want.content_key(content_hash), name
    taken = _read(video_clip(videos["64x48 30 fps"]), lambda total: sample_frames(total, 30.0, pp))[1]
    assert [_number(f) for f in taken] == sample_frames(90, 30.0, pp) == [0, 18, 36, 53, 71, 89]


def _read(clip, choose):
    """(the indices of the last choose, the frames kept after it) of a FileVideo's read."""
    asked, kept = [], []

    def ask(total):
        asked.append(choose(total))
        kept.clear()  # (choosing again starts over)
        return asked[-1]
    clip.read(ask, kept.append)
    return asked[-1], kept


def test_the_node_decodes_only_the_sampled_frames(pack, loaded, videos, monkeypatch):
    """The prefill equals the one from all frames (get_components, then the frames input), which then reads the
    video from the prefix cache; get_components is never called and only the 6 sampled frames of 90 (3 s at
    2 frames a second) are converted."""
    from comfy_api.latest import InputImpl

    from qwen35_fast.nodes import video as decode
    video = videos["64x48 30 fps"]
    parts = video.get_components()
    converted = []
    real = decode.to_tensor
    monkeypatch.setattr(decode, "to_tensor", lambda frame, how: converted.append(round(frame.time * 30)) or
                        real(frame, how))

    def no_full_decode(self):
        raise AssertionError("get_components decoded every frame")
    monkeypatch.setattr(InputImpl.VideoFromFile, "get_components", no_full_decode)
    loaded.model.kv.pool.clear()
    a = _run(pack, loaded, video=video)
    assert converted == [0, 18, 36, 53, 71, 89]
    b = _run(pack, loaded, frames=parts.images, frame_rate=float(parts.frame_rate))
    assert a.token_ids == b.token_ids and a.media == b.media and b.cached_tokens >= a.media[-1].end
    loaded.model.kv.pool.clear()
    cold = _run(pack, loaded, frames=parts.images, frame_rate=float(parts.frame_rate))
    assert cold.cached_tokens == 0 and torch.equal(a.logits, cold.logits)
    text = loaded.model.tokenizer.decode(a.token_ids)
    # frames 0, 18, 36, 53, 71, 89 of 90 at 30 fps: pairs at 0.3, 1.5 and 2.7 s
    assert all(f"<{t} seconds><|vision_start|>" in text for t in ("0.3", "1.5", "2.7"))


def test_a_file_video_holds_one_frame_at_a_time(videos, monkeypatch):
    """FileVideo drops each converted frame after keep, before the next is converted: with a keep that stores
    nothing, no two of them are ever alive together."""
    import weakref

    from qwen35_fast.nodes import video as decode
    alive, most = [0], [0]
    real = decode.to_tensor

    def to_tensor(frame, how):
        pixels = real(frame, how)
        alive[0] += 1
        most[0] = max(most[0], alive[0])
        weakref.finalize(pixels, lambda: alive.__setitem__(0, alive[0] - 1))
        return pixels
    monkeypatch.setattr(decode, "to_tensor", to_tensor)
    decode.video_clip(videos["64x48 30 fps"]).read(lambda total: list(range(total)), lambda frame: None)
    assert most[0] == 1 and alive[0] == 0


def test_the_frames_taken_are_the_sampled_ones_even_when_the_frame_count_is_off(videos, monkeypatch):
    """A container whose frame count (metadata) is wrong: the frames are sampled from the count decoded."""
    from comfy_api.latest import InputImpl

    from qwen35_fast.nodes.video import video_clip
    video = videos["64x48 30 fps"]
    for wrong in (60, 120):
        monkeypatch.setattr(InputImpl.VideoFromFile, "get_frame_count", lambda self: wrong)
        asked = []
        index, frames = _read(video_clip(video), lambda total: asked.append(total) or [0, total // 2, total - 1])
        assert asked == [wrong, 90] and index == [0, 45, 89]
        assert [_number(f) for f in frames] == index
    def no_count(self):
        raise ValueError("Could not determine frame count")
    monkeypatch.setattr(InputImpl.VideoFromFile, "get_frame_count", no_count)  # then the decode counts
    index, frames = _read(video_clip(video), lambda total: [total - 1])
    assert index == [89] and [_number(f) for f in frames] == [89]


def test_a_trimmed_video_keeps_its_window(videos):
    from qwen35_fast.nodes.video import video_clip
    frames = torch.stack(_read(video_clip(videos["trimmed"]), lambda total: list(range(total)))[1])
    full = videos["trimmed"].get_components().images
    assert torch.equal(frames, full) and _number(frames[0]) == 15  # 0.5 s at 30 fps


def test_a_video_in_memory_is_indexed_not_encoded(comfy, pack, loaded, monkeypatch):
    from comfy_api.latest import InputImpl, Types

    from qwen35_fast.nodes.video import video_clip
    frames = torch.rand(12, 64, 80, 3, generator=torch.Generator().manual_seed(1))
    video = InputImpl.VideoFromComponents(Types.VideoComponents(images=frames, frame_rate=Fraction(6)))
    monkeypatch.setattr(InputImpl.VideoFromComponents, "save_to", lambda *a, **k: 1 / 0)  # (its stream source)
    clip = video_clip(video)
    assert clip[0] is frames and clip[1] == 6.0
    assert _run(pack, loaded, video=video).vision.grids == _run(pack, loaded, frames=frames, frame_rate=6.0).vision.grids


def test_empty_and_broken_files_say_so(comfy, pack, loaded, tmp_path):
    from comfy_api.latest import InputImpl

    from qwen35_fast.runtime import Qwen35Error
    empty = tmp_path / "empty.avi"
    with av.open(str(empty), "w") as out:
        stream = out.add_stream("mjpeg", rate=30)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuvj420p"
        out.start_encoding()
    assert InputImpl.VideoFromFile(str(empty)).get_components().images.shape[0] == 0  # what ComfyUI reads in it
    with pytest.raises(Qwen35Error, match="the video has 0 frames; connect a video with at least one frame"):
        _run(pack, loaded, video=InputImpl.VideoFromFile(str(empty)))
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video" * 100)
    with pytest.raises(Qwen35Error, match=r"could not read the video .*broken\.mp4.*Invalid data.*re-encode it"):
        _run(pack, loaded, video=InputImpl.VideoFromFile(str(broken)))
    audio = tmp_path / "audio.wav"
    with av.open(str(audio), "w") as out:
        stream = out.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            out.mux(packet)
    with pytest.raises(Qwen35Error, match=r"could not read the video .*audio\.wav.*(?i:no video stream)"):
        _run(pack, loaded, video=InputImpl.VideoFromFile(str(audio)))


def _rotated(path, matrix):
    """The MP4 at `path` with the rotation part of its track's display matrix set to `matrix` (a, b, u, c, d, v),
    as a phone writes it for a portrait video."""
    import struct
    data = bytearray(path.read_bytes())
    at = data.index(b"tkhd") + 4 + 4 + 4 * 5 + 8 + 8  # version 0 box: the matrix after the volume
    data[at:at + 36] = struct.pack(">9i", *matrix, 0, 0, 1 << 30)
    path.write_bytes(bytes(data))
    return path


def test_a_phone_video_is_turned_as_comfyui_turns_it(comfy, tmp_path):
    """A portrait phone video is stored landscape with a rotation: the frames come out standing, turned the way
    ComfyUI's get_components turns them (the same pixels), not mirrored or upside down."""
    from comfy_api.latest import InputImpl

    from qwen35_fast.nodes.video import video_clip
    path = _rotated(write_video(tmp_path / "phone.mp4", 5, 10), (0, 1 << 16, 0, -(1 << 16), 0, 0))
    video = InputImpl.VideoFromFile(str(path))
    with av.open(str(path)) as container:
        assert abs(next(container.decode(video=0)).rotation) == 90
    full = video.get_components().images
    frames = torch.stack(_read(video_clip(video), lambda total: list(range(total)))[1])
    assert full.shape == (5, 64, 48, 3) and frames.shape == full.shape
    assert torch.equal(frames, full)


def test_a_video_with_alpha_gives_its_colour_channels(comfy, tmp_path):
    """A video with an alpha channel (PNG frames in a MOV, as exported for compositing): the frames are the
    3 colour channels get_components gives, and the prefill reads them as it reads the full decode."""
    from comfy_api.latest import InputImpl

    from qwen35_fast.nodes.video import video_clip
    from qwen35_fast.runtime.media import Preprocessing, preprocess_video, preprocess_video_source
    path = tmp_path / "alpha.mov"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("png", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "rgba"
        for i in range(6):
            img = np.zeros((48, 64, 4), np.uint8)
            img[..., 0], img[..., 1], img[..., 2], img[..., 3] = 30 * i, 100, 200, 128
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgba")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    video = InputImpl.VideoFromFile(str(path))
    full = video.get_components().images
    frames = torch.stack(_read(video_clip(video), lambda total: list(range(total)))[1])
    assert frames.shape == full.shape == (6, 48, 64, 3) and torch.equal(frames, full)
    assert torch.allclose(frames[3, 0, 0], torch.tensor([90, 100, 200]) / 255)
    pp = Preprocessing()
    got, want = preprocess_video_source(video_clip(video), pp), preprocess_video(full, 4.0, pp)
    assert torch.equal(got.pixels, want.pixels) and got.grid == want.grid


@pytest.mark.parametrize("count", ["unknown", 0])
def test_a_file_without_a_frame_count_is_sampled_from_its_decode(videos, monkeypatch, count):
    """A container that gives no frame count (ComfyUI raises, or says 0): the runtime's sampler picks from the
    frames the decode counts, and the prefill equals the one from the full decode."""
    from comfy_api.latest import InputImpl

    from qwen35_fast.nodes.video import video_clip
    from qwen35_fast.runtime.media import Preprocessing, preprocess_video, preprocess_video_source
    video = videos["64x48 30 fps"]
    parts = video.get_components()

    def frame_count(self):
        if count == "unknown":
            raise ValueError("Could not determine frame count")
        return count
    monkeypatch.setattr(InputImpl.VideoFromFile, "get_frame_count", frame_count)
    pp = Preprocessing()
    got = preprocess_video_source(video_clip(video), pp)
    want = preprocess_video(parts.images, float(parts.frame_rate), pp)
    assert torch.equal(got.pixels, want.pixels) and (got.grid, got.timestamps) == (want.grid, want.timestamps)


def test_a_video_that_changes_size_is_refused(comfy, pack, loaded, tmp_path):
    """A file whose frames change size part way (two recordings joined): the node says so and how to fix it,
    rather than sampling frames of two sizes."""
    from comfy_api.latest import InputImpl

    from qwen35_fast.runtime import Qwen35Error

    def part(width, height):
        buf = io.BytesIO()
        with av.open(buf, "w", format="mpegts") as out:
            stream = out.add_stream("mpeg2video", rate=8)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for i in range(8):
                frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 60 + 10 * i, np.uint8), format="rgb24")
                for packet in stream.encode(frame):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        return buf.getvalue()
    joined = tmp_path / "joined.ts"
    joined.write_bytes(part(64, 48) + part(96, 64))
    with pytest.raises(Qwen35Error, match=r"the video .*joined\.ts.* changes size at frame \d+ \(64x48 to 96x64\); "
                                          r"re-encode it at one size"):
        _run(pack, loaded, video=InputImpl.VideoFromFile(str(joined)))


class _NoRate:
    """A video stream whose container gives no average frame rate (PyAV's average_rate None); the rest is the
    real stream's."""
    average_rate = None

    def __init__(self, stream):
        object.__setattr__(self, "_stream", stream)

    def __getattr__(self, key):
        return getattr(self._stream, key)

    def __setattr__(self, key, value):
        setattr(self._stream, key, value)


class _NoRateContainer:
    """An opened file whose video streams are _NoRate (what get_components, get_frame_rate and our reader see)."""

    def __init__(self, container):
        self._container = container
        self.streams = type("Streams", (), {"video": [_NoRate(s) for s in container.streams.video],
                                            "audio": container.streams.audio,
                                            "__iter__": lambda s: iter(container.streams)})()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._container.__exit__(*exc)

    def __getattr__(self, key):
        real = getattr(self._container, key)
        if key in ("demux", "decode", "seek"):
            def unwrapped(*args, **kwargs):
                args = [getattr(a, "_stream", a) for a in args]
                kwargs = {k: getattr(v, "_stream", v) for k, v in kwargs.items()}
                return real(*args, **kwargs)
            return unwrapped
        return real


def test_a_stream_without_an_average_rate_is_read_at_the_containers_estimate(videos, monkeypatch):
    """A file whose video stream has no average frame rate: get_components gives its frames at 1 fps, while
    get_frame_rate estimates one from the container (frames / duration: 30 here). The VIDEO input is sampled at the
    estimate: at 1 fps the 3-second clip would read as 90 seconds, every frame sampled, its timestamps 30x too late."""
    from qwen35_fast.nodes.video import video_clip
    from qwen35_fast.runtime.media import Preprocessing, preprocess_video, preprocess_video_source
    real_open = av.open
    monkeypatch.setattr(av, "open", lambda *a, **k: _NoRateContainer(real_open(*a, **k)))
    video = videos["64x48 30 fps"]
    parts = video.get_components()
    assert parts.frame_rate == 1 and float(video.get_frame_rate()) == pytest.approx(30)  # ComfyUI's two answers
    pp = Preprocessing()
    got = preprocess_video_source(video_clip(video), pp)
    want = preprocess_video(parts.images, float(video.get_frame_rate()), pp)
    assert (got.grid, got.timestamps) == (want.grid, want.timestamps)
    assert got.grid[0] < preprocess_video(parts.images, 1.0, pp).grid[0]


def test_a_file_whose_frame_count_comfyui_cannot_take_is_counted_by_its_decode(comfy, tmp_path):
    """An animated WebP: ComfyUI's get_frame_count fails on its frames without a pts (a TypeError). The reader
    counts the frames by decoding them and gives what get_components gives: 0 frames where this FFmpeg decodes no
    animated WebP (the runtime's message, not ComfyUI's TypeError), else the same frames."""
    from comfy_api.latest import InputImpl

    from qwen35_fast.nodes.video import video_clip
    from qwen35_fast.runtime import Qwen35Error
    from qwen35_fast.runtime.media import preprocess_video_source
    if "libwebp_anim" not in av.codecs_available:
        pytest.skip("this PyAV has no animated WebP encoder")
    path = write_video(tmp_path / "anim.webp", 6, 4, codec="libwebp_anim")
    video = InputImpl.VideoFromFile(str(path))
    with pytest.raises(TypeError):
        video.get_frame_count()
    full = video.get_components().images
    frames = _read(video_clip(video), lambda total: list(range(total)))[1]
    assert len(frames) == full.shape[0] and all(torch.equal(f, g) for f, g in zip(frames, full))
    if not frames:
        with pytest.raises(Qwen35Error, match="the video has 0 frames; connect a video with at least one frame"):
            preprocess_video_source(video_clip(video))


@pytest.mark.parametrize("suffix", ["mkv", "webm"])
def test_a_file_without_a_frame_count_is_decoded_once(comfy, tmp_path, monkeypatch, suffix):
    """MKV / WebM carry no frame count: get_frame_count says 1 for every such file (untrimmed), and the reader
    counts the packets (no decode) so that one decode takes the sampled frames (it took two: the guess of 1 picked
    frame 0, the decode found 40)."""
    from comfy_api.latest import InputImpl

    from qwen35_fast.nodes.video import FileVideo, video_clip
    from qwen35_fast.runtime.media import Preprocessing, preprocess_video, preprocess_video_source
    codec = "h264" if suffix == "mkv" else "libvpx-vp9"
    if codec not in av.codecs_available:
        pytest.skip(f"this PyAV has no {codec} encoder")
    video = InputImpl.VideoFromFile(str(write_video(tmp_path / f"a.{suffix}", 40, 24, codec=codec)))
    assert video.get_frame_count() == 1
    decodes = []
    real = FileVideo._decode
    monkeypatch.setattr(FileVideo, "_decode", lambda self, index, keep: decodes.append(index) or real(self, index, keep))
    pp = Preprocessing()
    got = preprocess_video_source(video_clip(video), pp)
    parts = video.get_components()
    want = preprocess_video(parts.images, float(parts.frame_rate), pp)
    assert len(decodes) == 1 and parts.images.shape[0] == 40
    assert torch.equal(got.pixels, want.pixels) and (got.grid, got.timestamps) == (want.grid, want.timestamps)


def test_a_stream_whose_packets_have_no_pts_is_counted_and_decoded_once(comfy, tmp_path, monkeypatch):
    """A raw H.264 stream (.h264): no container, so no packet has a pts and ComfyUI's frame count fails (an OSError
    from its seek; its get_components fails too). The reader counts its packets, those without a pts among them,
    and one decode takes the sampled frames."""
    from comfy_api.latest import InputImpl

    from qwen35_fast.nodes.video import FileVideo, video_clip
    path = write_video(tmp_path / "raw.h264", 20, 10)
    with av.open(str(path)) as container:
        assert all(p.pts is None for p in container.demux(container.streams.video[0]))
    video = InputImpl.VideoFromFile(str(path))
    with pytest.raises(OSError):
        video.get_frame_count()
    decodes = []
    real = FileVideo._decode
    monkeypatch.setattr(FileVideo, "_decode", lambda self, index, keep: decodes.append(index) or real(self, index, keep))
    index, frames = _read(video_clip(video), lambda total: [0, total // 2, total - 1])
    assert decodes == [[0, 10, 19]] and index == [0, 10, 19] and [_number(f) for f in frames] == index


def test_one_prompt_per_image_decodes_a_file_video_once(pack, loaded, videos, monkeypatch):
    """One prompt per image with a VIDEO from a file: the file is decoded once for all the prompts, two of them
    already (it was decoded once a prompt), each prefill equals that prompt's own cold prefill, and a prefill made
    again after its node let it go reads the file again (the decoded frames are not kept with the outputs)."""
    from qwen35_fast.nodes import multimodal
    from qwen35_fast.nodes.video import FileVideo
    video = videos["64x48 30 fps"]
    decodes = []
    real = FileVideo._decode
    monkeypatch.setattr(FileVideo, "_decode", lambda self, index, keep: decodes.append(index) or real(self, index, keep))
    images = torch.rand(2, 64, 64, 3, generator=torch.Generator().manual_seed(2))
    loaded.model.kv.pool.clear()
    out = pack.Qwen35MultimodalPrefill.execute(
        model=loaded, prompt="<image> <video> What changes?", images=images, video=video, frames=None,
        frame_rate=24.0, mode=multimodal.PER_IMAGE, system_prompt="", thinking=False, max_pixels=0)[0]
    assert len(out) == 2 and len(decodes) == 1
    for i in (0, 1):
        loaded.model.kv.pool.clear()
        cold = _run(pack, loaded, prompt="<image> <video> What changes?", images=images[i:i + 1], video=video)
        assert cold.cached_tokens == 0 and cold.token_ids == out[i].prefill.token_ids
        assert cold.media == out[i].prefill.media and torch.equal(cold.logits, out[i].prefill.logits)
    assert len(decodes) == 3
    before = out[1].prefill
    loaded.model.kv.pool.clear()  # (the cold prefill of its prompt is not read for it)
    out[1].let_go_now()
    again = out[1].prefill
    assert again is not before and len(decodes) == 4
    assert again.token_ids == before.token_ids and torch.equal(again.logits, before.logits)
