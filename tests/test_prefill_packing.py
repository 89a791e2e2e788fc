"""Concurrent prefills computed together (`prefill_worker.packing.PrefillPacker`).

While the prompts queued hold more than `pack_tokens` tokens, a drain takes them in arrival
order up to `pack_tokens` tokens and computes them in one pack (under that backlog, one at a
time); each gets the first token, KV bytes and digests a prefill of it alone gets (to float
rounding, greedy tokens equal). A prompt
that cannot be admitted fails alone. A caller that goes away costs nothing queued and keeps
nothing computed: its prompt leaves the queue, or its blocks go back exactly once, whether
it went away while its pack was computed or after, before it read the result. Last, through
a real prefill worker: Prefill calls sent together are packed, and answer as the offline
engine does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

import pytest
import torch

from common.engine import Engine
from common.kv.allocator import blocks_for
from common.models import batching
from common.models.batching import MissingEmbeddingsError
from common.models.model_thread import ModelThread
from common.models.runner import LmRunner
from common.models.tiny import default_checkpoint
from common.multimodal.params import MultimodalParams
from common.sampling import SamplingParams
from common.server.role import RoleServer
from common.server.rpc import channel
from epd.v1 import prefill_service_pb2_grpc
from prefill_worker.packing import PrefillPacker
from tests.cluster import cluster_credentials
from tests.test_decode_batcher import model
from tests.test_kv_handoff import (
    BLOCK,
    GREEDY,
    ckpt,
    engine,
    eventually,
    img_part,
    make_handoff,
    prefill_request,
    user,
)
from tests.test_packed_prefill import _image_prompt
from tests.test_prefill_cancel import worker

__all__ = ["ckpt", "engine", "model", "worker"]  # fixtures shared with those modules

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOL = 1e-5  # packed vs alone: the tolerance of tests/test_packed_prefill.py
BLOCK_SIZE = 4  # fresh_runner's
FIRST = SamplingParams(max_tokens=1, ignore_eos=True)
EMPTY = MultimodalParams((), {}, 0)


def fresh_runner() -> LmRunner:
    return LmRunner.from_pretrained(default_checkpoint("tiny"), block_size=4, num_blocks=256)


def prompts(runner: LmRunner) -> list[tuple[list[int], MultimodalParams]]:
    """Mixed lengths, one with an image (its embeddings given)."""
    g = torch.Generator().manual_seed(3)
    text = [(torch.randint(0, 400, (n,), generator=g).tolist(), EMPTY) for n in (5, 13, 21)]
    return [text[0], text[1], _image_prompt(runner, 6, 2), text[2]]


async def pack_of(
    packer: PrefillPacker, items: list[tuple[list[int], MultimodalParams]]
) -> list[Any]:
    """Prefill `items` through `packer`, all queued before the model thread is free (it
    first finishes what it had, such as drains with nothing left to take)."""
    runner, gate, blocked = packer.runner, threading.Event(), threading.Event()

    def hold() -> None:
        blocked.set()
        gate.wait(10)

    busy = packer.model.submit(hold)
    await asyncio.to_thread(blocked.wait, 10)
    calls = [
        asyncio.ensure_future(
            packer.prefill(t, p, FIRST, runner.allocator.hashes(t, p), runner.positions(len(t), p))
        )
        for t, p in items
    ]
    await eventually(lambda: packer.waiting == len(items))  # what the metrics page shows
    gate.set()
    busy.result(10)
    return await asyncio.gather(*calls, return_exceptions=True)


async def test_queued_prompts_are_computed_in_one_pack_as_each_alone(model: ModelThread) -> None:
    runner, alone_runner = fresh_runner(), fresh_runner()
    packer = PrefillPacker(runner, model, pack_tokens=40)
    items = prompts(runner)  # 5, 13, 13 (an image) and 21 tokens: 52 queued, past 40
    results = await pack_of(packer, items)
    # 5 + 13 + 13 fit 40: one pack; then 21 tokens are queued, under 40: alone.
    assert packer.packs == 2 and packer.packed == 3 and packer.dropped == 0
    for (tokens, params), (seq, digests) in zip(items, results, strict=True):
        hashes = alone_runner.allocator.hashes(tokens, params)
        want = batching.prefill(alone_runner, tokens, params, FIRST, hashes=hashes)
        assert seq.output == want.output  # the same greedy first token
        n = blocks_for(len(tokens), BLOCK_SIZE)
        got_kv = runner.kv.buffer[seq.blocks[:n]]
        want_kv = alone_runner.kv.buffer[want.blocks[:n]]
        assert (got_kv - want_kv).abs().max().item() <= TOL
        assert len(digests) == n  # what the handle carries, one per prompt block
        assert digests == [runner.allocator.digest_of(b) for b in seq.blocks[:n]]
        batching.release(runner, seq)
    assert runner.allocator.pool.num_used_blocks == 0


async def test_a_backlog_past_pack_tokens_is_packed_in_order(model: ModelThread) -> None:
    runner = fresh_runner()
    packer = PrefillPacker(runner, model, pack_tokens=20)
    g = torch.Generator().manual_seed(4)
    items = [(torch.randint(0, 400, (n,), generator=g).tolist(), EMPTY) for n in (5, 13, 9, 30)]
    results = await pack_of(packer, items)
    # 57 tokens queued, past 20: 5 + 13 fit 20, 9 does not fit after them; then 39 queued:
    # 9 alone (30 does not fit after it); 30 is longer than 20 and runs alone.
    assert packer.packs == 3 and packer.packed == 2
    for seq, _ in results:
        batching.release(runner, seq)
    under = PrefillPacker(runner, model, pack_tokens=57)  # a backlog of 57 is not past it
    for seq, _ in await pack_of(under, items):
        batching.release(runner, seq)
    assert under.packs == 4 and under.packed == 0
    one = PrefillPacker(runner, model, pack_tokens=0)  # each prompt alone
    for seq, _ in await pack_of(one, items):
        batching.release(runner, seq)
    assert one.packs == 4 and one.packed == 0
    assert runner.allocator.pool.num_used_blocks == 0


async def test_a_prompt_sharing_blocks_not_yet_cached_waits_for_the_next_pack(
    model: ModelThread,
) -> None:
    runner = fresh_runner()
    packer = PrefillPacker(runner, model, pack_tokens=30)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 400, (12,), generator=g).tolist()
    other, last = (torch.randint(0, 400, (n,), generator=g).tolist() for n in (5, 21))
    longer = [*shared, *torch.randint(0, 400, (6,), generator=g).tolist()]
    # 12 + 12 + 5 fit 30 of the 50 queued, but the second prompt's blocks are the first's:
    # it waits, and then reuses them (as one prompt at a time would), with `longer` after.
    items = [(shared, EMPTY), (shared, EMPTY), (other, EMPTY), (last, EMPTY)]
    first, again, third, fourth = await pack_of(packer, items)
    assert packer.packed == 2  # the first and `other`; the copy waited
    assert first[0].cached_tokens == 0 and again[0].cached_tokens == 8  # 2 of its 3 blocks
    assert again[0].output == first[0].output and again[1] == first[1]
    for seq, _ in (first, again, third, fourth):
        batching.release(runner, seq)
    (grown, _), (base, _) = await pack_of(packer, [(longer, EMPTY), (shared, EMPTY)])
    assert grown.cached_tokens == 12 and base.cached_tokens == 8  # cached now: no wait
    for seq in (grown, base):
        batching.release(runner, seq)
    assert runner.allocator.pool.num_used_blocks == 0


async def test_a_prompt_that_cannot_be_admitted_fails_alone(model: ModelThread) -> None:
    runner = fresh_runner()
    packer = PrefillPacker(runner, model, pack_tokens=40)
    items = prompts(runner)
    tokens, params = items[2]
    items[2] = (tokens, dataclasses.replace(params, embeddings={}))  # its image: no rows
    results = await pack_of(packer, items)
    assert isinstance(results[2], MissingEmbeddingsError)
    # The pack of the first three computed two: the refused prompt is not counted.
    assert packer.packed == 2 and packer.packs == 2
    for k in (0, 1, 3):
        seq, _ = results[k]
        assert len(seq.output) == 1
        batching.release(runner, seq)
    assert runner.allocator.pool.num_used_blocks == 0


async def test_a_caller_that_goes_away_keeps_nothing(model: ModelThread) -> None:
    runner = fresh_runner()
    pool = runner.allocator.pool
    packer = PrefillPacker(runner, model, pack_tokens=20)
    (tokens, _), (other, _), _, (third, _) = prompts(runner)

    def start(t: list[int]) -> asyncio.Future[Any]:
        hashes = runner.allocator.hashes(t, EMPTY)
        return asyncio.ensure_future(
            packer.prefill(t, EMPTY, FIRST, hashes, runner.positions(len(t), EMPTY))
        )

    # Queued: it leaves the queue and is never computed.
    gate = threading.Event()
    busy = model.submit(gate.wait, 10)
    queued = start(tokens)
    await eventually(lambda: len(packer._queue) == 1)
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)
    gate.set()
    busy.result(10)
    assert packer.dropped == 1 and packer.packs == 0 and pool.num_used_blocks == 0
    assert runner.allocator.cached_hashes() == []

    # Cancelled while its pack computes: the pack's drain gives its blocks back.
    computing, go = threading.Event(), threading.Event()
    compute = packer._compute

    def gated(pack: Any) -> Any:
        computing.set()
        go.wait(10)
        return compute(pack)

    packer._compute = gated  # type: ignore[method-assign]
    gate = threading.Event()
    busy = model.submit(gate.wait, 10)
    kept, gone, alone = start(other), start(tokens), start(third)
    await eventually(lambda: len(packer._queue) == 3)  # 39 tokens, past 20: 13 + 5 packed
    gate.set()
    await asyncio.to_thread(computing.wait, 10)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    go.set()
    (seq, _), (last, _) = await kept, await alone
    assert packer.packed == 2
    await eventually(lambda: pool.num_used_blocks == len(seq.blocks) + len(last.blocks))
    batching.release(runner, seq)
    batching.release(runner, last)
    packer._compute = compute  # type: ignore[method-assign]

    # Done, but cancelled before it read the result: given back by the caller's side.
    drained = threading.Event()
    drain = packer._drain

    def signalled(loop: asyncio.AbstractEventLoop) -> None:
        drain(loop)
        drained.set()

    packer._drain = signalled  # type: ignore[method-assign]
    gate = threading.Event()
    busy = model.submit(gate.wait, 10)
    late = start(tokens)
    await eventually(lambda: len(packer._queue) == 1)
    gate.set()
    drained.wait(10)  # blocks the loop: the result is set, its wake-up not yet run
    late.cancel()
    await asyncio.gather(late, return_exceptions=True)
    await eventually(lambda: pool.num_used_blocks == 0)  # released once (twice would raise)
    assert packer.dropped == 1


async def test_a_prompt_sent_after_the_model_thread_stopped_is_refused_not_queued() -> None:
    runner, thread = fresh_runner(), ModelThread("test-stopped")
    packer = PrefillPacker(runner, thread, pack_tokens=0)
    thread.close()
    tokens = [5, 6, 7]
    hashes = runner.allocator.hashes(tokens, EMPTY)
    with pytest.raises(RuntimeError):
        await packer.prefill(tokens, EMPTY, FIRST, hashes, runner.positions(3, EMPTY))
    assert packer._queue == [] and runner.allocator.pool.num_used_blocks == 0


# ----------------------------------------------------------------- through a worker


async def test_prefill_calls_sent_together_are_packed_and_answer_as_the_engine(
    worker: RoleServer[Any], engine: Engine
) -> None:
    servicer = worker.servicer
    asks = [
        user("Packed one."),
        user(img_part(11), "Packed two, with a picture in it."),
        user("Packed three, a little longer than the first of them."),
    ]
    handoffs = [make_handoff(engine, ask) for ask in asks]
    want = [engine.generate(ask, GREEDY).token_ids[0] for ask in asks]
    # A backlog one token past pack_tokens: the first two prompts fit it, the third runs alone.
    servicer.packer.pack_tokens = sum(len(t) for t, _ in handoffs) - 1
    assert len(handoffs[0][0]) + len(handoffs[1][0]) <= servicer.packer.pack_tokens
    gate = threading.Event()
    busy = asyncio.ensure_future(servicer.model.call(gate.wait, 30))  # a long forward
    async with channel(worker.address, credentials=cluster_credentials()) as ch:
        stub = prefill_service_pb2_grpc.PrefillServiceStub(ch)
        try:
            calls = [
                stub.Prefill(prefill_request(t, p, GREEDY, rid=f"p{k}"), timeout=30)
                for k, (t, p) in enumerate(handoffs)
            ]
            await eventually(lambda: len(servicer.packer._queue) == len(calls))
        finally:
            gate.set()
            await busy
        replies = await asyncio.gather(*calls)
    assert [r.first_token_id for r in replies] == want
    assert servicer.packer.packs == 2 and servicer.packer.packed == 2
    for reply, (tokens, _) in zip(replies, handoffs, strict=True):
        assert len(reply.kv.block_digests) == blocks_for(len(tokens), BLOCK)
