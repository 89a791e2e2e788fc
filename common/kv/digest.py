"""Block payload digests: a short fingerprint of a KV block's bytes, computed where they live.

The prefill worker digests each block it lends; the decode worker digests the bytes it
pulled and compares before it uses or caches them, so a block overwritten by another
prompt's KV, a half-written or junk block, or a single flipped bit is caught. Digests cover
the raw bytes of the whole block (every layer, K and V, every token slot; see
`common.kv.cache`), whatever the buffer's dtype, and are equal on every device and for every
batch size or block order: CPU prefill and CUDA decode agree.

The construction: a two-level linear hash with exact integer arithmetic, then a compression.

1. Cut the block into `S = ceil(nbytes / CHUNK_BYTES)` chunks of `CHUNK_BYTES` bytes (the last
   zero-padded) and read each byte as a signed int8 `x`. For each of `LANES` lanes `j`:
   `y[s, j] = sum_k x[s, k] * R[k, j]`, with fixed pseudo-random coefficients `R[k, j]` drawn
   uniformly from the nonzero integers in [-63, 63]. `|y| <= 128 * 63 * 2048 < 2**24`, so the
   sums are exact in int32 (and in float32: every partial sum is an integer below 2**24, so any
   summation order gives the same result). This is one int8 GEMM `[n * S, 2048] x [2048, 16]`
   (`torch._int_mm`: oneDNN on a CPU with VNNI, cuBLASLt on CUDA), which runs at memory
   speed; on a CPU without VNNI (`common.cpu.int8_dot_products`), where oneDNN's int8 GEMM
   is 18x slower than that, the same integers go through a float32 GEMM, a few hundred rows
   at a time (exact, as above).
2. `lane[j] = sum_s y[s, j] * C[s, j] mod 2**64`, with fixed pseudo-random odd 64-bit `C`
   (wrapping int64 arithmetic; small, `1/32` of the block's size in int32).
3. `digest = blake2b(lane bytes || nbytes, 16 bytes)`, on the host over 136 bytes per block.

`R` and `C` come from SHAKE-128 of fixed labels (no torch or numpy RNG, whose streams may
change between versions); the tests pin them with golden digests.

Collision bounds (two blocks of the same length whose bytes differ):

- Any difference confined to one byte is always caught: `x * R[k, j]` is a nonzero int32 and
  odd `C` is invertible mod 2**64, so every lane changes.
- Any other fixed difference (one not chosen with knowledge of `R` and `C`: stale KV of
  another prompt, swapped tokens, flipped sign or top bits, zeroed ranges): take a chunk `s`
  where it is nonzero. In lane `j`, `dy[s, j] = 0` has probability <= 1/126 over `R[:, j]`
  (at most one value of a coefficient at a differing byte cancels it, the sums being exact
  integers); otherwise `|dy| < 2**25` has 2-adic valuation v <= 24 and, `C[s, j]` being a
  uniform odd residue mod 2**64, `C[s, j] * dy` hits the one cancelling value with probability
  <= 2**(v - 63) <= 2**-39. Lanes have independent coefficients, so all 16 lanes agree with
  probability <= (1/126 + 2**-39)**16 < 2**-111, plus 2**-128 for the blake2b compression
  (as a random function).
- Uniformly random bytes (junk) against any fixed block: the 16 x 16 coefficients of a chunk's
  first 16 bytes form an invertible matrix (checked in the tests), so the lane vector is an
  injective function of those 16 bytes: collision probability <= 2**-128, plus 2**-128 for
  blake2b.

This is an error-detecting code, not a MAC: the coefficients are public, so someone who can
write the holder's memory on purpose can forge a matching block.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Iterator, Sequence
from functools import cache

import torch

from common.cpu import int8_dot_products
from common.kv.cache import PagedKvCache

#: Bytes of one block's digest.
DIGEST_BYTES = 16
#: Independent hash lanes (a multiple of 8: CUDA's int8 GEMM wants it).
LANES = 16
#: Bytes per chunk of the first level; `128 * 63 * CHUNK_BYTES < 2**24` keeps it exact.
CHUNK_BYTES = 2048
#: Largest first-level coefficient magnitude (7 bits: no int16 saturation in any int8 GEMM).
MAX_COEFF = 63

# blake2b personalization: names the construction, so any change of it changes every digest.
_PERSON = b"epd-kv-digest/1"
# Rows of input per GEMM batch: bounds the int32 and int64 temporaries (1/32 and 1/16 of it).
_GROUP_BYTES = 32 * 1024 * 1024
# CUDA's int8 GEMM needs more than 16 rows; smaller products take the float32 path.
_CUDA_MIN_ROWS = 17
# Rows the float32 path converts at a time: 2 MB of float32, which stays in the cache.
_FLOAT_ROWS = 256

if sys.byteorder != "little":  # digests hash the lanes' in-memory bytes
    raise ImportError("common.kv.digest assumes a little-endian host")


def block_digests(blocks: torch.Tensor) -> list[bytes]:
    """Digest of each row of `blocks`, a `[n, block_bytes]` tensor of any dtype viewed as raw
    bytes (each row contiguous), on any device.

    One batched pass on `blocks`' device; only `n * LANES` int64 lanes come to the host.
    """
    if blocks.dim() != 2:
        raise ValueError(f"blocks must be [n, block_bytes], got shape {tuple(blocks.shape)}")
    if blocks.shape[1] and blocks.stride(1) != 1:
        raise ValueError("each row of blocks must be contiguous")
    raw = blocks.view(torch.int8) if blocks.dtype != torch.int8 else blocks
    n, nbytes = raw.shape
    if n == 0:
        return []
    if nbytes == 0:
        raise ValueError("blocks have no bytes")
    if n == 1 or raw.stride(0) == nbytes:
        pieces = [(i, raw[i : i + step]) for i, step in _steps(n, nbytes)]
    else:
        pieces = [(i, raw[i : i + 1]) for i in range(n)]
    return _finish(_lanes(pieces, n, nbytes, raw.device), nbytes)


def cache_block_digests(cache: PagedKvCache, block_ids: Sequence[int]) -> list[bytes]:
    """Digests of the given blocks of `cache`'s buffer, in the given order (one batched call;
    ids may repeat or be unordered). Raises `IndexError` for an id out of range.

    On the host, runs of consecutive ids are read in place; on an accelerator the blocks are
    gathered first (in bounded groups), which costs less there than many small GEMMs.
    """
    ids = [int(b) for b in block_ids]
    num_blocks = cache.spec.num_blocks
    for block_id in ids:
        if not 0 <= block_id < num_blocks:
            raise IndexError(f"block id {block_id} out of range [0, {num_blocks})")
    if not ids:
        return []
    nbytes = cache.spec.block_bytes
    rows = cache.buffer.view(-1).view(torch.int8).view(num_blocks, nbytes)
    unique = sorted(set(ids))
    pieces: list[tuple[int, torch.Tensor]] = []
    if rows.device.type == "cpu":
        start = 0
        for end in range(1, len(unique) + 1):
            if end == len(unique) or unique[end] != unique[end - 1] + 1:
                first = unique[start]
                for i, step in _steps(end - start, nbytes):
                    pieces.append((start + i, rows[first + i : first + i + step]))
                start = end
    else:
        index = torch.tensor(unique, dtype=torch.long, device=rows.device)
        for i, step in _steps(len(unique), nbytes):
            pieces.append((i, rows.index_select(0, index[i : i + step])))
    digests = _finish(_lanes(pieces, len(unique), nbytes, rows.device), nbytes)
    where = {block_id: k for k, block_id in enumerate(unique)}
    return [digests[where[block_id]] for block_id in ids]


# ------------------------------------------------------------------------------ internals


def _steps(n: int, nbytes: int) -> Iterator[tuple[int, int]]:
    """`(start, rows)` slices of `n` rows, each at most one GEMM group."""
    group = max(1, _GROUP_BYTES // nbytes)
    for start in range(0, n, group):
        yield start, min(group, n - start)


def _lanes(
    pieces: Sequence[tuple[int, torch.Tensor]], n: int, nbytes: int, device: torch.device
) -> torch.Tensor:
    """`[n, LANES]` int64 lanes of `n` rows, given as `(first row, [rows, nbytes] int8)` pieces
    (dense, each at most one group, together covering every row once)."""
    chunks = math.ceil(nbytes / CHUNK_BYTES)
    coeffs = row_coefficients(device)
    outer = chunk_coefficients(device, chunks)
    group = max(1, _GROUP_BYTES // nbytes)
    y = torch.empty(min(group, n), chunks, LANES, dtype=torch.int32, device=device)
    out = torch.empty(n, LANES, dtype=torch.int64, device=device)
    pending: list[tuple[int, int]] = []  # (first row, rows) held in y
    fill = 0

    def flush() -> None:
        nonlocal fill
        mixed = y[:fill].to(torch.int64).mul_(outer).sum(1)
        at = 0
        for first, rows in pending:
            out[first : first + rows] = mixed[at : at + rows]
            at += rows
        pending.clear()
        fill = 0

    for first, piece in pieces:
        rows = piece.shape[0]
        if fill + rows > y.shape[0]:
            flush()
        if nbytes % CHUNK_BYTES:
            piece = torch.nn.functional.pad(piece, (0, chunks * CHUNK_BYTES - nbytes))
        _products(
            piece.reshape(rows * chunks, CHUNK_BYTES),
            coeffs,
            y[fill : fill + rows].view(rows * chunks, LANES),
        )
        pending.append((first, rows))
        fill += rows
    if fill:
        flush()
    return out


def _products(x: torch.Tensor, coeffs: torch.Tensor, out: torch.Tensor) -> None:
    """`out = x @ coeffs` exactly, int8 `[m, CHUNK_BYTES]` x `[CHUNK_BYTES, LANES]` -> int32.

    The int8 GEMM where the device runs it fast (CUDA; a CPU with VNNI); else float32,
    which is exact here (see the module docstring), `_FLOAT_ROWS` rows at a time through
    one reused buffer, so the conversion stays in the cache.
    """
    cpu = x.device.type == "cpu"
    if int8_dot_products() if cpu else x.shape[0] >= _CUDA_MIN_ROWS:
        try:
            torch._int_mm(x, coeffs, out=out)
            return
        except (RuntimeError, NotImplementedError):
            pass  # no int8 GEMM for this device or shape: the float32 path is exact too
    weights = coeffs.to(torch.float32)
    rows = min(_FLOAT_ROWS, x.shape[0])
    values = torch.empty(rows, CHUNK_BYTES, dtype=torch.float32, device=x.device)
    sums = torch.empty(rows, LANES, dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[0], rows):
        n = min(rows, x.shape[0] - start)
        values[:n].copy_(x[start : start + n])
        torch.mm(values[:n], weights, out=sums[:n])
        out[start : start + n].copy_(sums[:n])


def _finish(lanes: torch.Tensor, nbytes: int) -> list[bytes]:
    """Compress each row's lanes (with the block length) to `DIGEST_BYTES` on the host."""
    data = lanes.cpu().contiguous().numpy().tobytes()
    width = LANES * 8
    tail = nbytes.to_bytes(8, "little")
    return [
        hashlib.blake2b(
            data[i : i + width] + tail, digest_size=DIGEST_BYTES, person=_PERSON
        ).digest()
        for i in range(0, len(data), width)
    ]


