"""Encoder outputs the router received inline, kept for an item seen again (router setting
`embedding_cache_mb`).

A repeated image whose KV the chosen prefill worker caches only in part still needs its
embedding: the blocks holding the image's last rows also hold the text after it, which
differs from request to request, so the worker computes those rows again. Without this
cache the router asks the encoder for it each time: the item's pixels go out (1.2 MB for a
224² image), the encoder parses and verifies them and answers from its own cache, and the
rows come back. With it, the rows the encoder gave for the same item last time go to the
prefill worker straight away.

What is kept: whole items only (not a span of a video's partitions), and only embeddings
whose every tensor came inline (a NIXL handle is a lease on the encoder's memory, not
bytes the router holds). The key is a digest of the item's content hash (which covers its
preprocessed content and the processing settings), the job's cache salt (a tenant's
entries are its own, as in the encoder cache) and the deployment's model identity (every
encoder serves it; a router that has not adopted one yet keeps nothing). Entries are the
encoder's own bytes, never mutated: a hit gives the prefill worker exactly what the
encoder would have answered. Bounded by bytes, least recently used first
(`common.byte_lru`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgpack

from common.byte_lru import ByteBudgetLru
from epd.v1 import multimodal_pb2, tensor_pb2

_SCHEME = "epd-router-embedding-key-v1"


@dataclass(frozen=True, slots=True)
class _Entry:
    rows: tensor_pb2.TensorRef  # inline
    deepstack: tuple[tensor_pb2.TensorRef, ...]  # inline, one per deepstack layer
    nbytes: int  # inline bytes held


class EmbeddingCache:
    """Whole-item inline encoder outputs by (content hash, cache salt, model identity)."""

    def __init__(self, budget_bytes: int, entry_bytes: int = 0) -> None:
        """`entry_bytes`: counted per kept output beside its bytes (`ByteBudgetLru`)."""
        self._lru: ByteBudgetLru[_Entry] = ByteBudgetLru(budget_bytes, entry_bytes)

    @property
    def hits(self) -> int:
        """Lookups that found an entry."""
        return self._lru.hits

    @property
    def bytes_used(self) -> int:
        """Inline bytes the kept outputs hold."""
        return self._lru.bytes_used

    @staticmethod
    def key(content_hash: bytes, cache_salt: str | None, model: str) -> bytes:
        """The entry key of an item (unambiguous: a digest of the three, packed)."""
        packed = msgpack.packb([_SCHEME, content_hash, cache_salt, model], use_bin_type=True)
        return hashlib.blake2b(packed, digest_size=32).digest()

    def get(self, key: bytes, item_index: int) -> multimodal_pb2.ItemEmbedding | None:
        """The kept embedding for `key`, as the embedding of item `item_index`, or None."""
        entry = self._lru.get(key)
        if entry is None:
            return None
        embedding = multimodal_pb2.ItemEmbedding(item_index=item_index, rows=entry.rows)
        embedding.deepstack.extend(entry.deepstack)
        return embedding

    def put(self, key: bytes, embedding: multimodal_pb2.ItemEmbedding) -> bool:
        """Keep a whole item's embedding if all of it is inline; whether it was kept."""
        refs = (embedding.rows, *embedding.deepstack)
        if embedding.HasField("partition_start") or any(
            ref.WhichOneof("data") != "inline_data" for ref in refs
        ):
            return False
        nbytes = sum(len(ref.inline_data) for ref in refs)
        entry = _Entry(_copy(embedding.rows), tuple(map(_copy, embedding.deepstack)), nbytes)
        return self._lru.put(key, entry)


def _copy(ref: tensor_pb2.TensorRef) -> tensor_pb2.TensorRef:
    out = tensor_pb2.TensorRef()
    out.CopyFrom(ref)
    return out
