"""The decode worker's continuous-batching loop: `DecodeBatcher` drives one `Batch`
(`common.models.batching`) from the event loop, one `Batch.step` per model-thread call, and
hands each stream (`Entry`) its new tokens as `Chunk`s.

Streams join (`add`) and leave (finish, or `cancel`) between steps. Block ownership: once
added, the loop owns a sequence's blocks and releases them exactly once (finish, cancel, a
failed step, or `stop`); a stream's `released` event is set when they are back in the pool.

A step that raises ends every stream the loop holds with `DecodeStepError` (their
`next_chunk` raises it, after the tokens sampled before), releases all their blocks, and
the loop keeps serving the streams that join later: one bad step costs the streams of that
batch, never the worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from common.errors import DECODE_STEP_FAILED
from common.models.batching import Batch
from common.models.model_thread import ModelThread
from common.models.runner import LmRunner
from common.models.sequence import LmSequence
from common.sampling import FinishReason
from common.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


class DecodeStepError(RuntimeError):
    """A decode step raised: the stream gets no more tokens and its blocks are back in the
    pool. The sequence's state is unknown, so the caller should resume the answer elsewhere
    from the tokens it has, not retry here."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """New tokens of one stream, and why it ended (on its last chunk)."""

    token_ids: list[int]  # tokens sampled since the previous chunk
    finish_reason: FinishReason | None  # set on the last chunk


@dataclass(eq=False, slots=True)
class Entry:
    """One running stream: its sequence and the queue its RPC reads chunks from."""

    seq: LmSequence  # owns blocks until the loop releases them
    # The stream's chunks; a `DecodeStepError`, always the last item, ends it with an error.
    queue: asyncio.Queue[Chunk | DecodeStepError] = field(default_factory=asyncio.Queue)
    sent: int = 1  # output tokens already delivered (the first one came from prefill)
    cancelled: bool = False  # the RPC went away; release at the next step boundary
    released: asyncio.Event = field(default_factory=asyncio.Event)  # its blocks are back

    async def next_chunk(self) -> Chunk:
        """Every token sampled since the last call, as one chunk: waits for a step's, then
        takes the chunks of steps already queued behind it too, so a stream whose sender
        fell behind the loop (a busy machine, a slow reader) catches up in one message
        rather than one per step. Token order and the finish reason are unchanged.

        Raises `DecodeStepError` once a failed step ended the stream (after the tokens
        sampled before it were returned), and again on every later call."""
        return self._merged(await self.queue.get())

    def ready(self) -> Chunk | None:
        """`next_chunk` without waiting: the tokens already sampled, or None when none are."""
        return None if self.queue.empty() else self._merged(self.queue.get_nowait())

    def _merged(self, item: Chunk | DecodeStepError) -> Chunk:
        if isinstance(item, DecodeStepError):
            self.queue.put_nowait(item)  # the stream stays failed for the next call too
            raise item
        chunk = item
        while chunk.finish_reason is None and not self.queue.empty():
            more = self.queue.get_nowait()
            if isinstance(more, DecodeStepError):
                self.queue.put_nowait(more)  # the last item: raised after these tokens
                break
            chunk = Chunk(chunk.token_ids + more.token_ids, more.finish_reason)
        return chunk


class DecodeBatcher:
    """The decode loop of one worker: drives a `Batch` from the event loop.

    Streams join (`add`) and leave (finish, or `cancel`) between steps; each step is one
    `Batch.step` on the model thread, which releases the blocks of sequences that finished
    or were cancelled before the loop hands each live stream its new tokens, so a stream
    that sees its last chunk also sees its blocks back in the pool. Joins and cancels are
    applied on the model thread at the step boundary, so the `Batch` is touched from that
    thread only. The other methods are touched only from the event loop.

    A step that raises fails every stream the loop holds (their `next_chunk` raises
    `DecodeStepError`), releases all their blocks, and the loop keeps serving new streams.
    """

    def __init__(self, runner: LmRunner, model: ModelThread, *, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.runner = runner
        self.model = model
        # A live stream gets its tokens once this many are new (its last ones at once).
        self.stream_interval = stream_interval
        self.batch = Batch(runner)  # touched on the model thread only
        self._entries: list[Entry] = []  # every stream holding blocks, in join order
        self._joining: list[LmSequence] = []  # added since the last step
        self._wake = asyncio.Event()
        self._freed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def steps(self) -> int:
        """Batched forwards run."""
        return self.batch.steps

    @property
    def max_batch_seen(self) -> int:
        """Largest batch decoded in one step."""
        return self.batch.max_batch_seen

    @property
    def running(self) -> int:
        """Sequences holding blocks in the loop."""
        return len(self._entries)

    def start(self) -> None:
        """Launch the loop task (idempotent). Needs a running event loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="epd-decode-loop")

    def add(self, seq: LmSequence) -> Entry:
        """Join the next step; the loop now owns `seq`'s blocks."""
        entry = Entry(seq, sent=len(seq.output))
        self._entries.append(entry)
        self._joining.append(seq)
        self._wake.set()
        return entry

    def cancel(self, entry: Entry) -> None:
        """The stream is gone: drop the sequence and free its blocks at the next boundary."""
        entry.cancelled = True
        self._wake.set()

    async def drop(self, entry: Entry) -> None:
        """`cancel`, then return once the loop has given the sequence's blocks back."""
        self.cancel(entry)
        await entry.released.wait()

    def freed(self) -> asyncio.Event:
        """The event set when the loop next gives blocks back to the pool (each free sets
        the current one and makes a new one): take it before looking at the pool."""
        return self._freed

    async def stop(self) -> None:
        """Stop the loop and release every running sequence's blocks."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        joining, self._joining = self._joining, []
        entries, self._entries = self._entries, []
        if entries:
            await self.model.call(self._release_all, joining)
        for entry in entries:
            entry.released.set()

    async def _loop(self) -> None:
        while True:
            if not self._entries:
                self._wake.clear()
                await self._wake.wait()
                continue
            stepped = [e for e in self._entries if not e.cancelled and e.seq.finish_reason is None]
            cancelled = [e.seq for e in self._entries if e.cancelled]
            joining, self._joining = self._joining, []
            try:
                released = await self.model.call(self._step, joining, cancelled)
            except Exception as exc:
                await self._fail(exc)
                continue
            if released:
                gone = set(released)
                for entry in self._entries:
                    if entry.seq in gone:
                        entry.released.set()
                self._entries = [e for e in self._entries if e.seq not in gone]
                self._wake_freed()
            interval = self.stream_interval
            for entry in stepped:
                output, reason = entry.seq.output, entry.seq.finish_reason
                if entry.cancelled or (reason is None and len(output) - entry.sent < interval):
                    continue
                entry.queue.put_nowait(Chunk(output[entry.sent :], reason))
                entry.sent = len(output)
            if not stepped:
                await asyncio.sleep(0)

    async def _fail(self, exc: Exception) -> None:
        """A step raised: release the blocks of every sequence the loop holds (those that
        joined during the step too), end each stream with `DecodeStepError`, and leave the
        loop empty for the streams that join next."""
        logger.error("decode step failed; ending %d streams", len(self._entries), exc_info=exc)
        joining, self._joining = self._joining, []
        entries, self._entries = self._entries, []
        try:
            await self.model.call(self._release_all, joining)
        except Exception:
            logger.exception("releasing the blocks of a failed decode step failed")
        finally:  # even when stopped meanwhile: no stream may wait for a chunk forever
            error = DecodeStepError(f"{DECODE_STEP_FAILED}: {type(exc).__name__}: {exc}")
            for entry in entries:
                entry.queue.put_nowait(error)
                entry.released.set()
            self._wake_freed()

    def _wake_freed(self) -> None:
        self._freed.set()
        self._freed = asyncio.Event()

    def _step(
        self, joining: Sequence[LmSequence], cancelled: Collection[LmSequence]
    ) -> list[LmSequence]:
        """Model thread: apply the joins and cancels of the boundary, then one step."""
        for seq in joining:
            self.batch.add(seq)
        for seq in cancelled:
            self.batch.cancel(seq)
        return self.batch.step()

    def _release_all(self, joining: Sequence[LmSequence]) -> None:
        for seq in joining:
            self.batch.add(seq)
        self.batch.release_all()
