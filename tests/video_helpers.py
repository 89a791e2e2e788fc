"""Writing test videos with PyAV: RGB arrays encoded as a stream's frames."""

from __future__ import annotations

from collections.abc import Iterable
from fractions import Fraction
from typing import Any

import av
import numpy as np


def mux_frames(
    container: Any, stream: Any, frames: Iterable[np.ndarray], time_base: Fraction, first: int = 0
) -> None:
    """Encode each RGB array of `frames` into `stream` as the next frame (pts from `first`,
    in `time_base` units), mux the packets into `container`, and flush the encoder."""
    for k, pixels in enumerate(frames, start=first):
        frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
        frame.pts, frame.time_base = k, time_base
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
