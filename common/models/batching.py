"""Scheduling over an `LmRunner` and its `KvAllocator`: admission, and the one batching step.

Admission: `admit` takes the blocks a prompt needs from the allocator (reusing the longest
cached prefix); `compute` runs the forwards of one or more admitted prompts together (packed
prefill) and caches the newly computed full blocks; `prefill` is both for one prompt;
`release` gives a finished sequence's blocks back. Both workers and the offline Engine admit
this way.

Continuous batching has one step mechanism, `Batch.step` (nano-vllm's schedule, run,
postprocess): pick the live sequences, decode one token for all of them in one forward,
then release the blocks of every sequence that finished or was cancelled. `Batch` is
synchronous; the Engine drives it in a plain loop, and the decode worker's `DecodeBatcher`
(`common.models.decode_loop`) drives it from its event loop, one `Batch.step` per
model-thread call.

Block ownership: a sequence owns its blocks from admission until `release`; once added to a
`Batch` the batch releases them exactly once (finish, cancel, or `release_all`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.kv.allocator import blocks_for
from common.kv.block_pool import PoolTooSmallError
from common.kv.digest import cache_block_digests
from common.models.qwen3_vl.rope import MropePositions
from common.models.runner import LmRunner, PrefillJob
from common.models.sequence import LmSequence
from common.multimodal.params import MultimodalParams
from common.sampling import SamplingParams

logger = logging.getLogger(__name__)


class MissingEmbeddingsError(RuntimeError):
    """Prefill needs an item's embeddings (its runs reach past the cached prefix) but the
    request carries none; the caller should encode the item and retry."""


# ---------------------------------------------------------------------------- admission


@dataclass(frozen=True, slots=True)
class Admission:
    """A prompt whose blocks are taken (cached prefix acquired), waiting to be computed."""

    job: PrefillJob  # what to compute; owns the blocks until `compute` hands them on
    hashes: list[bytes] | None  # the prompt's full-block hashes (None: no reuse, no caching)
    cached: int  # leading blocks reused from the prefix cache
    # Record the computed blocks' digests (workers hand them to peers; a private cache that
    # caches nothing never reads them, and they cost ~15% of a short prefill on CPU).
    digests: bool = True


def admit(
    runner: LmRunner,
    prompt_token_ids: Sequence[int],
    params: MultimodalParams,
    sampling: SamplingParams,
    *,
    hashes: list[bytes] | None,
    total_tokens: int | None = None,
    positions: MropePositions | None = None,
    keep_logits: bool = False,
    digests: bool = True,
) -> Admission:
    """Take the blocks a prompt needs, reusing the longest cached prefix of `hashes` whose
    bytes still match their digests (the last token is always computed).

    Blocks are taken for `total_tokens` slots (default: the prompt); the admission owns
    them until `compute`. `digests` False: `compute` records no digests (only for a cache
    that never offers its blocks to anyone and is not given `hashes`). Raises
    `NoFreeBlocksError` or `MissingEmbeddingsError` (an item that must be computed has no
    embeddings), taking nothing.
    """
    tokens = list(prompt_token_ids)
    n = len(tokens)
    if n == 0:
        raise ValueError("empty prompt")
    allocator = runner.allocator
    need = blocks_for(total_tokens or n, allocator.block_size)
    if need > allocator.pool.num_blocks:
        alone = blocks_for(n, allocator.block_size) > allocator.pool.num_blocks
        field = "prompt" if alone else "sampling.max_tokens"
        raise PoolTooSmallError(need, allocator.pool.num_blocks, field)
    cached = allocator.cached_prefix(hashes, n)
    if cached:  # reuse only blocks whose bytes are still the ones computed
        cached = allocator.check_prefix(cached, cache_block_digests(runner.kv, cached))
    start = len(cached) * allocator.block_size
    for i, item in enumerate(params.items):
        if item.end > start and i not in params.embeddings:
            raise MissingEmbeddingsError(
                f"item {i} reaches token {item.end - 1}, past the {start} cached tokens, "
                "but carries no embeddings"
            )
    blocks = allocator.allocate_prompt(cached, total_tokens or n)
    allocator.pool.count_lookups(len(hashes or ()), len(cached))  # counted once it is taken
    job = PrefillJob(tokens, params, sampling, blocks, start, positions, keep_logits)
    return Admission(job, hashes, len(cached), digests)


def compute(runner: LmRunner, admissions: Sequence[Admission]) -> list[LmSequence]:
    """Compute admitted prompts together (`LmRunner.prefill_many`) and sample each first
    token; record the digests of the computed prompt blocks (the partial last one too) and
    cache the new full blocks under the hashes. Each sequence takes over its admission's
    blocks; if the forward raises, every admission's blocks are released."""
    allocator = runner.allocator
    try:
        seqs = runner.prefill_many([a.job for a in admissions])
    except Exception:
        abandon(runner, admissions)
        raise
    for a in admissions:
        n = len(a.job.prompt_token_ids)
        blocks = a.job.blocks
        computed = blocks[a.cached : blocks_for(n, allocator.block_size)]
        if a.digests:
            allocator.record_digests(computed, cache_block_digests(runner.kv, computed))
        allocator.cache_prompt(blocks, a.hashes, n, a.cached)
    return seqs


