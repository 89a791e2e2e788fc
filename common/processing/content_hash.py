"""Item and partition content hashes: the one function the processor and the encoder share.

A content hash is 32 bytes of SHA-256 over a domain tag, the processor settings'
fingerprint, the modality, the patch grid, the patch rows' dtype and shape, and the rows'
bytes (DESIGN §2), each field framed by its length (`framed`). The rows are the processor's
uint8 patch codes (`common.processing.image`; the fingerprint covers the mean and std that
map them to the tower's values, so the codes name those values exactly), or float32 values
as routers from before codes sent them: the dtype in the header keeps the two apart. An item
with partitions (a video's temporal patches) hashes its partitions' hashes instead of its
rows (`partitioned_content_hash`): its rows are then read once, for the partition hashes the
block keys and the encoder cache need anyway.

The router's processor computes it while preprocessing; the encoder worker computes it
again from the patch rows it is asked to encode and never trusts the caller's (DESIGN §7),
so both must derive it from the same settings: `processor_settings` reads them from a
checkpoint folder the way `Processor.from_pretrained` does.

Why SHA-256: hashing the rows is most of a video's preprocessing (a 64-frame 224² video's
values were 38 MB, its codes are 9.5), and OpenSSL runs SHA-256 on the CPU's SHA
instructions (x86 SHA-NI, on AMD since Zen and on Intel's servers since Ice Lake; ARMv8's
SHA-2 extension): 1.64 GB/s on the project's AMD EPYC, against 0.80 GB/s for hashlib's
BLAKE2b, which has no such instructions. A CPU without them hashes SHA-256 more slowly than
BLAKE2b (about 0.5 GB/s). Routers from before used BLAKE2b (`BLAKE2B_SCHEME`); the encoder
still checks a hash of theirs that way, so a rolling upgrade keeps encoding
(`encoder_worker.requests`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from common.models.qwen3_vl.config import Qwen3VLConfig
from common.models.qwen3_vl.preprocessor import ProcessorSettings
from common.models.qwen3_vl.processor_files import read_processor_settings
from common.multimodal.params import ItemPartition

# Patch rows: uint8 codes (what the processor makes) or float32 values (older routers').
Rows = npt.NDArray[np.uint8] | npt.NDArray[np.float32] | torch.Tensor


@dataclass(frozen=True, slots=True)
class HashScheme:
    """How content hashes are made: the hash function and the domain tags (bump a tag if
    the hashed layout changes)."""

    new: Callable[[], Any]  # a fresh 32-byte hasher
    item_tag: bytes  # of item and partition content hashes (`content_hash`)
    partitioned_tag: bytes  # of an item hashed as its partitions' hashes


SCHEME = HashScheme(hashlib.sha256, b"epd.qwen3vl.item.v2", b"epd.qwen3vl.item-of-partitions.v2")
# What routers from before SHA-256 content hashes send (checked, never made, by encoders).
BLAKE2B_SCHEME = HashScheme(
    functools.partial(hashlib.blake2b, digest_size=32),
    b"epd.qwen3vl.item.v1",
    b"epd.qwen3vl.item-of-partitions.v1",
)


def processor_settings(folder: str | Path, config: Qwen3VLConfig) -> ProcessorSettings:
    """The checkpoint's processor settings: its preprocessor, video preprocessor and
    processor files over defaults from its vision config
    (`common.models.qwen3_vl.processor_files`)."""
    return read_processor_settings(folder, config)


def settings_digest(settings: ProcessorSettings) -> str:
    """A short digest of the settings every content hash covers (`fingerprint`): what an
    encoder registers and the router compares with its own (`WorkerInfo.processor`)."""
    return hashlib.blake2b(settings.fingerprint(), digest_size=16).hexdigest()


@functools.lru_cache(maxsize=4096)  # a few grids and shapes recur; json costs more than hashing
def _header(modality: str, grid: tuple[int, ...], dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    return json.dumps(
        {"modality": modality, "grid_thw": list(grid), "dtype": str(dtype), "shape": list(shape)},
        sort_keys=True,
        separators=(",", ":"),
    ).encode()


def content_hash(
    fingerprint: bytes,
    modality: str,
    patches: Rows,
    grid: tuple[int, int, int],
    scheme: HashScheme = SCHEME,
) -> bytes:
    """32 bytes by `scheme` (SHA-256 unless an older router's is checked) over
    `fingerprint` (`ProcessorSettings.fingerprint()`), modality, grid, dtype, shape and the
    patch bytes: of uint8 codes or float32 values, array or CPU tensor (`_rows`), so the
    encoder's hash of what it received equals the processor's hash of what it sent."""
    rows = _rows(patches)
    h = _hasher(scheme, scheme.item_tag, fingerprint, modality, grid, rows)
    h.update(np.ascontiguousarray(rows).data)
    return h.digest()


def partitioned_content_hash(
    fingerprint: bytes,
    modality: str,
    patches: Rows,
    grid: tuple[int, int, int],
    partition_hashes: Sequence[bytes],
    scheme: HashScheme = SCHEME,
) -> bytes:
    """The content hash of an item with partitions: 32 bytes by `scheme` over its own domain
    tag, the same fingerprint, modality, grid, dtype and shape as `content_hash`, and the
    partitions' content hashes in order (`content_hash` of each one's rows). Each of those
    names its rows exactly, so this names the item's rows as exactly as hashing them all
    would, without a second pass over the bytes; the tag keeps it apart from any
    `content_hash`. Only `patches`' dtype and shape are read."""
    rows = _rows(patches)
    h = _hasher(scheme, scheme.partitioned_tag, fingerprint, modality, grid, rows)
    for part in partition_hashes:
        h.update(part)
    return h.digest()


