"""Block payload digests: golden values and a pure-Python reference of the lane arithmetic,
determinism (batch size, order, dtype views, strided rows, cache ids, the float32 path), and
every corruption class the decode worker must catch."""

from __future__ import annotations

import hashlib
from fractions import Fraction
from operator import mul

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv import digest
from common.kv.cache import KvCacheSpec, PagedKvCache
from common.kv.digest import (
    CHUNK_BYTES,
    DIGEST_BYTES,
    LANES,
    MAX_COEFF,
    block_digests,
    cache_block_digests,
    chunk_coefficients,
    row_coefficients,
)

# bench-like layout, fewer layers: 2 layers x K/V x 16 tokens x 4 heads x 64 dims x bf16.
SPEC = KvCacheSpec(2, 4, 64, 16, torch.bfloat16, 12)
BLOCK = SPEC.block_bytes  # 32 KiB: 16 chunks


def filled_cache(spec: KvCacheSpec = SPEC, seed: int = 0) -> PagedKvCache:
    cache = PagedKvCache(spec)
    g = torch.Generator().manual_seed(seed)
    cache.buffer.copy_(torch.randn(spec.shape, generator=g).to(spec.dtype))
    return cache


def rows(cache: PagedKvCache) -> torch.Tensor:
    """The cache buffer as `[num_blocks, block_bytes]` uint8 (a view)."""
    return cache.buffer.view(-1).view(torch.uint8).view(cache.spec.num_blocks, -1)


def random_bytes(n: int, nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=g)


