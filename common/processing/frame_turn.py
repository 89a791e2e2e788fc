"""A decoded video frame turned as players show it (`upright_frame`), by its display matrix.

The matrix is read through a side-data container made for the frame, not the frame's own
`side_data`: PyAV ties a frame and that one in a reference cycle, and every kept frame's
decoded buffers (1.4 MB at 720p) stayed until a full collection (a 60 s file peaked 1.26x
what its request reserved, and 200 MB stayed after; ownfix review). Made per frame, it
holds the frame, the frame not it; read per frame, a matrix that changes mid-stream (a flip
keeps the rotation PyAV reports) turns each frame as its own says.
"""

from __future__ import annotations

import math
from typing import Any

import av
import numpy as np
from av.sidedata.sidedata import SideDataContainer, Type


def _display_matrix(frame: av.VideoFrame) -> bytes | None:
    """The frame's display matrix (nine int32), None when it has none."""
    sides: Any = SideDataContainer(frame)  # type: ignore[call-arg]  # (its stub takes none)
    found = sides.get(Type.DISPLAYMATRIX)  # (iterating it gives its data before PyAV 18.1.1,
    return None if found is None else bytes(found)  # its types from then: get is both's)


def upright_frame(frame: av.VideoFrame) -> np.ndarray:
    """The frame's RGB pixels as players show them: turned and flipped by its display matrix
    as FFmpeg's own autorotate does (a phone's portrait video is stored landscape with a
    quarter turn), as images are by their EXIF orientation. A turn other than a quarter
    one, or a degenerate matrix, leaves the frame as stored."""
    pixels = frame.to_ndarray(format="rgb24")
    turn = _turn(frame)
    if turn is None:
        return pixels
    m, theta = turn
    hflip = vflip = False
    if abs(theta - 90) < 1:  # clockwise, or with a flip the transpose
        pixels = np.rot90(pixels, 1)[::-1] if m[3] > 0 else np.rot90(pixels, -1)
    elif abs(theta - 180) < 1:
        hflip, vflip = m[0] < 0, m[4] < 0
    elif abs(theta - 270) < 1:  # counterclockwise, or with a flip the anti-transpose
        pixels = np.rot90(pixels, -1)[::-1] if m[3] < 0 else np.rot90(pixels, 1)
    elif abs(theta) < 1:
        vflip = m[4] < 0
    if hflip:
        pixels = pixels[:, ::-1]
    if vflip:
        pixels = pixels[::-1]
    return np.ascontiguousarray(pixels)


def upright_size(frame: av.VideoFrame) -> tuple[int, int]:
    """(height, width) of `upright_frame(frame)`, its pixels not made: a frame the processor
    does not sample is still checked for its turn (s42diff review, s43)."""
    turn = _turn(frame)
    if turn is not None and (abs(turn[1] - 90) < 1 or abs(turn[1] - 270) < 1):
        return frame.width, frame.height
    return frame.height, frame.width


def _turn(frame: av.VideoFrame) -> tuple[np.ndarray, float] | None:
    """The frame's display matrix and its clockwise turn in degrees, [0, 360); None without
    a matrix, or a degenerate one."""
    matrix = _display_matrix(frame)
    if matrix is None:
        return None
    m = np.frombuffer(matrix, dtype=np.int32).astype(np.float64)
    scale0, scale1 = math.hypot(m[0], m[3]), math.hypot(m[1], m[4])
    if not scale0 or not scale1:
        return None  # degenerate
    theta = float(round(math.degrees(math.atan2(m[1] / scale1, m[0] / scale0))))  # clockwise
    theta -= 360 * math.floor(theta / 360 + 0.9 / 360)
    return m, theta