def item_content_hash(
    fingerprint: bytes,
    modality: str,
    patches: Rows,
    grid: tuple[int, int, int],
    partitions: Sequence[ItemPartition],
) -> bytes:
    """An item's content hash: `partitioned_content_hash` of its `partitions` when it has
    any, else `content_hash` of its rows."""
    if partitions:
        hashes = [part.content_hash for part in partitions]
        return partitioned_content_hash(fingerprint, modality, patches, grid, hashes)
    return content_hash(fingerprint, modality, patches, grid)


def video_partitions(
    fingerprint: bytes,
    patches: Rows,
    grid: tuple[int, int, int],
    merge_size: int,
    known: Sequence[bytes] = (),
) -> tuple[ItemPartition, ...]:
    """A video's partitions: one per temporal patch (the tower attends within a frame only),
    each hashed from its rows unless its hash is `known` already (cached patches)."""
    t, h, w = grid
    step = h * w
    return tuple(
        ItemPartition(
            input_start=k * step,
            input_end=(k + 1) * step,
            output_rows=step // merge_size**2,
            content_hash=known[k]
            if known
            else content_hash(fingerprint, "video", patches[k * step : (k + 1) * step], (1, h, w)),
        )
        for k in range(t)
    )


def _rows(patches: Rows) -> npt.NDArray[np.uint8] | npt.NDArray[np.float32]:
    """The rows as a CPU array of their own dtype, uint8 (codes) or float32 (values): the
    dtype is hashed, so the two never collide, and any other is refused (ValueError)."""
    if isinstance(patches, torch.Tensor):
        if patches.dtype not in (torch.uint8, torch.float32):
            raise ValueError(f"patch rows are uint8 codes or float32 values, not {patches.dtype}")
        return patches.detach().cpu().numpy()  # contiguous or not: made so when hashed
    if patches.dtype not in (np.uint8, np.float32):
        raise ValueError(f"patch rows are uint8 codes or float32 values, not {patches.dtype}")
    return patches


def _hasher(
    scheme: HashScheme,
    tag: bytes,
    fingerprint: bytes,
    modality: str,
    grid: tuple[int, int, int],
    rows: npt.NDArray[np.uint8] | npt.NDArray[np.float32],
) -> Any:
    header = _header(str(modality), tuple(int(g) for g in grid), rows.dtype, rows.shape)
    return framed(scheme.new(), tag, fingerprint, header)


def framed(h: Any, *fields: bytes) -> Any:
    """`h` (a hashlib hasher) fed each field as its 8-byte little-endian length, then its
    bytes (so no two field lists feed the same bytes); the caller may update it with more."""
    for field in fields:
        h.update(len(field).to_bytes(8, "little"))
        h.update(field)
    return h
