"""Qwen3-VL video preprocessing: frame sampling, resize, patchify and frame timestamps.

A video arrives as decoded frames (a list of images, or a `(T, H, W, 3)` uint8 array) plus
its frame rate. Frames are sampled uniformly at `video_sample_fps` (clamped to the frame
bounds, as the reference does), resized together by the video smart-resize rule (the pixel
budget covers all frames) and patchified into codes like images, in groups of
`temporal_patch_size` frames (the last frame repeats to fill the last group). Each group is
one temporal patch: one grid step `t`, one run of placeholders in the prompt, and one
timestamp, the mean of its first and last frame's time in seconds.

A frame's time is its index / fps, unless the frames come as `TimedFrames` (decoded from a
container file by `common.processing.video_file`): then it is the frame's own time, from the
container's presentation timestamps, so the `<t seconds>` text in the prompt is the file's.

Resizing uses the same PIL bicubic path as images (the reference video processor resizes
with torchvision, so resized video pixels may differ from it in the last bits).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from common.errors import FieldError
from common.models.qwen3_vl.preprocessor import ProcessorSettings
from common.processing.image import (
    ByteArray,
    check_aspect_ratio,
    load_image,
    patch_codes,
    resize_rgb,
    to_rgb,
)
from common.processing.limits import check_fps


class VideoFileError(FieldError):
    """A video file that cannot be read: not a supported container, no video stream,
    corrupt data (`common.processing.video_file`)."""


@dataclass(frozen=True, slots=True, eq=False)
class TimedFrames:
    """Decoded frames, each with its own time (a container file's, sampled at `fps`)."""

    frames: ByteArray  # (T, H, W, 3) uint8 RGB
    times: tuple[float, ...]  # seconds of each frame from the stream's start, increasing
    fps: float  # rate the frames were sampled at (what `sample_frame_indices` assumes)

    def __post_init__(self) -> None:
        if self.frames.ndim != 4 or len(self.times) != len(self.frames):
            raise ValueError(
                f"timed frames need (T, H, W, 3) frames and T times, got "
                f"{self.frames.shape} and {len(self.times)}"
            )


@dataclass(frozen=True, slots=True, eq=False)
class PlannedFrames:
    """A decoded file's frames as the processor would make them of its `TimedFrames`, made
    as they were decoded: only the frames `plan` samples, resized to its size, beside every
    kept frame's time (`common.processing.frame_store`). The file's frames are never all
    held at their full size (a 130 s 720p file sampled at 2 fps: 718 MB; its 260 frames
    resized: 18 MB)."""

    frames: ByteArray  # (len(plan.indices), h, w, 3) uint8 RGB, resized to `plan.size`
    times: tuple[float, ...]  # seconds of every frame the file's sampling kept
    fps: float  # rate those frames stand for (what `TimedFrames.fps` would be)
    source_size: tuple[int, int]  # (width, height) of the frames as decoded, upright
    plan: VideoPlan  # `plan_video(len(times), fps, *source_size)`

    def __post_init__(self) -> None:
        h, w = self.plan.size
        if self.frames.shape != (len(self.plan.indices), h, w, 3):
            raise ValueError(
                f"planned frames need {len(self.plan.indices)} frames of {w}x{h}, got "
                f"{self.frames.shape}"
            )


@dataclass(frozen=True, slots=True)
class ProcessedVideo:
    """One video's patch codes and layout."""

    patches: ByteArray  # (grid_t * grid_h * grid_w, patch_dim) uint8 codes, time-major
    grid_thw: tuple[int, int, int]  # (temporal patches, patch rows, patch columns)
    timestamps: tuple[float, ...]  # seconds per temporal patch (mean of first/last frame)
    # Content hash of each temporal patch, where known already (the processed-partition
    # cache, `common.processing.video_cache`); () : the processor hashes them.
    partition_hashes: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class VideoPlan:
    """Which source frames a video keeps and the size they are resized to: a function of
    the frame count, rate and frame size alone (`plan_video`)."""

    indices: tuple[int, ...]  # sampled source frames
    padded: tuple[int, ...]  # `indices` with the last repeated to the temporal patch size
    size: tuple[int, int]  # (height, width) every frame is resized to

    def groups(self, temporal_patch_size: int) -> list[tuple[int, ...]]:
        """The source frames of each temporal patch, in order."""
        p = self.padded
        return [p[k : k + temporal_patch_size] for k in range(0, len(p), temporal_patch_size)]


def plan_video(
    count: int, fps: float, width: int, height: int, settings: ProcessorSettings
) -> VideoPlan:
    """The frames kept from `count` frames of `width` x `height` at `fps`, and their
    resized size (the sampling and the video smart-resize rule: both depend on the frame
    count, so a video with frames appended may keep other frames or resize them
    differently)."""
    indices = sample_frame_indices(count, fps, settings)
    size = smart_resize_video(
        len(indices),
        height,
        width,
        temporal_factor=settings.temporal_patch_size,
        factor=settings.factor,
        min_pixels=settings.video_min_pixels,
        max_pixels=settings.video_max_pixels,
    )
    padded = indices + [indices[-1]] * (-len(indices) % settings.temporal_patch_size)
    return VideoPlan(tuple(indices), tuple(padded), size)


def sample_frame_indices(total: int, fps: float, settings: ProcessorSettings) -> list[int]:
    """Source frame indices to keep: uniform, `video_sample_fps` per second of video."""
    if total < 1:
        raise ValueError("video has no frames")
    if settings.video_sample_fps is None:
        return list(range(total))
    count = int(total / fps * settings.video_sample_fps)
    count = min(max(count, settings.video_min_frames), settings.video_max_frames, total)
    return [int(i) for i in np.linspace(0, total - 1, count).round().astype(np.int64)]


def temporal_timestamps(
    indices: Sequence[int],
    fps: float,
    temporal_patch_size: int,
    frame_times: Sequence[float] | None = None,
) -> list[float]:
    """Time of each temporal patch: mean of its first and last frame's time (seconds).

    A frame's time is `frame_times[i]` when given (a container's), else `i / fps`.
    `indices` are padded with the last index to a multiple of `temporal_patch_size`.
    """
    padded = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch_size)
    times = [i / fps if frame_times is None else frame_times[i] for i in padded]
    return [
        (times[k] + times[k + temporal_patch_size - 1]) / 2
        for k in range(0, len(times), temporal_patch_size)
    ]


