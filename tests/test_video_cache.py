"""The processed-partition cache (`common.processing.video_cache`) through the router's reader
(`router.inputs.messages_from_proto`) and the real processor on the tiny checkpoint.

A video V, then V with frames appended: the second decodes only the new frames, and its
prompt (tokens, patch rows bit for bit, partition and item hashes) equals that of a
processor without the cache. Where the frame count changes the resize (the pixel budget
binds) nothing is reused and the result is still exact; another tenant's salt never hits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from common.processing.image_cache import ProcessedImageCache, StagedImages
from common.processing.processor import ProcessedPrompt, Processor
from epd.request import video_input
from epd.v1 import router_service_pb2
from router.inputs import messages_from_proto
from tests.model_fixtures import write_tiny_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("vc") / "c")


def chat(frames: np.ndarray) -> list[router_service_pb2.ChatMessage]:
    msg = router_service_pb2.ChatMessage(role="user")
    msg.content.add().text = "Clip:"
    msg.content.add().video.CopyFrom(video_input(list(frames), 2.0))
    msg.content.add().text = "What moves?"
    return [msg]


def decoded(messages: Any) -> int:
    """Frames of the chat's video the reader decoded (the others come from the cache)."""
    (video,) = [p for m in messages for p in m.content if hasattr(p, "frames")]
    return sum(getattr(f, "image", True) is not None for f in video.frames)


def same(a: ProcessedPrompt, b: ProcessedPrompt) -> None:
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.params == b.params  # item and partition hashes, runs, grids, times
    assert all(torch.equal(x, y) for x, y in zip(a.pixel_values, b.pixel_values, strict=True))


def processors(folder: Any, **settings: Any) -> tuple[Processor, Processor]:
    """(with the cache, without it), both with `settings` over the checkpoint's."""
    base = Processor.from_pretrained(folder)
    parts = (base.tokenizer, base.config, dataclasses.replace(base.settings, **settings))
    plain = Processor(*parts, base.template, base.generation)
    cached = Processor(*parts, base.template, base.generation, ProcessedImageCache(64 << 20))
    return cached, plain


def test_appended_frames_alone_are_decoded_and_the_prompt_is_exact(folder: Any) -> None:
    cached, plain = processors(folder)
    frames = np.random.default_rng(3).integers(0, 256, (13, 64, 64, 3), dtype=np.uint8)
    for count, fresh in ((8, 8), (12, 4), (13, 1), (13, 0)):
        # 13 frames: the last temporal patch is frame 12 twice, a patch of its own.
        messages = messages_from_proto(chat(frames[:count]), processor=cached)
        assert decoded(messages) == fresh
        same(cached.process(messages), plain.process(messages_from_proto(chat(frames[:count]))))
    # Another tenant's requests key their own entries: every frame decoded again.
    salted = messages_from_proto(chat(frames[:8]), processor=cached, cache_salt="tenant-b")
    assert decoded(salted) == 8


def test_a_video_whose_patches_are_all_cached_decodes_no_frame(
    folder: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its first frame was decoded whole on every request, to read its size.
    from PIL import ImageFile

    cached, _ = processors(folder)
    frames = np.random.default_rng(4).integers(0, 256, (8, 64, 64, 3), dtype=np.uint8)
    first = cached.process(messages_from_proto(chat(frames), processor=cached))
    loads: list[Any] = []
    load = ImageFile.ImageFile.load

    def counted(image: Any) -> Any:
        loads.append(image)
        return load(image)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counted)
    again = cached.process(messages_from_proto(chat(frames), processor=cached))
    assert loads == []
    same(again, first)


def test_a_resize_that_depends_on_the_frame_count_reuses_nothing_and_stays_exact(
    folder: Any,
) -> None:
    # A budget of 8 frames at 64x64: 12 frames are resized smaller than 8 are.
    cached, plain = processors(folder, video_max_pixels=8 * 64 * 64)
    frames = np.random.default_rng(4).integers(0, 256, (12, 64, 64, 3), dtype=np.uint8)
    first = cached.process(messages_from_proto(chat(frames[:8]), processor=cached))
    messages = messages_from_proto(chat(frames), processor=cached)
    assert decoded(messages) == 12
    second = cached.process(messages)
    assert first.grid_thw[0][1:] != second.grid_thw[0][1:]
    same(second, plain.process(messages_from_proto(chat(frames))))


def test_stored_patches_share_the_prompts_rows(folder: Any) -> None:
    # Each temporal patch made was stored as a copy of the rows the prompt holds: a request
    # held both until its first token (staged; ownfix review), and the cache both after.
    cached, _ = processors(folder)
    cache = cached.image_cache
    assert cache is not None
    frames = np.random.default_rng(5).integers(0, 256, (8, 64, 64, 3), dtype=np.uint8)
    store = StagedImages(cache)
    prompt = cached.process(messages_from_proto(chat(frames), processor=cached), store=store)
    store.keep()
    (rows,) = prompt.pixel_values
    stored = [cache.get(k) for k in cache.keys()]  # noqa: SIM118 (a list, not a dict)
    assert len(stored) == 4
    assert all(s is not None and np.shares_memory(s.patches, rows.numpy()) for s in stored)
    assert cache.bytes_used < 2 * rows.numel()  # the rows once, not per patch


def test_one_new_patch_does_not_push_its_videos_other_patches_out(folder: Any) -> None:
    # A new patch stored as a view of the whole joined video kept, and counted, the whole
    # video again: in a cache of 1.5 videos, the video with its last frame changed evicted
    # every patch of the video (ownfix review B2).
    base = Processor.from_pretrained(folder)
    parts = (base.tokenizer, base.config, base.settings, base.template, base.generation)
    frames = np.random.default_rng(9).integers(0, 256, (16, 64, 64, 3), dtype=np.uint8)
    (rows,) = Processor(*parts).process(messages_from_proto(chat(frames))).pixel_values
    cached = Processor(*parts, ProcessedImageCache(int(1.5 * rows.numel()) + (64 << 10)))
    cached.process(messages_from_proto(chat(frames), processor=cached))
    changed = frames.copy()
    changed[-1] ^= 1
    again = messages_from_proto(chat(changed), processor=cached)
    assert decoded(again) == 2  # the last patch's frames
    cached.process(again)
    assert decoded(messages_from_proto(chat(frames), processor=cached)) == 0
