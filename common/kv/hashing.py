"""Canonical KV block hashing: the one module router, prefill and decode all call.

A prompt is cut into blocks of `block_size` tokens; each *full* block gets a 32-byte
SHA-256 digest chained from its parent's. The key of a block is its parent hash, its token
ids, the multimodal extra keys of the runs that overlap it, the cache salt (first block
only) and the LoRA id. The byte layout is fixed (msgpack, see docs/block-hash.md) so any
process, machine or language computes the same hashes.

Extra keys come from the exact runs (DESIGN §3): for every run of every item that overlaps
a block `[s, e)`, the key is `(item hash, item-local row offset, uuid)` where the offset is
the rows the item placed in earlier runs plus `max(s, run_start) - run_start`. An item whose
processor set `partition_keys` (its partitions' encoder outputs and placement are
independent, so shared leading frames of two videos give the same KV) gets instead one key
per partition its overlapping rows touch: `(partition hash, partition-local row offset,
uuid)`. Those formulas live in `keys_by_span` alone: `block_hashes` calls it for the full
blocks, and `block_extra_keys` for one span. Text between runs is hashed as text, and a
layout that does not fit the prompt raises instead of silently hashing placeholders as text.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np
import numpy.typing as npt

from common.multimodal.params import MultimodalParams
from common.multimodal.validation import INT32_MAX

BLOCK_HASH_SCHEME = "epd-block-hash-v1"
PROMPT_DIGEST_SCHEME = "epd-prompt-digest-v1"


class MmKey(NamedTuple):
    """Extra key of one run's overlap with one block (with partition keys: with one
    partition of the item)."""

    content_hash: bytes  # the item's 32-byte content hash, or the partition's
    offset: int  # item-local (partition-local) row of the first overlapping placeholder
    uuid: str | None  # caller-supplied item identity


def root_hash(model_identity: str = "", kv_layout: str = "") -> bytes:
    """Parent of a prompt's first block: separates models and KV layouts."""
    return hashlib.sha256(
        msgpack.packb([BLOCK_HASH_SCHEME, model_identity, kv_layout], use_bin_type=True)
    ).digest()


DEFAULT_ROOT = root_hash()


def block_extra_keys(params: MultimodalParams | None, start: int, end: int) -> list[MmKey]:
    """Extra keys of the block `[start, end)`, in prompt order of items and runs."""
    if params is None or not params.items:
        return []
    return keys_by_span(params, np.array([start]), np.array([end])).get(0, [])


