"""KV layouts and KV events between their in-process types and the `epd.v1.kv` messages.

The runtime (`common.kv`, `common.models`) holds only `common.kv.layout.KvLayout` and
`common.kv.events.NumberedKvEvent`; registration, handles and `StreamKvEvents` convert here.
"""

from __future__ import annotations

from dataclasses import fields

from common.kv.block_pool import KvEventKind
from common.kv.events import NumberedKvEvent
from common.kv.layout import KvLayout
from epd.v1 import kv_pb2

_KINDS: dict[KvEventKind, kv_pb2.KvEventKind] = {
    "stored": kv_pb2.KV_EVENT_KIND_STORED,
    "removed": kv_pb2.KV_EVENT_KIND_REMOVED,
    "cleared": kv_pb2.KV_EVENT_KIND_CLEARED,
}


def layout_to_proto(layout: KvLayout) -> kv_pb2.KvLayout:
    """The wire form of a layout (the message has exactly the dataclass's fields)."""
    return kv_pb2.KvLayout(**{f.name: getattr(layout, f.name) for f in fields(KvLayout)})


def layout_from_proto(msg: kv_pb2.KvLayout) -> KvLayout:
    """Decode the wire form (no validation: `KvLayout.differences` does the checking)."""
    values = {f.name: getattr(msg, f.name) for f in fields(KvLayout)}
    values["dtype"] = int(values["dtype"])  # an ElementType enum value on the wire
    return KvLayout(**values)


def kv_event_to_proto(event: NumberedKvEvent) -> kv_pb2.KvEvent:
    """The wire form of a numbered prefix-cache change."""
    return kv_pb2.KvEvent(
        kind=_KINDS[event.event.kind],
        block_hashes=list(event.event.block_hashes),
        sequence=event.sequence,
    )
