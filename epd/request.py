"""The wire form of a chat for the router: `GenerateRequest`s built from OpenAI-like messages
(see `epd.client` for the message format), with images and videos encoded for the wire.
Blocking file reads; no network."""

from __future__ import annotations

import base64
import binascii
import io
import math
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from common.sampling import SamplingParams
from common.server.transport import DEFAULT_MAX_MESSAGE_MB
from common.settings.schema import MAX_SECONDS
from common.wire.sampling import sampling_to_proto
from epd.v1 import router_service_pb2

# The most bytes a request may take by default (a client's `max_message_mb`): a file past it
# is refused before it is read (a 600 MB file given by mistake took 1.8 GB for 13 s before
# gRPC refused the message without naming the part; client review, s32).
MAX_BYTES = DEFAULT_MAX_MESSAGE_MB << 20

# Files of a frames folder that are frames.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
Messages = Sequence[Mapping[str, Any]]

__all__ = [
    "IMAGE_SUFFIXES",
    "Messages",
    "build_request",
    "encode_image",
    "frame_files",
    "video_input",
]


def build_request(
    messages: Messages,
    sampling: SamplingParams | None = None,
    *,
    request_id: str = "",
    cache_salt: str | None = None,
    stop: str | Sequence[str] = (),
    max_bytes: int = MAX_BYTES,
) -> router_service_pb2.GenerateRequest:
    """The `GenerateRequest` of a chat; media encoded for the wire. `stop`: a string or
    strings ending the answer (not included), as OpenAI's ("": none). ValueError naming the
    part that cannot be sent; a file, or the whole request, past `max_bytes` (the gRPC
    message size limit) among them."""
    stops = ([stop] if stop else []) if isinstance(stop, str) or stop is None else stop
    if isinstance(stops, bytes | Mapping) or not isinstance(stops, Iterable):
        raise ValueError(f"stop: expected a string or a list of strings, got {stop!r:.60}")
    stops = list(stops)
    request = router_service_pb2.GenerateRequest(
        request_id=_text("" if request_id is None else request_id, "request_id")
        or uuid.uuid4().hex,
        sampling=sampling_to_proto(sampling or SamplingParams()),
        stop=[_text(t, f"stop[{k}]") for k, t in enumerate(stops)],
    )
    if cache_salt is not None:
        request.cache_salt = _text(cache_salt, "cache_salt")
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Iterable):
        raise ValueError(f"messages: expected a list of messages, got a {type(messages).__name__}")
    used = 0  # bytes of the parts so far (one ByteSize a request, not one a part: quadratic)
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}]: expected a message (a dict), got {message!r:.60}")
        role = str(message.get("role", ""))
        # OpenAI's newer name of the system role, as the HTTP API reads it.
        out = request.messages.add(role="system" if role == "developer" else role)
        content = message.get("content")
        if isinstance(content, str):
            out.content.add(text=_text(content, f"messages[{i}].content"))
            used += out.content[-1].ByteSize()
            continue
        if content is not None and not isinstance(content, list | tuple):
            raise ValueError(
                f"messages[{i}].content: expected a string or a list of parts, got a "
                f"{type(content).__name__}"
            )
        for j, part in enumerate(content or ()):  # each within what the others left
            _add_part(out, part, f"messages[{i}].content[{j}]", max_bytes - used)
            used += out.content[-1].ByteSize()
    size = request.ByteSize()
    if size > max_bytes:
        limit = _mib(max_bytes)
        raise ValueError(
            f"messages: the request takes {_mib(size)}, more than max_message_mb ({limit})"
        )
    return request


def _add_part(
    out: router_service_pb2.ChatMessage, part: Mapping[str, Any], where: str, max_bytes: int
) -> None:
    if not isinstance(part, Mapping):
        raise ValueError(f"{where}: expected a part (a dict with a 'type'), got {part!r:.60}")
    kind = part.get("type")
    uid = part.get("uuid")
    if kind == "text":
        text = part.get("text", "")
        if not isinstance(text, str):
            raise ValueError(f"{where}.text: expected a string, got {type(text).__name__}")
        out.content.add(text=_text(text, f"{where}.text"))
    elif kind in ("image", "image_url"):
        source = part.get("image") if kind == "image" else _data_url(part.get("image_url"), where)
        data = encode_image(source, f"{where}.image", max_bytes=max_bytes)
        image = router_service_pb2.ImageInput(data=data)
        if uid is not None:
            image.uuid = str(uid)
        out.content.add(image=image)
    elif kind == "video":
        video = video_input(part.get("video"), part.get("fps"), where, max_bytes=max_bytes)
        if uid is not None:
            video.uuid = str(uid)
        out.content.add(video=video)
    else:
        raise ValueError(f"{where}: unsupported content part type {kind!r}")


