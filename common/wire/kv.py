"""KV layouts and KV events between their in-process types and the `epd.v1.kv` messages.

The runtime (`common.kv`, `common.models`) holds only `common.kv.layout.KvLayout` and
`common.kv.events.NumberedKvEvent`; registration, handles and `StreamKvEvents` convert here.
"""

from __future__ import annotations

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
    """The wire form of a layout."""
    return kv_pb2.KvLayout(
        model=layout.model,
        dtype=layout.dtype,  # type: ignore[arg-type]  # ElementType is an int on the wire
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        layout=layout.layout,
        block_bytes=layout.block_bytes,
    )


def layout_from_proto(msg: kv_pb2.KvLayout) -> KvLayout:
    """Decode the wire form (no validation: `KvLayout.differences` does the checking)."""
    return KvLayout(
        model=msg.model,
        dtype=int(msg.dtype),
        block_size=msg.block_size,
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        layout=msg.layout,
        block_bytes=msg.block_bytes,
    )


def kv_event_to_proto(event: NumberedKvEvent) -> kv_pb2.KvEvent:
    """The wire form of a numbered prefix-cache change."""
    return kv_pb2.KvEvent(
        kind=_KINDS[event.event.kind],
        block_hashes=list(event.event.block_hashes),
        sequence=event.sequence,
    )
