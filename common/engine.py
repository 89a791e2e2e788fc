"""The monolithic offline engine: processor, vision tower and language model in one process.

It is the reference the disaggregated path is compared against, and small enough to read in
one sitting. The language model runs through the same `common.models.runner.LmRunner`, its
`KvAllocator` and the same scheduling (`common.models.batching`) as the prefill and decode
workers, so both paths share one prefill, decode, sampling and batching code path:

    process(messages)  -> ProcessedPrompt            (tokens, item metadata, pixels)
    encode(processed)  -> MultimodalParams            (+ embeddings, + mRoPE delta)
    prefill(tokens, params, sampling) -> LmSequence   (reuses cached prefix blocks, first token)
    prefill_many(prompts, sampling)   -> LmSequences  (several prompts computed together)
    decode_step(sequences)                            (one token for every running sequence)
    release(sequence)                                 (its blocks back to the pool)

`generate_batch` drives the shared `batching.Batch` synchronously: new requests are admitted
whenever a batch slot and enough KV blocks are free, the prompts admitted together are
prefilled together (packed into forwards, `batching.compute`), and every `Batch.step`
decodes all running sequences in one forward and releases the finished ones.

Prefix reuse: the prompt's full blocks are hashed with `common.kv.hashing.block_hashes` (the
same function router, prefill and decode use, from its default root); the longest
cached prefix is acquired from the `BlockPool`, only the rest is computed, and the newly
computed full prompt blocks are cached afterwards. At least the last prompt token is always
computed (its logits give the first token), and a cached block is never written.

Block ownership: a sequence owns one reference on each of its blocks from `prefill` until
`release` (done by the batch in `generate*` when it finishes). Blocks for the whole request
(`kv_slots`: the prompt and every generated token but the last) are taken at admission, so
decode never runs out of blocks mid-request. The language model's parts are reached
through `engine.runner` (`.model`, `.kv`, `.allocator.pool`, `.sampler`, ...).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.errors import FieldError
from common.kv.allocator import blocks_for
from common.kv.hashing import DEFAULT_ROOT
from common.models import batching
from common.models.generation import GenerationDefaults
from common.models.prompt_check import check_context
from common.models.qwen3_vl.config import Qwen3VLConfig
from common.models.qwen3_vl.rope import MropePositions
from common.models.qwen3_vl.text import LM_PREFIX, TextModel
from common.models.qwen3_vl.vision import VisionTower
from common.models.qwen3_vl.weights import LM_HEAD, VISUAL_PREFIX, load_weights
from common.models.runner import LmRunner
from common.models.sequence import LmSequence
from common.multimodal.params import ItemEmbedding, MultimodalParams
from common.processing.messages import ChatDicts, Message, messages_from_dicts
from common.processing.processor import ProcessedPrompt, Processor
from common.sampling import FinishReason, SamplingParams

logger = logging.getLogger(__name__)

# A chat as the public methods take it: the OpenAI-like dict form (or typed `Message`s),
# converted once at `process` by `messages_from_dicts`.
Messages = ChatDicts | Sequence[Message]


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """The outcome of one request."""

    token_ids: list[int]  # generated tokens, the stop token included
    # Detokenized `token_ids`, special tokens and the request's stop tokens skipped, as the
    # router's text (it showed a stop token's text the router leaves out: sampling review
    # L1, s44).
    text: str
    finish_reason: FinishReason  # "stop" or "length"
    prompt_tokens: int  # tokens in the prompt
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


# The Engine's `KvLayout.model`. Its prefix cache is private to the process, so its block
# hashes chain from `DEFAULT_ROOT` (as `block_hashes` does by default), not a layout root.
ENGINE_IDENTITY = "qwen3-vl/offline-engine"


def kv_slots(prompt_tokens: int, sampling: SamplingParams) -> int:
    """KV slots a request writes: its prompt and every generated token but the last (never
    fed back), as the decode worker and the router's admission count them."""
    return prompt_tokens + sampling.max_tokens - 1


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
        generation: GenerationDefaults | None = None,
    ) -> None:
        if max_batch < 1:  # else `generate` would wait for ever to admit anything
            raise ValueError(f"max_batch: must be at least 1, got {max_batch}")
        self.config = config
        self.vision = vision
        self.processor = processor
        self.max_batch = max_batch
        # The checkpoint's default sampling (`generation_config.json`), for requests that
        # pass no `SamplingParams` (see `sampling`).
        self.generation = generation or GenerationDefaults()
        # The language model, its KV cache and sampler, and its allocator: as on a worker.
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
        packed_weights: bool | None = None,
    ) -> Engine:
        """Load a Hugging Face-format Qwen3-VL checkpoint folder (its processor files, chat
        template and generation defaults included; `packed_weights`: `linear.Dense`)."""
        config = Qwen3VLConfig.from_file(path)
        tensors = load_weights(
            path, config, dtype=dtype, prefix=(VISUAL_PREFIX, LM_PREFIX, LM_HEAD), device=device
        )
        return cls(
            config,
            TextModel.from_weights(config, tensors, packed_weights=packed_weights),
            VisionTower.from_weights(config, tensors, packed_weights=packed_weights),
            Processor.from_pretrained(path),
            block_size=block_size,
            num_blocks=num_blocks,
            max_batch=max_batch,
            prefill_chunk=prefill_chunk,
            device=device,
            generation=GenerationDefaults.from_folder(path),
        )

    def sampling(self, **overrides: Any) -> SamplingParams:
        """The checkpoint's default `SamplingParams` (`generation_config.json`: temperature,
        top_p, top_k, max_new_tokens as max_tokens), then the given fields (None: unset)."""
        return self.generation.sampling(**overrides)

    # ------------------------------------------------------------------ encode / prefill

    def process(
        self, messages: Messages, *, images: Sequence[Any] = (), videos: Sequence[Any] = ()
    ) -> ProcessedPrompt:
        """Tokenize the chat and preprocess its media (delegates to the processor).

        The chat is typed here, the Engine's edge (`messages_from_dicts`; `ValueError` on a
        malformed message). `images` / `videos` are side payloads that media parts may name
        by `"index"`.
        """
        chat = messages_from_dicts(messages)
        return self.processor.process(chat, images=images, videos=videos)

    def encode(self, processed: ProcessedPrompt) -> MultimodalParams:
        """Run the vision tower over every item; attach embeddings and the mRoPE delta."""
        params = processed.params
        embeddings: dict[int, ItemEmbedding] = {}
        if params.items:
            pixels, grids = processed.vision_inputs()
            rows, deep = self.vision.encode(pixels.to(self.runner.device), grids)
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
    ) -> LmSequence:
        """Compute a prompt (reusing cached prefix blocks) and sample its first token.

        The returned sequence owns blocks for its `kv_slots`; pass it to
        `decode_step`, then `release`. With `keep_logits` it also holds the logits of every
        computed prompt token. Raises `NoFreeBlocksError` when the pool cannot hold them.
        """
        admission = self._admit(prompt_token_ids, params, sampling, use_prefix_cache, keep_logits)
        return batching.compute(self.runner, [admission])[0]

    def prefill_many(
        self,
        prompts: Sequence[tuple[Sequence[int], MultimodalParams]],
        sampling: SamplingParams,
        *,
        use_prefix_cache: bool = True,
    ) -> list[LmSequence]:
        """`prefill` of several prompts, computed together (packed into forwards). Blocks
        are taken for all of them first; raises `NoFreeBlocksError` taking nothing."""
        admitted: list[batching.Admission] = []
        try:
            for tokens, params in prompts:
                admitted.append(self._admit(tokens, params, sampling, use_prefix_cache))
        except Exception:
            batching.abandon(self.runner, admitted)
            raise
        return batching.compute(self.runner, admitted)

    def _admit(
        self,
        prompt_token_ids: Sequence[int],
        params: MultimodalParams,
        sampling: SamplingParams,
        use_prefix_cache: bool = True,
        keep_logits: bool = False,
    ) -> batching.Admission:
        """Take blocks for the request's `kv_slots` (see `batching.admit`)."""
        allocator = self.runner.allocator
        hashes = allocator.hashes(prompt_token_ids, params) if use_prefix_cache else None
        return batching.admit(
            self.runner,
            prompt_token_ids,
            params,
            sampling,
            hashes=hashes,
            total_tokens=kv_slots(len(prompt_token_ids), sampling),
            keep_logits=keep_logits,
            digests=use_prefix_cache,  # the Engine's blocks go nowhere: digests only guard reuse
        )

    # -------------------------------------------------------------------------- decode

    def decode_step(self, seqs: Sequence[LmSequence]) -> None:
        """Feed each unfinished sequence its newest token and sample the next, in one forward."""
        self.runner.decode_step(seqs)

    def release(self, seq: LmSequence) -> None:
        """Give the sequence's blocks back to the pool (cached prompt blocks stay cached)."""
        batching.release(self.runner, seq)

    # ---------------------------------------------------------------------- front doors

    def _result(self, seq: LmSequence) -> GenerateResult:
        assert seq.finish_reason is not None
        silent = frozenset(seq.sampling.stop_token_ids)
        return GenerateResult(
            token_ids=list(seq.output),
            text=self.processor.decode([t for t in seq.output if t not in silent]),
            finish_reason=seq.finish_reason,
            prompt_tokens=len(seq.prompt_token_ids),
            cached_tokens=seq.cached_tokens,
        )

    def _checked(
        self, index: int, prompt: ProcessedPrompt, sampling: SamplingParams
    ) -> ProcessedPrompt:
        """`prompt` (request `index`) if it and its `max_tokens` fit the model's context and
        the KV pool, as a deployment checks them; else ValueError naming the request."""
        tokens = len(prompt.prompt_token_ids)
        try:
            check_context(tokens, sampling.max_tokens, self.config.text.max_position_embeddings)
        except FieldError as exc:
            raise ValueError(f"request {index}: {exc}") from None
        allocator = self.runner.allocator
        need = blocks_for(kv_slots(tokens, sampling), allocator.block_size)
        if need > allocator.pool.num_blocks:  # it would wait for ever, or fail mid-batch
            raise ValueError(
                f"request {index}: prompt of {tokens} tokens + max_tokens "
                f"{sampling.max_tokens} needs {need} KV blocks; the pool has "
                f"{allocator.pool.num_blocks}"
            )
        return prompt

    def generate(
        self, messages: Messages, sampling: SamplingParams | None = None
    ) -> GenerateResult:
        """Generate for one chat (`sampling` None: the checkpoint's defaults)."""
        return self.generate_batch([messages], sampling)[0]

    def generate_batch(
        self,
        requests: Sequence[Messages],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerateResult]:
        """Generate for many chats with continuous batching; results in request order
        (`sampling` None: the checkpoint's defaults, `self.sampling()`)."""
        if sampling is None:
            sampling = self.sampling()
        params = [sampling] * len(requests) if isinstance(sampling, SamplingParams) else sampling
        if len(params) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(params)} sampling params")
        waiting = deque(range(len(requests)))
        # Every request processed and checked before any forward: one that cannot be served
        # fails the call before the others' work, not after it.
        processed = {
            i: self._checked(i, self.process(messages), params[i])
            for i, messages in enumerate(requests)
        }
        batch = batching.Batch(self.runner)
        index_of: dict[LmSequence, int] = {}
        results: dict[int, GenerateResult] = {}
        # Whatever fails (processing, encoding, a forward, a step), no block stays taken:
        # `compute` gives back its admissions' blocks itself, the rest is released here.
        try:
            while waiting or batch.running:
                admitted: list[batching.Admission] = []
                indices: list[int] = []
                try:
                    while waiting and len(batch.running) + len(admitted) < self.max_batch:
                        index = waiting[0]
                        prompt = processed[index]
                        total = kv_slots(len(prompt.prompt_token_ids), params[index])
                        busy = batch.running or admitted
                        if busy and not self.runner.allocator.can_allocate(total):
                            break  # wait for running sequences to free blocks
                        admitted.append(
                            self._admit(prompt.prompt_token_ids, self.encode(prompt), params[index])
                        )
                        waiting.popleft()
                        del processed[index]
                        indices.append(index)
                except BaseException:
                    batching.abandon(self.runner, admitted)
                    raise
                if admitted:  # the new prompts' prefill, packed into as few forwards as fit
                    for seq, index in zip(
                        batching.compute(self.runner, admitted), indices, strict=True
                    ):
                        index_of[seq] = index
                        batch.add(seq)
                for seq in batch.step():
                    results[index_of.pop(seq)] = self._result(seq)
        except BaseException:
            batch.release_all()
            raise
        return [results[i] for i in range(len(requests))]

    def prompt_logits(
        self, messages: Messages, *, images: Sequence[Any] = (), videos: Sequence[Any] = ()
    ) -> torch.Tensor:
        """Logits `[n, vocab]` over the whole prompt, computed from scratch (no reuse)."""
        processed = self.process(messages, images=images, videos=videos)
        params = self.encode(processed)
        return batching.prompt_logits(self.runner, processed.prompt_token_ids, params)
