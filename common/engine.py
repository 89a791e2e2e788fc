"""The monolithic offline engine: processor, vision tower and language model in one process.

It is the reference the disaggregated path is compared against, and small enough to read in
one sitting. The language model runs through the same `common.models.runner.LmRunner` the prefill
and decode workers use, so both paths share one prefill, decode and sampling code path:

    process(messages)  -> ProcessedPrompt            (tokens, item metadata, pixels)
    encode(processed)  -> MultimodalParams            (+ embeddings, + mRoPE delta)
    prefill(tokens, params, sampling) -> Sequence     (reuses cached prefix blocks, first token)
    decode_step(sequences)                            (one token for every running sequence)

`generate_batch` runs continuous batching over those pieces: new requests are admitted
(prefilled) whenever a batch slot and enough KV blocks are free, and every step decodes all
running sequences in one forward.

Prefix reuse: the prompt's full blocks are hashed with `common.block_hash.block_hashes` (the
same function router, prefill and decode use, from its default root); the longest
cached prefix is acquired from the `BlockPool`, only the rest is computed, and the newly
computed full prompt blocks are cached afterwards. At least the last prompt token is always
computed (its logits give the first token), and a cached block is never written.

Block ownership: a sequence owns one reference on each of its blocks from `prefill` until
`release` (called by `generate*` when it finishes). Blocks for the whole request (prompt +
`max_tokens`) are taken at admission, so decode never runs out of blocks mid-request.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.kv.block_pool import BlockPool
from common.kv.cache import PagedKvCache
from common.kv.hashing import DEFAULT_ROOT
from common.models.qwen3_vl.config import Qwen3VLConfig
from common.models.qwen3_vl.rope import MropePositions
from common.models.qwen3_vl.text import LM_PREFIX, TextModel
from common.models.qwen3_vl.vision import VisionTower
from common.models.qwen3_vl.weights import LM_HEAD, VISUAL_PREFIX, load_weights
from common.models.runner import LmRunner, LmSequence
from common.multimodal.params import ItemEmbedding, MultimodalParams
from common.processing.processor import ProcessedPrompt, Processor
from common.sampling import FinishReason, Sampler, SamplingParams, StopChecker

logger = logging.getLogger(__name__)

Messages = Sequence[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """The outcome of one request."""

    token_ids: list[int]  # generated tokens, the stop token included
    text: str  # detokenized `token_ids` (special tokens skipped)
    finish_reason: FinishReason  # "stop" or "length"
    prompt_tokens: int  # tokens in the prompt
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


# Engine-side state of one request between prefill and release: the runner's sequence.
RunningSequence = LmSequence

# The Engine's `KvLayout.model`. Its prefix cache is private to the process, so its block
# hashes chain from `DEFAULT_ROOT` (as `block_hashes` does by default), not a layout root.
ENGINE_IDENTITY = "qwen3-vl/offline-engine"


class Engine:
    """Everything in one process; see the module docstring for the flow and the contracts.

    Not thread-safe: one caller drives it.
    """

    def __init__(
        self,
        config: Qwen3VLConfig,
        text_model: TextModel,
        vision: VisionTower,
        processor: Processor,
        *,
        block_size: int = 16,
        num_blocks: int = 1024,
        max_batch: int = 32,
        prefill_chunk: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.vision = vision
        self.processor = processor
        self.max_batch = max_batch
        # The language model, its KV cache, block pool and sampler: the workers' runner.
        self.runner = LmRunner(
            config,
            text_model,
            identity=ENGINE_IDENTITY,
            block_size=block_size,
            num_blocks=num_blocks,
            prefill_chunk=prefill_chunk,
            device=device,
            root=DEFAULT_ROOT,
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        block_size: int = 16,
        num_blocks: int = 1024,
        max_batch: int = 32,
        prefill_chunk: int | None = None,
    ) -> Engine:
        """Load a Hugging Face-format Qwen3-VL checkpoint folder."""
        config = Qwen3VLConfig.from_file(path)
        tensors = load_weights(
            path, config, dtype=dtype, prefix=(VISUAL_PREFIX, LM_PREFIX, LM_HEAD), device=device
        )
        return cls(
            config,
            TextModel.from_weights(config, tensors),
            VisionTower.from_weights(config, tensors),
            Processor.from_pretrained(path),
            block_size=block_size,
            num_blocks=num_blocks,
            max_batch=max_batch,
            prefill_chunk=prefill_chunk,
            device=device,
        )

    # The runner's parts, under the names the Engine always had.

    @property
    def model(self) -> TextModel:
        return self.runner.model

    @property
    def kv(self) -> PagedKvCache:
        return self.runner.kv

    @property
    def pool(self) -> BlockPool:
        return self.runner.pool

    @property
    def sampler(self) -> Sampler:
        return self.runner.sampler

    @property
    def stop(self) -> StopChecker:
        return self.runner.stop

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    @property
    def prefill_chunk(self) -> int | None:
        return self.runner.prefill_chunk

    # ------------------------------------------------------------------ encode / prefill

    def process(
        self, messages: Messages, *, images: Sequence[Any] = (), videos: Sequence[Any] = ()
    ) -> ProcessedPrompt:
        """Tokenize the chat and preprocess its media (delegates to the processor).

        `images` / `videos` are side payloads that media parts may name by `"index"`.
        """
        return self.processor.process(messages, images=images, videos=videos)

    def encode(self, processed: ProcessedPrompt) -> MultimodalParams:
        """Run the vision tower over every item; attach embeddings and the mRoPE delta."""
        params = processed.params
        embeddings: dict[int, ItemEmbedding] = {}
        if params.items:
            pixels, grids = processed.vision_inputs()
            rows, deep = self.vision.encode(pixels.to(self.device), grids)
            sizes = self.vision.rows_per_item(grids)
            split_deep = [d.split(sizes) for d in deep]
            for i, item_rows in enumerate(rows.split(sizes)):
                embeddings[i] = ItemEmbedding(item_rows, tuple(d[i] for d in split_deep))
        delta = self.positions(processed.prompt_token_ids, params).delta
        return MultimodalParams(params.items, embeddings, delta)

    def positions(
        self, prompt_token_ids: Sequence[int], params: MultimodalParams
    ) -> MropePositions:
        """mRoPE positions of a prompt (see `rope.prompt_positions`)."""
        return self.runner.positions(len(prompt_token_ids), params)

    def prefill(
        self,
        prompt_token_ids: Sequence[int],
        params: MultimodalParams,
        sampling: SamplingParams,
        *,
        use_prefix_cache: bool = True,
        keep_logits: bool = False,
    ) -> RunningSequence:
        """Compute a prompt (reusing cached prefix blocks) and sample its first token.

        The returned sequence owns blocks for prompt + `max_tokens`; pass it to
        `decode_step`, then `release`. With `keep_logits` it also holds the logits of every
        computed prompt token. Raises `NoFreeBlocksError` when the pool cannot hold them.
        """
        hashes = self.runner.hashes(prompt_token_ids, params) if use_prefix_cache else None
        return self.runner.prefill(
            prompt_token_ids,
            params,
            sampling,
            hashes=hashes,
            total_tokens=len(prompt_token_ids) + sampling.max_tokens,
            keep_logits=keep_logits,
        )

    # -------------------------------------------------------------------------- decode

    def decode_step(self, seqs: Sequence[RunningSequence]) -> None:
        """Feed each unfinished sequence its newest token and sample the next, in one forward."""
        self.runner.decode_step(seqs)

    def release(self, seq: RunningSequence) -> None:
        """Give the sequence's blocks back to the pool (cached prompt blocks stay cached)."""
        self.runner.release(seq)

    # ---------------------------------------------------------------------- front doors

    def _result(self, seq: RunningSequence) -> GenerateResult:
        assert seq.finish_reason is not None
        return GenerateResult(
            token_ids=list(seq.output),
            text=self.processor.decode(seq.output),
            finish_reason=seq.finish_reason,
            prompt_tokens=len(seq.prompt_token_ids),
            cached_tokens=seq.cached_tokens,
        )

    def generate(self, messages: Messages, sampling: SamplingParams) -> GenerateResult:
        """Generate for one chat."""
        return self.generate_batch([messages], sampling)[0]

    def generate_batch(
        self,
        requests: Sequence[Messages],
        sampling: SamplingParams | Sequence[SamplingParams],
    ) -> list[GenerateResult]:
        """Generate for many chats with continuous batching; results in request order."""
        params = [sampling] * len(requests) if isinstance(sampling, SamplingParams) else sampling
        if len(params) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(params)} sampling params")
        waiting = deque(range(len(requests)))
        processed: dict[int, ProcessedPrompt] = {}
        running: list[tuple[int, RunningSequence]] = []
        results: dict[int, GenerateResult] = {}
        while waiting or running:
            while waiting and len(running) < self.max_batch:
                index = waiting[0]
                if index not in processed:
                    processed[index] = self.process(requests[index])
                prompt = processed[index]
                total = len(prompt.prompt_token_ids) + params[index].max_tokens
                if running and not self.pool.can_allocate(-(-total // self.block_size)):
                    break  # wait for running sequences to free blocks
                waiting.popleft()
                del processed[index]
                seq = self.prefill(prompt.prompt_token_ids, self.encode(prompt), params[index])
                running.append((index, seq))
            self.decode_step([s for _, s in running])
            still: list[tuple[int, RunningSequence]] = []
            for index, seq in running:
                if seq.finish_reason is None:
                    still.append((index, seq))
                else:
                    results[index] = self._result(seq)
                    self.release(seq)
            running = still
        return [results[i] for i in range(len(requests))]

    def prompt_logits(
        self, messages: Messages, *, images: Sequence[Any] = (), videos: Sequence[Any] = ()
    ) -> torch.Tensor:
        """Logits `[n, vocab]` over the whole prompt, computed from scratch (no reuse)."""
        processed = self.process(messages, images=images, videos=videos)
        params = self.encode(processed)
        return self.runner.prompt_logits(processed.prompt_token_ids, params)
