"""The vision tower against the reference `Qwen3VLVisionModel`, and its partition exactness."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from common.models.qwen3_vl.config import Qwen3VLConfig
from common.models.qwen3_vl.vision import VisionTower
from common.models.qwen3_vl.weights import load_weights
from common.processing.image import as_patch_values
from common.processing.processor import Processor
from tests.model_fixtures import reference_model, write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("vision") / "ckpt", seed=1)


@pytest.fixture(scope="module")
def config(ckpt: Path) -> Qwen3VLConfig:
    return Qwen3VLConfig.from_file(ckpt)


@pytest.fixture(scope="module")
def tower(ckpt: Path, config: Qwen3VLConfig) -> VisionTower:
    return VisionTower.from_weights(config, load_weights(ckpt, config, prefix="model.visual."))


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> Any:
    return reference_model(ckpt).model.visual


def _pixels(grid: list[list[int]], patch_dim: int, seed: int = 0) -> torch.Tensor:
    rows = sum(t * h * w for t, h, w in grid)
    return torch.randn(rows, patch_dim, generator=torch.Generator().manual_seed(seed))


GRIDS = {
    "square": [[1, 4, 4]],
    "wide": [[1, 2, 8]],
    "tall": [[1, 10, 4]],
    "larger_than_pos_table": [[1, 20, 6]],
    "smallest": [[1, 2, 2]],
    "video": [[3, 4, 6]],
    "mixed_batch": [[1, 4, 6], [2, 2, 4], [1, 6, 2]],
}


@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS.keys())
def test_matches_reference(tower: VisionTower, reference: Any, grid: list[list[int]]) -> None:
    grid_thw = torch.tensor(grid)
    pixels = _pixels(grid, tower.config.patch_dim)
    with torch.no_grad():
        ref = reference(pixels, grid_thw=grid_thw, return_dict=True)
    rows, deepstack = tower.encode(pixels, grid_thw)
    assert rows.shape == ref.pooler_output.shape == (sum(tower.rows_per_item(grid_thw)), 64)
    assert (rows - ref.pooler_output).abs().max().item() <= 1e-4
    assert len(deepstack) == len(ref.deepstack_features) == 2
    for mine, theirs in zip(deepstack, ref.deepstack_features, strict=True):
        assert mine.shape == rows.shape
        assert (mine - theirs).abs().max().item() <= 1e-4


def test_items_are_independent(tower: VisionTower) -> None:
    """Encoding items together or one by one gives the same rows, in item order."""
    grid = [[1, 4, 6], [2, 2, 4]]
    pixels = _pixels(grid, tower.config.patch_dim, seed=2)
    together, ds_together = tower.encode(pixels, torch.tensor(grid))
    first, ds_first = tower.encode(pixels[:24], torch.tensor(grid[:1]))
    second, _ = tower.encode(pixels[24:], torch.tensor(grid[1:]))
    torch.testing.assert_close(together, torch.cat([first, second]), rtol=0, atol=1e-6)
    torch.testing.assert_close(ds_together[0][:6], ds_first[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("per_frame", [False, True], ids=["batched", "per_frame"])
@pytest.mark.parametrize("frames", [[0], [2], [1, 3], [0, 1, 2, 3]])
def test_partition_subset_equals_rows_of_whole(
    tower: VisionTower, frames: list[int], per_frame: bool
) -> None:
    """Per-frame attention: any subset of temporal patches encodes to those rows of the whole
    item; bit-identical with `per_frame=True`, to float32 rounding of GEMMs otherwise."""
    t, h, w = 4, 4, 6
    pixels = _pixels([[t, h, w]], tower.config.patch_dim, seed=3)
    whole, whole_ds = tower.encode(pixels, torch.tensor([[t, h, w]]), per_frame=per_frame)
    per_in, per_out = h * w, h * w // tower.config.merge_unit
    subset = torch.cat([pixels[k * per_in : (k + 1) * per_in] for k in frames])
    grid = torch.tensor([[1, h, w]] * len(frames))
    rows, ds = tower.encode(subset, grid, per_frame=per_frame)
    atol = 0.0 if per_frame else 1e-6
    expect = torch.cat([whole[k * per_out : (k + 1) * per_out] for k in frames])
    torch.testing.assert_close(rows, expect, rtol=0, atol=atol)
    for mine, full in zip(ds, whole_ds, strict=True):
        expect_ds = torch.cat([full[k * per_out : (k + 1) * per_out] for k in frames])
        torch.testing.assert_close(mine, expect_ds, rtol=0, atol=atol)


def test_per_frame_matches_batched(tower: VisionTower) -> None:
    grid = [[3, 4, 6], [1, 2, 4]]
    pixels = _pixels(grid, tower.config.patch_dim, seed=4)
    batched, ds_batched = tower.encode(pixels, torch.tensor(grid))
    framed, ds_framed = tower.encode(pixels, torch.tensor(grid), per_frame=True)
    torch.testing.assert_close(framed, batched, rtol=0, atol=1e-6)
    torch.testing.assert_close(ds_framed[1], ds_batched[1], rtol=0, atol=1e-6)


def test_processor_output_encodes_to_item_lengths(ckpt: Path, tower: VisionTower) -> None:
    processor = Processor.from_pretrained(ckpt)
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (70, 100, 3), dtype=np.uint8))
    frames = [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(4)]
    prompt = processor.process(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": image},
                    {"type": "video", "video": frames, "fps": 2.0},
                    {"type": "text", "text": "Compare them."},
                ],
            }
        ]
    )
    pixels, grid = prompt.vision_inputs()
    rows, deepstack = tower.encode(pixels, grid)
    assert rows.shape[0] == sum(prompt.params.lengths)
    assert tower.rows_per_item(grid) == prompt.params.lengths
    # The video's partitions encode to exactly its rows, partition by partition.
    video = prompt.params.items[1]
    video_rows, _ = tower.encode(*prompt.vision_inputs([1]))
    part = video.partitions[1]  # its patch rows, sliced as the router sends them
    _, h, w = prompt.grid_thw[1]
    codes = prompt.pixel_values[1][part.input_start : part.input_end]
    assert prompt.settings is not None
    temporal = (part.input_end - part.input_start) // (h * w)
    part_grid = torch.tensor([[temporal, h, w]])
    part_rows, _ = tower.encode(as_patch_values(codes, prompt.settings), part_grid)
    first = video.partitions[0].output_rows
    torch.testing.assert_close(
        part_rows, video_rows[first : first + video.partitions[1].output_rows], rtol=0, atol=1e-6
    )
    assert len(deepstack) == len(tower.config.deepstack_visual_indexes)


def test_bfloat16_is_close(ckpt: Path, config: Qwen3VLConfig, tower: VisionTower) -> None:
    bf16 = VisionTower.from_weights(
        config, load_weights(ckpt, config, prefix="model.visual.", dtype=torch.bfloat16)
    )
    assert bf16.dtype == torch.bfloat16
    grid = torch.tensor([[1, 4, 4]])
    pixels = _pixels([[1, 4, 4]], config.vision.patch_dim)
    rows, _ = bf16.encode(pixels, grid)
    ref, _ = tower.encode(pixels, grid)
    assert rows.dtype == torch.bfloat16
    assert (rows.float() - ref).abs().max().item() < 0.05


def test_from_weights_names_missing_and_misshaped(ckpt: Path, config: Qwen3VLConfig) -> None:
    tensors = load_weights(ckpt, config, prefix="model.visual.")
    missing = dict(tensors)
    missing.pop("model.visual.merger.linear_fc2.bias")
    with pytest.raises(ValueError, match=r"missing: model\.visual\.merger\.linear_fc2\.bias"):
        VisionTower.from_weights(config, missing)
    bad = dict(tensors)
    bad["model.visual.pos_embed.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"misshaped: model\.visual\.pos_embed\.weight"):
        VisionTower.from_weights(config, bad)


def test_encode_rejects_bad_shapes(tower: VisionTower) -> None:
    with pytest.raises(ValueError, match="does not match grid_thw"):
        tower.encode(torch.zeros(5, tower.config.patch_dim), torch.tensor([[1, 2, 2]]))
    with pytest.raises(ValueError, match="multiples of 2"):
        tower.encode(torch.zeros(6, tower.config.patch_dim), torch.tensor([[1, 3, 2]]))


def test_frame_tables_are_reused_and_follow_the_weights(ckpt: Path, config: Qwen3VLConfig) -> None:
    """The position tables of a frame size are computed once per tower; changing the
    weights in place gives the tables of the new weights, as a fresh tower computes them."""

    def fresh() -> VisionTower:
        return VisionTower.from_weights(config, load_weights(ckpt, config, prefix="model.visual."))

    tower = fresh()
    grid = torch.tensor([[1, 4, 6], [2, 4, 6]])
    pixels = _pixels(grid.tolist(), tower.config.patch_dim)
    first, _ = tower.encode(pixels, grid)
    again, _ = tower.encode(pixels, grid)
    assert torch.equal(first, again)
    assert len(tower._frame_cache) == 1  # one frame size, computed once
    other = fresh()
    with torch.no_grad():
        tower.pos_embed.weight.mul_(2)
        other.pos_embed.weight.mul_(2)
    changed, _ = tower.encode(pixels, grid)
    assert not torch.equal(changed, first)
    assert torch.equal(changed, other.encode(pixels, grid)[0])


def test_a_tower_is_built_defined_and_without_the_compiler(ckpt: Path) -> None:
    # The position table was `torch.empty` when built directly (whatever memory held); and
    # building under the meta device ran the embedding's random init through torch's
    # reference ops, which import torch._dynamo: 1.9 s of every encoder's start (s36).
    import subprocess
    import sys

    config = Qwen3VLConfig.from_file(ckpt).vision
    torch.full((config.num_position_embeddings, config.hidden_size), 7.0)  # memory to reuse
    tables = [VisionTower(config).pos_embed.weight.detach() for _ in range(2)]
    assert torch.equal(*tables) and not tables[0].any()
    code = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from common.models.qwen3_vl.config import Qwen3VLConfig\n"
        "from common.models.qwen3_vl.weights import load_weights\n"
        "from common.models.qwen3_vl.vision import VisionTower\n"
        f"ckpt = Path({str(ckpt)!r})\n"
        "config = Qwen3VLConfig.from_file(ckpt)\n"
        "VisionTower.from_weights(config, load_weights(ckpt, config, prefix='model.visual.'))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
