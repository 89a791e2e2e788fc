"""Processor settings: how images and videos become patch rows (`preprocessor_config.json`).

One frozen record read from the checkpoint folder. Every field that changes the processed
pixels is part of `fingerprint()`, which goes into each item's content hash, so the same
picture processed under different settings never shares a hash.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, NoReturn

from common.errors import CheckpointError
from common.models.checkpoint_files import read_checkpoint_json

PREPROCESSOR_FILE = "preprocessor_config.json"
# Settings that count something (pixels, patches, frames). A low bound past its high one is
# not refused: a file setting only max_pixels below epd's default min_pixels is served by
# transformers, and the resize honours the high bound first.
_COUNTS = (
    "patch_size",
    "merge_size",
    "temporal_patch_size",
    "min_pixels",
    "max_pixels",
    "video_min_pixels",
    "video_max_pixels",
    "video_min_frames",
    "video_max_frames",
)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _refuse(key: str, why: str) -> NoReturn:
    raise CheckpointError(f"processor setting {key} {why}")


@dataclass(frozen=True, slots=True)
class ProcessorSettings:
    """Qwen3-VL image/video preprocessing settings (defaults are the released model's)."""

    # Spatial side of one vision patch, in pixels.
    patch_size: int = 16
    # Patches per side merged into one LM token (2 -> 2x2 patches per token).
    merge_size: int = 2
    # Frames stacked into one patch (images are repeated to fill it).
    temporal_patch_size: int = 2
    # Image pixel budget (height x width after resizing) lower and upper bound.
    min_pixels: int = 64 * 32 * 32
    max_pixels: int = 16384 * 32 * 32
    # Per-channel normalisation applied after scaling to [0, 1].
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    # Video pixel budget over all sampled frames (frames x height x width).
    video_min_pixels: int = 4096
    video_max_pixels: int = 24576 * 32 * 32
    # Frames sampled per second of video; None keeps every given frame.
    video_sample_fps: float | None = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 768
    # Source frame rate assumed when a video message does not give one (the reference's).
    video_default_fps: float = 24.0
    # Key a video's KV blocks by its temporal patches rather than the whole video, so a
    # video that shares leading frames with a cached one reuses their blocks (see
    # `partition_keys_exact`). Changes no pixels, so it is not in the fingerprint.
    video_partition_keys: bool = True

    def __post_init__(self) -> None:
        """Refuse what no image could be processed with (`CheckpointError` naming the key): a
        NaN mean or a zero std started cleanly, and every image request answered token 0."""
        for key in _COUNTS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                _refuse(key, f"must be a whole number >= 1, got {value!r}")
        for key in ("image_mean", "image_std"):
            values = getattr(self, key)
            if len(values) != 3 or not all(_finite(v) for v in values):
                _refuse(key, f"must be 3 finite numbers (one per channel), got {values!r}")
        if not all(v > 0 for v in self.image_std):
            _refuse("image_std", f"must be above 0, got {self.image_std!r}")
        for key in ("video_sample_fps", "video_default_fps"):
            value = getattr(self, key)
            if value is not None and not (_finite(value) and value > 0):
                _refuse(key, f"must be a finite number above 0, got {value!r}")

    @property
    def factor(self) -> int:
        """Resized image sides are multiples of this many pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ProcessorSettings:
        """Build from our `preprocessor_config.json` form; the reference's `size` dict is
        accepted for the image pixel bounds."""
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {k: v for k, v in raw.items() if k in known}
        size = raw.get("size")
        if isinstance(size, dict):
            if "shortest_edge" in size:
                values.setdefault("min_pixels", int(size["shortest_edge"]))
            if "longest_edge" in size:
                values.setdefault("max_pixels", int(size["longest_edge"]))
        for key in ("image_mean", "image_std"):
            if key in values:
                values[key] = tuple(float(x) for x in values[key])
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | Path) -> ProcessorSettings:
        """Read `preprocessor_config.json` (a file, or a folder holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / PREPROCESSOR_FILE
        return cls.from_dict(read_checkpoint_json(path))

    def to_dict(self) -> dict[str, Any]:
        """The `preprocessor_config.json` form, with the reference's keys added so its image
        processor reads the same bounds."""
        out = asdict(self)
        out["image_mean"] = list(self.image_mean)
        out["image_std"] = list(self.image_std)
        out["size"] = {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}
        out["processor_class"] = "Qwen3VLProcessor"
        out["image_processor_type"] = "Qwen2VLImageProcessor"
        return out

    def fingerprint(self) -> bytes:
        """Canonical bytes of every setting that changes the patch rows, for content
        hashes (`video_partition_keys` only changes block keys)."""
        values = asdict(self)
        del values["video_partition_keys"]
        return json.dumps(values, sort_keys=True, separators=(",", ":")).encode()


def partition_keys_exact(
    settings: ProcessorSettings,
    runs: Sequence[tuple[int, int]],
    partition_rows: Sequence[int],
) -> bool:
    """Whether a Qwen3-VL video may key its blocks by partition (docs/block-hash.md).

    The rule is exact when (a) a partition's encoder output depends on that partition
    alone and (b) its placement depends only on what precedes it in the prompt. Qwen3-VL
    gives both for one partition per temporal patch: the vision tower attends within a
    temporal patch (its `temporal_patch_size` frames are merged into the patch, never
    across patches) and the partition hash covers the patch rows and their `(1, h, w)`
    grid; each patch is its own run after its own `<t seconds>` text, and mRoPE places a
    run from the text position where it starts and its `(h, w)` alone (no position depends
    on the video's frame count or duration). Whatever the total length changes upstream
    (frame sampling, the pixel budget's resize) changes the patch rows, so the partition
    hashes. So the partitions must line up one to one with the runs; a layout that merged
    patches into one run (positions then depending on a frame's index in the video), or a
    partition spanning runs, keys by the whole item. `settings.video_partition_keys`
    False turns the rule off.
    """
    if not settings.video_partition_keys or len(runs) != len(partition_rows):
        return False
    return all(length == rows for (_, length), rows in zip(runs, partition_rows, strict=True))
