"""The router's edge: a `GenerateRequest` checked and turned into processor input.

Everything a client sends is validated here, before any worker sees the request: each
media payload is decoded (a payload PIL cannot open is an error naming its field, e.g.
`messages[0].content[1].image.data`), and the sampling parameters are checked and
normalised (proto3 zeros mean "default"). The chat becomes typed `Message`s here, once
(`common.processing.messages`); nothing after this reads the protobuf or a dict. Errors are
`InputError`s (a `ValueError`), which the server answers with INVALID_ARGUMENT.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

from PIL import Image

from common.processing.messages import ImagePart, Message, Part, TextPart, VideoPart
from epd.v1 import router_service_pb2

# A decompression bomb is refused rather than decoded.
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


class InputError(ValueError):
    """A malformed request; `field` names the offending request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def decode_image(data: bytes, field: str) -> Image.Image:
    """Open and fully decode one encoded image; `InputError` naming `field` when it cannot."""
    if not data:
        raise InputError(field, "is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise InputError(field, f"image of {image.width}x{image.height} is too large")
            image.load()
    except InputError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, Warning) as exc:
        raise InputError(field, f"is not a decodable image ({exc})") from None
    return image


def messages_from_proto(
    messages: Any,  # RepeatedCompositeFieldContainer[ChatMessage]
) -> tuple[Message, ...]:
    """The typed chat, media decoded to PIL images; `InputError` naming the field."""
    if not messages:
        raise InputError("messages", "is empty")
    out: list[Message] = []
    for i, message in enumerate(messages):
        if not message.role:
            raise InputError(f"messages[{i}].role", "is empty")
        parts = tuple(
            _part(part, f"messages[{i}].content[{j}]") for j, part in enumerate(message.content)
        )
        out.append(Message(message.role, parts))
    return tuple(out)


def _part(part: router_service_pb2.ContentPart, where: str) -> Part:
    kind = part.WhichOneof("content")
    if kind == "text":
        return TextPart(part.text)
    if kind == "image":
        return ImagePart(
            decode_image(part.image.data, f"{where}.image.data"),
            uuid=part.image.uuid if part.image.HasField("uuid") else None,
        )
    if kind == "video":
        video = part.video
        if not video.frames:
            raise InputError(f"{where}.video.frames", "is empty")
        if not video.fps > 0:
            raise InputError(f"{where}.video.fps", f"must be positive, got {video.fps}")
        frames = [
            decode_image(frame, f"{where}.video.frames[{k}]")
            for k, frame in enumerate(video.frames)
        ]
        sizes = {f.size for f in frames}
        if len(sizes) != 1:
            raise InputError(f"{where}.video.frames", f"frames differ in size: {sorted(sizes)}")
        return VideoPart(
            frames, float(video.fps), uuid=video.uuid if video.HasField("uuid") else None
        )
    raise InputError(where, "has no text, image or video")
