"""Checkpoint weights (names, shapes, load/save) and the deterministic tiny checkpoint."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import CheckpointError
from common.models.qwen3_vl.config import Qwen3VLConfig
from common.models.qwen3_vl.weights import (
    INDEX_FILE,
    expected_weight_shapes,
    load_weights,
    save_weights,
)
from common.models.tiny import default_checkpoint, make_tiny_checkpoint, tiny_config
from common.processing.processor import Processor
from tests.model_fixtures import (
    save_reference_checkpoint,
    tiny_reference_config_dict,
    tiny_token_ids,
    write_tiny_checkpoint,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def reference_ckpt(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, torch.Tensor], dict]:
    config_dict = tiny_reference_config_dict(tie_word_embeddings=request.param)
    folder, state = save_reference_checkpoint(tmp_path_factory.mktemp("ref") / "ckpt", config_dict)
    return folder, state, config_dict


def _file_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in load_file(str(folder / "model.safetensors")).items()}


def test_expected_shapes_match_reference_saved_names(reference_ckpt) -> None:
    folder, _, config_dict = reference_ckpt
    config = Qwen3VLConfig.from_dict(config_dict)
    assert expected_weight_shapes(config) == _file_shapes(folder)
    assert ("lm_head.weight" in expected_weight_shapes(config)) == (not config.tie_word_embeddings)


def test_expected_shapes_with_attention_bias(tmp_path: Path) -> None:
    config_dict = tiny_reference_config_dict(attention_bias=True, vision_depth=1, deepstack=(0,))
    folder, _ = save_reference_checkpoint(tmp_path / "ckpt", config_dict)
    assert expected_weight_shapes(Qwen3VLConfig.from_dict(config_dict)) == _file_shapes(folder)


def test_load_reference_saved_checkpoint(reference_ckpt) -> None:
    folder, state, _ = reference_ckpt
    config = Qwen3VLConfig.from_file(folder)
    tensors = load_weights(folder, config)
    assert set(tensors) == set(expected_weight_shapes(config))
    for name, tensor in tensors.items():
        assert torch.equal(tensor, state[name]), name


def test_load_prefix_and_dtype(tiny_ckpt: Path) -> None:
    config = Qwen3VLConfig.from_file(tiny_ckpt)
    lm = load_weights(
        tiny_ckpt, config, prefix=("model.language_model.", "lm_head."), dtype=torch.bfloat16
    )
    assert "lm_head.weight" in lm
    assert all(n.startswith(("model.language_model.", "lm_head.")) for n in lm)
    assert all(t.dtype == torch.bfloat16 for t in lm.values())
    visual = load_weights(tiny_ckpt, config, prefix="model.visual.")
    assert visual and all(n.startswith("model.visual.") for n in visual)
    assert set(lm) | set(visual) == set(expected_weight_shapes(config))


def test_reference_sharded_checkpoint_loads(tmp_path: Path) -> None:
    config_dict = tiny_reference_config_dict(vision_depth=1, deepstack=(0,))
    folder, state = save_reference_checkpoint(
        tmp_path / "ckpt", config_dict, max_shard_size="100KB"
    )
    assert (folder / INDEX_FILE).is_file()
    tensors = load_weights(folder, Qwen3VLConfig.from_file(folder))
    assert all(torch.equal(t, state[n]) for n, t in tensors.items())


def test_save_weights_sharded_roundtrip(
    tiny_ckpt: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = Qwen3VLConfig.from_file(tiny_ckpt)
    tensors = load_weights(tiny_ckpt, config)
    out = tmp_path / "sharded"
    files = save_weights(out, tensors, max_shard_bytes=256 * 1024)
    assert len(files) > 2 and (out / INDEX_FILE) in files
    (out / "config.json").write_text((tiny_ckpt / "config.json").read_text())
    with caplog.at_level(logging.INFO, logger="common.models.qwen3_vl.weights"):
        again = load_weights(out, config)
    # Loading a sharded checkpoint shows its progress: one line a shard, then the total.
    shards = len(files) - 1
    progress = [r.getMessage() for r in caplog.records if ": shard " in r.getMessage()]
    assert len(progress) == shards and progress[-1].count(f"shard {shards} of {shards}") == 1
    assert "MB" in caplog.records[-1].getMessage()
    assert set(again) == set(tensors)
    assert all(torch.equal(again[n], tensors[n]) for n in tensors)


def _copy_with(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_weight_is_named(tiny_ckpt: Path, tmp_path: Path) -> None:
    name = "model.visual.blocks.1.attn.qkv.bias"
    folder = _copy_with(tiny_ckpt, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(
        CheckpointError, match=r"missing 1: model\.visual\.blocks\.1\.attn\.qkv\.bias"
    ):
        load_weights(folder, Qwen3VLConfig.from_file(folder))


def test_misshaped_weight_is_named(tiny_ckpt: Path, tmp_path: Path) -> None:
    name = "model.language_model.layers.0.mlp.up_proj.weight"

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name][:-1].contiguous()

    folder = _copy_with(tiny_ckpt, tmp_path / "s", edit)
    with pytest.raises(CheckpointError, match=rf"misshaped 1: {name} \(expected \[128, 64\]"):
        load_weights(folder, Qwen3VLConfig.from_file(folder))


def test_unexpected_weight_is_named_but_inv_freq_is_harmless(
    tiny_ckpt: Path, tmp_path: Path
) -> None:
    def harmless(t: dict[str, torch.Tensor]) -> None:
        t["model.visual.rotary_pos_emb.inv_freq"] = torch.ones(4)

    ok = _copy_with(tiny_ckpt, tmp_path / "ok", harmless)
    load_weights(ok, Qwen3VLConfig.from_file(ok), prefix="model.visual.")

    def extra(t: dict[str, torch.Tensor]) -> None:
        t["model.visual.blocks.9.norm1.weight"] = torch.ones(4)

    bad = _copy_with(tiny_ckpt, tmp_path / "bad", extra)
    with pytest.raises(CheckpointError, match=r"unexpected 1: model\.visual\.blocks\.9\.norm1"):
        load_weights(bad, Qwen3VLConfig.from_file(bad))


def test_no_weights_file_is_clear(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"neither model\.safetensors nor"):
        load_weights(tmp_path, Qwen3VLConfig.from_dict(tiny_reference_config_dict()))


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        # A model card may suggest YaRN to stretch the context: refused, not run as plain
        # RoPE (it loaded and answered differently from the reference).
        ({"rope_type": "yarn", "factor": 8.0}, "rope_type 'yarn' is not supported"),
        ({"type": "dynamic", "factor": 2.0}, "rope_scaling.type 'dynamic' is not supported"),
        # Loaded, then failed every forward.
        ({"mrope_section": [4, 2, 1]}, "mrope_section .* summing to head_dim // 2"),
        ({"mrope_section": [4, 4]}, "mrope_section .* must be 3 numbers"),
    ],
)
def test_a_rotary_setting_the_model_does_not_compute_is_refused_at_load(
    rope: dict[str, Any], message: str
) -> None:
    raw = tiny_reference_config_dict()
    text = raw["text_config"]
    params = dict(text.pop("rope_parameters", None) or {})
    if "type" in rope:  # the older form: `rope_scaling` with `type`
        del params["rope_type"]
    params.update(rope)
    text["rope_scaling" if "type" in rope else "rope_parameters"] = params
    with pytest.raises(ValueError, match=message):
        Qwen3VLConfig.from_dict(raw)


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_tiny_checkpoint_is_deterministic(tmp_path: Path) -> None:
    a = make_tiny_checkpoint(tmp_path / "a", seed=3)
    b = make_tiny_checkpoint(tmp_path / "b", seed=3)
    assert _digests(a) == _digests(b)
    c = make_tiny_checkpoint(tmp_path / "c", seed=4)
    assert _digests(c)["model.safetensors"] != _digests(a)["model.safetensors"]
    assert _digests(c)["tokenizer.json"] == _digests(a)["tokenizer.json"]
    # Another process with another hash seed writes the same bytes.
    code = (
        "import sys; from common.models.tiny import make_tiny_checkpoint; "
        "make_tiny_checkpoint(sys.argv[1], seed=3)"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "d")], check=True, env=env)
    assert _digests(tmp_path / "d") == _digests(a)


def test_tiny_checkpoint_contents(tiny_ckpt: Path) -> None:
    names = {p.name for p in tiny_ckpt.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "preprocessor_config.json",
        "generation_config.json",
    } <= names
    config = Qwen3VLConfig.from_file(tiny_ckpt)
    params = sum(math.prod(s) for s in expected_weight_shapes(config).values())
    assert 300_000 <= params <= 3_000_000
    assert set(_file_shapes(tiny_ckpt)) == set(expected_weight_shapes(config))
    ids = tiny_token_ids()
    assert config.image_token_id == ids["<|image_pad|>"]
    assert config.video_token_id == ids["<|video_pad|>"]
    assert config.vision_start_token_id == ids["<|vision_start|>"]
    assert config.eos_token_ids == (ids["<|im_end|>"], ids["<|endoftext|>"])
    assert json.loads((tiny_ckpt / "generation_config.json").read_text())["eos_token_id"] == [
        ids["<|im_end|>"],
        ids["<|endoftext|>"],
    ]
    processor = Processor.from_pretrained(tiny_ckpt)
    vocab = processor.tokenizer.get_vocab_size(with_added_tokens=True)
    assert 1000 <= vocab <= config.text.vocab_size <= 2048
    text = "Describe this picture, please."
    ids_text = processor.tokenizer.encode(text).ids
    assert processor.decode(ids_text) == text
    assert len(ids_text) < len(text) // 2  # a trained BPE, not bytes


def test_bench_size_bounds() -> None:
    ids = tiny_token_ids()
    config = tiny_config("bench", vocab_size=1152, token_ids=ids)
    params = sum(math.prod(s) for s in expected_weight_shapes(config).values())
    assert 50_000_000 <= params <= 150_000_000


def test_reference_loads_tiny_checkpoint(tiny_ckpt: Path) -> None:
    from transformers import Qwen3VLForConditionalGeneration

    loaded: Any = Qwen3VLForConditionalGeneration.from_pretrained(
        str(tiny_ckpt), output_loading_info=True
    )
    info = loaded[1]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]


def test_default_checkpoint_is_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="common.models.tiny"):
        first = default_checkpoint()
    assert first == tmp_path / "checkpoints" / "tiny-0"
    assert "meaningless" in caplog.text
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="common.models.tiny"):
        assert default_checkpoint() == first
    assert caplog.text == ""
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == ["tiny-0"]  # no temp folders left
