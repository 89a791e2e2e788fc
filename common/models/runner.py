"""The language-model runner shared by the prefill and decode workers (no vision, no processor).

`LmRunner` owns one worker's `TextModel`, its block-major `PagedKvCache`, the `BlockPool` over
that cache and a `Sampler`. The offline `common.engine.Engine` runs its language model through
an `LmRunner` too, so a prefill worker followed by a decode worker produces exactly the
Engine's tokens:

    check_prompt / check_embeddings          -> raise MultimodalLayoutError naming the field
    hashes(tokens, params, salt, lora)       -> block hashes under this runner's root, or None
    prefill(tokens, params, sampling, ...)   -> LmSequence (prefix reuse, first token sampled)
    prompt_logits(tokens, params)            -> logits of every prompt token (no reuse)
    plan_import(hashes, n, total) / finish_import / abort_import   (decode: KV pulled by NIXL)
    resume(tokens, params, sampling, blocks, first_token) -> LmSequence (decode side)
    decode_step(seqs)                        (one token for every unfinished sequence)
    release(seq)

Block hashes: every hash is chained from `root = layout_root(kv_layout)`, the root of the
model identity (config + weight-file digest) and the KV layout, so two workers exchange or
reuse blocks only when model and layout agree. The router computes the same root from the
`KvLayout` a worker registers. (The offline Engine, whose cache is private, passes
`block_hash.DEFAULT_ROOT` as `root` instead.) A prompt whose layout cannot be hashed is
*uncacheable* (`hashes` returns None): it is computed, never cached, never offered for
transfer by hash.

Block ownership: every block id a runner method returns is owned by the caller with one
reference (`LmSequence.blocks`, `ImportPlan.blocks`) until `release` / `abort_import` or a
hand-over of those ids to a lease; cached blocks stay cached after release (LRU-evictable).

Not thread-safe: callers serialize every call (the workers run all of them on one executor
thread), because the pool and the KV buffer are shared by all requests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.kv import allocator as kv_import
from common.kv.allocator import ImportPlan, blocks_for
from common.kv.block_pool import BlockPool, KvEvent
from common.kv.cache import KvCacheSpec, PagedKvCache
from common.kv.hashing import block_hashes
from common.kv.layout import layout_root, model_identity
from common.models import prompt_check
from common.models.qwen3_vl.config import Qwen3VLConfig
from common.models.qwen3_vl.rope import MropePositions, decode_positions, prompt_positions
from common.models.qwen3_vl.text import LM_HEAD, LM_PREFIX, TextModel
from common.models.qwen3_vl.weights import load_weights
from common.multimodal.params import MultimodalParams
from common.sampling import FinishReason, Sampler, SamplingParams, StopChecker, make_generator
from common.wire.convert import element_type
from epd.v1 import kv_pb2

logger = logging.getLogger(__name__)


class MissingEmbeddingsError(RuntimeError):
    """Prefill needs an item's embeddings (its runs reach past the cached prefix) but the
    request carries none; the caller should encode the item and retry."""


@dataclass(slots=True)
class LmSequence:
    """Runner-side state of one request between prefill (or resume) and release."""

    prompt_token_ids: list[int]  # the prompt
    sampling: SamplingParams  # how tokens are picked and when to stop
    generator: torch.Generator | None  # the request's own randomness (seeded requests)
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


class LmRunner:
    """Language model + paged KV + block pool + sampler of one worker (see module docstring).

    Not thread-safe: serialize every call.
    """

    def __init__(
        self,
        config: Qwen3VLConfig,
        model: TextModel,
        *,
        identity: str,
        block_size: int = 16,
        num_blocks: int = 1024,
        prefill_chunk: int | None = None,
        device: torch.device | str = "cpu",
        root: bytes | None = None,
    ) -> None:
        self.config = config
        self.model = model
        # Model identity string, the `model` of the KvLayout (see `model_identity`).
        self.identity = identity
        self.device = torch.device(device)
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk
        t = config.text
        self.kv = PagedKvCache(
            KvCacheSpec(
                num_layers=t.num_hidden_layers,
                num_kv_heads=t.num_key_value_heads,
                head_dim=t.head_dim,
                block_size=block_size,
                dtype=model.dtype,
                num_blocks=num_blocks,
            ),
            self.device,
        )
        self.pool = BlockPool(num_blocks, record_events=False, on_event=self._on_event)
        self.sampler = Sampler()
        self.stop = StopChecker(frozenset(config.eos_token_ids))
        # Every hash in the prefix cache, in the order it entered (for event snapshots).
        self._cached: dict[bytes, None] = {}
        # Called with every KV event, on the thread that made it (the runner's caller).
        self.event_listeners: list[Callable[[KvEvent], None]] = []
        spec = self.kv.spec
        self.kv_layout = kv_pb2.KvLayout(
            model=identity,
            dtype=element_type(spec.dtype),
            block_size=block_size,
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            layout=spec.layout,
            block_bytes=spec.block_bytes,
        )
        # The hash every block hash chains from; workers always use the layout root.
        self.root = layout_root(self.kv_layout) if root is None else root
        self.placeholder_ids = frozenset((config.image_token_id, config.video_token_id))

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        block_size: int = 16,
        num_blocks: int = 1024,
        prefill_chunk: int | None = None,
    ) -> LmRunner:
        """Load the language model of a Hugging Face-format Qwen3-VL checkpoint folder."""
        config = Qwen3VLConfig.from_file(path)
        tensors = load_weights(
            path, config, dtype=dtype, prefix=(LM_PREFIX, LM_HEAD), device=device
        )
        return cls(
            config,
            TextModel.from_weights(config, tensors),
            identity=model_identity(path, config),
            block_size=block_size,
            num_blocks=num_blocks,
            prefill_chunk=prefill_chunk,
            device=device,
        )

    # ------------------------------------------------------------------- validation, hashing

    def check_prompt(self, prompt_token_ids: Sequence[int], params: MultimodalParams) -> None:
        """Raise `MultimodalLayoutError` naming the field unless the prompt fits this model
        (see `prompt_check.check_prompt`; embeddings are not looked at)."""
        prompt_check.check_prompt(self.config, prompt_token_ids, params)

    def check_embeddings(self, params: MultimodalParams) -> None:
        """Raise `MultimodalLayoutError` unless every attached embedding has the model's
        width and deepstack depth."""
        prompt_check.check_embeddings(self.config, params)

    def hashes(
        self,
        prompt_token_ids: Sequence[int],
        params: MultimodalParams,
        *,
        cache_salt: str | None = None,
        lora_id: str | None = None,
    ) -> list[bytes] | None:
        """Hashes of the prompt's full blocks under this runner's root; None = uncacheable."""
        try:
            return block_hashes(
                prompt_token_ids,
                self.block_size,
                params,
                cache_salt=cache_salt,
                lora_id=lora_id,
                root=self.root,
            )
        except ValueError:
            logger.warning("prompt layout cannot be hashed; request is uncacheable")
            return None

    def positions(self, num_tokens: int, params: MultimodalParams) -> MropePositions:
        """mRoPE positions of a prompt (see `rope.prompt_positions`)."""
        return prompt_positions(num_tokens, params.items, self.config.vision.spatial_merge_size)

    # -------------------------------------------------------------------------- prefill

    def prefill(
        self,
        prompt_token_ids: Sequence[int],
        params: MultimodalParams,
        sampling: SamplingParams,
        *,
        hashes: list[bytes] | None,
        total_tokens: int | None = None,
        keep_logits: bool = False,
    ) -> LmSequence:
        """Compute a prompt (reusing cached prefix blocks) and sample its first token.

        The longest cached prefix (at most `(n - 1) // block_size` blocks, so the last token
        is computed) is acquired, the rest computed, and the new full blocks cached under
        `hashes` (None: nothing reused or cached). Blocks are taken for `total_tokens` slots
        (default: the prompt). The sequence owns them; with `keep_logits` it also holds the
        logits of every computed prompt token. Raises
        `NoFreeBlocksError` (nothing taken) or `MissingEmbeddingsError` (nothing taken or
        cached) when an item that must be computed has no embeddings.
        """
        tokens = list(prompt_token_ids)
        n = len(tokens)
        if n == 0:
            raise ValueError("empty prompt")
        bs = self.block_size
        cached = self.pool.find_cached_prefix(hashes or [])[: (n - 1) // bs]
        start = len(cached) * bs
        for i, item in enumerate(params.items):
            if item.end > start and i not in params.embeddings:
                raise MissingEmbeddingsError(
                    f"item {i} reaches token {item.end - 1}, past the {start} cached tokens, "
                    "but carries no embeddings"
                )
        self.pool.acquire(cached)
        try:
            blocks = cached + self.pool.allocate(blocks_for(total_tokens or n, bs) - len(cached))
        except Exception:
            self.pool.release(cached)
            raise
        positions = self.positions(n, params)
        try:
            logits = self._forward(blocks, tokens, positions, params, start, keep_logits)
        except Exception:
            self.pool.release(blocks)
            raise
        full = n // bs
        if hashes and full > len(cached):
            self.pool.cache_blocks(blocks[len(cached) : full], hashes[len(cached) : full])
        seq = LmSequence(
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
        logger.debug("prefilled %d tokens (%d cached)", n, start)
        return seq

    def prompt_logits(
        self, prompt_token_ids: Sequence[int], params: MultimodalParams
    ) -> torch.Tensor:
        """Logits `[n, vocab]` over the whole prompt, computed from scratch into blocks that
        are given back afterwards (nothing reused or cached). Every item needs embeddings."""
        tokens = list(prompt_token_ids)
        blocks = self.pool.allocate(blocks_for(len(tokens), self.block_size))
        try:
            positions = self.positions(len(tokens), params)
            return self._forward(blocks, tokens, positions, params, 0, True)
        finally:
            self.pool.release(blocks)

    def _forward(
        self,
        blocks: list[int],
        tokens: list[int],
        positions: MropePositions,
        params: MultimodalParams,
        start: int,
        all_logits: bool,
    ) -> torch.Tensor:
        """One prefill forward over `tokens[start:]` into `blocks`: logits of the computed
        tokens `[n - start, vocab]` with `all_logits`, else of the last token `[vocab]`."""
        return self.model.prefill(
            self.kv.buffer,
            torch.tensor(blocks, device=self.device),
            torch.tensor(tokens, device=self.device),
            positions.positions.to(self.device),
            start=start,
            items=params.items,
            embeddings=params.embeddings,
            chunk_size=self.prefill_chunk,
            all_logits=all_logits,
        )

    # ---------------------------------------------------------------------- KV import

    def plan_import(
        self, hashes: list[bytes] | None, num_tokens: int, total_tokens: int
    ) -> ImportPlan:
        """Take blocks for a prompt whose KV is pulled from a prefill worker (reusing the full
        blocks this pool caches; see `kv_import.plan_import`). The caller owns the plan's
        blocks and must pass the plan to `finish_import` (after the pull) or `abort_import`.
        Raises `NoFreeBlocksError` with nothing taken.
        """
        return kv_import.plan_import(self.pool, self.block_size, hashes, num_tokens, total_tokens)

    def finish_import(self, plan: ImportPlan, hashes: list[bytes] | None) -> None:
        """Cache the pulled full blocks under their hashes (their bytes are now valid)."""
        kv_import.finish_import(self.pool, plan, hashes)

    def abort_import(self, plan: ImportPlan) -> None:
        """Give back every block of a plan whose pull failed or was cancelled."""
        self.pool.release(plan.blocks)

    def resume(
        self,
        prompt_token_ids: Sequence[int],
        params: MultimodalParams,
        sampling: SamplingParams,
        blocks: list[int],
        first_token: int,
    ) -> LmSequence:
        """A sequence continuing after a prefill elsewhere: the prompt's KV is in `blocks`
        (now owned by the sequence) and `first_token` was sampled there.

        A seeded, non-greedy request's generator is advanced past the first token's draw,
        so the rest of the tokens equal what one process would sample.
        """
        tokens = list(prompt_token_ids)
        seq = LmSequence(
            prompt_token_ids=tokens,
            sampling=sampling,
            generator=make_generator(sampling.seed, self.device),
            blocks=blocks,
            mrope_delta=self.positions(len(tokens), params).delta,
        )
        if seq.generator is not None and not sampling.is_greedy:
            vocab = self.config.text.vocab_size
            torch.empty(vocab, dtype=torch.float32, device=seq.generator.device).exponential_(
                generator=seq.generator
            )
        self._append(seq, first_token)
        return seq

    # -------------------------------------------------------------------------- decode

    def decode_step(self, seqs: Sequence[LmSequence]) -> None:
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
        tokens = self.sampler.sample(
            logits, [s.sampling for s in live], [s.generator for s in live]
        ).tolist()
        for s, token in zip(live, tokens, strict=True):
            self._append(s, token)

    def _append(self, seq: LmSequence, token: int | torch.Tensor) -> None:
        token_id = int(token.reshape(-1)[0]) if isinstance(token, torch.Tensor) else int(token)
        seq.output.append(token_id)
        seq.finish_reason = self.stop.check(seq.sampling, token_id, len(seq.output))

    def release(self, seq: LmSequence) -> None:
        """Give the sequence's blocks back to the pool (cached prompt blocks stay cached)."""
        self.pool.release(seq.blocks)
        seq.blocks = []

    # ------------------------------------------------------------------- cache snapshot

    def cached_hashes(self) -> list[bytes]:
        """Every hash in the prefix cache, oldest entry first."""
        return list(self._cached)

    def _on_event(self, event: KvEvent) -> None:
        if event.kind == "stored":
            self._cached.update(dict.fromkeys(event.block_hashes))
        elif event.kind == "removed":
            for block_hash in event.block_hashes:
                self._cached.pop(block_hash, None)
        else:
            self._cached.clear()
        for listener in self.event_listeners:
            listener(event)