def video_input(
    source: Any, fps: Any, where: str = "video", *, max_bytes: int = MAX_BYTES
) -> router_service_pb2.VideoInput:
    """The wire form of a video (see the module docstring): a file's bytes with the rate to
    sample it at (0: the router's default), or encoded frames with their rate."""
    if isinstance(source, str | Path):
        path = Path(source)
        if path.is_dir():
            source = frame_files(path, f"{where}.video")
        elif path.is_file():
            source = _read(path, f"{where}.video", max_bytes)
        else:
            raise ValueError(f"{where}.video: no such file or folder: {path}")
    if isinstance(source, bytes | bytearray | memoryview):
        rate = 0.0 if fps is None else _rate(fps, f"{where}.fps")
        if not rate >= 0:
            raise ValueError(f"{where}.fps: a video file's fps must be positive or 0, got {fps!r}")
        if len(source) == 0:
            raise ValueError(f"{where}.video: the video file is empty")
        return router_service_pb2.VideoInput(file=bytes(source), fps=rate)
    shape = getattr(source, "shape", None)  # an array: (T, H, W, C) only
    if shape is not None and len(shape) != 4:
        raise ValueError(
            f"{where}.video: a video array must be (T, H, W, C) (a grey one (T, H, W, 1)), "
            f"got {shape}"
        )
    if shape is None and not isinstance(source, list | tuple):
        raise ValueError(
            f"{where}.video: expected a file (a path or its bytes), a folder or list of frames "
            f"or a (T, H, W, C) array, got a {type(source).__name__}"
        )
    files = [Path(f) for f in source if isinstance(f, str | Path)] if shape is None else []
    if files:  # frame files: their sizes together first, none read before
        size = sum(_size(f, f"{where}.video") for f in files)
        if size > max_bytes:
            raise ValueError(
                f"{where}.video: {len(files)} frame files take {_mib(size)}, {_past(max_bytes)}"
            )
    if fps is None or not _rate(fps, f"{where}.fps") > 0:
        raise ValueError(f"{where}.fps: a video needs a positive fps, got {fps!r}")
    if source is None or len(source) == 0:
        raise ValueError(f"{where}.video: no frames")
    return router_service_pb2.VideoInput(
        frames=[
            encode_image(f, f"{where}.video[{k}]", max_bytes=max_bytes)
            for k, f in enumerate(source)
        ],
        fps=float(fps),
    )


def checked_timeout(timeout_s: float | None) -> float | None:
    """A request's `timeout_s` as sent: None for None or infinity (no limit), at most
    `MAX_SECONDS` (gRPC keeps deadlines in int64 nanoseconds: 1e12 s ended every call at
    once, DEADLINE_EXCEEDED, as if the router had timed out). ValueError naming it for one
    that is not a positive number (NaN, 0, negative)."""
    if timeout_s is None or timeout_s == math.inf:
        return None
    if not timeout_s > 0:
        raise ValueError(
            f"timeout_s: must be a positive number of seconds or None, got {timeout_s}"
        )
    return min(float(timeout_s), MAX_SECONDS)


def frame_files(folder: str | Path, where: str = "video") -> list[Path]:
    """The image files of a frames folder, in name order; ValueError naming `where` when
    it is not a folder or holds none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{where} {folder}: not a folder of frame images")
    frames = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not frames:
        raise ValueError(f"{where} {folder}: no image files ({', '.join(IMAGE_SUFFIXES)})")
    return frames


PNG_LEVEL = 1  # zlib level of the PNG an image or frame given as pixels is sent as


def encode_image(source: Any, where: str = "image", *, max_bytes: int = MAX_BYTES) -> bytes:
    """Encoded file bytes of an image source (bytes as given, a path's bytes, PNG else)."""
    if isinstance(source, bytes | bytearray | memoryview):
        return bytes(source)
    if isinstance(source, str | Path):
        return _read(Path(source), where, max_bytes)
    import numpy as np  # here, not at the top: `epd generate` starts without them
    from PIL import Image

    try:  # PIL's own errors (5 channels, an empty array, mode F) name no part
        if isinstance(source, np.ndarray):
            if source.dtype != np.uint8 or source.ndim not in (2, 3):
                raise ValueError(f"arrays must be (H, W[, C]) uint8, got {source.shape}")
            squeeze = source.ndim == 3 and source.shape[-1] == 1
            source = Image.fromarray(source[..., 0] if squeeze else source)
        if isinstance(source, Image.Image):
            # Lossless, and fast: zlib level 1 took a quarter of the CPU of PIL's default
            # (6) on a smooth 448x448 image (7.4 against 29.0 ms) for 1.5x the bytes, and the
            # same on noise; a video given as frames pays this per frame.
            buffer = io.BytesIO()
            source.save(buffer, format="PNG", compress_level=PNG_LEVEL)
            return buffer.getvalue()
    except (TypeError, ValueError, OSError) as exc:
        raise ValueError(f"{where}: cannot be sent as an image: {exc}") from None
    raise ValueError(f"{where}: unsupported image source {type(source).__name__}")


def _text(value: Any, where: str) -> str:
    """`value`, a string the wire can carry (UTF-8: no lone surrogate); ValueError naming
    `where` otherwise."""
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got a {type(value).__name__}")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"{where}: not UTF-8 text ({exc.reason} at {exc.start})") from None
    return value


def _read(path: Path, where: str, max_bytes: int) -> bytes:
    """A file's bytes; ValueError naming `where` when it cannot be read or is past
    `max_bytes` (found from its size, before it is read)."""
    size = _size(path, where)
    if size > max_bytes:
        raise ValueError(f"{where}: {path} takes {_mib(size)}, {_past(max_bytes)}")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{where}: cannot read {path}: {exc.strerror or exc}") from None


def _size(path: Path, where: str) -> int:
    try:
        return path.stat().st_size
    except OSError as exc:
        raise ValueError(f"{where}: cannot read {path}: {exc.strerror or exc}") from None


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


def _past(left: int) -> str:
    if left <= 0:
        return "and the parts before it take all of the request's max_message_mb"
    return f"more than the {_mib(left)} the request has left of max_message_mb"


def _data_url(value: Any, where: str) -> bytes:
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise ValueError(f"{where}.image_url: only base64 data URLs can be sent")
    payload = "".join(url.split(";base64,", 1)[1].split())  # wrapped lines are fine
    try:  # validated, as the router's HTTP API reads it: junk is refused, not skipped
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"{where}.image_url: not valid base64 ({exc})") from None


def _rate(fps: Any, where: str) -> float:
    """`fps` as a number; ValueError naming `where` when it is none."""
    try:
        return float(fps)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: not a number: {fps!r}") from None
