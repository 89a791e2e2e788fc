"""Processor settings from a checkpoint folder's files, the way `transformers` 5 saves them.

Files read, later ones winning key by key (so a newer, more specific file overrides):

1. defaults: `ProcessorSettings` with patch/merge/temporal sizes from `config.json`'s vision
   config;
2. `preprocessor_config.json` (the image processor; ours also holds our `video_*` keys);
3. `video_preprocessor_config.json` (the video processor);
4. `processor_config.json`, its nested `image_processor` and `video_processor` sections
   (what `ProcessorMixin.save_pretrained` writes in transformers 5).

Image keys: `patch_size`, `merge_size`, `temporal_patch_size`, `min_pixels` / `max_pixels`
(or `size` `{shortest_edge, longest_edge}`; the explicit keys win), `image_mean`,
`image_std`, and our own field names. Video keys: the same sizes, `size` / `min_pixels` /
`max_pixels` (the budget over all sampled frames), `fps` (sampling rate), `min_frames`,
`max_frames`, `do_sample_frames` (false keeps every frame). Keys that only restate what epd
always does (`do_resize`, `do_rescale` with 1/255, `do_normalize`, bicubic `resample`, ...)
are accepted silently. Any other key, or one of those with a value epd does not implement,
is logged once per (file, key) as a warning naming it: a setting is never dropped silently.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from common.errors import CheckpointError
from common.models.checkpoint_files import read_checkpoint_object
from common.models.qwen3_vl.config import Qwen3VLConfig
from common.models.qwen3_vl.preprocessor import PREPROCESSOR_FILE, ProcessorSettings

logger = logging.getLogger(__name__)

VIDEO_PREPROCESSOR_FILE = "video_preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"

_OWN_FIELDS = frozenset(ProcessorSettings.__dataclass_fields__)
_SIZES = ("patch_size", "merge_size", "temporal_patch_size")

# Keys that are metadata, or that describe what epd always does (value None also accepted).
_ACCEPTED: dict[str, Callable[[Any], bool]] = {
    "processor_class": lambda v: True,
    "image_processor_type": lambda v: True,
    "video_processor_type": lambda v: True,
    "feature_extractor_type": lambda v: True,
    "model_input_names": lambda v: True,
    "do_resize": lambda v: v is True,
    "do_rescale": lambda v: v is True,
    "rescale_factor": lambda v: abs(float(v) - 1 / 255) < 1e-9,
    "do_normalize": lambda v: v is True,
    "do_convert_rgb": lambda v: v is True,
    "resample": lambda v: v == 3,  # PIL bicubic
    "cap_pixels_per_frame": lambda v: v is False,
    "max_video_tokens": lambda v: True,  # only used with cap_pixels_per_frame
    "return_metadata": lambda v: True,
    "default_to_square": lambda v: True,
    "data_format": lambda v: v == "channels_first",
    "max_image_size": lambda v: True,
    "num_frames": lambda v: False,
    "max_duration": lambda v: False,
    "disable_grouping": lambda v: True,
    "device": lambda v: True,
    "return_tensors": lambda v: True,
    "input_data_format": lambda v: True,
    "video_metadata": lambda v: True,
}

_warned: set[tuple[str, str]] = set()


def read_processor_settings(folder: str | Path, config: Qwen3VLConfig) -> ProcessorSettings:
    """The checkpoint's processor settings (see the module docstring for the precedence).

    Raises `CheckpointError` naming the file when one cannot be read, or a value cannot be
    read as its setting's type.
    """
    folder = Path(folder)
    v = config.vision
    values: dict[str, Any] = {
        "patch_size": v.patch_size,
        "merge_size": v.spatial_merge_size,
        "temporal_patch_size": v.temporal_patch_size,
    }
    nested = _load(folder / PROCESSOR_FILE)
    sources: list[tuple[str, bool, Mapping[str, Any]]] = [
        (PREPROCESSOR_FILE, False, _load(folder / PREPROCESSOR_FILE)),
        (VIDEO_PREPROCESSOR_FILE, True, _load(folder / VIDEO_PREPROCESSOR_FILE)),
        (f"{PROCESSOR_FILE}:image_processor", False, _section(nested, "image_processor")),
        (f"{PROCESSOR_FILE}:video_processor", True, _section(nested, "video_processor")),
    ]
    video_norm: dict[str, tuple[str, Any]] = {}
    for name, is_video, raw in sources:
        found = _video_values(raw, name) if is_video else _image_values(raw, name)
        if is_video:  # one normalisation serves images and videos: the image processor's
            for key in ("image_mean", "image_std"):
                if key in found:
                    video_norm[key] = (name, found.pop(key))
        values.update(found)
    for key, (name, value) in video_norm.items():
        if value != values.get(key, ProcessorSettings.__dataclass_fields__[key].default):
            _warn(name, key, "differs from the image processor's; epd uses the image one")
    try:
        return ProcessorSettings(**values)
    except CheckpointError as exc:  # it names the setting; these name where it was read
        read = [name for name, _, raw in sources if raw] or ["no processor file: defaults"]
        raise CheckpointError(f"{folder} ({', '.join(read)}): {exc}") from None


def _load(path: Path) -> Mapping[str, Any]:
    return read_checkpoint_object(path) or {}


def _section(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    section = raw.get(key)
    return section if isinstance(section, dict) else {}


def _image_values(raw: Mapping[str, Any], name: str) -> dict[str, Any]:
    """ProcessorSettings values from an image processor dict."""
    out: dict[str, Any] = {}
    size = raw.get("size")
    if isinstance(size, dict):
        out.update(_pixel_bounds(size, name, "min_pixels", "max_pixels"))
    for key, value in raw.items():
        if key == "size" or (value is None and key != "video_sample_fps"):
            continue  # None: unset (our own video_sample_fps None keeps every frame)
        if key in _OWN_FIELDS:
            out[key] = _coerce(name, key, value)
        else:
            _check_accepted(name, key, value)
    return out


def _video_values(raw: Mapping[str, Any], name: str) -> dict[str, Any]:
    """ProcessorSettings values from a video processor dict."""
    out: dict[str, Any] = {}
    renamed = {
        "min_pixels": "video_min_pixels",
        "max_pixels": "video_max_pixels",
        "fps": "video_sample_fps",
        "min_frames": "video_min_frames",
        "max_frames": "video_max_frames",
    }
    size = raw.get("size")
    if isinstance(size, dict):
        out.update(_pixel_bounds(size, name, "video_min_pixels", "video_max_pixels"))
    for key, value in raw.items():
        if key in ("size", "do_sample_frames") or value is None:
            continue
        if key in renamed:
            out[renamed[key]] = _coerce(name, renamed[key], value)
        elif key in (*_SIZES, "image_mean", "image_std") or (
            key in _OWN_FIELDS and key.startswith("video_")
        ):
            out[key] = _coerce(name, key, value)
        else:
            _check_accepted(name, key, value)
    if raw.get("do_sample_frames") is False:
        out["video_sample_fps"] = None
    return out


def _pixel_bounds(size: Mapping[str, Any], name: str, low: str, high: str) -> dict[str, int]:
    out = {}
    for key, value in size.items():
        if value is None:
            continue
        if key in ("shortest_edge", "min_pixels"):  # min/max_pixels: older checkpoints
            out[low] = _coerce(name, f"size.{key}", value)
        elif key in ("longest_edge", "max_pixels"):
            out[high] = _coerce(name, f"size.{key}", value)
        else:
            _warn(name, f"size.{key}", "is not understood (epd reads shortest/longest_edge)")
    return out


def _coerce(name: str, key: str, value: Any) -> Any:
    try:
        if key in ("image_mean", "image_std"):
            if isinstance(value, str) or any(isinstance(x, bool | str) for x in value):
                raise TypeError(f"must be numbers, got {value!r}")
            return tuple(float(x) for x in value)
        if key == "video_sample_fps" or key == "video_default_fps":
            return None if value is None else float(value)
        if key == "video_partition_keys":
            if not isinstance(value, bool):
                raise TypeError(f"must be true or false, got {value!r}")
            return value
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not whole:  # 16.7 was read as 16, true as 1
            raise TypeError(f"must be a whole number, got {value!r}")
        return int(value)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{name}: setting {key}={value!r} is not a valid value ({exc})"
        ) from exc


def _check_accepted(name: str, key: str, value: Any) -> None:
    check = _ACCEPTED.get(key)
    if check is None:
        _warn(name, key, "is not understood by epd and is ignored")
        return
    try:
        fine = check(value)
    except (TypeError, ValueError):
        fine = False
    if not fine:
        _warn(name, key, f"= {value!r} is not supported by epd and is ignored")


def _warn(name: str, key: str, why: str) -> None:
    """Log once per (file, key) per process."""
    if (name, key) in _warned:
        return
    _warned.add((name, key))
    logger.warning("checkpoint %s: setting %s %s", name, key, why)
