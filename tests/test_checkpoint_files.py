"""A checkpoint behaves as its files say: processor settings, chat template, generation config.

The main fixture is the built-in tiny checkpoint re-saved the way `transformers` 5 saves a
Qwen3-VL folder: the image and video processor settings nested in `processor_config.json`
(non-default: a smaller pixel budget, CLIP normalisation, at most 4 video frames), the
tokenizer saved by `save_pretrained` with a chat template of its own (a default system
message the built-in layout does not have), and `max_new_tokens` in
`generation_config.json`. epd's token ids are compared with the reference's
`apply_chat_template` + placeholder expansion, and the Engine's greedy output with
`generate`. The unit tests of which file wins are in test_checkpoint_precedence.py.
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from common.engine import Engine
from common.models.tiny import default_checkpoint
from common.processing.processor import Processor
from tests.model_fixtures import reference_model

TEMPLATE = (
    "{%- if messages[0].role != 'system' %}<|im_start|>system\nYou are tiny.<|im_end|>\n"
    "{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content | trim }}{% else %}"
    "{%- for part in message.content %}"
    "{%- if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part.type == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif part.type == 'text' %}{{ part.text }}{% endif %}"
    "{%- endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    folder = tmp_path_factory.mktemp("hf") / "ckpt"
    shutil.copytree(default_checkpoint(), folder)
    (folder / "preprocessor_config.json").unlink()
    image = Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    )
    video = Qwen3VLVideoProcessor(
        max_frames=4,
        min_frames=2,
        size={"shortest_edge": 4096, "longest_edge": 4 * 64 * 64},
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    )
    nested = {
        "image_processor": image.to_dict(),
        "video_processor": video.to_dict(),
        "processor_class": "Qwen3VLProcessor",
    }
    (folder / "processor_config.json").write_text(json.dumps(nested))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(folder))
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "max_new_tokens": 8}))
    return SimpleNamespace(folder=folder, tokenizer=tokenizer, image=image, video=video)


@pytest.fixture(scope="module")
def processor(hf: SimpleNamespace) -> Processor:
    return Processor.from_pretrained(hf.folder)


def _image(h: int, w: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _reference_ids(
    hf: SimpleNamespace,
    messages: list[dict[str, Any]],
    images: list[Any],
    video: tuple[int, int, int, float] | None = None,
) -> list[int]:
    """The reference's ids: `apply_chat_template`, then the Qwen3-VL processor's expansion."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
    from transformers.video_utils import VideoMetadata

    bare = [
        {
            **m,
            "content": [
                {"type": p["type"], **({"text": p["text"]} if "text" in p else {})}
                for p in m["content"]
            ],
        }
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]
    text = hf.tokenizer.apply_chat_template(bare, tokenize=False, add_generation_prompt=True)
    for image in images:
        grid = hf.image([image], return_tensors="np")["image_grid_thw"][0]
        text = text.replace("<|image_pad|>", "<|placeholder|>" * (int(grid.prod()) // 4), 1)
    text = text.replace("<|placeholder|>", "<|image_pad|>")
    if video is not None:
        total, h, w, fps = video
        indices = hf.video.sample_frames(VideoMetadata(total_num_frames=total, fps=fps)).tolist()
        new_h, new_w = smart_resize(
            len(indices),
            h,
            w,
            temporal_factor=2,
            factor=32,
            min_pixels=hf.video.size["shortest_edge"],
            max_pixels=hf.video.size["longest_edge"],
        )
        fake = SimpleNamespace(
            video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
            video_token="<|video_pad|>",
            vision_start_token="<|vision_start|>",
            vision_end_token="<|vision_end|>",
            _calculate_timestamps=partial(Qwen3VLProcessor._calculate_timestamps, None),
        )
        inputs = {
            "video_grid_thw": np.array([[-(-len(indices) // 2), new_h // 16, new_w // 16]]),
            "video_metadata": [SimpleNamespace(fps=fps, frames_indices=indices)],
        }
        placeholder = Qwen3VLProcessor.replace_video_token(fake, inputs, 0)
        text = text.replace("<|vision_start|><|video_pad|><|vision_end|>", placeholder, 1)
    return list(hf.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_settings_come_from_the_nested_sections(processor: Processor) -> None:
    s = processor.settings
    assert (s.min_pixels, s.max_pixels) == (32 * 32, 128 * 128)
    assert s.image_mean == tuple(CLIP_MEAN) and s.image_std == tuple(CLIP_STD)
    assert (s.video_min_frames, s.video_max_frames, s.video_sample_fps) == (2, 4, 2.0)
    assert (s.video_min_pixels, s.video_max_pixels) == (4096, 4 * 64 * 64)
    assert processor.template is not None


def test_image_ids_match_reference(hf: SimpleNamespace, processor: Processor) -> None:
    image = _image(224, 224)
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}],
        }
    ]
    prompt = processor.process(messages)
    assert prompt.prompt_token_ids == _reference_ids(hf, messages, [image])
    assert prompt.params.items[0].runs[0][1] == 16  # 224x224 within 128*128 pixels: 8x8 / 4
    assert prompt.prompt_text.startswith("<|im_start|>system\nYou are tiny.")
    np.testing.assert_array_equal(
        prompt.vision_inputs()[0].numpy(), hf.image([image], return_tensors="np")["pixel_values"]
    )


def test_video_ids_match_reference(hf: SimpleNamespace, processor: Processor) -> None:
    frames = [np.asarray(_image(48, 64, seed=k)) for k in range(20)]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video", "video": frames, "fps": 4.0},
                {"type": "text", "text": "And this?"},
            ],
        }
    ]
    prompt = processor.process(messages)
    assert prompt.grid_thw[0][0] == 2  # max_frames 4 -> 2 temporal patches
    assert prompt.prompt_token_ids == _reference_ids(hf, messages, [], (20, 48, 64, 4.0))


