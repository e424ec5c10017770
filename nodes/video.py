"""A ComfyUI VIDEO -> the video runtime.prefill_multimodal reads, without decoding every frame to a tensor.

ComfyUI's get_components() turns every frame of a file into a float32 [H, W, 3] tensor (a minute of 1080p at
30 fps is 45 GB), while the prefill keeps about 2 frames a second, resized to a small pixel budget. A file is
therefore read by FileVideo, a runtime.media.VideoSource: PyAV decodes the frames in order, and only those the
runtime samples are converted, the way get_components converts them (so the prefill and its cache key are the
same as before), each handed to the runtime, which resizes it, before the next is decoded. A video held in
memory (VideoFromComponents) is given as its frames tensor, which the runtime indexes.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import av
import comfy.model_management as mm
import numpy as np
import torch
from comfy_api.latest import Input

from ..runtime import Qwen35Error

# pixel formats get_components reads as 8-bit RGB (then / 255); the others through 32-bit float planes
EIGHT_BIT = {"yuvj420p", "yuvj422p", "yuvj444p", "rgb24", "rgba", "pal8"}


def video_clip(video):
    """(frames [F, H, W, 3], fps) for a video without a stream of its own (frames in memory, where
    get_components() is a view); a FileVideo for one read from a file or bytes."""
    if getattr(type(video), "get_stream_source", None) in (None, Input.Video.get_stream_source):
        parts = video.get_components()
        return parts.images, float(parts.frame_rate)
    return FileVideo(video)


@dataclass(frozen=True)
class Conversion:
    """How get_components turns the frames of one stream into pixels, chosen from its first frame."""
    format: str  # what PyAV converts to: rgb24 / rgba, or gbrpf32le / gbrapf32le (float planes)
    eight_bit: bool
    pad: tuple | None  # (graph, source, sink) padding widths off a multiple of 32 (the graph held: its ends don't)


def conversion(frame, time_base) -> Conversion:
    """The Conversion get_components picks for a stream whose first frame (in the trim window) is `frame`."""
    alpha = frame.format.name == "pal8" or any(c.is_alpha for c in frame.format.components)
    eight_bit = frame.format.name in EIGHT_BIT
    fmt = ("rgba" if alpha else "rgb24") if eight_bit else ("gbrapf32le" if alpha else "gbrpf32le")
    pad = None
    if not eight_bit and frame.width % 32:  # as ComfyUI does: float conversion of such widths was not repeatable
        graph = av.filter.Graph()
        src = graph.add_buffer(width=frame.width, height=frame.height, format=frame.format.name, time_base=time_base)
        wide, high = -(-frame.width // 32) * 32, -(-frame.height // 32) * 32
        chain = [graph.add("pad", f"{wide}:{high}:0:0"),
                 graph.add("fillborders", f"left=0:right={wide - frame.width}:top=0:bottom={high - frame.height}"
                                          ":mode=smear"),
                 graph.add("buffersink")]
        for a, b in zip([src] + chain, chain):
            a.link_to(b)
        graph.configure()
        pad = (graph, src, chain[-1])
    return Conversion(fmt, eight_bit, pad)


def to_tensor(frame, how: Conversion) -> torch.Tensor:
    """One decoded frame -> [H, W, 3] float32 in 0..1, the pixels get_components gives for it."""
    if how.pad is None:
        pixels = frame.to_ndarray(format=how.format)
    else:
        how.pad[1].push(frame)
        pixels = how.pad[2].pull().to_ndarray(format=how.format)[:frame.height, :frame.width]
    if frame.rotation:
        pixels = np.rot90(pixels, k=round(frame.rotation // 90), axes=(0, 1))
    x = torch.from_numpy(np.ascontiguousarray(pixels[..., :3]))  # alpha, where there is one, is not the image's
    return x.float() / 255.0 if how.eight_bit else x


class FileVideo:
    """A VIDEO read from its stream source (a path or bytes) as a runtime.media.VideoSource: each read decodes
    the file once, in order, and hands only the frames asked for to keep, one at a time, so memory holds one
    frame at source size and no more (media.preprocess_video_source states the bound)."""

    def __init__(self, video):
        self.video = video
        self.name = _name(video)
        with _readable(self.name):
            # a stream without an average rate: get_frame_rate's estimate (frames / duration), where get_components
            # says 1 fps (a 30 fps clip would be sampled as if 30 times longer: 15x the frames, wrong timestamps)
            self.fps = float(video.get_frame_rate())
            self.start, self.duration = video.get_active_trim_window()

    def read(self, choose, keep) -> None:
        with _readable(self.name):
            try:
                guess = int(self.video.get_frame_count())  # container metadata: a guess that the decode checks
            except (ValueError, OSError, TypeError):  # (av's errors are these too; TypeError: frames without a pts)
                guess = 0
            if guess <= 1:  # get_frame_count says 1 for every untrimmed file without a frame count (MKV, WebM)
                guess = self._packets()
            total = self._decode(choose(guess) if guess > 0 else [], keep)
            if guess <= 0 or total != guess:  # no count or a wrong one: choose again (which starts over) from the
                self._decode(choose(total), keep)  # frames there are (0 frames: the runtime's message)

    def _decode(self, index: list[int], keep) -> int:
        """Calls keep with the frames at `index` (ascending), in order; returns how many frames the trim window has."""
        wanted: dict[int, int] = {}
        for i in index:
            wanted[i] = wanted.get(i, 0) + 1
        n, how, shape = 0, None, None
        with av.open(self.video.get_stream_source(), mode="r") as container:
            if not container.streams.video:
                raise Qwen35Error(f"could not read the video {self.name}: the file has no video stream; connect a "
                                  "video file")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"  # threads change the speed of decoding, not the frames
            start, end = self._window(container, stream)
            for packet in container.demux(stream):
                try:
                    decoded = packet.decode()
                except av.error.InvalidDataError:  # a damaged packet is skipped, as get_components skips it
                    continue
                for frame in decoded:
                    mm.throw_exception_if_processing_interrupted()  # Cancel during a long decode
                    if frame.pts is not None and frame.pts < start:
                        continue
                    if end is not None and frame.pts is not None and frame.pts >= end:
                        return n
                    if how is None:
                        how = conversion(frame, stream.time_base)
                    if n in wanted:
                        pixels = to_tensor(frame, how)
                        shape = shape or pixels.shape
                        if pixels.shape != shape:
                            raise Qwen35Error(f"the video {self.name} changes size at frame {n} ({shape[1]}x"
                                              f"{shape[0]} to {pixels.shape[1]}x{pixels.shape[0]}); re-encode "
                                              "it at one size")
                        for _ in range(wanted[n]):
                            keep(pixels)
                        del pixels  # before the next frame is decoded
                    n += 1
        return n

    def _window(self, container, stream) -> tuple[int, int | None]:
        """The trim window's first and end pts (None: to the end), the container sought to its start."""
        start = int(self.start / stream.time_base)
        if start:
            container.seek(start, stream=stream)
        return start, int((self.start + self.duration) / stream.time_base) if self.duration else None

    def _packets(self) -> int:
        """The video packets in the trim window, read without decoding: the frame count where a packet holds one
        frame (a guess the decode checks)."""
        n = 0
        with av.open(self.video.get_stream_source(), mode="r") as container:
            if not container.streams.video:
                return 0
            stream = container.streams.video[0]
            start, end = self._window(container, stream)
            for packet in container.demux(stream):
                if end is not None and packet.dts is not None and packet.dts >= end:
                    break  # (a packet's pts is never below its dts, which only grows)
                if packet.size and (packet.pts is None or start <= packet.pts and (end is None or packet.pts < end)):
                    n += 1
        return n


@contextlib.contextmanager
def _readable(name: str):
    """PyAV's and ComfyUI's errors on a file they cannot read, as a Qwen35Error that names the file."""
    try:
        yield
    except Qwen35Error:
        raise
    except (av.error.FFmpegError, ValueError) as e:
        raise Qwen35Error(f"could not read the video {name}: {e}; re-encode it (e.g. to an H.264 MP4) or connect "
                          "another file") from e


def _name(video) -> str:
    source = video.get_stream_source()
    return f"'{source}'" if isinstance(source, str) else "(in memory)"
