"""EncodeRequest → validated work: which cache keys each item needs, with their inputs.

`parse_request` checks every item against the vision config before anything else happens,
so a malformed request is refused whole (MultimodalLayoutError naming the field and item →
INVALID_ARGUMENT) and touches no cache. An item becomes one or more `Unit`s, the granule of
caching and encoding:

- an item without partitions is one unit keyed by its content hash;
- an item with partitions is one unit per requested partition (all of them when
  `partition_indices` is empty), keyed by the partition's hash.

`pixel_values` holds either the whole item's patch rows (`t*h*w` rows) or only the
requested partitions' rows, concatenated in order: uint8 patch codes, as the processor
makes them (`common.processing.image`; the engine maps a batch's codes to the tower's
values once, for the units it encodes), or float32 values, as routers from before codes
sent them. Either is hashed as it came (the dtype is in the hash), and a unit keeps it so.

No hash a caller sends is trusted (DESIGN §7): every cache key is computed here from the
patch rows it names (`common.processing.content_hash`, the processor's own function, so the
router's block hashes agree), and a request whose claimed hash differs from the computed one
is refused (INVALID_ARGUMENT naming `content_hash` or `partitions[k].content_hash`), never
corrected: a mismatch means a caller that is broken or lying, and answering it anyway would
hand it rows under a key it did not compute. An item's own hash is checked whenever its
whole patch rows are sent (for an item with partitions: as the hash of its partitions'
checked hashes, `partitioned_content_hash`, or over all its rows as a router from before
that names it); when only some partitions' rows are sent it cannot be, and then it is only
echoed in the response: the cache is keyed by the partitions' (checked) hashes. A hash that
is not the current scheme's (SHA-256) is checked as a router from before made it
(`BLAKE2B_SCHEME`, float32 values only), so a rolling upgrade keeps encoding; it keys the
cache as it is, and the two schemes' tags keep their hashes apart.

With `cache_salt` set (the router sets it from the authenticated tenant), every unit's key
is `salted_key(hash, salt)`: two tenants' identical images never share a cache entry, so
neither can learn from a hit what the other sent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from dataclasses import dataclass

import torch

from common.models.qwen3_vl.config import VisionConfig
from common.multimodal.params import Modality
from common.multimodal.validation import HASH_BYTES, MultimodalLayoutError
from common.processing.content_hash import (
    BLAKE2B_SCHEME,
    SCHEME,
    HashScheme,
    content_hash,
    partitioned_content_hash,
)
from common.wire.convert import tensor_from_ref
from epd.v1 import encoder_service_pb2, multimodal_pb2


@dataclass(frozen=True, slots=True)
class Unit:
    """One cache key's worth of encoder input."""

    key: bytes  # 32-byte content hash of `pixels` (computed here): the item's or partition's
    pixels: torch.Tensor  # (t*h*w, patch_dim) patch rows of this unit: uint8 codes or float32
    grid: tuple[int, int, int]  # (t, h, w) patch grid of this unit
    per_frame: bool  # encode frame by frame (bit-exact partition rows)
    output_rows: int  # embedding rows the unit makes
    input_rows: int = dataclasses.field(init=False)  # patch rows it consumes (pixels rows)

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_rows", int(self.pixels.shape[0]))


@dataclass(frozen=True, slots=True)
class ItemJob:
    """One requested item: the units whose rows, concatenated in order, are its output."""

    content_hash: bytes  # the item's hash (checked unless only partitions were sent), echoed
    partition_indices: tuple[int, ...]  # as requested, echoed in the response
    units: tuple[Unit, ...]  # in output order


_MODALITIES = {
    multimodal_pb2.MODALITY_IMAGE: Modality.IMAGE,
    multimodal_pb2.MODALITY_VIDEO: Modality.VIDEO,
}


def parse_request(
    request: encoder_service_pb2.EncodeRequest,
    vision: VisionConfig,
    fingerprint: bytes,
    *,
    exact_partitions: bool = True,
) -> list[ItemJob]:
    """Validate `request` and split it into jobs; MultimodalLayoutError on the first problem.

    `fingerprint` is the checkpoint's `ProcessorSettings.fingerprint()`, which every content
    hash covers."""
    if not request.items:
        raise MultimodalLayoutError("items", "no items to encode")
    jobs = [
        _parse_item(i, item, vision, fingerprint, exact_partitions)
        for i, item in enumerate(request.items)
    ]
    if not request.HasField("cache_salt"):
        return jobs
    salt = request.cache_salt
    return [
        dataclasses.replace(
            job,
            units=tuple(dataclasses.replace(u, key=salted_key(u.key, salt)) for u in job.units),
        )
        for job in jobs
    ]


