"""`LmSequence`: the state of one request from prefill (or resume) to release.

Made by `common.models.batching.prefill` (or `LmRunner.resume` on decode), advanced one
token per step by `LmRunner.decode_step`, and released through the worker's `KvAllocator`.
The sequence owns one reference on each of `blocks` until then; compared by identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.sampling import FinishReason, SamplingParams


@dataclass(eq=False, slots=True)
class LmSequence:
    """Runner-side state of one request between prefill (or resume) and release."""

    prompt_token_ids: list[int]  # the prompt
    sampling: SamplingParams  # how tokens are picked and when to stop
    blocks: list[int]  # KV block ids in sequence order; one reference owned on each
    mrope_delta: int  # position offset of tokens after the prompt
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (prefill)
    output: list[int] = field(default_factory=list)  # sampled tokens so far
    # Logits of the computed prompt tokens [n - cached_tokens, vocab], when asked for.
    prompt_logits: torch.Tensor | None = None
    finish_reason: FinishReason | None = None  # set once the request is done

    @property
    def num_computed(self) -> int:
        """Tokens whose K/V are in the cache (the newest sampled token is not yet)."""
        return len(self.prompt_token_ids) + len(self.output) - 1
