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
further: its cost is bounded, whatever the message's size. Unknown fields count under
`#<number>` and are not descended into; groups (wire types 3 and 4, unused by proto3) and a
length past the end are `DecodeError`s, as the parser would find them.
"""

from __future__ import annotations

from collections.abc import Mapping

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
    data: bytes, descriptor: Descriptor, bounds: Mapping[str, int], default: int, most: int
) -> dict[str, int]:
    """Refuse `data`, a serialized `descriptor` message, with `FieldError` when a field path
    (`messages.content`: dotted names, no indexes; the error names the element, as
    `messages[3].content`) occurs more often than `bounds` says for it, or `default` times
    for one it does not name, or when the message holds more than `most` fields in all (a
    packed field's elements not counted there: they cost no walking); occurrences are
    counted over the whole message, sub-messages' summed. `DecodeError` when the bytes are
    not protobuf wire format. Returns the counts, by path."""
    walk = _Walk(memoryview(data), bounds, default, most)
    walk.message(0, len(data), descriptor, "", "")
    return walk.counts


class _Walk:
    def __init__(
        self, data: memoryview, bounds: Mapping[str, int], default: int, most: int
    ) -> None:
        self.data = data
        self.bounds = bounds
        self.default = default
        self.left = most  # fields the walk may still read
        self.counts: dict[str, int] = {}

    def varint(self, pos: int, end: int) -> tuple[int, int]:
        data = self.data
        value = shift = 0
        while pos < end and shift < 64:
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value, pos
            shift += 7
        raise DecodeError("a varint runs past its message or 10 bytes")

    def count(self, path: str, shown: str, n: int) -> None:
        """Count `n` more of `path` (`shown`: as errors name it)."""
        total = self.counts[path] = self.counts.get(path, 0) + n
        bound = self.bounds.get(path, self.default)
        if total > bound:
            raise FieldError(shown, f"more than {bound} elements in the request")

    def message(self, pos: int, end: int, descriptor: Descriptor, path: str, shown: str) -> None:
        fields = descriptor.fields_by_number
        seen: dict[int, int] = {}  # each field's occurrences in this message so far
        while pos < end:
            self.left -= 1
            if self.left < 0:
                raise FieldError(shown.rstrip(".") or "request", "holds too many fields in all")
            tag, pos = self.varint(pos, end)
            number, wire = tag >> 3, tag & 7
            field = fields.get(number)
            name = field.name if field is not None else f"#{number}"
            key, index = f"{path}{name}", seen.get(number, 0)
            seen[number] = index + 1
            if wire == 0:
                _, pos = self.varint(pos, end)
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            elif wire == 2:
                length, pos = self.varint(pos, end)
                start, pos = pos, pos + length
                nested = pos <= end and field is not None
                if nested and self._nested(field, start, pos, key, shown, index):
                    continue
            else:
                raise DecodeError(f"wire type {wire} (a group) in {shown or 'the message'}")
            if pos > end:
                raise DecodeError(f"{shown}{name}: runs past the end of its message")
            self.count(key, f"{shown}{name}", 1)

    def _nested(
        self, field: FieldDescriptor, start: int, end: int, key: str, shown: str, index: int
    ) -> bool:
        """Count a length-delimited `field` that holds elements of its own (a sub-message,
        walked, the `index`th of its field in its message; a packed scalar field) and True,
        else False (a string or bytes: one element)."""
        named = f"{shown}{field.name}"
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            self.count(key, named, 1)
            inner = f"{named}[{index}]." if field.is_repeated else f"{named}."
            self.message(start, end, field.message_type, f"{key}.", inner)
            return True
        if field.type in _DELIMITED:
            return False
        width = _FIXED.get(field.type)
        chunk = self.data[start:end]
        n = len(chunk) // width if width else len(bytes(chunk).translate(None, _HIGH))
        self.count(key, named, n)
        return True