def salted_key(key: bytes, salt: str) -> bytes:
    """The 32-byte cache key of content hash `key` under a tenant's `salt`."""
    return hashlib.sha256(b"epd-encoder-salt-v1\x00" + salt.encode() + b"\x00" + key).digest()


def _check_hash(value: bytes, field: str, item: int) -> None:
    if len(value) != HASH_BYTES:
        raise MultimodalLayoutError(field, f"expected {HASH_BYTES} bytes, got {len(value)}", item)


def _verify(
    fingerprint: bytes,
    modality: Modality,
    pixels: torch.Tensor,
    grid: tuple[int, int, int],
    claimed: bytes,
    field: str,
    item: int,
) -> tuple[bytes, HashScheme]:
    """The content hash of `pixels` and its scheme: the current one's, or an older
    router's where that is what `claimed` is; refuses a `claimed` one that neither gives."""
    schemes = (SCHEME,) if pixels.dtype == torch.uint8 else (SCHEME, BLAKE2B_SCHEME)
    for scheme in schemes:
        computed = content_hash(fingerprint, str(modality), pixels, grid, scheme)
        if computed == claimed:
            return computed, scheme
    raise MultimodalLayoutError(
        field, "does not match the content hash computed from pixel_values", item
    )


def _parse_item(
    i: int,
    item: encoder_service_pb2.EncodeItem,
    vision: VisionConfig,
    fingerprint: bytes,
    exact: bool,
) -> ItemJob:
    _check_hash(item.content_hash, "content_hash", i)
    if item.modality == multimodal_pb2.MODALITY_AUDIO:
        raise MultimodalLayoutError("modality", "audio is not supported by this encoder", i)
    modality = _MODALITIES.get(item.modality)
    if modality is None:
        raise MultimodalLayoutError("modality", f"unknown modality {item.modality}", i)
    if len(item.grid_thw) != 3:
        raise MultimodalLayoutError("grid_thw", f"expected 3 values, got {len(item.grid_thw)}", i)
    if item.partitions and modality is not Modality.VIDEO:  # its key would be the whole's
        raise MultimodalLayoutError("partitions", f"only a video's are; this is {modality}", i)
    t, h, w = (int(v) for v in item.grid_thw)
    merge = vision.spatial_merge_size
    if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
        raise MultimodalLayoutError(
            "grid_thw", f"{(t, h, w)}: need t, h, w >= 1 and h, w multiples of {merge}", i
        )
    frame = h * w
    total = t * frame
    spans = _partition_spans(i, item, total, frame, vision.merge_unit)
    indices = tuple(int(p) for p in item.partition_indices)
    chosen = _chosen_partitions(i, indices, max(len(spans), 1))

    pixels = _pixels(i, item, vision, total, spans, chosen)
    whole = pixels.shape[0] == total
    item_hash = bytes(item.content_hash)  # checked below when it can be
    if not spans:
        item_hash, _ = _verify(
            fingerprint, modality, pixels, (t, h, w), item_hash, "content_hash", i
        )
        # A video's key is also that of one partition of the same rows (of its one temporal
        # patch, or any caller's partition spanning them all): it is encoded as partitions
        # are, or the cache would hand one the other's rows (their last bits may differ).
        per_frame = exact and modality is Modality.VIDEO
        unit = Unit(item_hash, pixels, (t, h, w), per_frame, total // vision.merge_unit)
        return ItemJob(item_hash, indices, (unit,))
    # Partition p's rows, checked against its claimed hash; with the whole item's rows every
    # partition is, and the item's hash is that of their hashes.
    given = range(len(spans)) if whole else chosen
    rows_of: dict[int, torch.Tensor] = {}
    offset = 0
    for p in given:
        start, end = spans[p][0], spans[p][1]
        rows_of[p] = pixels[start:end] if whole else pixels[offset : offset + end - start]
        offset += end - start
    checked = {
        p: _verify(
            fingerprint,
            modality,
            rows,
            ((rows.shape[0]) // frame, h, w),
            spans[p][3],
            f"partitions[{p}].content_hash",
            i,
        )
        for p, rows in rows_of.items()
    }
    keys = {p: key for p, (key, _) in checked.items()}
    if whole:
        derived = partitioned_content_hash(
            fingerprint,
            str(modality),
            pixels,
            (t, h, w),
            [keys[p] for p in range(len(spans))],
            checked[0][1],  # the scheme its first partition's hash was made by
        )
        # A router from before partition-hashed items names the item by all its rows:
        # as exact, so it is checked that way rather than refused (a rolling upgrade).
        if derived != item_hash:
            _verify(fingerprint, modality, pixels, (t, h, w), item_hash, "content_hash", i)
    units = []
    for p in chosen:
        rows = rows_of[p]
        grid = (rows.shape[0] // frame, h, w)
        units.append(Unit(keys[p], rows, grid, exact, spans[p][2]))
    return ItemJob(item_hash, indices, tuple(units))


def _partition_spans(
    i: int, item: encoder_service_pb2.EncodeItem, total: int, frame: int, merge_unit: int
) -> list[tuple[int, int, int, bytes]]:
    """(input_start, input_end, output_rows, hash) per partition, checked to tile the item
    in whole temporal patches."""
    spans = []
    expected_start = 0
    for k, part in enumerate(item.partitions):
        field = f"partitions[{k}]"
        _check_hash(part.content_hash, f"{field}.content_hash", i)
        start, end = int(part.input_start), int(part.input_end)
        if start != expected_start:
            raise MultimodalLayoutError(
                f"{field}.input_start", f"is {start}, expected {expected_start} (no gaps)", i
            )
        if end <= start or (end - start) % frame:
            raise MultimodalLayoutError(
                f"{field}.input_end",
                f"is {end}: a partition holds a positive number of whole temporal patches "
                f"of {frame} rows",
                i,
            )
        if part.output_rows != (end - start) // merge_unit:
            raise MultimodalLayoutError(
                f"{field}.output_rows",
                f"is {part.output_rows}, its input makes {(end - start) // merge_unit}",
                i,
            )
        spans.append((start, end, int(part.output_rows), bytes(part.content_hash)))
        expected_start = end
    if spans and expected_start != total:
        raise MultimodalLayoutError(
            "partitions", f"cover {expected_start} input rows, the grid has {total}", i
        )
    return spans


def _chosen_partitions(i: int, indices: tuple[int, ...], count: int) -> list[int]:
    if not indices:
        return list(range(count))
    for a, b in itertools.pairwise(indices):
        if b <= a:
            raise MultimodalLayoutError("partition_indices", "must be strictly increasing", i)
    if indices[-1] >= count:
        raise MultimodalLayoutError(
            "partition_indices", f"index {indices[-1]} but the item has {count} partition(s)", i
        )
    return list(indices)


def _pixels(
    i: int,
    item: encoder_service_pb2.EncodeItem,
    vision: VisionConfig,
    total: int,
    spans: list[tuple[int, int, int, bytes]],
    chosen: list[int],
) -> torch.Tensor:
    ref = item.pixel_values
    if ref.WhichOneof("data") is None:
        raise MultimodalLayoutError("pixel_values", "missing", i)
    if ref.WhichOneof("data") != "inline_data":
        raise MultimodalLayoutError("pixel_values", "must be inline (no transfer handles)", i)
    if len(ref.shape) != 2:  # checked before the tensor is made (a shape of millions)
        raise MultimodalLayoutError("pixel_values", f"{len(ref.shape)} dimensions, not 2", i)
    try:
        pixels = tensor_from_ref(ref, "pixel_values")
    except MultimodalLayoutError as exc:
        raise MultimodalLayoutError(
            "pixel_values", str(exc).removeprefix("pixel_values: "), i
        ) from None
    if pixels.dtype not in (torch.uint8, torch.float32):
        raise MultimodalLayoutError(
            "pixel_values", f"dtype {pixels.dtype}: uint8 patch codes or float32 values", i
        )
    subset = sum(spans[p][1] - spans[p][0] for p in chosen) if spans else total
    if (
        pixels.ndim != 2
        or pixels.shape[1] != vision.patch_dim
        or pixels.shape[0]
        not in (
            total,
            subset,
        )
    ):
        allowed = f"({total}, {vision.patch_dim})"
        if subset != total:
            allowed += f" or ({subset}, {vision.patch_dim}) for the requested partitions"
        raise MultimodalLayoutError(
            "pixel_values", f"shape {tuple(pixels.shape)}, expected {allowed}", i
        )
    if pixels.dtype == torch.float32 and not bool(torch.isfinite(pixels).all()):
        raise MultimodalLayoutError("pixel_values", "holds NaN or infinite values", i)
    return pixels
