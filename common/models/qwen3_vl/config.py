"""Qwen3-VL configuration, read from a Hugging Face-format `config.json`.

One frozen tree: `Qwen3VLConfig` holds a `TextConfig` (the language model) and a
`VisionConfig` (the vision tower). `from_dict` accepts what the reference
(`transformers.Qwen3VLConfig.to_dict()`) writes, with rope settings either under
`rope_parameters` (transformers >= 5) or `rope_scaling` + `rope_theta` (older checkpoints).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from common.models.generation import GenerationDefaults


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
    def from_dict(cls, raw: dict[str, Any]) -> Qwen3VLConfig:
        """Build from a `config.json` dict as the reference writes it."""
        text_raw = dict(raw.get("text_config") or {})
        vision_raw = dict(raw.get("vision_config") or {})
        text = TextConfig(
            vocab_size=int(text_raw["vocab_size"]),
            hidden_size=int(text_raw["hidden_size"]),
            intermediate_size=int(text_raw["intermediate_size"]),
            num_hidden_layers=int(text_raw["num_hidden_layers"]),
            num_attention_heads=int(text_raw["num_attention_heads"]),
            num_key_value_heads=int(text_raw["num_key_value_heads"]),
            head_dim=int(
                text_raw.get("head_dim")
                or text_raw["hidden_size"] // text_raw["num_attention_heads"]
            ),
            hidden_act=str(text_raw.get("hidden_act", "silu")),
            max_position_embeddings=int(text_raw.get("max_position_embeddings", 128000)),
            rms_norm_eps=float(text_raw.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(text_raw.get("attention_bias", False)),
            **_text_rope(text_raw),
        )
        vision = VisionConfig(
            depth=int(vision_raw["depth"]),
            hidden_size=int(vision_raw["hidden_size"]),
            intermediate_size=int(vision_raw["intermediate_size"]),
            num_heads=int(vision_raw["num_heads"]),
            out_hidden_size=int(vision_raw["out_hidden_size"]),
            hidden_act=str(vision_raw.get("hidden_act", "gelu_pytorch_tanh")),
            in_channels=int(vision_raw.get("in_channels", 3)),
            patch_size=int(vision_raw.get("patch_size", 16)),
            spatial_merge_size=int(vision_raw.get("spatial_merge_size", 2)),
            temporal_patch_size=int(vision_raw.get("temporal_patch_size", 2)),
            num_position_embeddings=int(vision_raw.get("num_position_embeddings", 2304)),
            deepstack_visual_indexes=tuple(
                int(i) for i in vision_raw.get("deepstack_visual_indexes", (8, 16, 24))
            ),
            rope_theta=float((vision_raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        )
        eos = raw.get("eos_token_id", text_raw.get("eos_token_id"))
        eos_ids = (
            () if eos is None else tuple(int(e) for e in ([eos] if isinstance(eos, int) else eos))
        )
        return cls(
            text=text,
            vision=vision,
            image_token_id=int(raw.get("image_token_id", 151655)),
            video_token_id=int(raw.get("video_token_id", 151656)),
            vision_start_token_id=int(raw.get("vision_start_token_id", 151652)),
            vision_end_token_id=int(raw.get("vision_end_token_id", 151653)),
            tie_word_embeddings=bool(
                raw.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", False))
            ),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> Qwen3VLConfig:
        """Read `config.json` (a file, or a checkpoint folder holding one; in a folder the
        `eos_token_id` of `generation_config.json` wins, see `common.models.generation`)."""
        path = Path(path)
        if not path.is_dir():
            return cls.from_dict(json.loads(path.read_text()))
        config = cls.from_dict(json.loads((path / "config.json").read_text()))
        eos = GenerationDefaults.from_folder(path).eos_token_ids
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


def _text_rope(text_raw: dict[str, Any]) -> dict[str, Any]:
    """Rope settings from either `rope_parameters` or the older `rope_scaling` form."""
    params = dict(text_raw.get("rope_parameters") or text_raw.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise ValueError(
            f"text_config rope_type {kind!r} is not supported (only {', '.join(_ROPE_TYPES)})"
        )
    theta = params.get("rope_theta", text_raw.get("rope_theta", 5_000_000.0))
    section = params.get("mrope_section", (24, 20, 20))
    return {
        "rope_theta": float(theta),
        "mrope_section": tuple(int(s) for s in section),
        "mrope_interleaved": bool(params.get("mrope_interleaved", True)),
    }
