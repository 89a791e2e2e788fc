"""Qwen3-VL input processing against the reference processors, and the prompt layout: images,
video sampling and placeholders, and mRoPE positions.

The chat template, payload order, hashes, errors and typed messages are in
test_processor_messages.py, which shares the fixtures and helpers here.
"""

from __future__ import annotations

import io
import threading
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from common.models.qwen3_vl.preprocessor import ProcessorSettings
from common.multimodal.params import Modality
from common.processing.image import smart_resize, to_rgb
from common.processing.messages import (
    Message,
    messages_from_dicts,
)
from common.processing.processor import Processor
from common.processing.video import sample_frame_indices, smart_resize_video, temporal_timestamps
from tests.model_fixtures import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("proc") / "ckpt")


@pytest.fixture(scope="module")
def processor(ckpt: Path) -> Processor:
    return Processor.from_pretrained(ckpt)


def _image(h: int, w: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    return Image.fromarray(data.squeeze(-1) if channels == 1 else data, mode=mode)


def _frames(n: int, h: int, w: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(n)]


def _user(*parts: dict) -> tuple[Message, ...]:
    """One user message, written in the dict form and typed as the Engine's edge does."""
    return messages_from_dicts([{"role": "user", "content": list(parts)}])


# --- images against the reference PIL image processor ---------------------------------------

IMAGE_CASES = {
    "wide": (50, 90, "RGB"),
    "tall": (120, 40, "RGB"),
    "below_min_pixels": (12, 20, "RGB"),
    "above_max_pixels": (300, 220, "RGB"),
    "thin": (20, 400, "RGB"),
    "rgba": (64, 64, "RGBA"),
    "grayscale": (70, 45, "L"),
}


@pytest.mark.parametrize("case", IMAGE_CASES.values(), ids=IMAGE_CASES.keys())
def test_image_matches_reference(processor: Processor, case: tuple[int, int, str]) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    s = processor.settings
    reference = Qwen2VLImageProcessorPil(
        patch_size=s.patch_size,
        merge_size=s.merge_size,
        temporal_patch_size=s.temporal_patch_size,
        size={"shortest_edge": s.min_pixels, "longest_edge": s.max_pixels},
        image_mean=list(s.image_mean),
        image_std=list(s.image_std),
    )
    h, w, mode = case
    image = _image(h, w, mode=mode)
    expected = reference([image], return_tensors="np")
    prompt = processor.process(_user({"type": "image", "image": image}))
    assert prompt.pixel_values[0].dtype == torch.uint8  # patch codes; values where encoded
    values, _ = prompt.vision_inputs()
    assert values.dtype == torch.float32
    np.testing.assert_array_equal(values.numpy(), expected["pixel_values"])
    assert [list(prompt.grid_thw[0])] == expected["image_grid_thw"].tolist()


def test_an_rgb_image_is_not_copied_to_be_made_rgb() -> None:
    """Processing holds one decoded copy of an RGB image, not two (`to_rgb`); other modes
    convert, transparency composited onto white."""
    rgb = Image.new("RGB", (8, 4), (10, 20, 30))
    assert to_rgb(rgb) is rgb
    rgba = Image.new("RGBA", (8, 4), (10, 20, 30, 0))
    assert to_rgb(rgba).mode == "RGB" and to_rgb(rgba).getpixel((0, 0)) == (255, 255, 255)
    grey = Image.new("L", (8, 4), 7)
    assert to_rgb(grey).getpixel((0, 0)) == (7, 7, 7)


def test_smart_resize_matches_reference() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        smart_resize as ref_image,
    )
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as ref_video

    rng = np.random.default_rng(0)
    for h, w in rng.integers(8, 2000, (200, 2)).tolist():
        bounds = {"min_pixels": 4096, "max_pixels": 300_000}
        assert smart_resize(h, w, factor=32, **bounds) == ref_image(h, w, 32, **bounds)
        for frames in (2, 5, 16):
            bounds = {"min_pixels": 8192, "max_pixels": 2_000_000}
            ours = smart_resize_video(frames, h, w, temporal_factor=2, factor=32, **bounds)
            theirs = ref_video(frames, h, w, temporal_factor=2, factor=32, **bounds)
            assert ours == theirs, (frames, h, w)


def test_image_sources_agree(processor: Processor, tmp_path: Path) -> None:
    image = _image(40, 70, seed=5)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    path = tmp_path / "x.png"
    path.write_bytes(buffer.getvalue())
    sources = [image, buffer.getvalue(), str(path), path, np.asarray(image)]
    prompts = [processor.process(_user({"type": "image", "image": s})) for s in sources]
    for p in prompts[1:]:
        assert torch.equal(p.pixel_values[0], prompts[0].pixel_values[0])
        assert p.params.items[0].content_hash == prompts[0].params.items[0].content_hash
    url = "data:image/png;base64," + __import__("base64").b64encode(buffer.getvalue()).decode()
    via_url = processor.process(_user({"type": "image_url", "image_url": {"url": url}}))
    assert via_url.params.hashes == prompts[0].params.hashes


