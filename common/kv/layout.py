"""A worker's KV layout, what two workers compare before exchanging blocks, and its root hash.

`KvLayout` is the one in-process description of a worker's paged KV: the runner builds it
from its cache (`KvLayout.of`), the router decodes it from a registration
(`common.wire.kv.layout_from_proto`), and both compare layouts with `differences` only.
Router, prefill and decode workers all derive a worker's root hash with `layout_root`, so
equal models and layouts give equal block hashes, and different ones never share a block.
No protobuf here: the wire form converts in `common.wire.kv`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import msgpack
import torch

from common.kv.cache import KvCacheSpec
from common.kv.hashing import root_hash

# The `epd.v1.ElementType` numbers of the cache dtypes. A root hash packs this number, so it
# is part of the hashing contract: the enum numbers are frozen by `buf breaking`, and a test
# pins this table against the bindings.
ELEMENT_TYPES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
}


# KvLayout fields after `model` and `dtype`, in order, copied from the cache spec.
_FROM_SPEC = ("block_size", "num_layers", "num_kv_heads", "head_dim", "layout", "block_bytes")


@dataclass(frozen=True, slots=True)
class KvLayout:
    """A worker's paged KV shape; peers must agree on every field to exchange blocks."""

    model: str  # model identity (config + weight digest), chained into the root hash
    dtype: int  # wire ElementType number of the cache (see ELEMENT_TYPES)
    block_size: int  # tokens per block
    num_layers: int  # decoder layers
    num_kv_heads: int  # KV heads per layer
    head_dim: int  # head dimension
    layout: str  # byte layout name (`common.kv.cache.KV_LAYOUT`)
    block_bytes: int  # bytes per block (follows from the rest; compared, not hashed)

    @property
    def dtype_name(self) -> str:
        """The cache's dtype by name ("bfloat16"), as the dtype settings say it."""
        return dtype_name(self.dtype)

    @classmethod
    def of(cls, model: str, spec: KvCacheSpec) -> KvLayout:
        """The layout of a worker serving `model` with a cache shaped by `spec`."""
        try:
            dtype = ELEMENT_TYPES[spec.dtype]
        except KeyError:
            raise ValueError(f"KV cache dtype {spec.dtype} has no wire element type") from None
        return cls(model, dtype, *(getattr(spec, name) for name in _FROM_SPEC))

    def differences(self, other: KvLayout) -> list[str]:
        """'field=mine (expected theirs)' for every field that differs; [] when equal (the
        dtype by name)."""
        shown = {"dtype": dtype_name}
        return [
            f"{f.name}={shown.get(f.name, repr)(getattr(self, f.name))} "
            f"(expected {shown.get(f.name, repr)(getattr(other, f.name))})"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


def dtype_name(element_type: int) -> str:
    """The name of a wire ElementType number among `ELEMENT_TYPES` ("bfloat16")."""
    for dtype, number in ELEMENT_TYPES.items():
        if number == element_type:
            return str(dtype).removeprefix("torch.")
    return f"element type {element_type}"


def layout_root(layout: KvLayout) -> bytes:
    """Root block hash of a worker's `KvLayout`: its model identity plus every field that
    decides the bytes of a block (not `block_bytes`, which follows from them).

    Router, prefill and decode all derive the root this way, so equal layouts give equal
    hashes and different models or layouts never share a block. The bytes are a wire
    contract between versions (pinned by a golden test).
    """
    key = msgpack.packb(
        [
            layout.layout,
            int(layout.dtype),
            layout.block_size,
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
        ],
        use_bin_type=True,
    )
    return root_hash(layout.model, key.hex())
