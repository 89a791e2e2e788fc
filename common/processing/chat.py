"""Qwen3-VL chat template: OpenAI-like messages -> text pieces and media slots, in order.

The layout is Qwen3-VL's (ChatML):

    [<|im_start|>system\\n{system}<|im_end|>\\n]      only when the first message is system
    <|im_start|>{role}\\n{content}<|im_end|>\\n        per message
    <|im_start|>assistant\\n                          generation prompt

Inside `content`, text parts are concatenated as they are and each image or video part
becomes a `MediaSlot`; the processor expands a slot into its placeholder tokens (see
`common.processing.processor`).

Accepted content parts: `{"type": "text", "text": str}`, `{"type": "image", "image": src}`
(`src`: encoded bytes, a path or a PIL image; OpenAI's `{"type": "image_url", "image_url":
{"url": "data:...;base64,..."}}` too) and `{"type": "video", "video": frames, "fps": float}`.
A media part may instead name a payload passed beside the messages with `"index": k`, or
carry no data at all to take the next unreferenced payload of its modality. `"uuid"` on a
media part is the caller's identity for the item.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.multimodal.params import Modality

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


@dataclass(frozen=True, slots=True)
class MediaSlot:
    """One image or video part of a message, in prompt order."""

    modality: Modality  # image or video
    data: Any | None  # inline payload, or None when it refers to a side payload
    index: int | None  # explicit side-payload index, when given
    uuid: str | None  # caller-supplied identity
    fps: float | None  # video frame rate, when given


Piece = str | MediaSlot


def render_chat(
    messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
) -> list[Piece]:
    """The prompt as text pieces and media slots in order (adjacent text is joined)."""
    pieces: list[Piece] = []

    def emit(piece: Piece) -> None:
        if isinstance(piece, str) and pieces and isinstance(pieces[-1], str):
            pieces[-1] += piece
        elif piece != "":
            pieces.append(piece)

    for number, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {number} has no role")
        if role == "system" and number != 0:
            raise ValueError("a system message may only come first")
        emit(f"{IM_START}{role}\n")
        for piece in _content_pieces(message.get("content"), number):
            emit(piece)
        emit(f"{IM_END}\n")
    if add_generation_prompt:
        emit(f"{IM_START}assistant\n")
    return pieces


def _content_pieces(content: Any, number: int) -> list[Piece]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, Sequence):
        raise ValueError(f"message {number}: content must be a string or a list of parts")
    out: list[Piece] = []
    for part in content:
        if not isinstance(part, Mapping):
            raise ValueError(f"message {number}: content part must be an object")
        kind = part.get("type")
        if kind == "text":
            out.append(str(part.get("text", "")))
        elif kind in ("image", "image_url"):
            data = part.get("image")
            if kind == "image_url":
                data = _decode_image_url(part.get("image_url"), number)
            out.append(_slot(Modality.IMAGE, data, part, number))
        elif kind == "video":
            fps = part.get("fps")
            slot = _slot(Modality.VIDEO, part.get("video"), part, number)
            out.append(
                MediaSlot(
                    slot.modality,
                    slot.data,
                    slot.index,
                    slot.uuid,
                    None if fps is None else float(fps),
                )
            )
        else:
            raise ValueError(f"message {number}: unsupported content part type {kind!r}")
    return out


def _slot(modality: Modality, data: Any, part: Mapping[str, Any], number: int) -> MediaSlot:
    index = part.get("index")
    if index is not None and (not isinstance(index, int) or index < 0):
        raise ValueError(f"message {number}: {modality} index must be a non-negative int")
    if data is not None and index is not None:
        raise ValueError(f"message {number}: {modality} part has both data and an index")
    uuid = part.get("uuid")
    return MediaSlot(modality, data, index, None if uuid is None else str(uuid), None)


def _decode_image_url(image_url: Any, number: int) -> bytes | str:
    url = image_url.get("url") if isinstance(image_url, Mapping) else image_url
    if not isinstance(url, str):
        raise ValueError(f"message {number}: image_url has no url")
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise ValueError(f"message {number}: only base64 data URLs are supported")
        return base64.b64decode(payload)
    if url.startswith("file://"):
        return url[len("file://") :]
    raise ValueError(f"message {number}: remote image URLs are not fetched; send the bytes")
