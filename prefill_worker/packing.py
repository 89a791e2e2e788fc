"""Concurrent prefills computed together: one forward for the prompts queued at once.

Every Prefill RPC hands its prompt to `PrefillPacker.prefill`, which queues it and asks the
model thread for one drain. A drain takes the queue's head: one prompt while the queue holds
at most `pack_tokens` prompt tokens, and past that a pack, the prompts in arrival order up
to `pack_tokens` tokens. It admits each (`batching.admit`: cached prefix reused, blocks
taken) and computes the admitted ones in one `batching.compute` (`LmRunner.prefill_many`:
the prompts' pieces packed into forwards). Per prompt that is the arithmetic of a prefill
alone (`tests/test_packed_prefill.py`); a short prompt's forward is mostly per-op overhead
and small matrix products, so a pack costs less than its prompts one by one. A drain that
finds the queue empty (a later one took its prompt) does nothing.

Why only past a backlog: every prompt of a pack waits for the whole pack, so a pack of k
prompts lowers their mean wait only if it is more than 2k / (k + 1) times cheaper than
computing them one by one (1.33x for two), more than it is on a CPU (1.15-1.5x,
docs/performance.md). It pays as capacity: when prompts arrive faster than they are
computed one by one, the queue grows and every later prompt waits for it. So a worker
computes one prompt at a time until its backlog passes `pack_tokens`, and then packs until
it is back under. With `pack_tokens` 0 every drain takes one prompt, as before packing.

A prompt that shares a block not yet cached with an earlier prompt of its pack (the same
system prompt or image, sent together) waits for the next pack, where it reuses that block
instead of computing it again, as it would have one prompt at a time. A prompt that cannot
be admitted (no free blocks, embeddings missing past the cached prefix) fails alone; a
forward that raises fails the prompts it computed, whose blocks go back
(`batching.compute`).

Cancellation (the RPC went away): a prompt still queued leaves the queue and is never
computed (`dropped`); one being computed finishes, and its blocks go back to the pool on the
model thread as soon as its pack is done; one already computed whose caller never took it
is given back likewise. Exactly one side gives the blocks back: the state moves under a
lock, and the caller reads a result only from a prompt that is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import threading
from dataclasses import dataclass

from common.kv.allocator import blocks_for
from common.kv.digest import cache_block_digests
from common.models import batching
from common.models.model_thread import ModelThread
from common.models.qwen3_vl.rope import MropePositions
from common.models.runner import LmRunner
from common.models.sequence import LmSequence
from common.multimodal.params import MultimodalParams
from common.sampling import SamplingParams


class _State(enum.Enum):
    QUEUED = "queued"  # waiting for a drain
    TAKEN = "taken"  # in a pack being computed
    DONE = "done"  # computed (or failed); `result` or `error` set


@dataclass(eq=False, slots=True)
class _Prompt:
    """One Prefill's prompt, from the RPC to the model thread and back."""

    tokens: list[int]
    params: MultimodalParams
    sampling: SamplingParams
    hashes: list[bytes] | None  # full-block hashes (None: no reuse, no caching)
    positions: MropePositions
    done: asyncio.Future[None]  # resolved on the event loop once the state is DONE
    state: _State = _State.QUEUED
    cancelled: bool = False  # the caller went away; whoever sees it last gives blocks back
    result: tuple[LmSequence, list[bytes]] | None = None  # the sequence, its blocks' digests
    error: BaseException | None = None


