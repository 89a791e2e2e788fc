"""How many elements each field of a protobuf message holds, read from its wire bytes before
it is parsed, so that a request of too many is refused at a cost bounded by the limits,
not by its size.

Parsing holds the GIL for the whole message (upb, in C), and what the receiver then does
per element runs in Python: a 1 MiB Generate of 524k empty chat messages (2 bytes each on
the wire) held the router's event loop 1.4 s, 100 MiB of them 144 s, every worker's
heartbeat failing meanwhile (stalls review). `check_counts` walks the wire format, led by
the message's descriptor: it counts each field's occurrences (a packed field's elements
from its bytes, in C) under the field's path, a singular field's too (a field sent again
is parsed again), descends into sub-messages, and raises `FieldError` naming the field
once a path passes its bound, or the fields read pass a bound of their own, before walking
further: its cost is bounded, whatever the message's size. Unknown fields (and a known one
sent in another wire type: the parser keeps either whole) are not counted nor descended
into, only read against the bound on fields in all; a length past the end is a
`DecodeError`, as the parser finds it, and so is a group (wire types 3 and 4, which proto3
has not), which a parser would keep as an unknown field.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from common.errors import FieldError

_HIGH = bytes(range(0x80, 0x100))  # a varint's bytes but its last: one byte left per varint
_FIXED = {  # bytes of one element of a packed fixed-width field
    FieldDescriptor.TYPE_DOUBLE: 8,
    FieldDescriptor.TYPE_FIXED64: 8,
    FieldDescriptor.TYPE_SFIXED64: 8,
    FieldDescriptor.TYPE_FLOAT: 4,
    FieldDescriptor.TYPE_FIXED32: 4,
    FieldDescriptor.TYPE_SFIXED32: 4,
}
_DELIMITED = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)


def check_counts(
    data: bytes,
    descriptor: Descriptor,
    bounds: Mapping[str, int],
    default: int,
    most: int,
    strings: Strings | None = None,
) -> dict[str, int]:
    """Refuse `data`, a serialized `descriptor` message, with `FieldError` when a field path
    (`messages.content`: dotted names, no indexes; the error names the element, as
    `messages[3].content`) occurs more often than `bounds` says for it, or `default` times
    for one it does not name, or when the message holds more than `most` fields in all (a
    packed field's elements not counted there: they cost no walking); occurrences are
    counted over the whole message, sub-messages' summed. `strings(path, field, size)` is
    called for each string or bytes value, in order, with its size on the wire (it raises
    to refuse it), and with size None as each occurrence of a singular sub-message field
    begins (one of a oneof replaces the member set before, strings or not). `DecodeError`
    when the bytes are not protobuf wire format. Returns the counts, by path."""
    walk = _Walk(bytes(data), bounds, default, most, strings)
    walk.message(0, len(data), descriptor, "", "")
    return walk.counts


_VARINT = re.compile(rb"[\x80-\xff]{0,9}[\x00-\x7f]")  # one varint, up to 10 bytes
_MESSAGE, _PACKED, _ONE = 0, 1, 2  # what a length-delimited occurrence of a field holds


# Called for each string or bytes value: (its path, the field as errors name it, its bytes);
# and (path, field, None) as a singular sub-message field's occurrence begins.
Strings = Callable[[str, str, int | None], None]


class _Walk:
    def __init__(
        self,
        data: bytes,
        bounds: Mapping[str, int],
        default: int,
        most: int,
        strings: Strings | None,
    ) -> None:
        self.data = data
        self.strings = strings
        self.bounds = bounds
        self.default = default
        self.left = most  # fields the walk may still read
        self.counts: dict[str, int] = {}
        # path -> field number -> (key, name, what it holds, sub-message, repeated, width,
        # the wire types it is read in)
        self._plans: dict[str, dict[int, tuple[str, str, int, Any, bool, int, tuple[int, ...]]]]
        self._plans = {}

    def varint(self, pos: int, end: int) -> tuple[int, int]:
        """A tag's or a length's varint: at most 5 bytes (more: a parser refuses it too)."""
        data = self.data
        value = shift = 0
        while pos < end and shift < 35:
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value, pos
            shift += 7
        raise DecodeError("a tag or a length runs past its message or 5 bytes")

    def count(self, key: str, shown: str, name: str, n: int) -> None:
        """Count `n` more of `key` (`shown` + `name`: as errors name it)."""
        total = self.counts[key] = self.counts.get(key, 0) + n
        bound = self.bounds.get(key, self.default)
        if total > bound:
            raise FieldError(f"{shown}{name}", f"more than {bound} elements in the request")

    def plan(self, descriptor: Descriptor, path: str) -> dict[int, tuple[Any, ...]]:
        plan = self._plans.get(path)
        if plan is None:
            plan = self._plans[path] = {}
            for number, field in descriptor.fields_by_number.items():
                kind = _MESSAGE if field.type == FieldDescriptor.TYPE_MESSAGE else _PACKED
                kind = _ONE if field.type in _DELIMITED else kind
                width = _FIXED.get(field.type, 0)
                sub = field.message_type
                natural = 2 if kind != _PACKED else {8: 1, 4: 5}.get(width, 0)
                # Another wire type the parser keeps as an unknown field (ownfixA, s41); a
                # repeated number may come packed.
                wires = (natural, 2) if field.is_repeated and kind == _PACKED else (natural,)
                plan[number] = (
                    f"{path}{field.name}",
                    field.name,
                    kind,
                    sub,
                    field.is_repeated,
                    width,
                    wires,
                )
        return plan

    def message(self, pos: int, end: int, descriptor: Descriptor, path: str, shown: str) -> None:
        plan, data = self.plan(descriptor, path), self.data
        seen: dict[int, int] = {}  # each message field's occurrences in this message so far
        while pos < end:
            self.left -= 1
            if self.left < 0:
                raise FieldError(shown.rstrip(".") or "request", "holds too many fields in all")
            if data[pos] < 0x80:  # one-byte varints: the common case, without a call
                tag, pos = data[pos], pos + 1
            else:
                tag, pos = self.varint(pos, end)
            number, wire = tag >> 3, tag & 7
            if wire == 0:  # its value: skipped in C
                skipped = _VARINT.match(data, pos, end)
                if skipped is None:
                    raise DecodeError("a value runs past its message or 10 bytes")
                pos = skipped.end()
            elif wire == 1 or wire == 5:
                pos += 8 if wire == 1 else 4
            elif wire == 2:
                if pos < end and data[pos] < 0x80:
                    length, pos = data[pos], pos + 1
                else:
                    length, pos = self.varint(pos, end)
                start, pos = pos, pos + length
            else:
                raise DecodeError(f"wire type {wire} (a group) in {shown or 'the message'}")
            if pos > end:
                raise DecodeError(f"{shown}field {number}: runs past the end of its message")
            known = plan.get(number)
            if known is None or wire not in known[6]:  # unknown: the parser keeps it whole;
                continue  # counted in `left` only
            key, name, kind, sub, repeated, width, _ = known
            if wire != 2 or kind == _ONE:
                self.count(key, shown, name, 1)
                if wire == 2 and self.strings is not None:
                    self.strings(key, f"{shown}{name}", pos - start)
            elif kind == _MESSAGE:
                index = seen[number] = seen.get(number, -1) + 1
                self.count(key, shown, name, 1)
                inner = f"{shown}{name}[{index}]." if repeated else f"{shown}{name}."
                if self.strings is not None and not repeated:
                    self.strings(key, f"{shown}{name}", None)
                self.message(start, pos, sub, f"{key}.", inner)
            elif width:
                self.count(key, shown, name, (pos - start) // width)
            else:  # packed varints: one at least per 10 bytes, refused before any copy
                floor = -(-(pos - start) // 10)
                if self.counts.get(key, 0) + floor > self.bounds.get(key, self.default):
                    self.count(key, shown, name, floor)
                self.count(key, shown, name, len(data[start:pos].translate(None, _HIGH)))
