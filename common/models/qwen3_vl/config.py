"""Qwen3-VL configuration, read from a Hugging Face-format `config.json`.

One frozen tree: `Qwen3VLConfig` holds a `TextConfig` (the language model) and a
`VisionConfig` (the vision tower). `from_dict` accepts what the reference
(`transformers.Qwen3VLConfig.to_dict()`) writes, with rope settings either under
`rope_parameters` (transformers >= 5) or `rope_scaling` + `rope_theta` (older checkpoints).

The file is read strictly (`common.models.checkpoint_files.JsonObject`): booleans are JSON
booleans, integers JSON integers, and every value is range-checked where it is read, so a
checkpoint that would load and then serve a silently different model, or fail every
request, is refused at start with a `CheckpointError` naming the file and the key: sizes
>= 1, attention heads a multiple of the KV heads, eps and rope theta finite and > 0,
`mrope_section` three numbers >= 0 summing to head_dim / 2, a context of >= 2 positions,
the special and end-of-sequence token ids inside the vocabulary, deepstack indexes naming
vision blocks, `model_type` `qwen3_vl`. A key it does not read is warned about once,
except the bookkeeping ones `transformers` writes (`_METADATA`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from common.errors import CheckpointError
from common.models.checkpoint_files import JsonObject, read_checkpoint_json, warn_once
from common.models.generation import GENERATION_FILE, GenerationDefaults

CONFIG_FILE = "config.json"
MODEL_TYPE = "qwen3_vl"


@dataclass(frozen=True, slots=True)
class TextConfig:
    """The language model's hyper-parameters."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str = "silu"
    max_position_embeddings: int = 128000
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    # Rotary frequency pairs given to the (t, h, w) position axes; sums to head_dim // 2.
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    # Qwen3-VL interleaves the three axes over frequencies (THWTHW...), not in blocks.
    mrope_interleaved: bool = True
    attention_bias: bool = False

    def __post_init__(self) -> None:
        # Nothing else depends on it: a wrong one would load, then fail every forward.
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(
                f"text_config mrope_section {list(self.mrope_section)} must be 3 numbers "
                f"summing to head_dim // 2 = {self.head_dim // 2}"
            )


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """The vision tower's hyper-parameters."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    num_position_embeddings: int = 2304
    # Vision blocks whose outputs feed the deepstack mergers, one per early LM layer.
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0

    @property
    def patch_dim(self) -> int:
        """Values in one flattened input patch: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one output row."""
        return self.spatial_merge_size**2


@dataclass(frozen=True, slots=True)
class Qwen3VLConfig:
    """A whole Qwen3-VL model: language model, vision tower and special token ids."""

    text: TextConfig
    vision: VisionConfig
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False
    # End-of-sequence token ids (from generation_config.json when present).
    eos_token_ids: tuple[int, ...] = field(default=())

    @classmethod
    def from_dict(cls, raw: object, *, file: str = CONFIG_FILE) -> Qwen3VLConfig:
        """Build from a `config.json` dict as the reference writes it, every value checked.

        Raises `CheckpointError` naming `file` and the key for a missing key, a value of the
        wrong JSON type, or one out of range (see the module docstring); keys it does not
        understand are warned about once (`checkpoint_files.warn_once`).
        """
        top = JsonObject(raw, file)
        model_type = top.string("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise top.error("model_type", f"{model_type!r} is not {MODEL_TYPE!r}")
        t, v = top.section("text_config"), top.section("vision_config")
        quantized = top.get("quantization_config") or t.get("quantization_config")
        if quantized:  # the weights' scales are not read: every product would be wrong
            method = quantized.get("quant_method") if isinstance(quantized, dict) else None
            raise top.error(
                "quantization_config",
                f"a quantized checkpoint ({method or 'unknown method'}) is not supported: "
                "serve its bfloat16 release",
            )
        t.get("model_type")
        v.get("model_type")
        text = _read_text(t)
        vision = _read_vision(v, text)
        vocab = text.vocab_size
        ids = {
            key: top.integer(key, default, minimum=0)
            for key, default in (
                ("image_token_id", 151655),
                ("video_token_id", 151656),
                ("vision_start_token_id", 151652),
                ("vision_end_token_id", 151653),
            )
        }
        eos_ids = t.integers("eos_token_id", (), minimum=0)
        eos_ids = top.integers("eos_token_id", eos_ids, minimum=0)
        for key, value in [*ids.items(), *(("eos_token_id", e) for e in eos_ids)]:
            if value >= vocab:
                raise top.error(key, f"{value} is outside the vocabulary [0, {vocab})")
        tie = top.boolean("tie_word_embeddings", t.boolean("tie_word_embeddings", False))
        for name in (*top.unread(_METADATA), *t.unread(_METADATA), *v.unread(_METADATA)):
            warn_once(file, name, "is not understood by epd and is ignored")
        return cls(text=text, vision=vision, tie_word_embeddings=tie, eos_token_ids=eos_ids, **ids)

    @classmethod
    def from_file(cls, path: str | Path) -> Qwen3VLConfig:
        """Read `config.json` (a file, or a checkpoint folder holding one; in a folder the
        `eos_token_id` of `generation_config.json` wins, see `common.models.generation`).
        Raises `CheckpointError` naming the file for anything unreadable or out of range."""
        path = Path(path)
        if not path.is_dir():
            return cls.from_dict(read_checkpoint_json(path), file=str(path))
        config = cls.from_dict(
            read_checkpoint_json(path / CONFIG_FILE), file=str(path / CONFIG_FILE)
        )
        eos = GenerationDefaults.from_folder(path).eos_token_ids
        for e in eos:
            if e >= config.text.vocab_size:
                raise CheckpointError(
                    f"{path / GENERATION_FILE}: eos_token_id {e} is outside the vocabulary "
                    f"[0, {config.text.vocab_size}) of {CONFIG_FILE}"
                )
        return replace(config, eos_token_ids=eos) if eos else config

    def to_dict(self) -> dict[str, Any]:
        """The `config.json` form the reference reads (transformers >= 5)."""
        text = asdict(self.text)
        rope_theta = text.pop("rope_theta")
        section = list(text.pop("mrope_section"))
        interleaved = text.pop("mrope_interleaved")
        text["model_type"] = "qwen3_vl_text"
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": rope_theta,
            "mrope_section": section,
            "mrope_interleaved": interleaved,
        }
        vision = asdict(self.vision)
        vision["model_type"] = "qwen3_vl_vision"
        vision["deepstack_visual_indexes"] = list(self.vision.deepstack_visual_indexes)
        vision["rope_parameters"] = {"rope_type": "axial", "rope_theta": vision.pop("rope_theta")}
        out: dict[str, Any] = {
            "architectures": ["Qwen3VLForConditionalGeneration"],
            "model_type": "qwen3_vl",
            "text_config": text,
            "vision_config": vision,
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.eos_token_ids:
            out["eos_token_id"] = list(self.eos_token_ids)
        return out


# The rotary kinds the text model computes: plain (multimodal) RoPE. A checkpoint asking
# for another (YaRN, dynamic NTK, linear scaling: what a model card may suggest to stretch
# the context) is refused, not run as plain RoPE with other answers than the reference's.
_ROPE_TYPES = ("default", "mrope")
_ROPE_KEYS = ("rope_type", "type", "rope_theta", "mrope_section", "mrope_interleaved")

# Keys `transformers` writes that change nothing epd computes (bookkeeping, training-only
# settings, the stored dtype): accepted without a warning wherever they appear.
_METADATA = frozenset(
    {
        "_attn_implementation_autoset",
        "_name_or_path",
        "architectures",
        "attention_dropout",
        "bos_token_id",
        "chunk_size_feed_forward",
        "decoder_start_token_id",
        "dtype",
        "finetuning_task",
        "id2label",
        "initializer_range",
        "is_encoder_decoder",
        "label2id",
        "output_attentions",
        "output_hidden_states",
        "pad_token_id",
        "prefix",
        "problem_type",
        "pruned_heads",
        "return_dict",
        "sep_token_id",
        "task_specific_params",
        "tf_legacy_loss",
        "tokenizer_class",
        "torch_dtype",
        "torchscript",
        "transformers_version",
        "use_bfloat16",
        "use_cache",
    }
)


def _read_text(t: JsonObject) -> TextConfig:
    """`text_config`, each size >= 1 and the heads consistent."""
    heads = t.integer("num_attention_heads", minimum=1)
    kv_heads = t.integer("num_key_value_heads", minimum=1)
    if heads % kv_heads:
        raise t.error("num_key_value_heads", f"{kv_heads} must divide num_attention_heads {heads}")
    hidden = t.integer("hidden_size", minimum=1)
    if not t.present("head_dim") and hidden % heads:
        raise t.error(
            "head_dim",
            f"is missing and hidden_size {hidden} is not a multiple of num_attention_heads {heads}",
        )
    head_dim = t.integer("head_dim", hidden // heads, minimum=1)
    if head_dim % 2:
        raise t.error("head_dim", f"{head_dim} must be even (rotary pairs)")
    return TextConfig(
        vocab_size=t.integer("vocab_size", minimum=1),
        hidden_size=hidden,
        intermediate_size=t.integer("intermediate_size", minimum=1),
        num_hidden_layers=t.integer("num_hidden_layers", minimum=1),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_act=t.string("hidden_act", "silu"),
        max_position_embeddings=t.integer("max_position_embeddings", 128000, minimum=2),
        rms_norm_eps=t.number("rms_norm_eps", 1e-6),
        attention_bias=t.boolean("attention_bias", False),
        **_text_rope(t, head_dim),
    )


def _text_rope(t: JsonObject, head_dim: int) -> dict[str, Any]:
    """Rope settings from either `rope_parameters` or the older `rope_scaling` form."""
    params = t.section("rope_parameters" if t.present("rope_parameters") else "rope_scaling")
    kind_key = "type" if params.present("type") and not params.present("rope_type") else "rope_type"
    kind = params.string(kind_key, "default")
    if kind not in _ROPE_TYPES:
        raise params.error(kind_key, f"{kind!r} is not supported (only {', '.join(_ROPE_TYPES)})")
    theta = params.number("rope_theta", t.number("rope_theta", 5_000_000.0))
    section = params.integers("mrope_section", (24, 20, 20), minimum=0)
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise params.error(
            "mrope_section",
            f"{list(section)} must be 3 numbers summing to head_dim // 2 = {head_dim // 2}",
        )
    interleaved = params.boolean("mrope_interleaved", True)
    for name in params.unread(_ROPE_KEYS):
        warn_once(t.file, name, "is not understood by epd and is ignored")
    return {"rope_theta": theta, "mrope_section": section, "mrope_interleaved": interleaved}


def _read_vision(v: JsonObject, text: TextConfig) -> VisionConfig:
    """`vision_config`, each size >= 1, the heads, the output width and deepstack consistent."""
    hidden, heads = v.integer("hidden_size", minimum=1), v.integer("num_heads", minimum=1)
    if hidden % heads:
        raise v.error("num_heads", f"{heads} must divide hidden_size {hidden}")
    out = v.integer("out_hidden_size", minimum=1)
    if out != text.hidden_size:
        raise v.error(
            "out_hidden_size", f"{out} must equal text_config.hidden_size {text.hidden_size}"
        )
    positions = v.integer("num_position_embeddings", 2304, minimum=1)
    if math.isqrt(positions) ** 2 != positions:
        raise v.error("num_position_embeddings", f"{positions} must be a square (a grid)")
    depth = v.integer("depth", minimum=1)
    deepstack = v.integers("deepstack_visual_indexes", (8, 16, 24), minimum=0)
    for index in deepstack:
        if index >= depth:
            raise v.error("deepstack_visual_indexes", f"{index} is not a block in [0, {depth})")
    rope = v.section("rope_parameters")
    rope.get("rope_type")  # "axial" as transformers writes it; the tower has one kind
    theta = rope.number("rope_theta", 10000.0)
    for name in rope.unread():
        warn_once(v.file, name, "is not understood by epd and is ignored")
    return VisionConfig(
        depth=depth,
        hidden_size=hidden,
        intermediate_size=v.integer("intermediate_size", minimum=1),
        num_heads=heads,
        out_hidden_size=out,
        hidden_act=v.string("hidden_act", "gelu_pytorch_tanh"),
        in_channels=v.integer("in_channels", 3, minimum=1),
        patch_size=v.integer("patch_size", 16, minimum=1),
        spatial_merge_size=v.integer("spatial_merge_size", 2, minimum=1),
        temporal_patch_size=v.integer("temporal_patch_size", 2, minimum=1),
        num_position_embeddings=positions,
        deepstack_visual_indexes=deepstack,
        rope_theta=theta,
    )