def block_hashes(
    token_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
    block_size: int,
    params: MultimodalParams | None = None,
    *,
    cache_salt: str | None = None,
    lora_id: str | int | None = None,
    root: bytes = DEFAULT_ROOT,
) -> list[bytes]:
    """One 32-byte hash per full block of `token_ids`; the partial last block gets none.

    Raises `ValueError` when a token id is outside int32, `block_size` < 1, or a run of
    `params` does not fit the prompt (placeholders are never hashed as plain text).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    tokens = _token_bytes(token_ids)
    num_tokens = len(tokens) // 4
    num_full = num_tokens // block_size
    keys: dict[int, list[MmKey]] = {}
    if params is not None and params.items:
        params.check_fits(num_tokens)
        block_starts = np.arange(num_full, dtype=np.int64) * block_size
        keys = keys_by_span(params, block_starts, block_starts + block_size)
    stride = 4 * block_size
    # The msgpack of [parent, tokens, keys, salt, lora] is assembled from pre-packed parts:
    # byte-for-byte what msgpack.packb of that list gives, without packing per block. What
    # follows the parent in a block without keys is cut for every block from one array.
    pack = msgpack.Packer(use_bin_type=True).pack
    head = b"\x95" + pack(bytes(32))[:-32]  # fixarray(5), bin header of the parent
    token_head = pack(bytes(stride))[:-stride]  # bin header of the token bytes
    later = pack(None) + pack(lora_id)  # no salt past the first block, the LoRA id
    rests = _rests(tokens, num_full, stride, token_head, pack([]) + later)
    for b, block_keys in keys.items():
        rests[b] = token_head + tokens[b * stride : (b + 1) * stride] + pack(block_keys) + later
    if num_full:
        rest = token_head + tokens[:stride] + pack(keys.get(0, []))
        rests[0] = rest + pack(cache_salt) + pack(lora_id)
    sha256 = hashlib.sha256
    out: list[bytes] = []
    parent = root
    for rest in rests:
        parent = sha256(head + parent + rest).digest()
        out.append(parent)
    return out


def _rests(tokens: bytes, blocks: int, stride: int, lead: bytes, tail: bytes) -> list[bytes]:
    """`lead + the block's token bytes + tail` for each of `blocks` blocks."""
    width = len(lead) + stride + len(tail)
    rows = np.empty((blocks, width), dtype=np.uint8)
    rows[:, : len(lead)] = np.frombuffer(lead, dtype=np.uint8)
    cut = np.frombuffer(tokens, dtype=np.uint8, count=blocks * stride)
    rows[:, len(lead) : len(lead) + stride] = cut.reshape(blocks, stride)
    rows[:, len(lead) + stride :] = np.frombuffer(tail, dtype=np.uint8)
    data = rows.tobytes()
    return [data[o : o + width] for o in range(0, len(data), width)]


def prompt_digest(
    token_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
    params: MultimodalParams | None = None,
    *,
    cache_salt: str | None = None,
    lora_id: str | int | None = None,
    root: bytes = DEFAULT_ROOT,
) -> bytes:
    """SHA-256 of a whole prompt: every token (the partial last block's too), every item's
    layout (modality, content hash, runs, uuid, mRoPE grid, frame times), the mRoPE delta,
    cache salt and LoRA id, under `root`. Two prompts whose KV can differ never share it;
    a KV handle carries it so the reader checks the handle was made for its prompt."""
    items = [] if params is None else params.items
    layout = [
        [
            None if it.modality is None else str(it.modality),
            it.content_hash,
            [list(run) for run in it.runs],
            it.uuid,
            None if it.grid_thw is None else list(it.grid_thw),
            list(it.frame_timestamps),
        ]
        for it in items
    ]
    delta = None if params is None else params.mrope_position_delta
    body = [PROMPT_DIGEST_SCHEME, root, _token_bytes(token_ids), layout, delta]
    return hashlib.sha256(msgpack.packb([*body, cache_salt, lora_id], use_bin_type=True)).digest()


def _token_bytes(token_ids: Sequence[int] | npt.NDArray[np.integer[Any]]) -> bytes:
    """Token ids as little-endian int32 bytes, rejecting values outside int32."""
    if isinstance(token_ids, list):
        try:  # a list of ints (what processors give): struct packs and range-checks in C
            return struct.pack(f"<{len(token_ids)}i", *token_ids)
        except struct.error:
            pass  # not all int32: numpy below names what is wrong
    arr = np.asarray(token_ids)
    if arr.size == 0:
        return b""
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be a 1-D integer sequence, got {arr.dtype} {arr.shape}")
    if arr.dtype != np.int32 and (arr.min() < -INT32_MAX - 1 or arr.max() > INT32_MAX):
        raise ValueError("token ids must fit in int32")
    return arr.astype("<i4", copy=False).tobytes()


def keys_by_span(
    params: MultimodalParams, starts: npt.NDArray[np.int64], ends: npt.NDArray[np.int64]
) -> dict[int, list[MmKey]]:
    """Extra keys of every span `[starts[i], ends[i])` that overlaps a run, by span index.

    A span's keys are, in prompt order, one `(item hash, offset, uuid)` per run
    `[rs, rs + len)` with `rs < end` and `rs + len > start`, where offset is the rows the
    item placed in its earlier runs plus `max(start, rs) - rs`. For an item with
    `partition_keys`, the run's overlapping item rows `[r0, r1)` give instead one
    `(partition hash, max(r0, p0) - p0, uuid)` per partition `[p0, p1)` of item rows with
    `p0 < r1` and `p1 > r0`, in partition order. A span that overlaps no run (gap text
    only) is absent. `starts` must be ascending, as blocks are.

    Computed on arrays: an item without partition keys is one "unit" of rows `[0, inf)`
    keyed by the item, an item with them one unit per partition; every item's units are
    laid out on one row axis (item after item), so the units a (span, run) pair touches
    are a `searchsorted` range there.
    """
    run_starts = params.run_positions
    run_ends = run_starts + params.run_lengths
    lo = np.searchsorted(run_ends, starts, side="right")
    hi = np.searchsorted(run_starts, ends, side="left")
    counts = np.maximum(hi - lo, 0)
    span, run = _expand(lo, counts)  # one entry per (span, overlapping run) pair
    if not len(span):
        return {}
    item = params.run_items[run]
    row0 = params.run_row_offsets[run] - run_starts[run]  # item row = prompt index + row0
    r0 = row0 + np.maximum(starts[span], run_starts[run])
    r1 = row0 + np.minimum(ends[span], run_ends[run])
    base, unit_start, unit_hash = _units(params)
    g0, g1 = base[item] + r0, base[item] + r1
    first = np.searchsorted(unit_start, g0, side="right") - 1
    pair, unit = _expand(first, np.searchsorted(unit_start, g1, side="left") - first)
    offsets = (np.maximum(g0[pair], unit_start[unit]) - unit_start[unit]).tolist()
    uuids = [it.uuid for it in params.items]
    keys: dict[int, list[MmKey]] = {}
    spans, items = span[pair].tolist(), item[pair].tolist()
    for s, u, o, i in zip(spans, unit.tolist(), offsets, items, strict=True):
        key = MmKey(unit_hash[u], o, uuids[i])
        found = keys.get(s)
        if found is None:
            keys[s] = [key]
        else:
            found.append(key)
    return keys


def _expand(
    first: npt.NDArray[np.int64], counts: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """`(i, first[i] + j)` for every `i` and `0 <= j < counts[i]`, in that order."""
    owner = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    cumulative = np.cumsum(counts) - counts
    return owner, first[owner] + np.arange(len(owner), dtype=np.int64) - cumulative[owner]


def _units(
    params: MultimodalParams,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], list[bytes]]:
    """Each item's first row on the shared row axis, each unit's first row there (ascending)
    and each unit's content hash (see `keys_by_span`)."""
    rows = np.bincount(params.run_items, params.run_lengths, len(params.items)).astype(np.int64)
    base = np.cumsum(rows) - rows
    unit_start: list[int] = []
    unit_hash: list[bytes] = []
    for item, first in zip(params.items, base.tolist(), strict=True):
        if item.partition_keys:
            for part in item.partitions:
                unit_start.append(first)
                unit_hash.append(part.content_hash)
                first += part.output_rows
        else:
            unit_start.append(first)
            unit_hash.append(item.content_hash)
    return base, np.array(unit_start, dtype=np.int64), unit_hash
