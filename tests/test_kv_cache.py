"""PagedKvCache: byte layout, block addresses, where a token's K/V live (`token_slots`; the
model's own writes there: tests/test_text_model.py); the KvLayout of a cache, its wire
form and its pinned root hash."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from common.kv.cache import KV_LAYOUT, KvCacheSpec, PagedKvCache, token_slots
from common.kv.layout import ELEMENT_TYPES, KvLayout, layout_root
from common.wire.convert import element_type
from common.wire.kv import layout_from_proto, layout_to_proto


def make_spec(
    *,
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_dim: int = 4,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    num_blocks: int = 8,
) -> KvCacheSpec:
    return KvCacheSpec(num_layers, num_kv_heads, head_dim, block_size, dtype, num_blocks)


def test_spec_sizes_and_layout():
    spec = make_spec(dtype=torch.bfloat16)
    assert spec.layout == KV_LAYOUT == "block-major/layer,kv,token,head,dim"
    assert spec.shape == (8, 2, 2, 4, 2, 4)
    assert spec.block_bytes == 2 * 2 * 4 * 2 * 4 * 2
    assert spec.total_bytes == spec.block_bytes * 8
    assert spec.layout_key == make_spec(dtype=torch.bfloat16, num_blocks=99).layout_key
    assert spec.layout_key != make_spec(dtype=torch.float16).layout_key


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "block_size"])
def test_spec_rejects_bad_sizes(field):
    with pytest.raises(ValueError, match=field):
        make_spec(**{field: 0})
    with pytest.raises(ValueError, match="dtype"):
        KvCacheSpec(1, 1, 1, 1, "float32", 1)


def test_a_pool_the_device_cannot_hold_is_refused_naming_num_blocks():
    # torch's own words (an allocator traceback) named no setting (edges review, s36).
    from common.kv.cache import KvPoolTooLarge

    with pytest.raises(KvPoolTooLarge, match=r"num_blocks: a KV pool of 1000000000000 blocks"):
        PagedKvCache(make_spec(num_blocks=10**12))  # 256 TiB


def test_a_host_pool_past_the_memory_free_is_refused_before_it_is_touched(monkeypatch):
    # torch.zeros on the host touches every page: a pool the allocator let through but the
    # memory could not hold was killed by the kernel, with no line (ownfix review B, s36).
    import common.kv.cache as cache

    spec = make_spec()
    monkeypatch.setattr(cache, "host_bytes_free", lambda: spec.total_bytes - 1)
    with pytest.raises(cache.KvPoolTooLarge, match=r"num_blocks: .* of host memory free\)"):
        PagedKvCache(spec)
    monkeypatch.setattr(cache, "host_bytes_free", lambda: spec.total_bytes)
    assert PagedKvCache(spec).buffer.numel() * 4 == spec.total_bytes
    monkeypatch.undo()
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert 0 < (cache.host_bytes_free() or 0) <= total  # read off this machine


def test_buffer_is_one_contiguous_block_major_tensor():
    spec = make_spec()
    cache = PagedKvCache(spec)
    assert cache.buffer.shape == spec.shape and cache.buffer.is_contiguous()
    assert cache.buffer.device.type == "cpu"
    assert cache.buffer.numel() * cache.buffer.element_size() == spec.total_bytes
    assert not cache.buffer.any()


@pytest.mark.parametrize("block_id", [0, 3, 7])
def test_block_address_covers_exactly_that_block(block_id):
    spec = make_spec()
    cache = PagedKvCache(spec)
    cache.buffer[block_id] = torch.arange(cache.buffer[0].numel(), dtype=spec.dtype).view(
        cache.buffer[0].shape
    )
    addr, nbytes = cache.block_address(block_id)
    assert nbytes == spec.block_bytes
    assert addr == cache.buffer.data_ptr() + block_id * spec.block_bytes
    raw = ctypes.string_at(addr, nbytes)
    assert raw == cache.buffer[block_id].numpy().tobytes()
    # Byte formula of the module docstring: (block, layer, kv, token, head, dim).
    b, layer, i, t, h, d = block_id, 1, 1, 2, 1, 3
    L, S, H, D = spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim
    off = (((((b * L + layer) * 2 + i) * S + t) * H + h) * D + d) * spec.itemsize
    value = ctypes.c_float.from_address(cache.buffer.data_ptr() + off).value
    assert value == cache.buffer[b, layer, i, t, h, d].item()


def test_merged_descriptors_join_adjacent_ids():
    cache = PagedKvCache(make_spec())
    base, nb = cache.buffer.data_ptr(), cache.spec.block_bytes
    assert cache.merged_descriptors([4, 5, 6, 1, 2, 7]) == [
        (base + 4 * nb, 3 * nb),
        (base + 1 * nb, 2 * nb),
        (base + 7 * nb, nb),
    ]
    assert cache.merged_descriptors([]) == []
    with pytest.raises(IndexError):
        cache.block_address(8)


def test_token_slots_1d_and_2d():
    table = torch.tensor([5, 2, 7])
    blocks, offsets = token_slots(table, torch.tensor([0, 3, 4, 9]), 4)
    assert blocks.tolist() == [5, 5, 2, 7] and offsets.tolist() == [0, 3, 0, 1]
    tables = torch.tensor([[5, 2, 0], [1, 6, 3]])
    blocks, offsets = token_slots(tables, torch.tensor([5, 10]), 4)  # row b in its table
    assert blocks.tolist() == [2, 3] and offsets.tolist() == [1, 2]
    with pytest.raises(ValueError, match="token_slots"):
        token_slots(tables, torch.tensor([5]), 4)


# ------------------------------------------------------------------------- KV layout

LAYOUT_MODEL = "qwen3-vl/0123456789abcdef0123456789abcdef"
# Root hashes computed before the layout became a dataclass (from the protobuf `KvLayout`):
# routers and workers of different versions must keep deriving the same roots.
GOLDEN_ROOTS = {
    torch.bfloat16: "b62febf8fa57a2ba0b50cb01ca70a21fd1df5e3b6a75b08f29b377796277fe1e",
    torch.float32: "43a2faf5be761908d91ca98fddb412e16c1384a8ef8a1a3ba1d1c975e5a2b8ab",
}


@pytest.mark.parametrize("dtype", list(GOLDEN_ROOTS))
def test_layout_root_is_pinned(dtype: torch.dtype) -> None:
    spec = make_spec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=dtype)
    layout = KvLayout.of(LAYOUT_MODEL, spec)
    assert layout.layout == KV_LAYOUT
    assert layout.block_bytes == spec.block_bytes
    assert layout_root(layout).hex() == GOLDEN_ROOTS[dtype]


def test_layout_element_types_are_the_wire_numbers() -> None:
    for dtype, number in ELEMENT_TYPES.items():
        assert number == int(element_type(dtype))


def test_layout_wire_round_trip_and_differences() -> None:
    layout = KvLayout.of(LAYOUT_MODEL, make_spec())
    msg = layout_to_proto(layout)
    assert layout_from_proto(msg) == layout
    assert layout_root(layout_from_proto(msg)) == layout_root(layout)
    other = KvLayout.of(LAYOUT_MODEL, make_spec(block_size=8))
    assert layout.differences(layout) == []
    assert layout.differences(other) == [
        "block_size=4 (expected 8)",
        f"block_bytes={layout.block_bytes} (expected {other.block_bytes})",
    ]


def test_the_documented_root_recipe_gives_the_golden_root() -> None:
    """docs/block-hash.md says how a deployment's root is made, for clients in other
    languages: SHA-256 of msgpack([scheme, model, hex(msgpack(layout fields))])."""
    import hashlib

    import msgpack

    fields = ["block-major/layer,kv,token,head,dim", 1, 16, 2, 2, 16]
    layout = msgpack.packb(fields, use_bin_type=True).hex()
    root = hashlib.sha256(
        msgpack.packb(["epd-block-hash-v1", LAYOUT_MODEL, layout], use_bin_type=True)
    ).hexdigest()
    assert root == GOLDEN_ROOTS[torch.float32]
    docs = Path(__file__).resolve().parent.parent / "docs" / "block-hash.md"
    assert root in docs.read_text()
