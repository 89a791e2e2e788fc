"""What a video file takes in memory while it decodes, from its header (`decoder_bytes`),
in its stream's own pixel format (`pixel_bytes`); the router counts it against a request's
media budget (`router.media_cost`) before anything is decoded."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import av

if TYPE_CHECKING:
    from common.processing.video_header import VideoHeader

# A kept frame's pixels (RGB, 3 bytes each). While a file decodes, FFmpeg holds up to 16
# reference frames and a few more in the stream's own format, and the conversion to RGB
# 8 bytes a pixel of one frame (`decoder_bytes`): a 4K file of 16 references in 10-bit
# 4:4:4 took 1.1 GB where 20 bytes a pixel of any format were counted (ownfix review).
FRAME_BYTES_PER_PIXEL = 3
DECODER_FRAMES = 20
CONVERSION_BYTES_PER_PIXEL = 8
ASSUMED_FORMAT = "yuv420p"  # where a header names none: checked as the first frame decodes


@functools.cache
def pixel_bytes(name: str) -> float:
    """Bytes a pixel of a frame in FFmpeg's pixel format `name` takes (1.5 for yuv420p);
    16, as much as the widest software format (32-bit float RGBA), for one no frame can be
    made in (a hardware one)."""
    try:
        frame = av.VideoFrame(256, 256, name)
    except (av.FFmpegError, ValueError, TypeError):  # (PyAV's ArgumentError is a ValueError)
        return 16.0
    return sum(plane.buffer_size for plane in frame.planes) / (256 * 256)


def decoder_bytes(header: VideoHeader) -> int:
    """What decoding the file holds besides its kept frames, from its header."""
    per_pixel = DECODER_FRAMES * pixel_bytes(header.pixel_format) + CONVERSION_BYTES_PER_PIXEL
    return math.ceil(header.width * header.height * per_pixel)
