"""The language-model runner shared by the prefill and decode workers (no vision, no processor).

`LmRunner` runs forwards, computes positions and samples: it owns one worker's `TextModel`,
its block-major `PagedKvCache` and a `Sampler`. It never takes or frees a block: which blocks
a sequence computes into is decided by the worker's `KvAllocator` (`runner.allocator`) and
the scheduling in `common.models.batching`. The offline `common.engine.Engine` runs its
language model through an `LmRunner` too, so a prefill worker followed by a decode worker
produces exactly the Engine's tokens:

    check_prompt(tokens, params)             -> mRoPE positions; MultimodalLayoutError if bad
    prefill(tokens, params, sampling, blocks, start) -> LmSequence (first token sampled)
    prefill_many(jobs)                       -> LmSequences (prompts packed into forwards)
    forward(blocks, tokens, positions, params, start) -> prompt logits (nothing sampled)
    resume(tokens, sampling, blocks, generated, mrope_delta) -> LmSequence (decode side)
    decode_step(seqs)                        (one token for every unfinished sequence)

Why the runner carries the allocator: the KV buffer and the pool over it are sized by the
same `num_blocks`, and the hash root follows from the runner's `kv_layout`, so building them
together keeps one object for every worker (and the Engine) to hold; no runner method uses
it. The root is `layout_root(kv_layout)` on workers, `common.kv.hashing.DEFAULT_ROOT` (passed as
`root`) for the offline Engine, whose cache is private.

Not thread-safe: callers serialize every call (the workers run all of them on one executor
thread), because the KV buffer and the pool are shared by all requests.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from common.kv.allocator import KvAllocator
from common.kv.cache import KvCacheSpec, PagedKvCache
from common.kv.layout import KvLayout, layout_root
from common.models import prompt_check
from common.models.identity import load_identified
from common.models.malloc_settings import tune_malloc
from common.models.qwen3_vl.config import Qwen3VLConfig
from common.models.qwen3_vl.prefill_plan import PrefillRequest
from common.models.qwen3_vl.rope import MropePositions, decode_positions, prompt_positions
from common.models.qwen3_vl.text import LM_HEAD, LM_PREFIX, Segment, TextModel
from common.models.running_kv import RunningKv
from common.models.sequence import LmSequence
from common.multimodal.params import MultimodalParams
from common.sampling import Sampler, SamplingParams, StopChecker

logger = logging.getLogger(__name__)

#: Tokens per packed prefill forward by default: enough for 32 short prompts in one forward.
DEFAULT_PREFILL_BUDGET = 2048


def _long(values: Sequence[int] | array[int]) -> torch.Tensor:
    """An int64 CPU tensor of `values`: through an `array`, several times faster than
    `torch.tensor` on a list of ints (which a decode step builds a few of)."""
    buffer = values if isinstance(values, array) else array("q", values)
    if not buffer:  # frombuffer refuses an empty buffer
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(buffer, dtype=torch.long)


@dataclass(frozen=True, slots=True)
class PrefillJob:
    """One prompt for `LmRunner.prefill_many` (the arguments of `LmRunner.prefill`)."""

    prompt_token_ids: list[int]  # the whole prompt
    params: MultimodalParams  # its items and the embeddings of those to compute
    sampling: SamplingParams  # how its first token is picked
    blocks: list[int]  # its blocks, handed to the sequence; the first `start` tokens' K/V set
    start: int = 0  # first token to compute
    positions: MropePositions | None = None  # the prompt's, when already computed
    keep_logits: bool = False  # keep the logits of every computed prompt token


class LmRunner:
    """Language model + paged KV + sampler of one worker (see module docstring).

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
        prefill_budget: int | None = None,
        contiguous_decode: bool = True,
        device: torch.device | str = "cpu",
        root: bytes | None = None,
    ) -> None:
        tune_malloc()  # process-wide: freed activations stay in the heap (see the module)
        self.config = config
        self.model = model
        # Model identity string, the `model` of the KvLayout (see `model_identity`).
        self.identity = identity
        self.device = torch.device(device)
        self.block_size = block_size
        # Most tokens per forward piece of one prompt (None: a whole prompt per piece).
        self.prefill_chunk = prefill_chunk
        # Most tokens per forward when `prefill_many` packs several prompts' pieces (a piece
        # longer than this still runs, alone). Default: `prefill_chunk` when set (a forward
        # stays as small as a chunk), else DEFAULT_PREFILL_BUDGET.
        self.prefill_budget = prefill_budget or prefill_chunk or DEFAULT_PREFILL_BUDGET
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
        self.sampler = Sampler()
        self.stop = StopChecker(frozenset(config.eos_token_ids))
        self.kv_layout = KvLayout.of(identity, self.kv.spec)
        # Contiguous K/V rows of the decode batch (a second copy; the paged cache is truth).
        self.running = RunningKv(self.kv)
        # Decode attention reads `running`'s rows (False: gathers the blocks every step).
        self.contiguous_decode = contiguous_decode
        # The worker's blocks and prefix cache (see the module docstring for why it is here).
        self.allocator = KvAllocator.create(
            num_blocks, block_size, layout_root(self.kv_layout) if root is None else root
        )
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
        packed_weights: bool | None = None,
    ) -> LmRunner:
        """Load the language model of a Hugging Face-format Qwen3-VL checkpoint folder
        (`packed_weights`: see `linear.Dense`)."""
        config = Qwen3VLConfig.from_file(path)
        tensors, identity = load_identified(
            path, config, dtype=dtype, prefix=(LM_PREFIX, LM_HEAD), device=device
        )
        return cls(
            config,
            TextModel.from_weights(config, tensors, packed_weights=packed_weights),
            identity=identity,
            block_size=block_size,
            num_blocks=num_blocks,
            prefill_chunk=prefill_chunk,
            device=device,
        )

    # --------------------------------------------------------------- validation, positions

    def check_prompt(
        self, prompt_token_ids: Sequence[int], params: MultimodalParams
    ) -> MropePositions:
        """The prompt's mRoPE positions; raise `MultimodalLayoutError` naming the field unless
        the prompt fits this model (see `prompt_check.check_prompt`; embeddings unchecked)."""
        return prompt_check.check_prompt(self.config, prompt_token_ids, params)

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
        blocks: list[int],
        start: int = 0,
        positions: MropePositions | None = None,
        keep_logits: bool = False,
    ) -> LmSequence:
        """Compute `prompt[start:]` into `blocks` (the first `start` tokens' K/V are there
        already) and sample the first token.

        The sequence takes over `blocks` (the caller's reference). `positions` are the
        prompt's (computed when None). With `keep_logits` the sequence also holds the logits
        of every computed prompt token. Raises whatever the forward raises, owning nothing.
        """
        job = PrefillJob(
            list(prompt_token_ids), params, sampling, blocks, start, positions, keep_logits
        )
        return self.prefill_many([job])[0]

    def prefill_many(self, jobs: Sequence[PrefillJob]) -> list[LmSequence]:
        """`prefill` of several prompts, packed into forwards of at most `prefill_budget`
        tokens (each prompt cut into `prefill_chunk` pieces as when alone, so its K/V and
        logits are the ones `prefill` computes). Raises whatever a forward raises, owning
        nothing."""
        positions = [j.positions or self.positions(len(j.prompt_token_ids), j.params) for j in jobs]
        requests = [
            PrefillRequest(
                torch.tensor(j.blocks, device=self.device),
                torch.tensor(j.prompt_token_ids, device=self.device),
                pos.positions.to(self.device),
                j.start,
                j.params.items,
                j.params.embeddings,
                j.keep_logits,
            )
            for j, pos in zip(jobs, positions, strict=True)
        ]
        all_logits = self.model.prefill_many(
            self.kv.buffer,
            requests,
            chunk_size=self.prefill_chunk,
            token_budget=self.prefill_budget,
        )
        seqs = []
        for job, pos, logits in zip(jobs, positions, all_logits, strict=True):
            sampling = job.sampling
            seq = LmSequence(
                prompt_token_ids=job.prompt_token_ids,
                sampling=sampling,
                blocks=job.blocks,
                mrope_delta=pos.delta,
                cached_tokens=job.start,
                prompt_logits=logits if job.keep_logits else None,
            )
            last = logits[-1:] if job.keep_logits else logits.unsqueeze(0)
            self._append(seq, self.sampler.sample(last, [sampling], [len(job.prompt_token_ids)]))
            seqs.append(seq)
        logger.debug("prefilled %d prompts", len(jobs))
        return seqs

    def forward(
        self,
        blocks: list[int],
        tokens: list[int],
        positions: MropePositions,
        params: MultimodalParams,
        start: int,
        all_logits: bool,
    ) -> torch.Tensor:
        """One prefill over `tokens[start:]` into `blocks` (in `prefill_chunk` pieces):
        logits of the computed tokens `[n - start, vocab]` with `all_logits`, else of the
        last token `[vocab]`."""
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

    # -------------------------------------------------------------------------- decode

    def resume(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        blocks: list[int],
        generated: Sequence[int],
        *,
        mrope_delta: int,
    ) -> LmSequence:
        """A sequence continuing after a prefill elsewhere: the prompt's KV is in `blocks`
        (now owned by the sequence), `generated` are the tokens sampled so far (the
        prefill's first token, then any a failed decode worker had streamed), and
        `mrope_delta` is the prompt's (from `check_prompt`).

        The K/V of every generated token but the newest are computed here, in one forward
        (`blocks` must have room for them). Seeded draws depend on the position only
        (`common.sampling`), so the rest of the tokens equal what one process would sample.
        """
        if not generated:
            raise ValueError("resume needs at least the first token")
        seq = LmSequence(
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            blocks=blocks,
            mrope_delta=mrope_delta,
        )
        n, recompute = len(seq.prompt_token_ids), list(generated[:-1])
        if recompute:
            index = torch.arange(n, n + len(recompute))
            segment = Segment(
                torch.tensor(blocks, device=self.device),
                torch.tensor(recompute, device=self.device),
                decode_positions(index, torch.tensor(mrope_delta)).to(self.device),
                n,
                None,
                0,  # only their K/V are wanted
            )
            self.model.forward_segments(self.kv.buffer, [segment])
        for token in generated:
            self._append(seq, token)
        return seq

    def decode_step(self, seqs: Sequence[LmSequence]) -> None:
        """Feed each unfinished sequence its newest token and sample the next, in one forward.

        With `contiguous_decode`, attention reads the sequences' contiguous rows in
        `self.running` (filled from the paged cache the first time a sequence decodes, and
        within its memory budget; see `common.models.running_kv`), in the rows' order;
        sequences are sampled independently, so the order changes nothing. Without it, or
        past the budget, attention gathers their blocks.
        """
        live = [s for s in seqs if s.finish_reason is None]
        if not live:
            self.running.clear()
            return
        rows = self.contiguous_decode and self.running.fits(live)  # else blocks are gathered
        if rows:
            live = self.running.arrange(live)
        else:
            self.running.clear()
        computed = [s.num_computed for s in live]
        size = self.block_size
        # The block of each new token's slot (position `computed`); the whole tables only
        # when attention gathers blocks.
        try:
            slot_blocks = _long([s.blocks[n // size] for s, n in zip(live, computed, strict=True)])
        except IndexError:
            short = next(
                n for s, n in zip(live, computed, strict=True) if n // size >= len(s.blocks)
            )
            raise ValueError(
                f"a sequence has no KV block for its token at position {short}"
            ) from None
        tables = None
        if not rows:
            width = max(len(s.blocks) for s in live)
            flat = array("q")
            for s in live:
                flat.extend(s.blocks)
                flat.extend([0] * (width - len(s.blocks)))
            tables = _long(flat).view(len(live), width).to(self.device)
        seq_lens = _long([n + 1 for n in computed])
        try:
            logits = self.model.decode(
                self.kv.buffer,
                tables,
                _long([s.output[-1] for s in live]).to(self.device),
                decode_positions(seq_lens - 1, _long([s.mrope_delta for s in live])).to(
                    self.device
                ),
                seq_lens.to(self.device),
                rows=self.running.view() if rows else None,
                slot_blocks=slot_blocks.to(self.device),
            )
        except BaseException:
            self.running.clear()  # rows may hold a partly written step
            raise
        if rows:
            self.running.advanced()
        tokens = self.sampler.sample(
            logits, [s.sampling for s in live], [n + 1 for n in computed]
        ).tolist()
        for s, token in zip(live, tokens, strict=True):
            self._append(s, token)

    def _append(self, seq: LmSequence, token: int | torch.Tensor) -> None:
        token_id = int(token.reshape(-1)[0]) if isinstance(token, torch.Tensor) else int(token)
        seq.output.append(token_id)
        seq.finish_reason = self.stop.check(seq.sampling, token_id, len(seq.output))
