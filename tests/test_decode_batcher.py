"""The decode worker's loop (`batching.DecodeBatcher`) on a real tiny runner and model
thread, without servers: `drop` returns once the dropped sequence's blocks are back in the
pool (what a stream refused after joining, e.g. for a lost lease, relies on), and `stop`
sets every stream's `released`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from common.models import batching
from common.models.batching import DecodeBatcher
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

    async def stream(every: int) -> tuple[list[int], list[batching.Chunk]]:
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
