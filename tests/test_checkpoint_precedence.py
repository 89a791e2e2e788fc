"""Which checkpoint file wins: processor settings precedence across the preprocessor,
video and nested processor files, unknown-setting warnings, chat template sources and
errors, and generation defaults (unit tests on small hand-written folders).
"""

from __future__ import annotations

import json
import logging
import shutil
from functools import partial
from pathlib import Path

import pytest

from common.errors import CheckpointError
from common.models import generation
from common.models.generation import GenerationDefaults
from common.models.qwen3_vl import processor_files
from common.models.qwen3_vl.config import Qwen3VLConfig
from common.models.qwen3_vl.preprocessor import ProcessorSettings
from common.models.tiny import default_checkpoint
from common.processing.processor import Processor
from common.processing.template import find_chat_template


def _write(folder: Path, name: str, obj: object) -> None:
    (folder / name).write_text(json.dumps(obj))


@pytest.fixture
def config() -> Qwen3VLConfig:
    return Qwen3VLConfig.from_file(default_checkpoint())


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processor_files, "_warned", set())


def test_settings_precedence(tmp_path: Path, config: Qwen3VLConfig) -> None:
    read = partial(processor_files.read_processor_settings, tmp_path, config)
    v = config.vision
    assert read() == ProcessorSettings(
        patch_size=v.patch_size,
        merge_size=v.spatial_merge_size,
        temporal_patch_size=v.temporal_patch_size,
    )
    _write(
        tmp_path,
        "preprocessor_config.json",
        {"size": {"shortest_edge": 100, "longest_edge": 200}, "max_pixels": 300},
    )
    assert (read().min_pixels, read().max_pixels) == (100, 300)  # explicit key over size
    _write(tmp_path, "video_preprocessor_config.json", {"max_frames": 5, "fps": 1})
    assert (read().video_max_frames, read().video_sample_fps) == (5, 1.0)
    _write(
        tmp_path,
        "processor_config.json",
        {
            "image_processor": {"size": {"longest_edge": 400}},
            "video_processor": {"max_frames": 7, "do_sample_frames": False},
        },
    )
    s = read()
    assert (s.min_pixels, s.max_pixels) == (100, 400)
    assert (s.video_max_frames, s.video_sample_fps) == (7, None)


def test_unset_values_and_older_size_keys(tmp_path: Path, config: Qwen3VLConfig) -> None:
    _write(
        tmp_path,
        "preprocessor_config.json",
        {
            "min_pixels": None,
            "max_pixels": None,
            "size": {"min_pixels": 1000, "max_pixels": 9000},
        },
    )
    s = processor_files.read_processor_settings(tmp_path, config)
    assert (s.min_pixels, s.max_pixels) == (1000, 9000)


def test_unknown_setting_warns_once(
    tmp_path: Path, config: Qwen3VLConfig, caplog: pytest.LogCaptureFixture
) -> None:
    _write(
        tmp_path,
        "processor_config.json",
        {
            "image_processor": {"crop_to_fit": True, "do_resize": True, "resample": 2},
            "video_processor": {"num_frames": 8, "image_mean": [0.1, 0.2, 0.3]},
        },
    )
    with caplog.at_level(logging.WARNING, logger=processor_files.__name__):
        processor_files.read_processor_settings(tmp_path, config)
        processor_files.read_processor_settings(tmp_path, config)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4, messages
    for key in ("crop_to_fit", "resample", "num_frames", "image_mean"):
        assert sum(key in m for m in messages) == 1, key
    assert not any("do_resize" in m for m in messages)


def test_builtin_checkpoint_reads_as_before(
    config: Qwen3VLConfig, caplog: pytest.LogCaptureFixture
) -> None:
    folder = default_checkpoint()
    with caplog.at_level(logging.WARNING):
        processor = Processor.from_pretrained(folder)
    assert processor.settings == ProcessorSettings.from_file(folder)
    assert processor.template is None and not caplog.records


