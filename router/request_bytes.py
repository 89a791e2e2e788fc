"""A Generate request's bytes: checked on the wire before they are parsed, then decoded
(`decode_request`, on a thread), and what the decoded request holds beside them
(`decoded_bytes`), which `router.held` counts.

Before parsing, from the wire alone (`common.wire.counts`): each field's elements (parsing
and counting 524k empty messages of 1 MiB held the router's event loop 1.4 s: stalls
review), and each string's bytes (`_Strings`): the text of the prompt, roles and text parts
in all against `max_prompt_text_bytes` (the UTF-8 bytes on the wire are the bytes the
processor counts), and the ids, salt, uuids and stop strings against their characters (at
most 4 bytes each). Parsed first, a refused 255 MiB prompt was copied again at every read
of it (each a UTF-8 decode, GIL held), then once more to count it: two such requests of one
tenant, within its share, took a router to 5-8 GB and stalled its loop 18 s of 25
(attacker review, s40).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from common.errors import FieldError
from common.multimodal.validation import MAX_UUID_CHARS
from common.processing.limits import InputLimits, check_text_bytes
from common.sampling import MAX_STOP_TOKEN_IDS
from common.wire.counts import check_counts
from epd.v1 import router_service_pb2
from router.ids import MAX_ID_CHARS
from router.stop import EMPTY_STOP, MAX_STOP_CHARS, MAX_STOP_STRINGS, TOO_MANY_STOPS


@dataclass(frozen=True, slots=True)
class Sized:
    """A Generate request and the bytes it holds, as `decode_request` counts them."""

    request: router_service_pb2.GenerateRequest
    size: int


ELEMENT_BYTES = 64  # per message, content part, stop string and video frame, decoded
INT_BYTES = 8  # per resume token and stop token id, decoded (1 byte each on the wire)


def decoded_bytes(request: router_service_pb2.GenerateRequest, per_part: int = 0) -> int:
    """What the decoded `request` holds beside its wire bytes: `ELEMENT_BYTES` for each
    message, content part, stop string and video frame (an empty one is 2 bytes on the wire
    and ~45 decoded) and `INT_BYTES` for each resume token and stop token id; `per_part`
    more for each message and content part (what a parsed HTTP body holds of them)."""
    parts = frames = 0
    for message in request.messages:
        parts += len(message.content)
        for part in message.content:
            if part.HasField("video"):
                frames += len(part.video.frames)
    ints = len(request.resume_tokens) + len(request.sampling.stop_token_ids)
    shaped = len(request.messages) + parts
    return (
        ELEMENT_BYTES * (shaped + len(request.stop) + frames) + INT_BYTES * ints + per_part * shaped
    )


# The most messages, content parts and video frames a Generate holds, each in all (the HTTP
# API's bound on a body's objects), and the most fields in all (each message's role, ...).
MAX_ELEMENTS = 1 << 16
MAX_FIELDS = 5 * MAX_ELEMENTS

# Refusals of the prompt field, here and after parsing (`router.prepare`).
EMPTY_PROMPT = "is empty"
PROMPT_AND_MESSAGES = "give either messages or a prompt, not both"

# The strings whose UTF-8 bytes are the prompt's text (`InputLimits.max_text_bytes`).
TEXT = frozenset(("prompt", "messages.role", "messages.content.text"))
# Strings of at most so many characters, and the refusal past them (as the checks after
# parsing word it): refused on the wire past 4 bytes a character, which no string that
# passes those checks has.
_IDS = f"is over {MAX_ID_CHARS} characters"
_UUIDS = f"is over {MAX_UUID_CHARS} characters"
CHARACTERS = {
    "request_id": (MAX_ID_CHARS, _IDS),
    "cache_salt": (MAX_ID_CHARS, _IDS),
    "stop": (MAX_STOP_CHARS, f"a stop string may have at most {MAX_STOP_CHARS} characters"),
    "messages.content.image.uuid": (MAX_UUID_CHARS, _UUIDS),
    "messages.content.video.uuid": (MAX_UUID_CHARS, _UUIDS),
}


class _Strings:
    """What `check_counts` calls for each string on the wire; `check` then refuses as the
    checks after parsing would, in their order: the ids, the stop strings, then the prompt
    and the chat message by message (each message's role, then its parts: a part's text
    summed into the text's bytes, an image's or video's uuid against its characters). A
    singular field sent again counts as the parser keeps it, its last value, and a part as
    the last member of its oneof it was sent, strings or not (text, image or video: ownfixB,
    ownfixC, s41 review F1). A request with several faults is refused naming the first of
    them in that order; a fault only the checks after parsing find may come before it, and
    too many elements (stop strings, tokens) are refused as the walk meets them, first."""

    def __init__(self, max_text_bytes: int | None) -> None:
        self.limits = InputLimits(max_text_bytes=max_text_bytes)
        self.text: dict[str, int] = {}  # field (as errors name it) -> its bytes
        self.bounded: dict[str, tuple[int, str]] = {}  # field -> (its bytes, its path)
        self.stop_fault: str | None = None  # the first stop string's, empty or too long

    def __call__(self, path: str, field: str, size: int | None) -> None:
        if path.startswith(_PART):  # a part holds its oneof's last member: not the others
            member = path.removeprefix(_PART).split(".")[0]  # text, image or video
            part = field[: field.rindex(f".{member}")]
            if member != "text":
                self.text.pop(f"{part}.text", None)
            for other in {"image", "video"} - {member}:
                self.bounded.pop(f"{part}.{other}.uuid", None)
        if size is None:  # a sub-message begins: its member switched the oneof, if any
            return
        if path in TEXT:
            self.text[field] = size
        if path == "stop":  # repeated: every one counts, the first fault named
            if self.stop_fault is None and not size:
                self.stop_fault = EMPTY_STOP
            elif self.stop_fault is None and size > 4 * MAX_STOP_CHARS:
                self.stop_fault = CHARACTERS[path][1]
        elif path in CHARACTERS:
            self.bounded[field] = (size, path)

    def check(self, messages: bool) -> None:
        """Refuse as the checks after parsing would (the class docstring); `messages`:
        the request holds a message (an empty one too)."""
        for field in ("request_id", "cache_salt"):
            self._characters(field)
        if self.stop_fault is not None:
            raise FieldError("stop", self.stop_fault)
        if "prompt" in self.text:  # sent (an optional field: present though empty)
            if not self.text["prompt"]:
                raise FieldError("prompt", EMPTY_PROMPT)
            if messages:
                raise FieldError("prompt", PROMPT_AND_MESSAGES)
        over = self.limits.max_text_bytes is not None and (
            sum(self.text.values()) > self.limits.max_text_bytes
        )
        if not over and all(size <= 4 * CHARACTERS[p][0] for size, p in self.bounded.values()):
            return
        used = 0
        for field in sorted({*self.text, *self.bounded}, key=_processor_order):
            if field in self.bounded:
                self._characters(field)
            else:
                used += self.text[field]
                check_text_bytes(used, self.limits, field)

    def _characters(self, field: str) -> None:
        size, path = self.bounded.get(field, (0, ""))
        if path and size > 4 * CHARACTERS[path][0]:
            raise FieldError(field, CHARACTERS[path][1])


_PART = "messages.content."
_INDEXES = re.compile(r"messages\[(\d+)\]\.(?:role|content\[(\d+)\]\..+)")


def _processor_order(field: str) -> tuple[int, int]:
    """Where the checks after parsing meet `field`: the ids and the prompt first, then
    message by message, its role before its parts (a client may send a message's content
    before its role)."""
    found = _INDEXES.fullmatch(field)
    if found is None:  # the prompt (the ids were checked before)
        return (-1, -1)
    return (int(found[1]), -1 if found[2] is None else int(found[2]))


def decode_request(data: bytes, max_model_len: int, max_text_bytes: int | None = None) -> Sized:
    """The request and what it holds decoded: its wire bytes plus `decoded_bytes`. Its
    elements and strings are checked from its bytes first (the module docstring; FieldError
    naming the field). Run it on a thread: it may take a second or so."""
    bounds = {
        "stop": MAX_STOP_STRINGS,
        "sampling.stop_token_ids": MAX_STOP_TOKEN_IDS,
        "resume_tokens": max_model_len,
    }
    descriptor = router_service_pb2.GenerateRequest.DESCRIPTOR
    strings = _Strings(max_text_bytes)
    try:
        counts = check_counts(data, descriptor, bounds, MAX_ELEMENTS, MAX_FIELDS, strings)
    except FieldError as exc:  # worded as `check_stop` words it (ownfixA review, s41)
        if exc.field != "stop":
            raise
        raise FieldError("stop", TOO_MANY_STOPS) from None
    strings.check(bool(counts.get("messages")))
    request = router_service_pb2.GenerateRequest.FromString(data)
    return Sized(request, len(data) + decoded_bytes(request))
