"""The decode worker's loop (`decode_loop.DecodeBatcher`) on a real tiny runner and model
thread, without servers: `drop` returns once the dropped sequence's blocks are back in the
pool (what a stream refused after joining, e.g. for a lost lease, relies on), and `stop`
sets every stream's `released`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from common.models import batching
from common.models.decode_loop import Chunk, DecodeBatcher, DecodeStepError
from common.models.model_thread import ModelThread
from common.models.runner import LmRunner
from common.models.sequence import LmSequence
from common.models.tiny import default_checkpoint
from common.multimodal.params import MultimodalParams
from common.sampling import SamplingParams

LONG = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def runner() -> LmRunner:
    return LmRunner.from_pretrained(default_checkpoint("tiny"), block_size=4, num_blocks=64)


@pytest.fixture
def model() -> Iterator[ModelThread]:
    thread = ModelThread("test-decode-batcher")
    yield thread
    thread.close()


def prefilled(runner: LmRunner, n: int, sampling: SamplingParams = LONG) -> LmSequence:
    tokens = [5 + (7 * i + n) % 90 for i in range(6 + n)]
    return batching.prefill(
        runner,
        tokens,
        MultimodalParams((), {}, 0),
        sampling,
        hashes=None,
        total_tokens=len(tokens) + sampling.max_tokens,
    )


def test_drop_returns_with_the_blocks_back(runner: LmRunner, model: ModelThread) -> None:
    kept, dropped = prefilled(runner, 1), prefilled(runner, 2)
    kept_blocks = len(kept.blocks)

    async def run() -> int:
        batcher = DecodeBatcher(runner, model)
        batcher.start()
        entries = [batcher.add(kept), batcher.add(dropped)]
        await entries[1].next_chunk()
        await batcher.drop(entries[1])
        held = runner.allocator.pool.num_used_blocks  # read at once: no other step ran
        await batcher.stop()
        assert entries[0].released.is_set()
        return held

    assert asyncio.run(run()) == kept_blocks  # the dropped sequence's are back
    assert dropped.finish_reason is None and len(dropped.output) < LONG.max_tokens
    assert runner.allocator.pool.num_used_blocks == 0
    runner.allocator.pool.check_invariants()


@pytest.mark.parametrize("interval", [1, 3, 7])
def test_stream_interval_groups_tokens_without_changing_them(
    runner: LmRunner, model: ModelThread, interval: int
) -> None:
    """With `stream_interval` n, every chunk but the last carries n tokens (a multiple of n
    when the reader fell behind and steps' chunks merged) and the last at least one; the
    tokens, in order, are the greedy answer decoded without it."""
    short = SamplingParams(max_tokens=11, ignore_eos=True)

    async def stream(every: int) -> tuple[list[int], list[Chunk]]:
        batcher = DecodeBatcher(runner, model, stream_interval=every)
        batcher.start()
        s = prefilled(runner, 3, short)
        entry = batcher.add(s)
        chunks = [await entry.next_chunk()]
        while chunks[-1].finish_reason is None:
            chunks.append(await entry.next_chunk())
        await batcher.stop()
        return s.output, chunks

    expected, _ = asyncio.run(stream(1))
    output, chunks = asyncio.run(stream(interval))
    assert output == expected and len(output) == short.max_tokens
    assert [t for c in chunks for t in c.token_ids] == output[1:]  # the first came from prefill
    assert all(c.token_ids and len(c.token_ids) % interval == 0 for c in chunks[:-1])
    assert chunks[-1].token_ids
    assert [c.finish_reason is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    runner.allocator.pool.check_invariants()


def test_stream_interval_must_be_positive(runner: LmRunner, model: ModelThread) -> None:
    with pytest.raises(ValueError, match="stream_interval"):
        DecodeBatcher(runner, model, stream_interval=0)


def greedy_alone(runner: LmRunner, n: int, sampling: SamplingParams) -> list[int]:
    """The tokens `prefilled(runner, n, sampling)` decodes to alone, by `Batch.step`."""
    seq = prefilled(runner, n, sampling)
    batch = batching.Batch(runner)
    batch.add(seq)
    while batch.running:
        batch.step()
    return seq.output


def test_a_failed_step_fails_its_streams_and_the_loop_goes_on(
    runner: LmRunner, model: ModelThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second step raises: both running streams get the tokens sampled before it, then
    `DecodeStepError` (again on a later read: never a hang), their blocks are back in the
    pool, and a stream that joins afterwards is served to the end, as if alone."""
    short = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = greedy_alone(runner, 3, short)
    real = runner.decode_step
    calls = 0

    def flaky(seqs: list[LmSequence]) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise MemoryError("no room to grow the running KV")
        real(seqs)

    monkeypatch.setattr(runner, "decode_step", flaky)

    async def run() -> tuple[list[list[int]], int, list[int], list[Chunk]]:
        batcher = DecodeBatcher(runner, model)
        batcher.start()
        entries = [batcher.add(prefilled(runner, 1)), batcher.add(prefilled(runner, 2))]
        before: list[list[int]] = []
        for entry in entries:
            before.append((await asyncio.wait_for(entry.next_chunk(), 10)).token_ids)
            for _ in range(2):
                with pytest.raises(DecodeStepError, match="MemoryError: no room"):
                    await asyncio.wait_for(entry.next_chunk(), 10)
            assert entry.released.is_set()
        held = runner.allocator.pool.num_used_blocks
        later = prefilled(runner, 3, short)
        entry = batcher.add(later)
        chunks = [await asyncio.wait_for(entry.next_chunk(), 10)]
        while chunks[-1].finish_reason is None:
            chunks.append(await asyncio.wait_for(entry.next_chunk(), 10))
        await batcher.stop()
        return before, held, later.output, chunks

    before, held, output, chunks = asyncio.run(run())
    assert [len(tokens) for tokens in before] == [1, 1]  # the first step's token each
    assert held == 0
    assert output == expected
    assert [t for c in chunks for t in c.token_ids] == expected[1:]
    assert chunks[-1].finish_reason == "length"
    assert runner.allocator.pool.num_used_blocks == 0
    runner.allocator.pool.check_invariants()


def test_a_submitted_call_that_fails_is_logged(
    model: ModelThread, caplog: pytest.LogCaptureFixture
) -> None:
    # Cleanups are submitted without anyone waiting (pulled KV cached, blocks given back):
    # one that raised said nothing (races review).
    def cache_pulled_blocks() -> None:
        raise RuntimeError("the pool is gone")

    with caplog.at_level("ERROR", logger="common.models.model_thread"):
        model.submit(cache_pulled_blocks).exception(timeout=5)
        for _ in range(100):
            if caplog.records:
                break
            time.sleep(0.01)
    assert "cache_pulled_blocks failed" in caplog.text and "the pool is gone" in caplog.text
