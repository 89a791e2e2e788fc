"""Checks that a request's prompt fits a model, before any block is taken.

Each raises `MultimodalLayoutError` naming the offending field (and item), so a worker can
reject the request with a precise message; `LmRunner.check_prompt` is the entry point (the
embeddings' shapes are checked from the wire, before any is pulled:
`common.wire.convert.embeddings_from_proto`). `check_context` (prompt tokens + `max_tokens`
within the context) is shared by the router and both KV workers, each calling it before any
other work.
`check_prompt` returns the prompt's mRoPE positions it had to compute to check them, so a
worker computes them once per request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.errors import FieldError
from common.models.qwen3_vl.config import Qwen3VLConfig
from common.models.qwen3_vl.rope import MropePositions, prompt_positions
from common.multimodal.params import Modality, MultimodalParams
from common.multimodal.validation import MultimodalLayoutError


def check_prompt(
    config: Qwen3VLConfig, prompt_token_ids: Sequence[int], params: MultimodalParams
) -> MropePositions:
    """The prompt's mRoPE positions; raise unless the prompt is non-empty, its ids are in
    the vocabulary, placeholders sit exactly at the runs, and positions are computable from
    the items' runs and grids. Embeddings are not looked at."""
    n = len(prompt_token_ids)
    if n == 0:
        raise MultimodalLayoutError("prompt_token_ids", "empty prompt")
    vocab = config.text.vocab_size
    tokens = torch.as_tensor(list(prompt_token_ids), dtype=torch.long)
    bad = torch.nonzero((tokens < 0) | (tokens >= vocab)).flatten()
    if bad.numel():
        i = int(bad[0])
        raise MultimodalLayoutError(
            "prompt_token_ids", f"token {i} (id {int(tokens[i])}) outside vocab [0, {vocab})"
        )
    by_modality = {Modality.IMAGE: config.image_token_id, Modality.VIDEO: config.video_token_id}
    params.check_placeholders(prompt_token_ids, sorted(set(by_modality.values())), by_modality)
    try:
        return prompt_positions(n, params.items, config.vision.spatial_merge_size)
    except ValueError as exc:
        raise MultimodalLayoutError("items.grid_thw", str(exc)) from None


def check_context(prompt_tokens: int, max_tokens: int, context: int) -> None:
    """Raise `FieldError` for a prompt that leaves no room to generate, or a `max_tokens`
    that would run past the model's context of `context` positions."""
    if prompt_tokens >= context:
        raise FieldError(
            "prompt_token_ids",
            f"prompt of {prompt_tokens} tokens does not fit the model's context of "
            f"{context} tokens (at least one token must be generated)",
        )
    if prompt_tokens + max_tokens > context:
        raise FieldError(
            "sampling.max_tokens",
            f"{max_tokens}: prompt of {prompt_tokens} tokens + max_tokens exceeds the "
            f"model's context of {context} tokens (at most {context - prompt_tokens})",
        )
