"""Paged KV cache: the block-major buffer (`cache`) and the block pool (`block_pool`)."""

from common.kv.block_pool import BlockPool, KvEvent, KvEventKind, NoFreeBlocksError
from common.kv.cache import KV_LAYOUT, KvCacheSpec, PagedKvCache, slot_ids

__all__ = [
    "KV_LAYOUT",
    "BlockPool",
    "KvCacheSpec",
    "KvEvent",
    "KvEventKind",
    "NoFreeBlocksError",
    "PagedKvCache",
    "slot_ids",
]