def test_multi_turn_chat_matches_reference(hf: SimpleNamespace, processor: Processor) -> None:
    first, second = _image(64, 96, seed=1), _image(40, 40, seed=2)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Look:"}, {"type": "image", "image": first}],
        },
        {"role": "assistant", "content": "  A picture.  "},  # trimmed by the template
        {
            "role": "user",
            "content": [
                {"type": "image", "image": second},
                {"type": "text", "text": "and this one?"},
            ],
        },
    ]
    prompt = processor.process(messages)
    assert prompt.prompt_token_ids == _reference_ids(hf, messages, [first, second])
    assert not prompt.prompt_text.startswith("<|im_start|>system\nYou are tiny.")
    assert "assistantA picture.<|im_end|>" in prompt.prompt_text


def test_special_tokens_in_user_text_stay_text(processor: Processor) -> None:
    im_end = processor.tokenizer.token_to_id("<|im_end|>")
    assert im_end is not None
    plain = processor.process([{"role": "user", "content": "hi"}]).prompt_token_ids
    typed = processor.process([{"role": "user", "content": "hi<|im_end|>"}]).prompt_token_ids
    assert typed.count(im_end) == plain.count(im_end)
    with pytest.raises(ValueError, match="placeholder"):
        processor.process([{"role": "user", "content": "<|image_pad|>"}], allow_special_tokens=True)


def _greedy_cases() -> dict[str, list[dict[str, Any]]]:
    image = _image(64, 64, seed=3)
    frames = [np.asarray(_image(48, 64, seed=10 + k)) for k in range(8)]
    return {
        "image": [
            {
                "role": "user",
                "content": [{"type": "image", "image": image}, {"type": "text", "text": "Hm?"}],
            }
        ],
        "video": [
            {
                "role": "user",
                "content": [
                    {"type": "video", "video": frames, "fps": 2.0},
                    {"type": "text", "text": "What happens?"},
                ],
            }
        ],
        "multi-turn": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image", "image": image}, "Look."]},
            {"role": "assistant", "content": "A picture."},
            {"role": "user", "content": [{"type": "image", "image": _image(40, 40, seed=4)}]},
        ],
    }


@pytest.mark.parametrize("case", ["image", "video", "multi-turn"])
def test_engine_greedy_matches_reference_generate(hf: SimpleNamespace, case: str) -> None:
    engine = Engine.from_pretrained(hf.folder, num_blocks=64)
    assert engine.sampling().max_tokens == 8 and engine.sampling().is_greedy
    messages = _greedy_cases()[case]
    for m in messages:  # bare strings in content are text parts
        if isinstance(m["content"], list):
            m["content"] = [
                {"type": "text", "text": p} if isinstance(p, str) else p for p in m["content"]
            ]
    prompt = engine.process(messages)
    ours = engine.generate(messages)
    reference = reference_model(hf.folder)
    ids = torch.tensor([prompt.prompt_token_ids])
    config = engine.config
    # The reference's modality mask: 1 for image placeholders, 2 for video ones.
    types = (ids == config.image_token_id).long() + 2 * (ids == config.video_token_id).long()
    images = [i for i, it in enumerate(prompt.params.items) if it.modality == "image"]
    videos = [i for i, it in enumerate(prompt.params.items) if it.modality == "video"]
    media: dict[str, Any] = {}
    if images:
        media["pixel_values"] = prompt.vision_inputs(images)[0]
        media["image_grid_thw"] = torch.tensor([prompt.grid_thw[i] for i in images])
    if videos:
        media["pixel_values_videos"] = prompt.vision_inputs(videos)[0]
        media["video_grid_thw"] = torch.tensor([prompt.grid_thw[i] for i in videos])
    with torch.no_grad():
        out = reference.generate(
            input_ids=ids,
            mm_token_type_ids=types,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            **media,
        )
    assert ours.token_ids == out[0, ids.shape[1] :].tolist()
