"""The monolithic offline engine: processor, vision tower and language model in one process.

It is the reference the disaggregated path is compared against, and small enough to read in
one sitting:

    process(messages)  -> ProcessedPrompt            (tokens, item metadata, pixels)
    encode(processed)  -> MultimodalParams            (+ embeddings, + mRoPE delta)
    prefill(tokens, params, sampling) -> Sequence     (reuses cached prefix blocks, first token)
    decode_step(sequences)                            (one token for every running sequence)

`generate_batch` runs continuous batching over those pieces: new requests are admitted
(prefilled) whenever a batch slot and enough KV blocks are free, and every step decodes all
running sequences in one forward.

Prefix reuse: the prompt's full blocks are hashed with `common.block_hash.block_hashes` (the
same function router, prefill and decode use); the longest cached prefix is acquired from
the `BlockPool`, only the rest is computed, and the newly computed full prompt blocks are
cached afterwards. At least the last prompt token is always computed (its logits give the
first token), and a cached block is never written.

Block ownership: a sequence owns one reference on each of its blocks from `prefill` until
`release` (called by `generate*` when it finishes). Blocks for the whole request (prompt +
`max_tokens`) are taken at admission, so decode never runs out of blocks mid-request.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common.block_hash import block_hashes
from common.kv.block_pool import BlockPool
from common.kv.cache import KvCacheSpec, PagedKvCache
from common.models.qwen3_vl.config import Qwen3VLConfig
from common.models.qwen3_vl.rope import MropePositions, decode_positions, prompt_positions
from common.models.qwen3_vl.text import LM_PREFIX, TextModel
from common.models.qwen3_vl.vision import VisionTower
from common.models.qwen3_vl.weights import LM_HEAD, VISUAL_PREFIX, load_weights
from common.multimodal import ItemEmbedding, MultimodalParams
from common.processor import ProcessedPrompt, Processor
from common.sampling import FinishReason, Sampler, SamplingParams, StopChecker, make_generator

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


@dataclass(slots=True)
class RunningSequence:
    """Engine-side state of one request between prefill and release."""

    request_id: int  # engine-local id, in admission order
    prompt_token_ids: list[int]  # the prompt
    sampling: SamplingParams  # how tokens are picked and when to stop
    generator: torch.Generator | None  # the request's own randomness (seeded requests)
    blocks: list[int]  # KV block ids in sequence order; one reference owned on each
    mrope_delta: int  # position offset of tokens after the prompt
    cached_tokens: int  # prompt tokens reused from the prefix cache
    output: list[int] = field(default_factory=list)  # sampled tokens so far
    # Logits of the computed prompt tokens [n - cached_tokens, vocab], when asked for.
    prompt_logits: torch.Tensor | None = None
    finish_reason: FinishReason | None = None  # set once the request is done

    @property
    def num_computed(self) -> int:
        """Tokens whose K/V are in the cache (the newest sampled token is not yet)."""
        return len(self.prompt_token_ids) + len(self.output) - 1


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
        self.model = text_model
        self.vision = vision
        self.processor = processor
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        t = config.text
        self.kv = PagedKvCache(
            KvCacheSpec(
                num_layers=t.num_hidden_layers,
                num_kv_heads=t.num_key_value_heads,
                head_dim=t.head_dim,
                block_size=block_size,
                dtype=text_model.dtype,
                num_blocks=num_blocks,
            ),
            self.device,
        )
        self.pool = BlockPool(num_blocks, record_events=False)
        self.sampler = Sampler()
        self.stop = StopChecker(frozenset(config.eos_token_ids))
        self._ids = itertools.count()

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
        merge = self.config.vision.spatial_merge_size
        return prompt_positions(len(prompt_token_ids), params.items, merge)

    def _hashes(self, prompt_token_ids: Sequence[int], params: MultimodalParams) -> list[bytes]:
        try:
            return block_hashes(prompt_token_ids, self.block_size, params)
        except ValueError:
            logger.warning("prompt layout cannot be hashed; computing it without prefix reuse")
            return []

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

        The returned sequence owns its blocks; pass it to `decode_step`, then `release`.
        With `keep_logits` it also holds the logits of every computed prompt token.
        Raises `NoFreeBlocksError` when the pool cannot hold prompt + `max_tokens`.
        """
        tokens = list(prompt_token_ids)
        n = len(tokens)
        if n == 0:
            raise ValueError("empty prompt")
        hashes = self._hashes(tokens, params) if use_prefix_cache else []
        cached = self.pool.find_cached_prefix(hashes)[: (n - 1) // self.block_size]
        total_blocks = -(-(n + sampling.max_tokens) // self.block_size)
        self.pool.acquire(cached)
        try:
            blocks = cached + self.pool.allocate(total_blocks - len(cached))
        except Exception:
            self.pool.release(cached)
            raise
        start = len(cached) * self.block_size
        positions = self.positions(tokens, params)
        try:
            logits = self.model.prefill(
                self.kv.buffer,
                torch.tensor(blocks, device=self.device),
                torch.tensor(tokens, device=self.device),
                positions.positions.to(self.device),
                start=start,
                items=params.items,
                embeddings=params.embeddings,
                chunk_size=self.prefill_chunk,
                all_logits=keep_logits,
            )
        except Exception:
            self.pool.release(blocks)
            raise
        full = n // self.block_size
        if hashes and full > len(cached):
            self.pool.cache_blocks(blocks[len(cached) : full], hashes[len(cached) : full])
        seq = RunningSequence(
            request_id=next(self._ids),
            prompt_token_ids=tokens,
            sampling=sampling,
            generator=make_generator(sampling.seed, self.device),
            blocks=blocks,
            mrope_delta=positions.delta,
            cached_tokens=start,
            prompt_logits=logits if keep_logits else None,
        )
        last = logits[-1:] if keep_logits else logits.unsqueeze(0)
        self._append(seq, self.sampler.sample(last, [sampling], [seq.generator]))
        logger.debug("request %d: prefilled %d tokens (%d cached)", seq.request_id, n, start)
        return seq

    # -------------------------------------------------------------------------- decode

    def decode_step(self, seqs: Sequence[RunningSequence]) -> None:
        """Feed each unfinished sequence its newest token and sample the next, in one forward."""
        live = [s for s in seqs if s.finish_reason is None]
        if not live:
            return
        width = max(len(s.blocks) for s in live)
        tables = torch.zeros(len(live), width, dtype=torch.long)
        for i, s in enumerate(live):
            tables[i, : len(s.blocks)] = torch.tensor(s.blocks)
        seq_lens = torch.tensor([s.num_computed + 1 for s in live])
        deltas = torch.tensor([s.mrope_delta for s in live])
        logits = self.model.decode(
            self.kv.buffer,
            tables.to(self.device),
            torch.tensor([s.output[-1] for s in live], device=self.device),
            decode_positions(seq_lens - 1, deltas).to(self.device),
            seq_lens.to(self.device),
        )
        self._append_batch(live, logits)

    def _append_batch(self, live: Sequence[RunningSequence], logits: torch.Tensor) -> None:
        tokens = self.sampler.sample(
            logits, [s.sampling for s in live], [s.generator for s in live]
        ).tolist()
        for s, token in zip(live, tokens, strict=True):
            self._append(s, token)

    def _append(self, seq: RunningSequence, token: int | torch.Tensor) -> None:
        token_id = int(token.reshape(-1)[0]) if isinstance(token, torch.Tensor) else int(token)
        seq.output.append(token_id)
        seq.finish_reason = self.stop.check(seq.sampling, token_id, len(seq.output))

    def release(self, seq: RunningSequence) -> None:
        """Give the sequence's blocks back to the pool (cached prompt blocks stay cached)."""
        self.pool.release(seq.blocks)
        seq.blocks = []

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
        tokens = processed.prompt_token_ids
        blocks = self.pool.allocate(-(-len(tokens) // self.block_size))
        try:
            return self.model.prefill(
                self.kv.buffer,
                torch.tensor(blocks, device=self.device),
                torch.tensor(tokens, device=self.device),
                self.positions(tokens, params).positions.to(self.device),
                items=params.items,
                embeddings=params.embeddings,
                chunk_size=self.prefill_chunk,
                all_logits=True,
            )
        finally:
            self.pool.release(blocks)