class PrefillPacker:
    """Queue of a prefill worker's prompts and the drains that compute them in packs.

    Counters: `packs` (drains that computed something), `packed` (prompts computed in a pack
    of more than one), `dropped` (prompts whose caller went away before a drain took them).
    `prefill` is called from the event loop; the drains run on `model`'s thread.
    """

    def __init__(self, runner: LmRunner, model: ModelThread, *, pack_tokens: int) -> None:
        if pack_tokens < 0:
            raise ValueError(f"pack_tokens must not be negative, got {pack_tokens}")
        self.runner = runner
        self.model = model
        self.pack_tokens = pack_tokens  # most prompt tokens a drain takes (0: one prompt)
        self.packs = 0
        self.packed = 0
        self.dropped = 0
        self._lock = threading.Lock()  # guards `_queue` and every prompt's state
        self._queue: list[_Prompt] = []

    @property
    def waiting(self) -> int:
        """Prompts queued for the model thread, not taken yet (any thread)."""
        with self._lock:
            return len(self._queue)

    async def prefill(
        self,
        tokens: list[int],
        params: MultimodalParams,
        sampling: SamplingParams,
        hashes: list[bytes] | None,
        positions: MropePositions,
    ) -> tuple[LmSequence, list[bytes]]:
        """Compute a prompt (with whatever else is queued when its turn comes) and sample its
        first token; the sequence (owning its blocks) and the digests of its prompt blocks.
        Raises what admitting or computing it raised (`NoFreeBlocksError`,
        `MissingEmbeddingsError`, a forward's error)."""
        loop = asyncio.get_running_loop()
        prompt = _Prompt(tokens, params, sampling, hashes, positions, loop.create_future())
        with self._lock:
            self._queue.append(prompt)
        try:
            drain = self.model.submit(self._drain, loop)
        except RuntimeError:  # the model thread is shut down: nothing will compute it
            with self._lock:
                self._queue.remove(prompt)
            raise
        try:
            await asyncio.shield(prompt.done)
        except asyncio.CancelledError:
            self._abandon(prompt)
            drain.cancel()  # not begun: nothing for it to do (begun: it finishes)
            raise
        if prompt.error is not None:
            raise prompt.error
        assert prompt.result is not None  # DONE without an error
        return prompt.result

    def _abandon(self, prompt: _Prompt) -> None:
        """The caller went away: a queued prompt leaves the queue; a computed one's blocks
        go back now; one being computed is given back by its drain."""
        with self._lock:
            prompt.cancelled = True
            state = prompt.state
            if state is _State.QUEUED:
                self._queue.remove(prompt)
                self.dropped += 1
        if state is _State.DONE and prompt.result is not None:
            with contextlib.suppress(RuntimeError):  # shut down: the pool goes with it
                self.model.submit(batching.release, self.runner, prompt.result[0])

    # ----------------------------------------------------------------- model thread

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """Model thread: compute the queue's head in one pack (`_take`); prompts deferred by
        `_compute` go back to the head of the queue, with a drain of their own."""
        with self._lock:
            pack = self._take()
            for prompt in pack:
                prompt.state = _State.TAKEN
        if not pack:
            return
        deferred: list[_Prompt] = []
        try:
            deferred = self._compute(pack)
        finally:
            with self._lock:
                back = [p for p in deferred if not p.cancelled]
                for prompt in back:
                    prompt.state = _State.QUEUED
                self._queue[:0] = back
                self.dropped += len(deferred) - len(back)  # went away before computed
                done = [p for p in pack if all(p is not d for d in back)]
                for prompt in done:
                    prompt.state = _State.DONE
                    if prompt.result is None and prompt.error is None and not prompt.cancelled:
                        prompt.error = RuntimeError("the prefill was not computed")
                orphans = [p for p in done if p.cancelled and p.result is not None]
            computed = sum(p.result is not None for p in done)  # not the refused ones
            self.packs += computed > 0
            if computed > 1:
                self.packed += computed
            for prompt in orphans:
                assert prompt.result is not None
                batching.release(self.runner, prompt.result[0])
            for prompt in done:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    loop.call_soon_threadsafe(_resolve, prompt.done)
            if back:
                self.model.submit(self._drain, loop)

    def _take(self) -> list[_Prompt]:
        """The queue's head: one prompt while the queue holds at most `pack_tokens` prompt
        tokens; past that, prompts in arrival order while their tokens fit `pack_tokens`
        (at least one). Under the lock."""
        queue, count = self._queue, 1
        if sum(len(p.tokens) for p in queue) > self.pack_tokens:
            tokens = len(queue[0].tokens)
            while count < len(queue) and tokens + len(queue[count].tokens) <= self.pack_tokens:
                tokens += len(queue[count].tokens)
                count += 1
        pack, self._queue = queue[:count], queue[count:]
        return pack

    def _compute(self, pack: list[_Prompt]) -> list[_Prompt]:
        """Admit each prompt (one that cannot be admitted fails alone), compute the admitted
        ones together, and set each prompt's result or error. A prompt with a block that an
        earlier prompt of the pack computes (a shared prefix not cached yet) is not admitted
        but returned, deferred: computed after this pack, it reuses those blocks instead of
        computing them a second time."""
        runner = self.runner
        admitted: list[tuple[_Prompt, batching.Admission]] = []
        deferred: list[_Prompt] = []
        computing: set[bytes] = set()  # hashes of the blocks this pack computes
        for prompt in pack:
            if prompt.hashes and not computing.isdisjoint(prompt.hashes):
                deferred.append(prompt)
                continue
            try:
                admission = batching.admit(
                    runner,
                    prompt.tokens,
                    prompt.params,
                    prompt.sampling,
                    hashes=prompt.hashes,
                    positions=prompt.positions,
                )
            except Exception as exc:
                prompt.error = exc
                continue
            admitted.append((prompt, admission))
            if admission.hashes:
                full = len(prompt.tokens) // runner.block_size
                computing.update(admission.hashes[admission.cached : full])
        if not admitted:
            return deferred
        try:
            seqs = batching.compute(runner, [a for _, a in admitted])
        except Exception as exc:  # every admission's blocks were given back
            for prompt, _ in admitted:
                prompt.error = exc
            return deferred
        for (prompt, _), seq in zip(admitted, seqs, strict=True):
            prompt.result = (seq, self._digests(seq, len(prompt.tokens)))
        return deferred

    def _digests(self, seq: LmSequence, num_tokens: int) -> list[bytes]:
        """The digests of the prompt blocks' bytes (recorded by the prefill for every block
        it computed or verified)."""
        runner = self.runner
        prompt_blocks = seq.blocks[: blocks_for(num_tokens, runner.block_size)]
        known = [runner.allocator.digest_of(b) for b in prompt_blocks]
        if any(d is None for d in known):  # not expected: prefill records every block
            return cache_block_digests(runner.kv, prompt_blocks)
        return [d for d in known if d is not None]


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)
