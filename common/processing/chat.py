"""Qwen3-VL chat template: typed messages -> text pieces and media parts, in order.

The layout is Qwen3-VL's (ChatML):

    <|im_start|>{role}\\n{content}<|im_end|>\\n        per message, system ones too
    <|im_start|>assistant\\n                          generation prompt

A system message may come anywhere, and several may (OpenAI's API takes them so: agent
frameworks add a developer message after the system one); a later one is a turn of its own,
as Qwen3's template renders it.

Inside `content`, text parts are concatenated as they are and each image or video part
stays a piece of its own; the processor expands it into its placeholder tokens (see
`common.processing.processor`). The template's own control tokens come as `Control`
pieces, apart from the text: everything in a `str` piece (a role, user text) is text, and
the processor tokenizes a special token spelled in it as plain text unless told otherwise.
The messages are `common.processing.messages.Message`s: the dict form is converted before
it gets here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.processing.messages import ImagePart, MediaPart, Message, TextPart, VideoPart

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


@dataclass(frozen=True, slots=True)
class Control:
    """`count` copies of one control token, inserted by the template or the processor."""

    token: str  # the special token's text, e.g. "<|im_start|>"
    count: int = 1


Piece = str | Control | MediaPart


def render_chat(messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[Piece]:
    """The prompt as text, control-token and media pieces in order (adjacent text is
    joined). Raises `ValueError` for a content part it cannot render."""
    pieces: list[Piece] = []

    def emit(piece: Piece) -> None:
        if isinstance(piece, str) and pieces and isinstance(pieces[-1], str):
            pieces[-1] += piece
        elif piece != "":
            pieces.append(piece)

    for number, message in enumerate(messages):
        emit(Control(IM_START))
        emit(f"{message.role}\n")
        for part in message.content:
            if isinstance(part, TextPart):
                emit(part.text)
            elif isinstance(part, ImagePart | VideoPart):
                emit(part)
            else:
                raise ValueError(f"message {number}: unsupported content part {part!r}")
        emit(Control(IM_END))
        emit("\n")
    if add_generation_prompt:
        emit(Control(IM_START))
        emit("assistant\n")
    return pieces
