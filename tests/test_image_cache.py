"""The processed-image cache: a repeated image's bytes are not decoded or hashed again, and
what the processor makes of it is bit for bit what it makes without the cache."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common.byte_lru import ByteBudgetLru
from common.processing.image import KeyedImage
from common.processing.image_cache import ProcessedImage, ProcessedImageCache, image_key
from common.processing.limits import InputLimits
from common.processing.messages import ImagePart
from common.processing.processor import Processor
from epd.client import build_request
from epd.v1 import router_service_pb2
from router.inputs import InputError, messages_from_proto
from tests.model_fixtures import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("imgcache") / "ckpt")


@pytest.fixture()
def cached(ckpt: Path) -> Processor:
    return Processor.from_pretrained(ckpt, image_cache_bytes=64 << 20)


@pytest.fixture(scope="module")
def plain(ckpt: Path) -> Processor:
    return Processor.from_pretrained(ckpt)


def png(seed: int, h: int = 40, w: int = 56) -> bytes:
    array = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def request(*images: bytes, text: str = "describe") -> router_service_pb2.GenerateRequest:
    content: list[dict[str, object]] = [{"type": "image", "image": data} for data in images]
    content.append({"type": "text", "text": text})
    return build_request([{"role": "user", "content": content}])


def same_prompt(a: object, b: object) -> None:
    assert a.prompt_token_ids == b.prompt_token_ids  # type: ignore[attr-defined]
    assert a.params == b.params  # type: ignore[attr-defined]
    assert a.grid_thw == b.grid_thw  # type: ignore[attr-defined]
    for x, y in zip(a.pixel_values, b.pixel_values, strict=True):  # type: ignore[attr-defined]
        assert torch.equal(x, y)


def test_repeated_bytes_hit_and_give_identical_prompts(cached: Processor, plain: Processor) -> None:
    first = messages_from_proto(request(png(1)).messages, processor=cached)
    (part,) = [p for p in first[0].content if isinstance(p, ImagePart)]
    assert isinstance(part.data, KeyedImage) and part.data.image is not None  # decoded
    a = cached.process(first)
    assert cached.image_cache is not None and len(cached.image_cache) == 1
    again = messages_from_proto(request(png(1), text="other").messages, processor=cached)
    (part,) = [p for p in again[0].content if isinstance(p, ImagePart)]
    assert isinstance(part.data, KeyedImage) and part.data.image is None  # not decoded
    hits = cached.image_cache.hits
    b = cached.process(again)
    assert cached.image_cache.hits == hits + 1
    reference = plain.process(messages_from_proto(request(png(1), text="other").messages))
    same_prompt(b, reference)
    assert a.params.items[0].content_hash == b.params.items[0].content_hash


def test_key_covers_bytes_and_settings(cached: Processor, ckpt: Path) -> None:
    data = png(2)
    assert cached.image_key(data) == cached.image_key(bytes(data))
    assert cached.image_key(data) != cached.image_key(png(3))
    other = dataclasses.replace(cached.settings, max_pixels=cached.settings.max_pixels // 2)
    assert image_key(other.fingerprint(), data) != cached.image_key(data)


def test_evicted_between_check_and_processing_decodes_again(
    cached: Processor, plain: Processor
) -> None:
    data = png(4)
    messages_from_proto(request(data).messages, processor=cached)  # not processed: no entry
    cached.process(messages_from_proto(request(data).messages, processor=cached))
    chat = messages_from_proto(request(data).messages, processor=cached)
    assert cached.image_cache is not None
    cached.image_cache._entries.clear()  # evicted after the check
    cached.image_cache.bytes_used = 0
    same_prompt(cached.process(chat), plain.process(messages_from_proto(request(data).messages)))
    assert cached.image_key(data) in cached.image_cache


def test_limits_and_errors_still_checked_on_a_hit(cached: Processor) -> None:
    data = png(5, 64, 64)
    cached.process(messages_from_proto(request(data).messages, processor=cached))
    with pytest.raises(InputError) as err:
        messages_from_proto(
            request(data).messages, InputLimits(max_image_pixels=32 * 32), processor=cached
        )
    assert err.value.field == "messages[0].content[0].image.data"
    with pytest.raises(InputError) as err:
        messages_from_proto(request(data, b"not an image").messages, processor=cached)
    assert err.value.field == "messages[0].content[1].image.data"


def test_plain_bytes_and_videos(cached: Processor, plain: Processor) -> None:
    data = png(6)
    chat = [{"role": "user", "content": [{"type": "image", "image": data}]}]
    a = cached.process(chat)
    b = cached.process(chat)
    assert cached.image_cache is not None and cached.image_cache.hits == 1
    same_prompt(a, plain.process(chat))
    same_prompt(b, a)
    frames = np.random.default_rng(0).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    video = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 2.0}]}]
    same_prompt(cached.process(video), plain.process(video))


def test_budget_bounds_the_cache() -> None:
    def entry(rows: int) -> ProcessedImage:
        return ProcessedImage(np.zeros((rows, 4), np.float32), (1, rows, 1), bytes(32))

    cache = ProcessedImageCache(3 * 16 * 4 * 4)
    assert isinstance(cache, ByteBudgetLru)
    for k in range(4):
        assert cache.put(bytes([k]) * 32, entry(16))
    assert cache.keys() == [bytes([k]) * 32 for k in (1, 2, 3)]
    assert cache.evictions == 1 and cache.bytes_used == 3 * 16 * 4 * 4
    assert not cache.put(b"x" * 32, entry(64))
    with pytest.raises(ValueError, match="negative"):
        ProcessedImageCache(-1)


def test_tenants_never_share_entries(cached: Processor) -> None:
    data = png(7)
    cached.process(messages_from_proto(request(data).messages, processor=cached, cache_salt="a"))
    assert cached.image_key(data, "a") != cached.image_key(data, "b") != cached.image_key(data)
    for salt, hit in (("a", True), ("b", False), (None, False)):
        chat = messages_from_proto(request(data).messages, processor=cached, cache_salt=salt)
        (part,) = [p for p in chat[0].content if isinstance(p, ImagePart)]
        assert isinstance(part.data, KeyedImage)
        assert (part.data.image is None) == hit
