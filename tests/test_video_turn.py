"""A video file's frames turned by their own display matrix, read without holding the frame
(`common.processing.frame_turn`), and the decoder's memory counted in the stream's own pixel
format (`common.processing.video_memory.decoder_bytes`; ownfix reviews C and D)."""

from __future__ import annotations

import gc
import io
from fractions import Fraction
from typing import Any

import av
import numpy as np
import pytest
from av.bitstream import BitStreamFilterContext

from common.processing.frame_turn import _display_matrix, upright_frame
from common.processing.video_file import VideoFileError, open_video
from common.processing.video_header import VideoHeader
from common.processing.video_memory import decoder_bytes, pixel_bytes
from tests.video_helpers import mux_frames

ORIENT = "h264_metadata=display_orientation=insert"


def _encoded(pix_fmt: str = "yuv420p", frames: int = 8, size: tuple[int, int] = (128, 64)) -> bytes:
    width, height = size
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=2)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        stream.options = {"bframes": "0", "x264-params": "keyint=1"}
        pixels = np.zeros((height, width, 3), np.uint8)
        pixels[: height // 2, : width // 2] = 255  # the top-left quadrant white
        mux_frames(container, stream, [pixels] * frames, Fraction(1, 2))
    return buf.getvalue()


def _flipped_first_half(frames: int = 8) -> bytes:
    """A file whose first half of frames carries a vertical flip, the rest none."""
    source: Any = av.open(io.BytesIO(_encoded(frames=frames)))
    video = source.streams.video[0]
    out = io.BytesIO()
    with av.open(out, "w", format="matroska") as container:
        stream = container.add_stream_from_template(video)
        for k, packet in enumerate(p for p in source.demux(video) if p.size):
            flip = BitStreamFilterContext(f"{ORIENT}:rotate=0:flip=vertical", video)
            for each in flip.filter(packet) if k < frames // 2 else [packet]:
                each.stream = stream
                container.mux(each)
    return out.getvalue()


def test_a_flip_that_changes_mid_stream_turns_each_frame_as_its_own_matrix_says() -> None:
    # Read only when the rotation PyAV reports changed, a flip (rotation 0 either way) of
    # the first frame was applied to every frame after (ownfix review D).
    try:
        data = _flipped_first_half()
    except (av.FFmpegError, ValueError) as exc:
        pytest.skip(f"this FFmpeg cannot insert a display orientation: {exc}")
    with av.open(io.BytesIO(data)) as opened:  # which frames FFmpeg gives a matrix
        container: Any = opened
        flipped = [_display_matrix(f) is not None for f in container.decode(video=0)]
    assert True in flipped and False in flipped
    frames = open_video(data, fps=2.0, max_frames=8).decode().frames
    assert [bool(f[16, 32, 0] < 128) for f in frames] == flipped  # white moved down if so


def test_reading_a_frames_matrix_keeps_no_hold_on_it() -> None:
    # A frame's own side data ties them in a cycle: every kept frame's decoded buffers
    # stayed until a full collection (ownfix review C).
    with av.open(io.BytesIO(_encoded(frames=2))) as opened:
        container: Any = opened
        frame = next(container.decode(video=0))
        before = len(gc.get_referrers(frame))
        upright_frame(frame)
        assert len(gc.get_referrers(frame)) == before


def test_the_decoder_is_counted_in_the_streams_own_pixel_format() -> None:
    # A 4K file of 16 references in 10-bit 4:4:4 took 1.1 GB where 20 bytes a pixel of any
    # format were counted (324 MiB reserved, taken at the default 512 MiB).
    header = open_video(_encoded("yuv444p10le", frames=2), fps=2.0, max_frames=8).header
    assert header.pixel_format == "yuv444p10le" and pixel_bytes("yuv444p10le") == 6
    four_k = (3840, 2160, 2.0, 30.0, (0.0, 0.5, 1.0, 1.5))
    assert decoder_bytes(VideoHeader(*four_k, "yuv444p10le")) > 512 << 20
    assert decoder_bytes(VideoHeader(*four_k, "yuv420p")) < 320 << 20


def _raw_h264(pix_fmt: str, frames: int, start: int) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="h264") as opened:
        container: Any = opened
        stream = container.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = 256, 144, pix_fmt
        stream.options = {"preset": "ultrafast", "x264-params": "bframes=0:keyint=1000"}
        pictures = (np.full((144, 256, 3), k, np.uint8) for k in range(start, start + frames))
        mux_frames(container, stream, pictures, Fraction(1, 30), first=start)
    return buf.getvalue()


def test_a_stream_that_turns_wider_mid_way_is_refused() -> None:
    # Its header and first frames say yuv420p, then its own parameters switch to 10-bit
    # 4:4:4: checked on the first frame only, a 4K one took 2.3x what it reserved.
    joined = _raw_h264("yuv420p", 2, 0) + _raw_h264("yuv444p10le", 30, 2)
    source: Any = av.open(io.BytesIO(joined), format="h264")
    out = io.BytesIO()
    with av.open(out, "w", format="matroska") as container:
        video = source.streams.video[0]
        stream = container.add_stream_from_template(video)
        for k, packet in enumerate(p for p in source.demux(video) if p.size):
            packet.time_base = Fraction(1, 1000)
            packet.pts = packet.dts = round(k * 1000 / 30)
            packet.stream = stream
            container.mux(packet)
    opened = open_video(out.getvalue(), fps=30.0, max_frames=64, field="video")
    assert opened.header.pixel_format == "yuv420p"
    with pytest.raises(VideoFileError, match="yuv444p10le") as refused:
        opened.decode()
    assert refused.value.field == "video"
