"""Qwen3-VL input processing beyond the reference comparisons: the chat template, item order
against payload order, content hashes, errors, and the typed message form."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from common.multimodal.params import Modality
from common.processing.messages import (
    ImagePart,
    Message,
    TextPart,
    VideoPart,
    messages_from_dicts,
)
from common.processing.processor import Processor
from tests.test_processor import _frames, _image, _user, ckpt, processor

__all__ = ["ckpt", "processor"]  # module fixtures shared with test_processor


# --- chat template, payload order, hashes, errors -----------------------------------------------


def test_chat_template(processor: Processor) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
        {"role": "user", "content": [{"type": "image", "image": _image(32, 32)}]},
    ]
    prompt = processor.process(messages_from_dicts(messages))
    pads = "<|image_pad|>" * prompt.params.items[0].length
    assert prompt.prompt_text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        f"<|im_start|>user\n<|vision_start|>{pads}<|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = processor.process(messages_from_dicts(messages[:2]), add_generation_prompt=False)
    assert not no_prompt.prompt_text.endswith("assistant\n")
    assert no_prompt.params.items == ()


def test_item_order_differs_from_payload_order(processor: Processor) -> None:
    first, second = _image(40, 40, seed=10), _image(64, 96, seed=11)
    video = _frames(4, 32, 32)
    prompt = processor.process(
        _user(
            {"type": "image", "index": 1, "uuid": "img-b"},
            {"type": "video"},
            {"type": "text", "text": "and"},
            {"type": "image", "index": 0},
            {"type": "image", "image": first},
        ),
        images=[first, second],
        videos=[video],
    )
    items = prompt.params.items
    assert [(i.modality, i.payload_index) for i in items] == [
        (Modality.IMAGE, 1),
        (Modality.VIDEO, 0),
        (Modality.IMAGE, 0),
        (Modality.IMAGE, 2),  # inline payloads come after the side payloads
    ]
    assert items[0].uuid == "img-b" and items[2].uuid is None
    alone = processor.process(_user({"type": "image", "image": second}))
    assert torch.equal(prompt.pixel_values[0], alone.pixel_values[0])
    assert items[0].content_hash == alone.params.items[0].content_hash
    assert items[2].content_hash == items[3].content_hash  # same picture, same hash
    assert prompt.grid_thw[0] == (1, 4, 6)
    # Runs are in prompt order and disjoint; each item's rows = t*h*w / 4.
    positions = [r for i in items for r in i.runs]
    assert positions == sorted(positions)
    assert prompt.params.lengths == [int(np.prod(g)) // 4 for g in prompt.grid_thw]
    pixels, grid = prompt.vision_inputs([2, 0])
    assert grid.tolist() == [list(prompt.grid_thw[2]), list(prompt.grid_thw[0])]
    assert pixels.shape[0] == sum(int(np.prod(g)) for g in grid.tolist())


def test_hash_depends_on_settings(ckpt: Path, processor: Processor) -> None:
    image = _image(200, 200, seed=7)
    base = processor.process(_user({"type": "image", "image": image})).params.items[0]
    again = processor.process(_user({"type": "image", "image": image})).params.items[0]
    assert base.content_hash == again.content_hash and len(base.content_hash) == 32
    other = processor.process(_user({"type": "image", "image": _image(200, 200, seed=8)}))
    assert other.params.items[0].content_hash != base.content_hash
    import dataclasses

    smaller = Processor(
        processor.tokenizer,
        processor.config,
        dataclasses.replace(processor.settings, max_pixels=64 * 64),
    )
    resized = smaller.process(_user({"type": "image", "image": image})).params.items[0]
    assert resized.grid_thw != base.grid_thw and resized.content_hash != base.content_hash
    renormed = Processor(
        processor.tokenizer,
        processor.config,
        dataclasses.replace(processor.settings, video_max_frames=8),
    )
    same_pixels = renormed.process(_user({"type": "image", "image": image})).params.items[0]
    assert same_pixels.content_hash != base.content_hash  # settings are part of the hash


def test_errors(processor: Processor) -> None:
    sneaky = _user({"type": "text", "text": "sneaky <|image_pad|>"})
    assert not processor.process(sneaky).params.items  # plain text by default
    with pytest.raises(ValueError, match="must not contain placeholder tokens"):
        processor.process(sneaky, allow_special_tokens=True)
    with pytest.raises(ValueError, match="refers to payload 2"):
        processor.process(_user({"type": "image", "index": 2}), images=[_image(32, 32)])
    with pytest.raises(ValueError, match="unsupported content part"):
        processor.process(_user({"type": "audio", "audio": b""}))
    with pytest.raises(ValueError, match="no role"):
        processor.process(messages_from_dicts([{"content": "x"}]))
    # A later system message is a turn of its own (it was refused: OpenAI takes them).
    later = processor.process(
        (Message("user", (TextPart("a"),)), Message("system", (TextPart("b"),)))
    )
    assert processor.tokenizer.decode(later.prompt_token_ids, skip_special_tokens=False).startswith(
        "<|im_start|>user\na<|im_end|>\n<|im_start|>system\nb<|im_end|>\n"
    )
    with pytest.raises(ValueError, match="differ in size"):
        frames = _frames(2, 32, 32) + _frames(2, 40, 32)
        processor.process(_user({"type": "video", "video": frames, "fps": 1.0}))


# --- typed messages ---------------------------------------------------------------------------


def test_dict_form_converts_to_typed_messages() -> None:
    image, frames = _image(16, 16), _frames(2, 16, 16)
    url = "data:image/png;base64,"
    dicts: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image, "uuid": 7},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "video", "video": frames, "fps": 2},
                {"type": "video", "index": 0},
                {"type": "text", "text": "?"},
            ],
        },
        {"role": "assistant", "content": None},
    ]
    chat = messages_from_dicts(dicts)
    system, user, assistant = chat
    assert system == Message("system", (TextPart("Be brief."),))
    assert assistant == Message("assistant")
    img, via_url, video, side, text = user.content
    assert isinstance(img, ImagePart) and img.data is image and img.uuid == "7"
    assert isinstance(via_url, ImagePart) and via_url.data == b""
    assert isinstance(video, VideoPart) and video.frames is frames and video.fps == 2.0
    assert isinstance(side, VideoPart) and side.index == 0 and side.payload is None
    assert text == TextPart("?")
    assert messages_from_dicts(chat) == chat  # typed messages pass through


def test_typed_and_dict_messages_process_alike(processor: Processor) -> None:
    image, frames = _image(40, 40, seed=3), _frames(4, 32, 32, seed=4)
    typed = (
        Message("system", (TextPart("Be brief."),)),
        Message(
            "user",
            (ImagePart(image, uuid="a"), TextPart("and"), VideoPart(frames, 2.0), ImagePart()),
        ),
    )
    dicts: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image, "uuid": "a"},
                {"type": "text", "text": "and"},
                {"type": "video", "video": frames, "fps": 2.0},
                {"type": "image"},
            ],
        },
    ]
    side = [_image(24, 24, seed=5)]
    a = processor.process(typed, images=side)
    b = processor.process(messages_from_dicts(dicts), images=side)
    assert a.prompt_token_ids == b.prompt_token_ids and a.params.hashes == b.params.hashes
    assert [i.uuid for i in a.params.items] == ["a", None, None]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ImagePart(b"x", index=0), "both data and an index"),
        (lambda: VideoPart(index=-1), "non-negative int"),
        (lambda: Message(""), "no role"),
        (lambda: messages_from_dicts([{"role": "user", "content": 3}]), "message 0: content"),
        (
            lambda: messages_from_dicts(
                [{"role": "u", "content": [{"type": "image", "index": -2}]}]
            ),
            "message 0: image index",
        ),
        (
            lambda: messages_from_dicts(
                [{"role": "u", "content": [{"type": "image_url", "image_url": "https://x"}]}]
            ),
            "not fetched",
        ),
    ],
)
def test_malformed_messages_are_value_errors(build: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_messages_are_frozen() -> None:
    import dataclasses

    message = Message("user", (TextPart("hi"),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.role = "assistant"  # type: ignore[misc]
