"""Continuous batching: one loop task advances every running sequence by one token per step.

Requests join (`add`) and leave (finish, or `cancel`) between steps; each step is a single
batched forward on the model thread. After a step the loop first releases the blocks of
sequences that finished or were cancelled, then hands each live stream its new tokens, so a
stream that sees its last chunk also sees its blocks back in the pool.

Block ownership: `add` takes over the sequence's blocks; the loop releases them exactly once
(finish, cancel, or `stop`). Touched only from the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from common.models.model_thread import ModelThread
from common.models.runner import LmRunner, LmSequence
from common.sampling import FinishReason

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Chunk:
    """New tokens of one stream, and why it ended (on its last chunk)."""

    token_ids: list[int]  # tokens sampled since the previous chunk
    finish_reason: FinishReason | None  # set on the last chunk


@dataclass(eq=False, slots=True)
class Entry:
    """One running stream: its sequence and the queue its RPC reads chunks from."""

    seq: LmSequence  # owns blocks until the loop releases them
    queue: asyncio.Queue[Chunk] = field(default_factory=asyncio.Queue)
    sent: int = 1  # output tokens already delivered (the first one came from prefill)
    cancelled: bool = False  # the RPC went away; release at the next step boundary


class DecodeBatcher:
    """The decode loop of one worker; see the module docstring."""

    def __init__(self, runner: LmRunner, model: ModelThread) -> None:
        self.runner = runner
        self.model = model
        self.steps = 0  # batched forwards run
        self.max_batch_seen = 0  # largest batch decoded in one step
        self._running: list[Entry] = []
        self._wake = asyncio.Event()
        self._freed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> int:
        """Sequences holding blocks in the loop."""
        return len(self._running)

    def start(self) -> None:
        """Launch the loop task (idempotent). Needs a running event loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="epd-decode-loop")

    def add(self, seq: LmSequence) -> Entry:
        """Join the next step; the loop now owns `seq`'s blocks."""
        entry = Entry(seq, sent=len(seq.output))
        self._running.append(entry)
        self._wake.set()
        return entry

    def cancel(self, entry: Entry) -> None:
        """The stream is gone: drop the sequence and free its blocks at the next boundary."""
        entry.cancelled = True
        self._wake.set()

    async def wait_freed(self) -> None:
        """Return after the loop next gives blocks back to the pool."""
        await self._freed.wait()

    async def stop(self) -> None:
        """Stop the loop and release every running sequence's blocks."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        entries, self._running = self._running, []
        if entries:
            await self.model.call(self._release, [e.seq for e in entries])

    async def _loop(self) -> None:
        while True:
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [e for e in self._running if not e.cancelled and e.seq.finish_reason is None]
            if batch:
                await self.model.call(self.runner.decode_step, [e.seq for e in batch])
                self.steps += 1
                self.max_batch_seen = max(self.max_batch_seen, len(batch))
            done = [e for e in self._running if e.cancelled or e.seq.finish_reason is not None]
            if done:
                self._running = [e for e in self._running if e not in done]
                await self.model.call(self._release, [e.seq for e in done])
                self._freed.set()
                self._freed = asyncio.Event()
            for entry in batch:
                if entry.cancelled:
                    continue
                new = entry.seq.output[entry.sent :]
                entry.sent = len(entry.seq.output)
                entry.queue.put_nowait(Chunk(new, entry.seq.finish_reason))
            if not batch:
                await asyncio.sleep(0)

    def _release(self, seqs: list[LmSequence]) -> None:
        for seq in seqs:
            self.runner.release(seq)
