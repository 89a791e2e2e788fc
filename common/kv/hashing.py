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
uuid)`. Those formulas live in `keys_by_span` (and its `_pieces`) alone: `block_hashes`
calls it for the full blocks, and `block_extra_keys` for one span. Text between runs is
hashed as text, and a layout that does not fit the prompt raises instead of silently
hashing placeholders as text.
"""

from __future__ import annotations

import hashlib
import struct
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np
import numpy.typing as npt

from common.multimodal.params import MultimodalItemMetadata, MultimodalParams
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
    return keys_by_span(params, [start], [end]).get(0, [])


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
        # Lists, not ranges: `keys_by_span` bisects and indexes them, faster on a list.
        starts = list(range(0, num_full * block_size, block_size))
        ends = list(range(block_size, (num_full + 1) * block_size, block_size))
        keys = keys_by_span(params, starts, ends)
    stride = 4 * block_size
    # The msgpack of [parent, tokens, keys, salt, lora] is joined from pre-packed parts:
    # byte-for-byte what msgpack.packb of that list gives, without packing per block. A
    # block without keys ends like every other; only keyed blocks and the first pack more.
    pack = msgpack.Packer(use_bin_type=True).pack
    head = b"\x95" + pack(bytes(32))[:-32]  # fixarray(5), bin header of the parent
    token_head = pack(bytes(stride))[:-stride]  # bin header of the token bytes
    later = pack(None) + pack(lora_id)  # no salt past the first block, the LoRA id
    tails = [pack([]) + later] * num_full
    for b, block_keys in keys.items():
        tails[b] = pack(block_keys) + later
    if num_full:
        tails[0] = pack(keys.get(0, [])) + pack(cache_salt) + pack(lora_id)
    # Each block hashes `head`, its parent, then `token_head + tokens + tail` (known before
    # the chain starts): a copy of the state after `head` and two updates cost less than
    # a fresh hash of the joined message (OpenSSL looks its digest up per new hash).
    rests = [
        token_head + tokens[at : at + stride] + tail
        for at, tail in zip(range(0, num_full * stride, stride), tails, strict=True)
    ]
    fresh = hashlib.sha256(head).copy
    out: list[bytes] = []
    parent = root
    for rest in rests:
        state = fresh()
        state.update(parent)
        state.update(rest)
        parent = state.digest()
        out.append(parent)
    return out


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
    params: MultimodalParams,
    starts: npt.NDArray[np.int64] | Sequence[int],
    ends: npt.NDArray[np.int64] | Sequence[int],
) -> dict[int, list[MmKey]]:
    """Extra keys of every span `[starts[i], ends[i])` that overlaps a run, by span index.

    A span's keys are, in prompt order, one `(item hash, offset, uuid)` per run
    `[rs, rs + len)` with `rs < end` and `rs + len > start`, where offset is the rows the
    item placed in its earlier runs plus `max(start, rs) - rs`. For an item with
    `partition_keys`, the run's overlapping item rows `[r0, r1)` give instead one
    `(partition hash, max(r0, p0) - p0, uuid)` per partition `[p0, p1)` of item rows with
    `p0 < r1` and `p1 > r0`, in partition order. A span that overlaps no run (gap text
    only) is absent. `starts` and `ends` must be ascending, as blocks are.

    Both rules are one: a key per overlap of a span with a *piece* `(prompt start, prompt
    end, hash, row)`, offset `row + max(start, piece start) - piece start`. An item's pieces
    are its runs (`_pieces`); with partition keys, each run cut where partitions meet. The
    spans a piece overlaps are a `bisect` range. Planning runs this right after processing
    a request, caches cold; per span it is a few list operations.
    """
    if isinstance(starts, np.ndarray):  # bisect and indexing: faster on lists
        starts, ends = starts.tolist(), np.asarray(ends).tolist()
    keys: dict[int, list[MmKey]] = {}
    make = tuple.__new__  # MmKey's own __new__ is Python code, twice as slow per key
    for item in params.items:
        uuid = item.uuid
        for begin, end, digest, row in _pieces(item):
            for span in range(bisect_right(ends, begin), bisect_left(starts, end)):
                first = starts[span]
                key = make(MmKey, (digest, row + (first - begin if first > begin else 0), uuid))
                found = keys.get(span)
                if found is None:
                    keys[span] = [key]
                else:
                    found.append(key)
    return keys


def _pieces(item: MultimodalItemMetadata) -> list[tuple[int, int, bytes, int]]:
    """`(prompt start, prompt end, hash, first row)` of each stretch of an item's
    placeholders that one key names: a run (item hash, item rows placed before it), or with
    `partition_keys` the part of a run inside one partition (its hash, partition-local row).
    Rows no partition covers get no piece, as in the rule."""
    if not item.partition_keys:
        pieces, row = [], 0
        for start, length in item.runs:
            pieces.append((start, start + length, item.content_hash, row))
            row += length
        return pieces
    parts = item.partitions
    if sum(p.output_rows for p in parts) != item.length:  # unvalidated: no key, none wrong
        raise ValueError("partition_keys on an item whose partitions do not make its rows")
    pieces = []
    unit, p0 = 0, 0  # the first partition not yet wholly placed, and its first item row
    row = 0  # item row of the run's first placeholder
    for start, length in item.runs:
        end_row, shift = row + length, start - row  # shift: item row to prompt index
        while unit < len(parts):
            p1 = p0 + parts[unit].output_rows
            if p1 > row:
                if p0 >= end_row:
                    break  # starts in a later run
                a, b = max(row, p0), min(end_row, p1)
                pieces.append((a + shift, b + shift, parts[unit].content_hash, a - p0))
                if p1 > end_row:
                    break  # goes on in the next run
            unit, p0 = unit + 1, p1
        row = end_row
    return pieces
