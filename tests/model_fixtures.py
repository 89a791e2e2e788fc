"""Shared tiny-model helpers for tests (vision, processor, checkpoint, language model), and
the prompt factories the end-to-end tests share (`image`, `video`, `user`).

Import these from test modules and wrap them in fixtures there, e.g.

    @pytest.fixture(scope="session")
    def tiny_ckpt(tmp_path_factory):
        return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))

`transformers` (the reference) is imported lazily, only by the helpers that need it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from common.kv.cache import KvCacheSpec
from common.models.qwen3_vl.config import Qwen3VLConfig, TextConfig, VisionConfig
from common.models.tiny import SPECIAL_TOKENS, make_tiny_checkpoint, train_tokenizer


def image(seed: int, width: int = 64, height: int = 48) -> Image.Image:
    """A random RGB image, the same for the same arguments."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def video(seed: int, frames: int = 8, size: int = 64) -> np.ndarray:
    """Random `(frames, size, size, 3)` uint8 frames, the same for the same arguments."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (frames, size, size, 3), dtype=np.uint8)


def user(*parts: Any) -> list[Any]:
    """A chat of one user message of `parts`: a str is a text part, a dict a part as it is.
    (list[Any]: the openai client's typed message params take it too.)"""
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [{"role": "user", "content": content}]


def kv_buffer(text: TextConfig, num_blocks: int, block_size: int) -> torch.Tensor:
    """A zeroed float32 paged KV buffer for a model of `text` (`common.kv.cache`'s layout)."""
    spec = KvCacheSpec(
        text.num_hidden_layers,
        text.num_key_value_heads,
        text.head_dim,
        block_size,
        torch.float32,
        num_blocks,
    )
    return torch.zeros(spec.shape)


def tiny_token_ids() -> dict[str, int]:
    """Ids of the Qwen3-VL special tokens in the tiny checkpoints' tokenizer."""
    tokenizer = train_tokenizer()
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    return {t: i for t, i in ids.items() if i is not None}


def tiny_reference_config_dict(
    *,
    vocab_size: int = 1152,
    text_hidden: int = 32,
    text_layers: int = 2,
    text_heads: int = 4,
    text_kv_heads: int = 2,
    vision_hidden: int = 32,
    vision_depth: int = 3,
    vision_heads: int = 4,
    deepstack: tuple[int, ...] = (0, 1),
    num_position_embeddings: int = 64,
    tie_word_embeddings: bool = False,
    attention_bias: bool = False,
) -> dict[str, Any]:
    """A tiny `config.json` dict that both `transformers.Qwen3VLConfig(**d)` and
    `Qwen3VLConfig.from_dict(d)` read, with the tiny tokenizer's special token ids.

    Text head_dim is `text_hidden // text_heads` (8 for the defaults); mrope_section is sized
    to it. Vision patch_size 16, merge 2, out_hidden_size = text_hidden.
    """
    ids = tiny_token_ids()
    head_dim = text_hidden // text_heads
    half = head_dim // 2
    section = (half - 2 * (half // 4), half // 4, half // 4)
    config = Qwen3VLConfig(
        text=TextConfig(
            vocab_size=vocab_size,
            hidden_size=text_hidden,
            intermediate_size=2 * text_hidden,
            num_hidden_layers=text_layers,
            num_attention_heads=text_heads,
            num_key_value_heads=text_kv_heads,
            head_dim=head_dim,
            rope_theta=1_000_000.0,
            mrope_section=section,
            attention_bias=attention_bias,
        ),
        vision=VisionConfig(
            depth=vision_depth,
            hidden_size=vision_hidden,
            intermediate_size=2 * vision_hidden,
            num_heads=vision_heads,
            out_hidden_size=text_hidden,
            patch_size=16,
            num_position_embeddings=num_position_embeddings,
            deepstack_visual_indexes=deepstack,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie_word_embeddings,
        eos_token_ids=(ids["<|im_end|>"], ids["<|endoftext|>"]),
    )
    return config.to_dict()


def write_tiny_checkpoint(path: str | Path, *, seed: int = 0, size: str = "tiny") -> Path:
    """A complete tiny checkpoint folder (ours: config, weights, tokenizer, preprocessor)."""
    return make_tiny_checkpoint(path, seed=seed, size=size)  # type: ignore[arg-type]


def reference_model(folder: str | Path) -> Any:
    """The reference `Qwen3VLForConditionalGeneration` loaded from a folder, float32, eval."""
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32)
    return model.eval()


def save_reference_checkpoint(
    path: str | Path, config_dict: dict[str, Any], *, seed: int = 0, **save_kwargs: Any
) -> tuple[Path, dict[str, torch.Tensor]]:
    """Build a randomly initialised reference model from `config_dict`, `save_pretrained` it
    to `path`, and return the folder and the reference's state dict."""
    from transformers import Qwen3VLConfig as RefConfig
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(RefConfig(**config_dict)).eval()
    path = Path(path)
    model.save_pretrained(str(path), **save_kwargs)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return path, state