def test_an_image_is_turned_upright_by_its_exif_orientation(processor: Processor) -> None:
    # A phone's portrait photo is stored landscape with Orientation 6 (turn 90 degrees
    # clockwise to show); it was processed sideways. transformers' `load_image` turns it.
    from PIL import ImageOps

    stored = _image(40, 80, seed=6)  # 80 wide, 40 tall
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    stored.save(buffer, format="PNG", exif=exif.tobytes())
    shown = ImageOps.exif_transpose(Image.open(io.BytesIO(buffer.getvalue())))
    assert shown.size == (40, 80)
    turned = processor.process(_user({"type": "image", "image": buffer.getvalue()}))
    want = processor.process(_user({"type": "image", "image": shown}))
    assert turned.params.items[0].grid_thw == want.params.items[0].grid_thw
    assert torch.equal(turned.pixel_values[0], want.pixel_values[0])


def test_an_image_whose_exif_is_mangled_keeps_its_stored_orientation(processor: Processor) -> None:
    # Its pixels decode, its EXIF does not: turning it raised struct.error out of
    # processing, an HTTP 500.
    stored = Image.new("RGB", (64, 32), (10, 20, 30))
    exif = Image.Exif()
    exif[0x0112] = 6  # turn to show
    exif[0x010F] = "camera maker"
    exif[0x8769] = {0x9003: "2020:01:01 00:00:00"}
    buffer = io.BytesIO()
    stored.save(buffer, format="JPEG", exif=exif.tobytes())
    data = bytearray(buffer.getvalue())
    data[data.index(b"Exif\x00\x00") + 6 + 11] = 2  # a tag number's low byte
    mangled = processor.process(_user({"type": "image", "image": bytes(data)}))
    plain = processor.process(_user({"type": "image", "image": stored}))
    assert mangled.params.items[0].grid_thw == plain.params.items[0].grid_thw


# --- video ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("total", "fps"), [(30, 10.0), (7, 2.0), (100, 24.0), (3, 30.0)])
def test_frame_sampling_matches_reference(total: int, fps: float) -> None:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    settings = ProcessorSettings(video_sample_fps=2.0, video_min_frames=4, video_max_frames=768)
    fake = SimpleNamespace(fps=2.0, min_frames=4, max_frames=768)
    metadata = VideoMetadata(total_num_frames=total, fps=fps)
    expected = Qwen3VLVideoProcessor.sample_frames(fake, metadata).tolist()
    assert sample_frame_indices(total, fps, settings) == expected


@pytest.mark.parametrize("indices", [[0, 3, 5], [0, 6, 12, 17], [4]])
def test_timestamps_match_reference(indices: list[int]) -> None:
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    expected = Qwen3VLProcessor._calculate_timestamps(None, list(indices), 10.0, 2)
    assert temporal_timestamps(indices, 10.0, 2) == expected