def reference_digest(data: bytes) -> bytes:
    """The construction of the module docstring, in Python integers (mod 2**64 by hand)."""
    coeffs = list(zip(*row_coefficients().tolist(), strict=True))  # [lane][byte]
    chunks = -(-len(data) // CHUNK_BYTES)
    outer = chunk_coefficients("cpu", chunks).tolist()
    lanes = [0] * LANES
    for s in range(chunks):
        x = [(b ^ 0x80) - 0x80 for b in data[s * CHUNK_BYTES : (s + 1) * CHUNK_BYTES]]
        for j in range(LANES):
            y = sum(map(mul, x, coeffs[j]))
            lanes[j] = (lanes[j] + y * outer[s][j]) % 2**64
    packed = b"".join(v.to_bytes(8, "little") for v in lanes) + len(data).to_bytes(8, "little")
    return hashlib.blake2b(packed, digest_size=16, person=b"epd-kv-digest/1").digest()


# --------------------------------------------------------------------- the construction


def test_golden_digests():
    # Pins the coefficient streams and the compression: prefill and decode must agree.
    pattern = torch.arange(4096 + 100).remainder(251).to(torch.uint8)
    assert block_digests(pattern[None])[0].hex() == "4239ef50393077ca4384939340cd6ebc"
    zeros = torch.zeros(1, CHUNK_BYTES, dtype=torch.uint8)
    assert block_digests(zeros)[0].hex() == "3a6632092fbe5a65c3cfef41ed27e011"
    assert row_coefficients()[0, :4].tolist() == [-53, -35, -10, -23]
    assert chunk_coefficients("cpu", 2)[:, 0].tolist() == [
        7830188007792669163,
        -5970110809037998463,
    ]


@pytest.mark.parametrize(
    "fill",
    ["random", "all 0x7f", "all 0x80", "alternating 0x7f 0x80", "all 0xff"],
)
@pytest.mark.parametrize("nbytes", [CHUNK_BYTES, 2 * CHUNK_BYTES + 100])
def test_matches_python_reference(fill, nbytes):
    # The extremes drive the int8 GEMM's sums to their largest magnitudes; the chunk
    # coefficients make every int64 product and sum wrap.
    if fill == "random":
        data = random_bytes(1, nbytes, seed=nbytes)[0]
    elif fill == "alternating 0x7f 0x80":
        data = torch.tensor([0x7F, 0x80], dtype=torch.uint8).repeat(nbytes // 2)
    else:
        data = torch.full((nbytes,), int(fill.split("0x")[1], 16), dtype=torch.uint8)
    assert block_digests(data[None]) == [reference_digest(bytes(data.tolist()))]


def test_torch_int64_arithmetic_wraps_mod_2_64():
    g = torch.Generator().manual_seed(1)
    a = torch.randint(-(2**63), 2**63 - 1, (64,), dtype=torch.int64, generator=g)
    b = torch.randint(-(2**24), 2**24, (64,), dtype=torch.int64, generator=g)
    want = sum(x * y for x, y in zip(a.tolist(), b.tolist(), strict=True)) % 2**64
    assert int((a * b).sum()) % 2**64 == want


def test_coefficients():
    r = row_coefficients()
    assert r.shape == (CHUNK_BYTES, LANES) and r.dtype == torch.int8
    assert int(r.abs().max()) == MAX_COEFF and int((r == 0).sum()) == 0
    counts = torch.bincount(r.flatten().to(torch.int64) + MAX_COEFF, minlength=2 * MAX_COEFF + 1)
    assert int(counts[MAX_COEFF]) == 0 and int(counts.min()) == 0  # only zero is missing
    assert int(counts[counts > 0].min()) > 150 and int(counts.max()) < 380  # ~260 each
    c = chunk_coefficients("cpu", 64)
    assert c.shape == (64, LANES) and bool((c % 2 != 0).all())
    assert torch.equal(chunk_coefficients("cpu", 3), c[:3])  # one stream for every size


def test_first_sixteen_bytes_coefficients_are_invertible():
    # The random-bytes bound of the module docstring rests on this matrix having full rank.
    m = [[Fraction(v) for v in row] for row in row_coefficients()[:LANES].tolist()]
    rank = 0
    for col in range(LANES):
        pivot = next((i for i in range(rank, LANES) if m[i][col] != 0), None)
        if pivot is None:
            continue
        m[rank], m[pivot] = m[pivot], m[rank]
        for i in range(rank + 1, LANES):
            f = m[i][col] / m[rank][col]
            m[i] = [a - f * b for a, b in zip(m[i], m[rank], strict=True)]
        rank += 1
    assert rank == LANES


# -------------------------------------------------------------------------- determinism


def test_one_fixed_length_digest_per_row():
    digests = block_digests(random_bytes(5, BLOCK))
    assert DIGEST_BYTES == 16
    assert len(digests) == 5 and all(len(d) == DIGEST_BYTES for d in digests)
    assert block_digests(random_bytes(0, BLOCK)) == []


def test_same_bytes_same_digest_across_calls_batches_and_orders():
    data = random_bytes(9, BLOCK)
    whole = block_digests(data)
    assert block_digests(data) == whole
    assert [block_digests(data[i : i + 1])[0] for i in range(9)] == whole
    order = [4, 0, 8, 2, 2, 7]
    assert block_digests(data[order]) == [whole[i] for i in order]


def test_digest_reads_raw_bytes_of_any_dtype():
    data = random_bytes(3, BLOCK)
    want = block_digests(data)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64):
        assert block_digests(data.view(dtype)) == want, dtype


def test_strided_rows_digest_like_contiguous_ones():
    wide = random_bytes(4, BLOCK + 64)
    assert block_digests(wide[:, 32 : 32 + BLOCK]) == block_digests(
        wide[:, 32 : 32 + BLOCK].clone()
    )
    with pytest.raises(ValueError, match="contiguous"):
        block_digests(random_bytes(BLOCK, 2).t())
    with pytest.raises(ValueError, match=r"\[n, block_bytes\]"):
        block_digests(random_bytes(1, BLOCK)[0])


def test_batches_larger_than_a_group(monkeypatch):
    data = random_bytes(7, BLOCK)
    want = [block_digests(data[i : i + 1])[0] for i in range(7)]
    monkeypatch.setattr(digest, "_GROUP_BYTES", 3 * BLOCK)  # groups of 3 rows
    assert block_digests(data) == want
    cache = filled_cache()
    ids = [11, 3, 4, 5, 6, 9, 0, 1]
    assert cache_block_digests(cache, ids) == block_digests(rows(cache)[ids])


def test_float32_path_gives_the_same_digests(monkeypatch):
    data = torch.cat([random_bytes(3, BLOCK), torch.full((1, BLOCK), 0x7F, dtype=torch.uint8)])
    want = block_digests(data)

    def no_int8_gemm(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no int8 GEMM here")

    monkeypatch.setattr(torch, "_int_mm", no_int8_gemm)
    assert block_digests(data) == want


@pytest.mark.parametrize("int8", [False, True], ids=["float32-gemm", "int8-gemm"])
def test_both_cpu_kernels_give_the_same_digests(monkeypatch, int8: bool) -> None:
    """The CPU takes the int8 GEMM only with VNNI (`common.cpu.int8_dot_products`), else
    the float32 one in slices of `_FLOAT_ROWS` rows: the digests are the same bytes, here
    over more chunk rows than one slice holds (and a partial last slice)."""
    data = random_bytes(5, 3 * digest._FLOAT_ROWS * digest.CHUNK_BYTES // 4 + 100)
    want = [block_digests(data[i : i + 1])[0] for i in range(5)]
    monkeypatch.setattr(digest, "int8_dot_products", lambda: int8)
    assert block_digests(data) == want
    monkeypatch.setattr(digest, "_FLOAT_ROWS", 7)
    assert block_digests(data) == want


def test_cache_block_digests_match_the_rows():
    cache = filled_cache()
    want = block_digests(rows(cache))
    ids = [7, 3, 4, 5, 3, 0, 11, 7]  # unordered, repeated, runs and singles
    assert cache_block_digests(cache, ids) == [want[i] for i in ids]
    assert cache_block_digests(cache, []) == []
    with pytest.raises(IndexError, match="out of range"):
        cache_block_digests(cache, [0, SPEC.num_blocks])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cache_digests_in_any_dtype_and_unaligned_block_size(dtype):
    # 3 layers x 2 x 3 tokens x 1 head x 5 dims: blocks are not a multiple of a chunk.
    spec = KvCacheSpec(3, 1, 5, 3, dtype, 6)
    cache = filled_cache(spec, seed=3)
    digests = cache_block_digests(cache, range(6))
    assert digests == [reference_digest(bytes(r.tolist())) for r in rows(cache)]
    assert len(set(digests)) == 6


# ---------------------------------------------------------------------------- corruption


def test_different_blocks_differ():
    data = torch.cat(
        [
            random_bytes(200, BLOCK),
            torch.arange(1, 51, dtype=torch.uint8)[:, None].expand(50, BLOCK),  # bench fill
            torch.zeros(1, BLOCK, dtype=torch.uint8),
        ]
    )
    assert len(set(block_digests(data))) == len(data)


def test_another_prompts_kv_and_junk_are_caught():
    cache, other = filled_cache(seed=0), filled_cache(seed=1)
    mine = cache_block_digests(cache, range(SPEC.num_blocks))
    assert not set(mine) & set(cache_block_digests(other, range(SPEC.num_blocks)))
    assert not set(mine) & set(block_digests(random_bytes(64, BLOCK, seed=9)))
    assert not set(mine) & set(block_digests(torch.zeros(2, BLOCK, dtype=torch.uint8)))


def test_a_flipped_top_bit_of_any_word_is_caught():
    # Every 32-bit word of a 4 KiB block, and every bf16 element's sign: one batched call.
    base = random_bytes(1, 4096, seed=5)
    want = block_digests(base)[0]
    for dtype in (torch.int32, torch.int16):
        n = 4096 // dtype.itemsize
        flips = base.repeat(n, 1).view(dtype)
        flips[torch.arange(n), torch.arange(n)] ^= torch.iinfo(dtype).min  # the top bit
        assert want not in set(block_digests(flips))


@settings(max_examples=60, deadline=None)
@given(
    position=st.integers(0, BLOCK - 1),
    xor=st.integers(1, 255),
)
def test_a_single_changed_byte_anywhere_is_caught(position, xor):
    cache = _CACHE
    want = cache_block_digests(cache, [5])
    raw = rows(cache)
    raw[5, position] ^= xor
    try:
        assert cache_block_digests(cache, [5]) != want
    finally:
        raw[5, position] ^= xor
    assert cache_block_digests(cache, [5]) == want


@settings(max_examples=30, deadline=None)
@given(
    layer=st.integers(0, SPEC.num_layers - 1),
    kv=st.integers(0, 1),
    slots=st.lists(st.integers(0, SPEC.block_size - 1), min_size=2, max_size=2, unique=True),
)
def test_swapped_tokens_are_caught(layer, kv, slots):
    block = _CACHE.buffer[2].clone()
    want = block_digests(block.view(1, -1))
    a, b = slots
    swapped = block.clone()
    swapped[layer, kv, a], swapped[layer, kv, b] = block[layer, kv, b], block[layer, kv, a]
    assert block_digests(swapped.view(1, -1)) != want


def test_structured_differences_are_caught():
    block = _CACHE.buffer[4]
    want = block_digests(block.reshape(1, -1))[0]
    variants = [
        block.roll(1, dims=2),  # every token one slot late (a stale offset)
        block.flip(1),  # K and V exchanged
        block.flip(0),  # layers in the wrong order
        -block,  # every sign flipped
        torch.where(torch.arange(SPEC.block_size)[:, None, None] < 8, block, 0),  # half written
    ]
    got = block_digests(torch.stack([v.contiguous() for v in variants]).view(len(variants), -1))
    assert want not in got and len(set(got)) == len(variants)


_CACHE = filled_cache(seed=7)
