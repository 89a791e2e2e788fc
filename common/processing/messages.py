"""Chat messages as typed values: what `Processor.process` takes.

The chat is typed once, at the edge, and nothing past the edge reads a dict:
- the router builds `Message`s from the wire's `ChatMessage`s (`router.inputs`), media
  already decoded, every error naming its request field;
- the public Python API (`Engine.generate`, `Engine.process`, ...) takes the OpenAI-like
  dict form, which `messages_from_dicts` (the one converter of that form) turns into
  `Message`s.

The dict form: `{"role": str, "content": str | [part, ...] | None}` with parts
`{"type": "text", "text": str}`, `{"type": "image", "image": src}` (`src`: encoded bytes, a
path, a PIL image or an array; OpenAI's `{"type": "image_url", "image_url": {"url":
"data:...;base64,..."}}` too) and `{"type": "video", "video": frames, "fps": float}`
(frames: a list of images, a `(T, H, W, C)` array, or a file's `TimedFrames` or
`PlannedFrames`, whose own rate is the default fps). A media part may instead name a side
payload with `"index": k`, or carry no data at all to take the next unreferenced payload of
its modality; `"uuid"` is the caller's identity for the item.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from common.multimodal.params import Modality
from common.processing.image import ImageSource
from common.processing.limits import InputLimits, check_text_bytes
from common.processing.video import PlannedFrames, TimedFrames

# Decoded or encoded frames: a list of images, one (T, H, W, C) uint8 array, or frames with
# their own times (decoded from a video file by `common.processing.video_file`).
VideoSource = Sequence[ImageSource] | npt.NDArray[np.uint8] | TimedFrames | PlannedFrames


@dataclass(frozen=True, slots=True)
class TextPart:
    """Text, rendered into the prompt as it is."""

    text: str


def _check_reference(modality: Modality, data: object, index: int | None) -> None:
    if index is not None and (not isinstance(index, int) or isinstance(index, bool) or index < 0):
        raise ValueError(f"{modality} index must be a non-negative int, got {index!r}")
    if data is not None and index is not None:
        raise ValueError(f"{modality} part has both data and an index")


# Media parts compare by identity (eq=False): their payloads are arrays and images, whose
# equality is element-wise or costly.
@dataclass(frozen=True, slots=True, eq=False)
class ImagePart:
    """An image: inline `data`, side payload `index`, or neither (the next unreferenced
    image payload). Raises `ValueError` when both are given or the index is negative."""

    modality: ClassVar[Modality] = Modality.IMAGE
    data: ImageSource | None = None  # encoded bytes, a path, a PIL image or an array
    index: int | None = None  # position among the side `images` payloads
    uuid: str | None = None  # caller-supplied identity of the item

    def __post_init__(self) -> None:
        _check_reference(self.modality, self.data, self.index)

    @property
    def payload(self) -> ImageSource | None:
        """The inline payload, or None when it refers to a side payload."""
        return self.data


@dataclass(frozen=True, slots=True, eq=False)
class VideoPart:
    """A video: inline `frames`, side payload `index`, or neither (as `ImagePart`)."""

    modality: ClassVar[Modality] = Modality.VIDEO
    frames: VideoSource | None = None  # decoded frames, in order
    fps: float | None = None  # frame rate of `frames` (None: the processor's default)
    index: int | None = None  # position among the side `videos` payloads
    uuid: str | None = None  # caller-supplied identity of the item

    def __post_init__(self) -> None:
        _check_reference(self.modality, self.frames, self.index)

    @property
    def payload(self) -> VideoSource | None:
        """The inline payload, or None when it refers to a side payload."""
        return self.frames


MediaPart = ImagePart | VideoPart
Part = TextPart | ImagePart | VideoPart


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message: a role and its content parts in order."""

    role: str  # "system" (first message only), "user", "assistant", ...
    content: tuple[Part, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.role, str) or not self.role:
            raise ValueError("message has no role")


# The OpenAI-like form the public Python API accepts.
ChatDicts = Sequence[Mapping[str, Any]]


def messages_from_dicts(messages: ChatDicts | Sequence[Message]) -> tuple[Message, ...]:
    """The typed chat of the dict form (see the module docstring); `Message`s pass through.

    Raises `ValueError` naming the message on anything malformed.
    """
    out: list[Message] = []
    for number, message in enumerate(messages):
        if isinstance(message, Message):
            out.append(message)
            continue
        if not isinstance(message, Mapping):
            raise ValueError(f"message {number} must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {number} has no role")
        try:
            out.append(Message(role, _parts(message.get("content"))))
        except ValueError as exc:
            raise ValueError(f"message {number}: {exc}") from None
    return tuple(out)


def _parts(content: Any) -> tuple[Part, ...]:
    if content is None:
        return ()
    if isinstance(content, str):
        return (TextPart(content),)
    if not isinstance(content, Sequence):
        raise ValueError("content must be a string or a list of parts")
    return tuple(_part(part) for part in content)


def _part(part: Any) -> Part:
    if not isinstance(part, Mapping):
        raise ValueError("content part must be an object")
    kind = part.get("type")
    uuid = part.get("uuid")
    uuid = None if uuid is None else str(uuid)
    if kind == "text":
        return TextPart(str(part.get("text", "")))
    if kind == "image":
        return ImagePart(part.get("image"), part.get("index"), uuid)
    if kind == "image_url":
        return ImagePart(_decode_image_url(part.get("image_url")), part.get("index"), uuid)
    if kind == "video":
        fps = part.get("fps")
        video = part.get("video")
        if fps is None and isinstance(video, TimedFrames | PlannedFrames):
            fps = video.fps
        return VideoPart(video, None if fps is None else float(fps), part.get("index"), uuid)
    raise ValueError(f"unsupported content part type {kind!r}")


def _decode_image_url(image_url: Any) -> bytes | str:
    url = image_url.get("url") if isinstance(image_url, Mapping) else image_url
    if not isinstance(url, str):
        raise ValueError("image_url has no url")
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise ValueError("only base64 data URLs are supported")
        return base64.b64decode(payload)
    if url.startswith("file://"):
        return url[len("file://") :]
    raise ValueError("remote image URLs are not fetched; send the bytes")


def check_text_limits(chat: Sequence[Message], limits: InputLimits) -> None:
    """Count the UTF-8 bytes of roles and text parts; refuse past `max_text_bytes`."""
    used = 0
    for i, message in enumerate(chat):
        used += len(message.role.encode())
        check_text_bytes(used, limits, f"messages[{i}].role")
        for j, part in enumerate(message.content):
            if isinstance(part, TextPart):
                used += len(part.text.encode())
                check_text_bytes(used, limits, f"messages[{i}].content[{j}].text")


def assign_payloads(slots: Sequence[MediaPart], side_counts: Mapping[Modality, int]) -> list[int]:
    """Payload index of each slot (see `common.processing.processor.Processor.process`)."""
    explicit = {
        m: {s.index for s in slots if s.modality == m and s.index is not None} for m in side_counts
    }
    next_free = dict.fromkeys(side_counts, 0)
    inline_next = dict(side_counts)
    out: list[int] = []
    for slot in slots:
        m = slot.modality
        if slot.payload is not None:
            out.append(inline_next[m])
            inline_next[m] += 1
            continue
        if slot.index is not None:
            index = slot.index
        else:
            while next_free[m] in explicit[m]:
                next_free[m] += 1
            index = next_free[m]
            next_free[m] += 1
        if index >= side_counts[m]:
            raise ValueError(f"{m} part refers to payload {index}, but {side_counts[m]} were given")
        out.append(index)
    return out