def smart_resize_video(
    num_frames: int,
    height: int,
    width: int,
    *,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """Target frame `(height, width)`: multiples of `factor`, with frames x height x width
    within the bounds (the reference video rule; frames below `temporal_factor` count as
    `temporal_factor`)."""
    num_frames = max(num_frames, temporal_factor)
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    check_aspect_ratio(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class _Frames:
    """A video's frames as images, each made when asked for: of an array, only the frames
    sampled are made images, one at a time (all of them at once held the video twice more
    beside the array; ownfix review)."""

    def __init__(self, frames: Any) -> None:
        if isinstance(frames, TimedFrames):
            frames = frames.frames
        if isinstance(frames, np.ndarray):
            if frames.ndim != 4 or frames.shape[-1] not in (1, 3, 4):
                raise ValueError(f"video array must be (T, H, W, C), got {frames.shape}")
        elif isinstance(frames, Sequence) and not isinstance(frames, str | bytes):
            frames = [load_image(f) for f in frames]
        else:
            raise TypeError(
                f"video must be a list of frames or a (T, H, W, C) array, got {type(frames)}"
            )
        self._frames = frames

    def __len__(self) -> int:
        return len(self._frames)

    def size(self, i: int) -> tuple[int, int]:
        """Frame `i`'s (width, height)."""
        frame = self._frames[i]
        return (frame.shape[1], frame.shape[0]) if isinstance(frame, np.ndarray) else frame.size

    def __getitem__(self, i: int) -> Image.Image:
        frame = self._frames[i]
        if isinstance(frame, np.ndarray):
            return load_image(np.ascontiguousarray(frame, dtype=np.uint8))
        return frame


def preprocess_video(frames: Any, fps: float, settings: ProcessorSettings) -> ProcessedVideo:
    """Decoded frames at `fps` frames per second -> patch rows, grid and timestamps.

    `TimedFrames` and `PlannedFrames` bring their own rate and times; `fps` is then
    ignored. `PlannedFrames` were sampled and resized as they were decoded, by this plan."""
    if isinstance(frames, PlannedFrames):
        plan = plan_video(len(frames.times), frames.fps, *frames.source_size, settings)
        if plan != frames.plan:
            raise ValueError("the video's frames were planned with other processor settings")
        patches, grid = patch_codes(frames.frames, settings)
        timestamps = video_timestamps(plan, frames.fps, settings, frames.times)
        return ProcessedVideo(patches, grid, timestamps)
    frame_times = None
    if isinstance(frames, TimedFrames):
        fps, frame_times = frames.fps, frames.times
    check_fps(fps)
    images = _Frames(frames)
    indices = sample_frame_indices(len(images), fps, settings)
    sizes = {images.size(i) for i in indices}
    if len(sizes) != 1:
        raise ValueError(f"video frames differ in size: {sorted(sizes)}")
    ((width, height),) = sizes
    plan = plan_video(len(images), fps, width, height, settings)
    pixels = resized_frames((images[i] for i in plan.indices), plan.size, len(plan.indices))
    patches, grid = patch_codes(pixels, settings)
    return ProcessedVideo(patches, grid, video_timestamps(plan, fps, settings, frame_times))


def resized_frames(
    images: Sequence[Image.Image] | Iterable[Image.Image],
    size: tuple[int, int],
    count: int | None = None,
) -> ByteArray:
    """Frames as RGB, resized to `size` `(height, width)`, stacked `(T, H, W, 3)` uint8, in
    place (no list of them beside the stack); `count`: how many `images` gives, where it
    is no sequence (made one at a time)."""
    if count is None:
        assert isinstance(images, Sequence)
        count = len(images)
    out = np.empty((count, size[0], size[1], 3), dtype=np.uint8)
    for k, image in enumerate(images):
        out[k] = resize_rgb(to_rgb(image), size[0], size[1])
    return out


def video_timestamps(
    plan: VideoPlan, fps: float, settings: ProcessorSettings, frame_times: Sequence[float] | None
) -> tuple[float, ...]:
    """Seconds of each temporal patch of a planned video (`temporal_timestamps`)."""
    return tuple(temporal_timestamps(plan.indices, fps, settings.temporal_patch_size, frame_times))
