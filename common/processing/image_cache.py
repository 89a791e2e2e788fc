"""The processed-image cache: an encoded image's bytes -> its patch codes, grid and hash.

A served image that repeats (the same PNG or JPEG sent again) would otherwise be decoded,
resized, patchified and content-hashed again on every request, although the
result is a pure function of the encoded bytes and the processor settings. The cache keys
that result by `image_key`: 32 bytes of SHA-256 over a domain tag, the settings'
fingerprint (`ProcessorSettings.fingerprint()`: patch, merge and temporal sizes, min/max
pixels, mean/std, ...) and the encoded bytes, so a hit is exact: same bytes under the same
settings give the same patch codes, bit for bit, and the same content hash (DESIGN §2). It
never keys by the content hash a caller claims, nor by anything cheaper than a
cryptographic digest of every byte. The router adds the request's cache salt (derived from
the tenant) to the key, so one tenant cannot learn from a faster answer that another sent
the same image (DESIGN §7), as the encoder and KV caches are salted.

A request's processing stores what it made through a `StagedImages`, kept only once the
router answers it: a request refused after its media were processed (past the context,
needing more KV blocks than a worker has, text spelling placeholder tokens, frames of
different sizes) leaves the cache as it was (bad input changes no cache).

The same cache holds a video's processed temporal patches (`common.processing.video_cache`,
keys of their own domain tag over the frames' image keys), one budget for both.

Bounded: least recently used entries are dropped once the patch rows held exceed
`budget_bytes` (an entry larger than the budget is not stored; 0 stores nothing). Entries
are never mutated after `put`; readers share their arrays and must not write to them.
Thread-safe: the router prepares requests on worker threads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from common.byte_lru import ByteBudgetLru
from common.processing.content_hash import framed

# Domain tag of the cache key; bump it if the keyed layout changes.
_KEY_TAG = b"epd.processed-image.v2"


@dataclass(frozen=True, slots=True, eq=False)
class ProcessedImage:
    """What preprocessing one encoded image gives: shared, read only."""

    patches: npt.NDArray[np.uint8]  # (grid_h * grid_w, patch_dim) patch codes
    grid: tuple[int, int, int]  # (1, grid_h, grid_w)
    content_hash: bytes  # `common.processing.content_hash` of the codes, as the processor's
    # What holds the codes' memory when they are a view of it (a video's rows, which its
    # temporal patches share): the cache counts it once (`common.byte_lru`). None: `patches`.
    owner: npt.NDArray[np.uint8] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held by the patch codes (the cache's budget unit)."""
        return int(self.patches.nbytes)


def image_key(fingerprint: bytes, data: bytes, salt: str | None = None) -> bytes:
    """The cache key of encoded image `data` under processor settings `fingerprint`, for
    the tenant whose cache salt is `salt` (None: none)."""
    salted = b"" if salt is None else b"\x01" + salt.encode()
    h = framed(hashlib.sha256(), _KEY_TAG, fingerprint, salted)
    h.update(data)
    return h.digest()


class ProcessedImageCache(ByteBudgetLru[ProcessedImage]):
    """LRU map `image_key` -> `ProcessedImage` under a byte budget of patch rows
    (`common.byte_lru.ByteBudgetLru`; see the module docstring)."""


class ImageStore(Protocol):
    """Where processing looks up and stores processed images: the cache, or one request's
    `StagedImages` over it."""

    def __contains__(self, key: bytes) -> bool: ...

    def get(self, key: bytes) -> ProcessedImage | None: ...

    def put(self, key: bytes, entry: ProcessedImage) -> bool: ...


class StagedImages:
    """One request's view of `cache`: it reads the cache and what the request made itself;
    what it made enters the cache at `keep` (once the request is answered), never if the
    request is refused. Used by one request at a time."""

    def __init__(self, cache: ProcessedImageCache) -> None:
        self.cache = cache
        self._made: dict[bytes, ProcessedImage] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._made or key in self.cache

    def get(self, key: bytes) -> ProcessedImage | None:
        made = self._made.get(key)
        return made if made is not None else self.cache.get(key)

    def put(self, key: bytes, entry: ProcessedImage) -> bool:
        self._made[key] = entry
        return True

    def keep(self) -> None:
        """Store what the request made in the cache (no-op once done)."""
        for key, entry in self._made.items():
            self.cache.put(key, entry)
        self._made.clear()
