"""Where `VideoFile.decode` puts the frames it keeps, one per sample time at most.

- `WholeFrames`: every kept frame at its decoded size, in place (`TimedFrames`): what
  `decode_video` gives a caller that processes them itself (the offline engine, tests).
- `PlannedStore`: only the frames the processor's plan samples, resized as they are decoded
  (`PlannedFrames`): the router's. The plan (`plan_video`: which frames, what size) is a
  function of the kept frames' count, rate and size; the store plans for the count its
  file is said to keep (`common.processing.video_sampling.kept_from_packets`), and a file
  that keeps another is planned again for what it kept and decoded once more (`None` from
  `result`). Its frames are resized one by one, by the same calls on the same pixels as the
  processor's (`_Frames`, `resized_frames`), so the codes are the same bytes.

Either refuses a stream that turns its frames differently as it plays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from common.processing.image import load_image, resize_rgb, to_rgb
from common.processing.video import PlannedFrames, TimedFrames, VideoFileError, VideoPlan

# (kept frames, their rate, width, height) -> the processor's plan of them.
Planner = Callable[[int, float, int, int], VideoPlan]


class WholeFrames:
    """Every kept frame, whole, written in place (a list of them then stacked held each
    twice: ownfix review)."""

    def __init__(self, count: int, field: str) -> None:
        self.count = count  # sample times: the most frames kept
        self.field = field
        self._frames: np.ndarray | None = None

    def wants(self, k: int) -> bool:
        """Whether `keep` takes the `k`th kept frame's pixels: every one."""
        return True

    def keep(self, k: int, pixels: np.ndarray) -> None:
        """The `k`th kept frame (upright RGB pixels)."""
        if self._frames is None:
            self._frames = _room(self.count, pixels.shape, self.field)
        else:
            _same_turn(self._frames.shape[1:3], pixels.shape[:2], self.field)
        self._frames[k] = pixels

    def check(self, size: tuple[int, int]) -> None:
        """A kept frame's upright (height, width), where `keep` does not take it (never:
        it takes every one)."""
        if self._frames is not None:
            _same_turn(self._frames.shape[1:3], size, self.field)

    def result(self, times: Sequence[float], fps: float) -> TimedFrames:
        assert self._frames is not None
        return TimedFrames(self._frames[: len(times)], tuple(times), fps)


class PlannedStore:
    """The frames a plan for `count` kept frames at `fps` samples, resized as kept."""

    def __init__(self, count: int, fps: float, planner: Planner, field: str) -> None:
        self.count = count  # the kept frames planned for
        self.fps = fps
        self.planner = planner
        self.field = field
        self.kept = 0  # frames kept, once `result` was asked
        self._shape: tuple[int, ...] = ()  # a decoded frame's
        self._plan: VideoPlan | None = None
        self._frames: np.ndarray | None = None
        self._slot: dict[int, int] = {}  # kept frame -> its row of `_frames`

    def wants(self, k: int) -> bool:
        """Whether `keep` takes the `k`th kept frame's pixels: the first (the plan is made
        of its size) and those the plan samples; the others need not be made RGB."""
        return self._plan is None or k in self._slot

    def keep(self, k: int, pixels: np.ndarray) -> None:
        """The `k`th kept frame (upright RGB pixels): resized, where the plan samples it."""
        if self._plan is None:
            self._shape = pixels.shape
            height, width = pixels.shape[:2]
            self._plan = self.planner(self.count, self.fps, width, height)
            self._frames = _room(len(self._plan.indices), (*self._plan.size, 3), self.field)
            self._slot = {index: row for row, index in enumerate(self._plan.indices)}
        else:
            self.check(pixels.shape[:2])
        row = self._slot.get(k)
        if row is not None:
            assert self._frames is not None
            image = to_rgb(load_image(np.ascontiguousarray(pixels, dtype=np.uint8)))
            self._frames[row] = resize_rgb(image, *self._plan.size)

    def check(self, size: tuple[int, int]) -> None:
        """A kept frame's upright (height, width), where `keep` does not take its pixels: a
        stream that turns its frames as it plays is refused whatever the plan samples."""
        _same_turn(self._shape[:2], size, self.field)

    def result(self, times: Sequence[float], fps: float) -> PlannedFrames | None:
        """The planned frames, or None where the plan was made for another count or rate
        (decode again, planned for what was kept)."""
        self.kept = len(times)
        if len(times) != self.count or fps != self.fps:
            return None
        assert self._plan is not None and self._frames is not None
        height, width = self._shape[:2]
        return PlannedFrames(self._frames, tuple(times), fps, (width, height), self._plan)


def _same_turn(first: tuple[int, ...], size: tuple[int, ...], field: str) -> None:
    if size != first:
        raise VideoFileError(field, "turns its frames differently as it plays")


def _room(count: int, shape: tuple[int, ...], field: str) -> np.ndarray:
    """Room for `count` frames of `shape`, or a `VideoFileError` where there is none (a caller
    with no media budget, a host that does not overcommit memory)."""
    try:
        return np.empty((count, *shape), dtype=np.uint8)
    except MemoryError:
        raise VideoFileError(
            field, f"decodes to {count} frames of {shape}: more than fits in memory here"
        ) from None
