"""A checkpoint's small files are read strictly: a value that would load a silently different
model, or fail every request, is refused at start with a `CheckpointError` naming the file
and the key; an unreadable file (bad JSON, a FIFO, /dev/zero, too large) names its path;
each role's `main` exits 2 with one line. The chat template's checks are in
tests/test_checkpoint_template.py.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from common.errors import CheckpointError, FieldError
from common.models.checkpoint_files import read_checkpoint_json, read_checkpoint_text
from common.models.generation import GenerationDefaults
from common.models.qwen3_vl.config import Qwen3VLConfig
from common.models.tiny import default_checkpoint
from common.processing.processor import Processor
from common.server.main import RoleMain
from common.settings.base import ServerSettings
from common.wire.sampling import sampling_from_proto
from epd.v1 import sampling_pb2

Raw = dict[str, Any]


def _config(ckpt_copy: Path) -> Raw:
    raw: Raw = json.loads((ckpt_copy / "config.json").read_text())
    return raw


def _set(path: str, value: Any) -> Callable[[Raw], None]:
    def edit(raw: Raw) -> None:
        *parents, last = path.split(".")
        for key in parents:
            raw = raw[key]
        if value is _DELETE:
            del raw[last]
        else:
            raw[last] = value

    return edit


_DELETE = object()
_ROPE = "text_config.rope_parameters"

# (edit of the tiny config.json, the key the error must name, what it must say)
BAD_CONFIGS = [
    ("tie_word_embeddings", "false", "must be true or false"),  # bool("false") was True
    ("text_config.attention_bias", "false", "must be true or false"),
    (f"{_ROPE}.mrope_interleaved", "false", "must be true or false"),
    ("text_config.rms_norm_eps", math.nan, "finite number > 0"),
    ("text_config.rms_norm_eps", -1.0, "finite number > 0"),
    (f"{_ROPE}.rope_theta", math.nan, "finite number > 0"),
    (f"{_ROPE}.rope_theta", -1.0, "finite number > 0"),
    (f"{_ROPE}.mrope_section", [10, -1, -1], "integer >= 0"),
    ("text_config.hidden_size", 64.9, "must be an integer"),  # int() made it 64
    ("text_config.hidden_size", "64", "must be an integer"),
    ("text_config.hidden_size", 0, "integer >= 1"),
    ("text_config.vocab_size", _DELETE, "is missing"),
    ("text_config.num_hidden_layers", -1, "integer >= 1"),
    ("text_config.max_position_embeddings", 0, "integer >= 2"),
    ("text_config.num_key_value_heads", 3, "3 must divide num_attention_heads 4"),
    ("text_config.num_key_value_heads", 0, "integer >= 1"),
    ("text_config.vocab_size", 100, "outside the vocabulary"),  # image_token_id 1143
    ("eos_token_id", [1000000], "outside the vocabulary"),
    ("eos_token_id", "<|im_end|>", "must be an integer"),
    ("vision_config.deepstack_visual_indexes", [0, 99], "99 is not a block in \\[0, 3\\)"),
    ("vision_config.num_heads", 3, "must divide hidden_size"),
    ("vision_config.depth", 0, "integer >= 1"),
    ("vision_config.num_position_embeddings", 250, "must be a square"),
    ("vision_config.out_hidden_size", 32, "must equal text_config.hidden_size"),
    ("model_type", "llama", "is not 'qwen3_vl'"),
    ("text_config", "oops", "must be a JSON object"),
]


@pytest.mark.parametrize(("key", "value", "message"), BAD_CONFIGS)
def test_a_bad_config_value_is_refused_naming_the_file_and_key(
    ckpt_copy: Path, key: str, value: Any, message: str
) -> None:
    raw = _config(ckpt_copy)
    _set(key, value)(raw)
    (ckpt_copy / "config.json").write_text(json.dumps(raw))
    named = "image_token_id" if key == "text_config.vocab_size" and value == 100 else key
    with pytest.raises(CheckpointError, match=rf"config\.json: {named}\b.*{message}"):
        Qwen3VLConfig.from_file(ckpt_copy)
    with pytest.raises(CheckpointError, match=r"config\.json: "):
        Processor.from_pretrained(ckpt_copy)  # what the router and the Engine load


def test_a_whole_float_is_its_integer(ckpt_copy: Path) -> None:
    raw = _config(ckpt_copy)
    raw["text_config"]["hidden_size"] = 64.0
    assert Qwen3VLConfig.from_dict(raw) == Qwen3VLConfig.from_dict(_config(ckpt_copy))


# Qwen/Qwen3-VL-2B-Instruct's config.json as published (transformers 4.57 layout: rope
# under `rope_scaling`, an integer `rope_theta`, `dtype`, the vision `model_type` qwen3_vl).
REAL_2B = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "mrope_interleaved": True,
            "mrope_section": [24, 20, 20],
            "rope_type": "default",
        },
        "rope_theta": 5000000,
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": True,
    "transformers_version": "4.57.0.dev0",
    "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17],
        "depth": 24,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1024,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4096,
        "model_type": "qwen3_vl",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2048,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}


def test_real_config_files_load_without_a_warning(
    ckpt_copy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import transformers

    caplog.set_level(logging.WARNING)
    config = Qwen3VLConfig.from_dict(REAL_2B)
    assert (config.text.rope_theta, config.text.mrope_section) == (5e6, (24, 20, 20))
    assert config.tie_word_embeddings and config.eos_token_ids == (151645,)
    # Everything transformers 5 writes (to_dict, not only the diff save_pretrained keeps).
    full = transformers.Qwen3VLConfig(**_config(ckpt_copy)).to_dict()
    assert Qwen3VLConfig.from_dict(full) == Qwen3VLConfig.from_dict(_config(ckpt_copy))
    assert [r.message for r in caplog.records] == []


def test_an_unknown_key_is_warned_once_naming_file_and_key(
    ckpt_copy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    raw = _config(ckpt_copy)
    raw["text_config"].update(use_sliding_window=True, sliding_window=128)
    (ckpt_copy / "config.json").write_text(json.dumps(raw))
    caplog.set_level(logging.WARNING)
    Qwen3VLConfig.from_file(ckpt_copy)
    Qwen3VLConfig.from_file(ckpt_copy)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    for key in ("text_config.use_sliding_window", "text_config.sliding_window"):
        assert any("config.json" in line and key in line for line in lines)


@pytest.mark.parametrize(
    "name",
    [
        "config.json",
        "generation_config.json",
        "preprocessor_config.json",
        "tokenizer_config.json",
        "chat_template.json",
        "tokenizer.json",
    ],
)
def test_a_file_that_is_not_json_is_named(ckpt_copy: Path, name: str) -> None:
    (ckpt_copy / name).write_text('{"a": ')
    with pytest.raises(CheckpointError, match=rf"{name}: not "):
        Processor.from_pretrained(ckpt_copy)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "chat_template.jinja"])
def test_a_file_that_is_not_a_regular_file_is_refused_at_once(ckpt_copy: Path, name: str) -> None:
    (ckpt_copy / name).unlink(missing_ok=True)
    if name == "tokenizer.json":
        os.mkfifo(ckpt_copy / name)  # opening it waited for a writer for good
    else:
        (ckpt_copy / name).symlink_to("/dev/zero")  # read until MemoryError
    with pytest.raises(CheckpointError, match=rf"{name}: not a regular file"):
        Processor.from_pretrained(ckpt_copy)


def test_a_file_past_the_size_cap_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"pad": "x" * 100}))
    assert read_checkpoint_json(path)["pad"] == "x" * 100
    with pytest.raises(CheckpointError, match=r"config\.json: \d+ bytes, more than 64"):
        read_checkpoint_text(path, limit=64)


def test_generation_defaults_are_checked_at_load(ckpt_copy: Path) -> None:
    bad = {"temperature": math.nan, "do_sample": True, "max_new_tokens": -3, "top_p": 7}
    (ckpt_copy / "generation_config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: temperature"):
        Processor.from_pretrained(ckpt_copy)
    for raw, key in (
        ({"top_p": 7}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"top_k": -1}, "top_k"),
        ({"do_sample": "true"}, "do_sample"),
        ({"eos_token_id": [1, "x"]}, "eos_token_id"),
    ):
        with pytest.raises(CheckpointError, match=rf"generation_config\.json: {key}"):
            GenerationDefaults.from_dict(raw)
    (ckpt_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": 5000}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id 5000"):
        Qwen3VLConfig.from_file(ckpt_copy)


def test_a_bad_default_never_escapes_sampling_from_proto_as_a_sampling_error() -> None:
    defaults = GenerationDefaults(temperature=math.nan)  # built past from_dict's check
    with pytest.raises(FieldError, match=r"sampling\.temperature"):
        sampling_from_proto(sampling_pb2.SamplingParams(temperature=0.0), defaults)


def test_a_role_main_exits_2_with_one_line_on_a_checkpoint_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def serve(settings: ServerSettings) -> Any:
        raise CheckpointError("/m/config.json: text_config.vocab_size is missing")

    entry = RoleMain(ServerSettings, serve, "python -m role", "a role")
    with pytest.raises(SystemExit) as exited:
        entry.main([])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == "python -m role: error: /m/config.json: text_config.vocab_size is missing\n"


def test_the_router_names_the_config_file_it_cannot_read(
    ckpt_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from router.__main__ import main

    (ckpt_copy / "config.json").write_text('{"vocab_size": ')
    with pytest.raises(SystemExit) as exited:
        main(["--model", str(ckpt_copy), "--insecure", "--port", "0"])
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "config.json: not valid JSON" in lines[0], lines


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"image_mean": [0.5, float("nan"), 0.5]}, "image_mean"),
        ({"image_std": [0.5, 0, 0.5]}, "image_std"),
        ({"patch_size": 16.7}, "patch_size"),
        ({"min_pixels": True}, "min_pixels"),
        ({"max_pixels": -5}, "max_pixels"),
        ({"size": {"shortest_edge": "big"}}, "size.shortest_edge"),
        ({"image_mean": [0.5, 0.5]}, "image_mean"),
    ],
)
def test_a_preprocessor_setting_no_image_could_use_is_refused_naming_it(
    tmp_path: Path, values: dict[str, Any], named: str
) -> None:
    # A NaN mean or a zero std started cleanly and every image request answered token 0;
    # a size of "big" was a traceback (exit 1); 16.7 was read as 16, true as 1.
    from common.models.qwen3_vl.processor_files import read_processor_settings

    ckpt_copy = tmp_path / "ckpt"
    shutil.copytree(default_checkpoint(), ckpt_copy)
    path = ckpt_copy / "preprocessor_config.json"
    raw = json.loads(path.read_text())
    raw.update(values)
    path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=named.replace(".", r"\.")) as refused:
        read_processor_settings(ckpt_copy, Qwen3VLConfig.from_file(ckpt_copy))
    assert "preprocessor_config.json" in str(refused.value)


def test_a_quantized_checkpoint_is_refused_in_one_short_line(tmp_path: Path) -> None:
    # Its config was warned about as ignored, then the weights check listed every scale
    # tensor (15 KB on one line); FP8 weights without scales started.
    raw = json.loads((default_checkpoint() / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(
        CheckpointError, match="quantization_config a quantized checkpoint \\(fp8\\)"
    ):
        Qwen3VLConfig.from_dict(raw, file="config.json")


def test_a_weights_refusal_lists_some_names_and_counts_the_rest(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from common.models.qwen3_vl.weights import check_checkpoint

    ckpt_copy = tmp_path / "ckpt"
    shutil.copytree(default_checkpoint(), ckpt_copy)
    tensors = load_file(str(ckpt_copy / "model.safetensors"))
    for k in range(40):
        tensors[f"model.language_model.layers.0.mlp.scale_{k}"] = torch.ones(1)
    save_file(tensors, str(ckpt_copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"unexpected 40: .*, and 30 more") as refused:
        check_checkpoint(ckpt_copy, Qwen3VLConfig.from_file(ckpt_copy))
    assert len(str(refused.value)) < 1200


def test_a_generation_setting_epd_does_not_apply_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # repetition_penalty 1.3 was dropped without a word: answers differ from transformers'.
    raw: dict[str, Any] = {"do_sample": True, "temperature": 0.7, "repetition_penalty": 1.3}
    raw |= {"num_beams": 1, "bos_token_id": 1, "transformers_version": "4.56.0"}
    raw |= {"use_cache": True, "output_attentions": False}  # what transformers 5 writes
    with caplog.at_level(logging.WARNING):
        GenerationDefaults.from_dict(raw, file="gen-warned.json")
    warned = [r.getMessage() for r in caplog.records if "gen-warned.json" in r.getMessage()]
    assert len(warned) == 1 and "repetition_penalty" in warned[0]  # not the neutral num_beams


def test_a_preprocessor_file_setting_only_a_small_max_pixels_loads(tmp_path: Path) -> None:
    # It was refused as "min_pixels 65536 is past max_pixels 50176", blaming epd's own
    # default; transformers serves the same file.
    from common.models.qwen3_vl.processor_files import read_processor_settings

    ckpt_copy = tmp_path / "ckpt"
    shutil.copytree(default_checkpoint(), ckpt_copy)
    (ckpt_copy / "preprocessor_config.json").write_text(json.dumps({"max_pixels": 50176}))
    settings = read_processor_settings(ckpt_copy, Qwen3VLConfig.from_file(ckpt_copy))
    assert settings.max_pixels == 50176
    # A bad value is refused naming the files it was read from.
    (ckpt_copy / "preprocessor_config.json").unlink()
    (ckpt_copy / "processor_config.json").write_text(
        json.dumps({"image_processor": {"image_std": [0.5, 0, 0.5]}})
    )
    with pytest.raises(
        CheckpointError, match=r"processor_config\.json:image_processor\).*image_std"
    ):
        read_processor_settings(ckpt_copy, Qwen3VLConfig.from_file(ckpt_copy))
