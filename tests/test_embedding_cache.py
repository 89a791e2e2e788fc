"""`router.embedding_cache.EmbeddingCache`: whole items' inline encoder outputs, by content
hash, cache salt and model identity; partition spans and NIXL-held outputs are not kept;
a hit is the encoder's bytes, as the embedding of the asking item; bounded by bytes."""

from __future__ import annotations

from epd.v1 import multimodal_pb2, tensor_pb2
from router.embedding_cache import EmbeddingCache

HASH = bytes(range(32))


def inline(nbytes: int, fill: int = 1) -> tensor_pb2.TensorRef:
    return tensor_pb2.TensorRef(shape=[nbytes // 4, 1], inline_data=bytes([fill]) * nbytes)


def embedding(nbytes: int = 64, index: int = 0) -> multimodal_pb2.ItemEmbedding:
    emb = multimodal_pb2.ItemEmbedding(item_index=index, rows=inline(nbytes, 1))
    emb.deepstack.extend([inline(nbytes, 2), inline(nbytes, 3)])
    return emb


def test_a_kept_output_comes_back_as_the_asking_items_embedding() -> None:
    cache = EmbeddingCache(1 << 20)
    key = cache.key(HASH, None, "m")
    assert cache.get(key, 0) is None
    given = embedding(index=0)
    assert cache.put(key, given)
    given.rows.inline_data = b"changed"  # the cache holds its own copy
    got = cache.get(key, 3)
    assert got is not None and got.item_index == 3
    assert got.rows.inline_data == bytes([1]) * 64
    assert [d.inline_data for d in got.deepstack] == [bytes([2]) * 64, bytes([3]) * 64]
    assert cache.hits == 1 and cache.bytes_used == 3 * 64


def test_keys_separate_content_tenants_and_models() -> None:
    keys = {
        EmbeddingCache.key(HASH, None, "m"),
        EmbeddingCache.key(bytes(32), None, "m"),
        EmbeddingCache.key(HASH, "tenant-a", "m"),
        EmbeddingCache.key(HASH, "tenant-b", "m"),
        EmbeddingCache.key(HASH, "", "m"),
        EmbeddingCache.key(HASH, None, "m2"),
    }
    assert len(keys) == 6
    assert EmbeddingCache.key(HASH, "a", "m") == EmbeddingCache.key(HASH, "a", "m")


def test_only_whole_inline_outputs_are_kept() -> None:
    cache = EmbeddingCache(1 << 20)
    span = embedding()
    span.partition_start, span.partition_end = 1, 3
    assert not cache.put(cache.key(HASH, None, "m"), span)
    held = embedding()
    held.deepstack[1].handle.lease_id = "lease"  # one tensor behind a NIXL lease
    assert not cache.put(cache.key(HASH, None, "m"), held)
    assert cache.get(cache.key(HASH, None, "m"), 0) is None


def test_the_budget_drops_the_least_recently_used() -> None:
    cache = EmbeddingCache(2 * 3 * 64)  # two entries
    a, b, c = (cache.key(bytes([k]) * 32, None, "m") for k in range(3))
    assert cache.put(a, embedding()) and cache.put(b, embedding())
    assert cache.get(a, 0) is not None  # b is now the least recently used
    assert cache.put(c, embedding())
    assert cache.get(b, 0) is None and cache.get(a, 0) is not None
    assert not cache.put(cache.key(HASH, None, "m"), embedding(nbytes=1024))  # over budget


def test_the_router_keys_kept_outputs_by_the_deployments_dtype_too() -> None:
    # A deployment whose workers all left and came back in another dtype (one dtype a
    # deployment, `Registry.dtype_now`) must not be given the other dtype's kept rows.
    from types import SimpleNamespace

    from router.encode import EncodeStage

    registry = SimpleNamespace(expected_model="m", dtype_now=lambda: "float32")
    stage = EncodeStage(SimpleNamespace(registry=registry), None, 1 << 20, 2, 1 << 20)  # type: ignore[arg-type]
    job = SimpleNamespace(
        cache_salt=None,
        prompt=SimpleNamespace(params=SimpleNamespace(items=[SimpleNamespace(content_hash=HASH)])),
    )
    kept, keys = stage._kept(job, [0], {})  # type: ignore[arg-type]
    assert not kept
    assert stage.embeddings is not None and stage.embeddings.put(keys[0], embedding())
    assert 0 in stage._kept(job, [0], {})[0]  # type: ignore[arg-type]
    registry.dtype_now = lambda: "bfloat16"
    assert stage._kept(job, [0], {}) == ({}, {0: EmbeddingCache.key(HASH, None, "m/bfloat16")})  # type: ignore[arg-type]