def test_video_prompt_layout(processor: Processor) -> None:
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    frames = _frames(6, 48, 64)
    prompt = processor.process(
        _user(
            {"type": "text", "text": "Watch:"},
            {"type": "video", "video": frames, "fps": 2.0},
            {"type": "text", "text": "What happens?"},
        )
    )
    (item,) = prompt.params.items
    assert item.modality == Modality.VIDEO
    assert prompt.grid_thw == ((3, 4, 4),) and item.grid_thw == (3, 4, 4)
    assert item.frame_timestamps == (0.25, 1.25, 2.25)

    # The placeholder text is the reference processor's for the same grid and frames.
    fake = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
        video_token="<|video_pad|>",
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        _calculate_timestamps=partial(Qwen3VLProcessor._calculate_timestamps, None),
    )
    inputs = {
        "video_grid_thw": np.array([[3, 4, 4]]),
        "video_metadata": [SimpleNamespace(fps=2.0, frames_indices=list(range(6)))],
    }
    placeholder = Qwen3VLProcessor.replace_video_token(fake, inputs, 0)
    assert placeholder.startswith("<0.2 seconds><|vision_start|><|video_pad|>")
    assert prompt.prompt_text == (
        f"<|im_start|>user\nWatch:{placeholder}What happens?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompt.prompt_token_ids == processor.tokenizer.encode(prompt.prompt_text).ids

    # One run per temporal patch, each wrapped in vision_start/end, timestamps between them.
    ids = prompt.prompt_token_ids
    cfg = processor.config
    assert len(item.runs) == 3 and all(n == 4 for _, n in item.runs)
    for k, (start, n) in enumerate(item.runs):
        assert (
            ids[start - 1] == cfg.vision_start_token_id
            and ids[start + n] == cfg.vision_end_token_id
        )
        assert set(ids[start : start + n]) == {cfg.video_token_id}
        if k:
            prev_end = item.runs[k - 1][0] + item.runs[k - 1][1]
            gap = processor.decode(ids[prev_end + 1 : start - 1])
            assert gap == f"<{item.frame_timestamps[k]:.1f} seconds>"
    mask = prompt.params.placeholder_mask(len(ids))
    assert np.array_equal(mask, np.asarray(ids) == cfg.video_token_id)

    # Partitions: one per temporal patch, slicing the item's patch rows.
    assert [(p.input_start, p.input_end, p.output_rows) for p in item.partitions] == [
        (0, 16, 4),
        (16, 32, 4),
        (32, 48, 4),
    ]
    assert prompt.pixel_values[0].shape == (48, processor.config.vision.patch_dim)


def test_video_partition_hashes_share_common_frames(processor: Processor) -> None:
    base = _frames(8, 64, 64, seed=1)
    changed = base[:4] + _frames(4, 64, 64, seed=2)
    settings_fps = {"type": "video", "fps": 2.0}
    a = processor.process(_user({**settings_fps, "video": base})).params.items[0]
    b = processor.process(_user({**settings_fps, "video": changed})).params.items[0]
    assert len(a.partitions) == 4
    assert [p.content_hash for p in a.partitions[:2]] == [p.content_hash for p in b.partitions[:2]]
    assert a.partitions[2].content_hash != b.partitions[2].content_hash
    assert a.content_hash != b.content_hash
    assert len({p.content_hash for p in a.partitions} | {a.content_hash}) == 5


def test_video_array_input_and_odd_frame_count(processor: Processor) -> None:
    frames = np.stack(_frames(5, 40, 40, seed=3))
    prompt = processor.process(_user({"type": "video", "video": frames, "fps": 1.0}))
    item = prompt.params.items[0]
    # 5 frames at 1 fps, sampled at 2 fps -> all 5; padded to 6 -> 3 temporal patches.
    assert prompt.grid_thw[0][0] == 3
    assert item.frame_timestamps == (0.5, 2.5, 4.0)


def _documented_mrope_positions(prompt: Any, merge: int) -> np.ndarray:
    """mRoPE positions built only from what `ProcessedPrompt`'s docstring promises."""
    n = len(prompt.prompt_token_ids)
    runs = sorted(
        (start, length, grid)
        for item, grid in zip(prompt.params.items, prompt.grid_thw, strict=True)
        for start, length in item.runs
    )
    out = np.zeros((3, n), dtype=np.int64)
    pos = cursor = 0
    for start, length, (_, h, w) in [*runs, (n, 0, (1, 0, 0))]:
        text = np.arange(start - cursor) + pos
        out[:, cursor:start] = text
        pos += start - cursor
        if length:
            rows, cols = np.divmod(np.arange(length), w // merge)
            out[:, start : start + length] = [pos + 0 * rows, pos + rows, pos + cols]
            pos += max(h, w) // merge
        cursor = start + length
    return out


def test_grid_thw_gives_reference_mrope_positions(processor: Processor) -> None:
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    prompt = processor.process(
        _user(
            {"type": "image", "image": _image(40, 100, seed=1)},
            {"type": "text", "text": "then"},
            {"type": "video", "video": _frames(6, 64, 96), "fps": 2.0},
            {"type": "image", "image": _image(90, 30, seed=2)},
        )
    )
    cfg = processor.config
    ids = torch.tensor([prompt.prompt_token_ids])
    types = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
    grids = [torch.tensor(g) for g in prompt.grid_thw]
    kinds = [i.modality for i in prompt.params.items]
    fake = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2)),
        get_vision_position_ids=partial(Qwen3VLModel.get_vision_position_ids, None),
    )
    expected, _ = Qwen3VLModel.get_rope_index(
        fake,
        ids,
        types,
        image_grid_thw=torch.stack(
            [g for g, k in zip(grids, kinds, strict=True) if k == Modality.IMAGE]
        ),
        video_grid_thw=torch.stack(
            [g for g, k in zip(grids, kinds, strict=True) if k == Modality.VIDEO]
        ),
    )
    np.testing.assert_array_equal(_documented_mrope_positions(prompt, 2), expected[:, 0].numpy())


def test_tokenizing_a_long_prompt_lets_other_threads_run(processor: Processor) -> None:
    # `Tokenizer.encode` held the GIL for its whole call: a tenant's 1 MiB prompt, tokenized
    # on a prepare thread, stalled the router's event loop for everyone for a second
    # (httpattack review, s33). Measured: the longest gap of a thread ticking every 5 ms.
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        started = time.monotonic()
        prompt = processor.process_text("a " * 1_000_000)
        took = time.monotonic() - started
    finally:
        done.set()
        ticker.join()
    assert len(prompt.prompt_token_ids) >= 1_000_000
    assert max(gaps) < max(0.1, took / 4), (max(gaps), took)  # encode's: the whole call