def _stream(label: bytes, nbytes: int) -> bytes:
    """`nbytes` of a fixed pseudo-random stream (a prefix of the same stream for any size)."""
    return hashlib.shake_128(_PERSON + b"/" + label).digest(nbytes)


@cache
def _row_coefficients_cpu() -> torch.Tensor:
    # Rejection-sample bytes below 252 (= 2 * 126), so `b % 126` is uniform, then map
    # 0..125 onto the nonzero integers -63..63.
    want = CHUNK_BYTES * LANES
    raw = torch.frombuffer(bytearray(_stream(b"rows", want + want // 4)), dtype=torch.uint8)
    kept = raw[raw < 4 * MAX_COEFF].to(torch.int16)
    if kept.numel() < want:
        raise AssertionError("coefficient stream too short")  # never: about 1.6% are dropped
    values = kept[:want] % (2 * MAX_COEFF) - MAX_COEFF
    values = values + (values >= 0).to(torch.int16)
    return values.to(torch.int8).view(CHUNK_BYTES, LANES)


@cache
def _row_coefficients_on(device: torch.device) -> torch.Tensor:
    # Stored lane-major and passed transposed (a column-major [CHUNK_BYTES, LANES]): the
    # weight layout cuBLASLt's int8 GEMM is known to take; oneDNN takes either.
    return _row_coefficients_cpu().t().contiguous().to(device).t()


def row_coefficients(device: torch.device | str = "cpu") -> torch.Tensor:
    """First-level coefficients `R`, `[CHUNK_BYTES, LANES]` int8 on `device` (cached)."""
    return _row_coefficients_on(torch.device(device))


@cache
def _chunk_coefficients_on(device: torch.device, chunks: int) -> torch.Tensor:
    values = torch.frombuffer(bytearray(_stream(b"chunks", 8 * chunks * LANES)), dtype=torch.int64)
    return (values | 1).view(chunks, LANES).to(device)


def chunk_coefficients(device: torch.device | str, chunks: int) -> torch.Tensor:
    """Second-level coefficients `C`, `[chunks, LANES]` odd int64 on `device` (cached)."""
    return _chunk_coefficients_on(torch.device(device), chunks)