def test_template_sources(tmp_path: Path) -> None:
    assert find_chat_template(tmp_path) is None
    _write(
        tmp_path, "tokenizer_config.json", {"chat_template": [{"name": "default", "template": "b"}]}
    )
    assert find_chat_template(tmp_path) == "b"
    _write(tmp_path, "processor_config.json", {"chat_template": "p"})
    assert find_chat_template(tmp_path) == "p"
    _write(tmp_path, "chat_template.json", {"chat_template": "j"})
    assert find_chat_template(tmp_path) == "j"
    (tmp_path / "chat_template.jinja").write_text("f")
    assert find_chat_template(tmp_path) == "f"


_CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize(
    ("failure", "message"),
    [
        ("{{ raise_exception('no hi, please') }}", "no hi, please"),
        ("<|image_pad|>", "outside"),
        # What a template's own code raises is its failure too, not a crash (INTERNAL).
        ("{{ range(10**9) | list }}", "chat template"),
        ("{{ 1 // 0 }}", "chat template"),
    ],
)
def test_template_errors_are_value_errors(tmp_path: Path, failure: str, message: str) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(default_checkpoint(), folder)
    # Failing on every chat: refused at load, naming the file (it would fail every request).
    (folder / "chat_template.jinja").write_text(failure + _CHATML)
    with pytest.raises(CheckpointError, match=rf"chat_template\.jinja: .*{message}"):
        Processor.from_pretrained(folder)
    # Failing on one request: that request's ValueError.
    source = "{% if messages[-1].content == 'hi' %}" + failure + "{% endif %}" + _CHATML
    (folder / "chat_template.jinja").write_text(source)
    processor = Processor.from_pretrained(folder)
    processor.process([{"role": "user", "content": "hello"}])
    with pytest.raises(ValueError, match=message):
        processor.process([{"role": "user", "content": "hi"}])


def test_generation_defaults(tmp_path: Path) -> None:
    assert GenerationDefaults.from_folder(tmp_path).sampling() == generation.SamplingParams()
    _write(
        tmp_path,
        "generation_config.json",
        {
            "do_sample": True,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "max_new_tokens": 5,
            "eos_token_id": 3,
        },
    )
    defaults = GenerationDefaults.from_folder(tmp_path)
    s = defaults.sampling()
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (f32(0.7), f32(0.9), 20, 5)
    assert defaults.eos_token_ids == (3,)
    assert defaults.sampling(max_tokens=2, temperature=None).max_tokens == 2
    _write(tmp_path, "generation_config.json", {"temperature": 0.7, "top_k": 20})
    greedy = GenerationDefaults.from_folder(tmp_path).sampling()
    assert greedy.is_greedy and greedy.top_k == 20


def f32(value: float) -> float:
    """`value` as SamplingParams keeps it: the float32 the wire carries (sampling L4, s44)."""
    return generation.SamplingParams(top_p=value).top_p


@pytest.mark.parametrize("raw", [{"do_sample": True}, {"do_sample": True, "temperature": None}])
def test_do_sample_without_temperature_samples_at_one(tmp_path: Path, raw: dict) -> None:
    """As transformers' `generate` does: sampling asked for, no temperature given."""
    _write(tmp_path, "generation_config.json", {**raw, "top_p": 0.9})
    s = GenerationDefaults.from_folder(tmp_path).sampling()
    assert (s.temperature, s.top_p) == (1.0, f32(0.9)) and not s.is_greedy


def test_generation_eos_wins_over_config(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(default_checkpoint(), folder)
    _write(folder, "generation_config.json", {"eos_token_id": [7, 9]})
    assert Qwen3VLConfig.from_file(folder).eos_token_ids == (7, 9)
    assert Qwen3VLConfig.from_file(folder / "config.json").eos_token_ids != (7, 9)


def test_wire_sampling_takes_checkpoint_defaults() -> None:
    from common.wire.sampling import sampling_from_proto
    from epd.v1 import sampling_pb2

    defaults = GenerationDefaults(top_p=0.8, top_k=5, max_new_tokens=3)
    unset = sampling_from_proto(sampling_pb2.SamplingParams(temperature=0.5), defaults)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.max_tokens) == (0.5, f32(0.8), 5, 3)
    given = sampling_pb2.SamplingParams(temperature=0.5, top_p=0.5, top_k=2, max_tokens=9)
    s = sampling_from_proto(given, defaults)
    assert (s.top_p, s.top_k, s.max_tokens) == (0.5, 2, 9)
    assert sampling_from_proto(sampling_pb2.SamplingParams()).max_tokens == 16
