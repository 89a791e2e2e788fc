"""What a video file's headers say (`VideoHeader`, `read_header`) and the limits checked on
them before a frame is decoded (`common.processing.video_file`): the frame size and duration
(`check_header`), the pixels decoded to reach the last sample time (`check_decoding`), and,
as frames decode, a pixel format no wider than the header's (`check_format`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import av

from common.processing.limits import MIN_FPS, LimitError
from common.processing.video import VideoFileError
from common.processing.video_memory import ASSUMED_FORMAT, pixel_bytes
from common.processing.video_sampling import sample_times

# The fastest frame rate a file may declare, and the one assumed when it declares none.
# Frames are decoded in order up to the last sample time, so duration x rate bounds the
# work; a small file declaring 1000 fps would otherwise have the router decode every one.
MAX_SOURCE_RATE = 240.0


@dataclass(frozen=True, slots=True)
class VideoHeader:
    """What the headers of a video file say, checked against the limits."""

    width: int  # frame width in pixels
    height: int  # frame height in pixels
    duration_s: float  # length of the video stream in seconds
    rate: float | None  # average frames per second, None when the header has none
    sample_times: tuple[float, ...]  # seconds (from the stream's start) of the frames to keep
    pixel_format: str = ASSUMED_FORMAT  # the decoder's, FFmpeg's name


def read_header(
    container: av.container.InputContainer, fps: float, max_frames: int, field: str
) -> VideoHeader:
    if not container.streams.video:
        raise VideoFileError(field, "has no video stream")
    stream = container.streams.video[0]
    codec = stream.codec_context  # None: a codec this build of FFmpeg does not know
    if codec is None:
        raise VideoFileError(field, "has a video stream in a codec this server cannot decode")
    width, height = codec.width, codec.height
    if width < 1 or height < 1:
        raise VideoFileError(field, f"has no frame size in its header ({width}x{height})")
    if stream.duration and stream.time_base:
        duration = float(stream.duration * stream.time_base)
    elif container.duration:
        duration = container.duration / av.time_base
    else:
        raise VideoFileError(field, "has no duration in its header")
    if not duration > 0 or not math.isfinite(duration):
        raise VideoFileError(field, f"has a duration of {duration} s")
    rate = float(stream.average_rate) if stream.average_rate else None
    if rate is not None and not MIN_FPS <= rate <= MAX_SOURCE_RATE:
        raise VideoFileError(
            field,
            f"declares {rate:g} frames per second; a file may declare {MIN_FPS:g} to "
            f"{MAX_SOURCE_RATE:g}",
        )
    times = sample_times(duration, fps, max_frames)
    pixel_format = codec.format.name if codec.format is not None else ASSUMED_FORMAT
    return VideoHeader(width, height, duration, rate, times, pixel_format)


def check_format(name: str, header: VideoHeader, field: str) -> None:
    """Refuse frames whose pixel format takes more than the one its header's decoding was
    counted for (`decoder_bytes`)."""
    if pixel_bytes(name) > pixel_bytes(header.pixel_format):
        raise VideoFileError(
            field,
            f"decodes to {name} frames, wider than the {header.pixel_format} its request's "
            "memory was counted for",
        )


def check_decoding(header: VideoHeader, limit: int | None, field: str) -> None:
    """Refuse a file whose frames up to its last sample time, at the rate its header states,
    hold more than `limit` pixels (a header with no rate: counted while decoding)."""
    if limit is None or header.rate is None:
        return
    frames = math.ceil(header.sample_times[-1] * header.rate) + 1
    if frames * header.width * header.height > limit:
        raise LimitError(
            field,
            f"sampling it means decoding {frames} frames of {header.width}x{header.height} "
            f"to reach {header.sample_times[-1]:.1f} s, past max_video_decoded_pixels = "
            f"{limit}; send fewer seconds, a lower resolution or its frames",
        )


def check_header(
    header: VideoHeader, max_pixels: int | None, max_seconds: float | None, field: str
) -> None:
    pixels = header.width * header.height
    if max_pixels is not None and pixels > max_pixels:
        raise LimitError(
            field,
            f"video of {header.width}x{header.height} = {pixels} pixels per frame exceeds "
            f"max_image_pixels = {max_pixels}",
        )
    if max_seconds is not None and header.duration_s > max_seconds:
        raise LimitError(
            field,
            f"video of {header.duration_s:.1f} s exceeds max_video_seconds = {max_seconds}",
        )