def abandon(runner: LmRunner, admissions: Sequence[Admission]) -> None:
    """Give back the blocks of admissions that will not be computed."""
    for a in admissions:
        runner.allocator.release(a.job.blocks)


def prefill(
    runner: LmRunner,
    prompt_token_ids: Sequence[int],
    params: MultimodalParams,
    sampling: SamplingParams,
    *,
    hashes: list[bytes] | None,
    total_tokens: int | None = None,
    positions: MropePositions | None = None,
    keep_logits: bool = False,
) -> LmSequence:
    """Compute one prompt (reusing cached prefix blocks) and sample its first token:
    `admit`, then `compute`. The sequence owns its blocks. Raises `NoFreeBlocksError` or
    `MissingEmbeddingsError`, taking nothing."""
    admission = admit(
        runner,
        prompt_token_ids,
        params,
        sampling,
        hashes=hashes,
        total_tokens=total_tokens,
        positions=positions,
        keep_logits=keep_logits,
    )
    return compute(runner, [admission])[0]


def prompt_logits(
    runner: LmRunner, prompt_token_ids: Sequence[int], params: MultimodalParams
) -> torch.Tensor:
    """Logits `[n, vocab]` over the whole prompt, computed from scratch into blocks that are
    given back afterwards (nothing reused or cached). Every item needs embeddings."""
    tokens = list(prompt_token_ids)
    blocks = runner.allocator.allocate_prompt([], len(tokens))
    try:
        positions = runner.positions(len(tokens), params)
        return runner.forward(blocks, tokens, positions, params, 0, True)
    finally:
        runner.allocator.release(blocks)


def release(runner: LmRunner, seq: LmSequence) -> None:
    """Give the sequence's blocks back to the pool (cached prompt blocks stay cached)."""
    runner.allocator.release(seq.blocks)
    seq.blocks = []


# ------------------------------------------------------------------------------- the step


class Batch:
    """The running sequences of one runner, advanced together by `step`.

    Synchronous and not thread-safe: call every method from the thread that owns the
    runner (the Engine's caller, or the decode worker's model thread).
    """

    def __init__(self, runner: LmRunner) -> None:
        self.runner = runner
        self.running: list[LmSequence] = []  # admitted, not yet released, in join order
        self.steps = 0  # batched forwards run
        self.max_batch_seen = 0  # largest batch decoded in one step
        self.decoded = 0  # sequences decoded, summed over steps (divided by steps: mean batch)
        self.step_seconds = 0.0  # wall time of the steps' forwards
        self.step_cpu_seconds = 0.0  # CPU time of this thread in them (below wall: waiting)
        self._cancelled: set[LmSequence] = set()  # released at the next step boundary

    def add(self, seq: LmSequence) -> None:
        """Join the next step; the batch now owns `seq`'s blocks."""
        self.running.append(seq)

    def cancel(self, seq: LmSequence) -> None:
        """Drop `seq` at the next step: it is not decoded again, and its blocks are freed."""
        self._cancelled.add(seq)

    def step(self) -> list[LmSequence]:
        """Schedule, run, postprocess: decode one token for every live, uncancelled
        sequence in one forward, then release (and drop) every sequence that finished or
        was cancelled. Returns the released sequences, in join order."""
        live = [s for s in self.running if s not in self._cancelled and s.finish_reason is None]
        if live:
            wall, cpu = time.perf_counter(), time.thread_time()
            self.runner.decode_step(live)
            self.step_cpu_seconds += time.thread_time() - cpu
            self.step_seconds += time.perf_counter() - wall
            self.steps += 1
            self.decoded += len(live)
            self.max_batch_seen = max(self.max_batch_seen, len(live))
        done = [s for s in self.running if s in self._cancelled or s.finish_reason is not None]
        if done:
            self.running = [s for s in self.running if s not in set(done)]
            self._cancelled.difference_update(done)
            for seq in done:
                release(self.runner, seq)
        return done

    def release_all(self) -> None:
        """Release every running sequence's blocks (shutdown)."""
        seqs, self.running = self.running, []
        self._cancelled.clear()
        for seq in seqs:
            release(self.runner, seq)
