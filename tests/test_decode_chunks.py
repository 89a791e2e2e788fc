"""A decode stream's sender takes every step's tokens queued since its last message at once
(`decode_loop.Entry.next_chunk`): same tokens, same order, same finish reason, fewer messages
when the sender is behind the loop; `Entry.ready` takes them without waiting (the stream's
first message, once the lease is confirmed); a stream a failed step ended gives its tokens,
then raises `DecodeStepError` on every later read."""

from __future__ import annotations

import asyncio

import pytest

from common.models.decode_loop import Chunk, DecodeStepError, Entry
from common.models.sequence import LmSequence
from common.sampling import SamplingParams


def _entry() -> Entry:
    seq = LmSequence(prompt_token_ids=[1, 2], sampling=SamplingParams(), blocks=[], mrope_delta=0)
    return Entry(seq)


def test_queued_steps_come_out_as_one_chunk_in_order() -> None:
    async def run() -> list[Chunk]:
        entry = _entry()
        for tokens in ([5], [6, 7], [8]):
            entry.queue.put_nowait(Chunk(tokens, None))
        first = await entry.next_chunk()
        entry.queue.put_nowait(Chunk([9], "length"))
        return [first, await entry.next_chunk()]

    first, last = asyncio.run(run())
    assert (first.token_ids, first.finish_reason) == ([5, 6, 7, 8], None)
    assert (last.token_ids, last.finish_reason) == ([9], "length")


def test_merging_stops_at_the_finishing_chunk() -> None:
    async def run() -> tuple[Chunk, int]:
        entry = _entry()
        entry.queue.put_nowait(Chunk([5], None))
        entry.queue.put_nowait(Chunk([6], "stop"))
        entry.queue.put_nowait(Chunk([7], None))  # never read by a finished stream
        return await entry.next_chunk(), entry.queue.qsize()

    chunk, left = asyncio.run(run())
    assert (chunk.token_ids, chunk.finish_reason, left) == ([5, 6], "stop", 1)


def test_waits_for_the_next_step_when_nothing_is_queued() -> None:
    async def run() -> Chunk:
        entry = _entry()
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, entry.queue.put_nowait, Chunk([4], None))
        return await asyncio.wait_for(entry.next_chunk(), 5)

    assert asyncio.run(run()).token_ids == [4]


def test_ready_takes_what_is_queued_without_waiting() -> None:
    async def run() -> tuple[Chunk | None, Chunk | None, int]:
        entry = _entry()
        empty = entry.ready()
        entry.queue.put_nowait(Chunk([5], None))
        entry.queue.put_nowait(Chunk([6], "length"))
        return empty, entry.ready(), entry.queue.qsize()

    empty, chunk, left = asyncio.run(run())
    assert empty is None
    assert chunk is not None and (chunk.token_ids, chunk.finish_reason, left) == (
        [5, 6],
        "length",
        0,
    )


def test_a_failed_stream_gives_its_tokens_then_raises_every_time() -> None:
    async def run() -> Chunk:
        entry = _entry()
        entry.queue.put_nowait(Chunk([5], None))
        entry.queue.put_nowait(Chunk([6], None))
        entry.queue.put_nowait(DecodeStepError("decode step failed: MemoryError: x"))
        first = await entry.next_chunk()
        for _ in range(2):
            with pytest.raises(DecodeStepError, match="MemoryError"):
                await asyncio.wait_for(entry.next_chunk(), 5)
        with pytest.raises(DecodeStepError):
            entry.ready()
        return first

    first = asyncio.run(run())
    assert (first.token_ids, first.finish_reason) == ([5, 6], None)
