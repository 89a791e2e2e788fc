"""A decode step that fails after the worker said it took the KV (its first chunk): the router
prefills again and goes on on a decode worker with a fresh lease; it never hands the lease
the failing worker took to another, nor suspects the prefill worker that held it (kvimport
review: a step failing while the lease's release was confirmed ended the stream before that
chunk, and the router did both)."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from common.errors import DECODE_STEP_FAILED
from common.kv.block_pool import NoFreeBlocksError
from common.roles import Role
from common.sampling import SamplingParams
from common.server.rpc import status_for
from epd.v1 import decode_service_pb2
from tests.test_failover_router import BreakingDecode, cluster
from tests.test_router import FIRST, TEXT, FakeDecode, FakeEncoder, FakePrefill, ckpt

__all__ = ["ckpt", "cluster"]  # fixtures


class TakenThenStepFailingDecode(BreakingDecode):
    """A decode worker whose stream, the first of those `failed` is shared by, says it took
    the KV, then fails its step."""

    def __init__(self, failed: list[str]) -> None:
        super().__init__(None)
        self.failed = failed  # lease ids of the streams failed

    async def Decode(self, request, context):
        if not self.failed:
            self.requests.append(request)
            self.failed.append(request.kv.lease_id)
            yield decode_service_pb2.DecodeResponse(blocks_pulled=3)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{DECODE_STEP_FAILED}: x")
        async for response in super().Decode(request, context):
            yield response


async def test_a_step_failed_after_the_kv_was_taken_prefills_again(cluster) -> None:
    await cluster.add(Role.ENCODER, FakeEncoder())
    prefill = FakePrefill()
    await cluster.add(Role.PREFILL, prefill)
    failed: list[str] = []
    workers = [TakenThenStepFailingDecode(failed) for _ in range(2)]
    for worker in workers:
        await cluster.add(Role.DECODE, worker)
    result = await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=10), timeout_s=20)
    assert result.token_ids == [FIRST, *range(101, 110)]
    leases = [r.kv.lease_id for w in workers for r in w.requests]
    assert len(failed) == 1 and len(prefill.requests) == 2
    assert len(leases) == 2 and len(set(leases)) == 2  # the taken lease not handed on
    (holder,) = cluster.router.orchestrator.registry.workers(Role.PREFILL)
    assert not holder.suspect


class LateFailingDecode(BreakingDecode):
    """A decode worker whose call, the first of those `failed` is shared by, fails with
    `code` before any chunk, `after_s` after it came (a worker frozen, then lost)."""

    def __init__(self, failed: list[str], code: grpc.StatusCode, after_s: float) -> None:
        super().__init__(None)
        self.failed, self.code, self.after_s = failed, code, after_s
        self.message = "kv.lease_id: the lease was not live"

    async def Decode(self, request, context):
        if not self.failed:
            self.requests.append(request)
            self.failed.append(request.kv.lease_id)
            await asyncio.sleep(self.after_s)
            await context.abort(self.code, self.message)
        async for response in super().Decode(request, context):
            yield response


@pytest.mark.parametrize("ttl_ms", [200, 60_000])
async def test_a_handle_whose_lease_ran_out_is_not_handed_on(cluster, ttl_ms: int) -> None:
    # A decode worker lost before its first chunk, past the lease's TTL: the router sent
    # the same handle on (clocks review, s36), for a READ of blocks the holder may have
    # given to another prompt, refused only by their digests; now a fresh prefill first.
    await cluster.add(Role.ENCODER, FakeEncoder())
    prefill = FakePrefill()
    prefill.lease_ttl_ms = ttl_ms
    await cluster.add(Role.PREFILL, prefill)
    failed: list[str] = []
    workers = [LateFailingDecode(failed, grpc.StatusCode.UNAVAILABLE, 0.4) for _ in range(2)]
    for worker in workers:
        await cluster.add(Role.DECODE, worker)
    result = await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=4), timeout_s=20)
    assert result.token_ids == [FIRST, 101, 102, 103]
    leases = [r.kv.lease_id for w in workers for r in w.requests]
    ran_out = ttl_ms < 400
    assert len(prefill.requests) == (2 if ran_out else 1)
    assert len(set(leases)) == (2 if ran_out else 1)  # a live one is handed on as it was


@pytest.mark.parametrize(("ttl_ms", "after_s"), [(200, 0.4), (60_000, 0.05)])
async def test_a_lease_its_holder_said_was_gone_does_not_make_it_suspect(
    cluster, ttl_ms: int, after_s: float
) -> None:
    # Gone well before its TTL too: a lease a decode worker released, then died, its handle
    # sent on (a rule sparing the holder only past the TTL passed with 200 ms alone: s37diff).
    await cluster.add(Role.ENCODER, FakeEncoder())
    prefill = FakePrefill()
    prefill.lease_ttl_ms = ttl_ms
    await cluster.add(Role.PREFILL, prefill)
    failed: list[str] = []
    for _ in range(2):
        await cluster.add(Role.DECODE, LateFailingDecode(failed, grpc.StatusCode.ABORTED, after_s))
    result = await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=4), timeout_s=20)
    assert result.token_ids == [FIRST, 101, 102, 103] and len(prefill.requests) == 2
    (holder,) = cluster.router.orchestrator.registry.workers(Role.PREFILL)
    assert not holder.suspect  # it let the lease go when it was due: nothing wrong with it


async def lapsed_while_no_decode(
    cluster, prefill: FakePrefill, back: FakeDecode, back_at: list[str] | None = None
):
    """A 3-token answer prefilled under a 300 ms lease while the only decode worker is
    dead (its calls fail UNAVAILABLE at once); `back` registers 0.6 s later, past the TTL,
    its address appended to `back_at`."""
    await cluster.add(Role.ENCODER, FakeEncoder())
    prefill.lease_ttl_ms = 300
    await cluster.add(Role.PREFILL, prefill)
    dead = await cluster.add(Role.DECODE, FakeDecode())
    await cluster.servers[-1].stop(0)  # killed
    # Its port kept from anything else (bound, not listening: calls to it are refused at
    # once): in a full run the request hung to its deadline once (s42); a socket that
    # listens there and never speaks holds a call twice worker_keepalive_s, 20 s here
    # (ownfixC; `back` taking the port does not).
    with socket.socket() as held:
        await _bind(held, int(dead.rsplit(":", 1)[1]))
        answer = asyncio.create_task(
            cluster.client.generate_text(TEXT, SamplingParams(max_tokens=3), timeout_s=20)
        )
        while not prefill.requests:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.6)  # past the TTL, the router waiting for a decode worker
        address = await cluster.add(Role.DECODE, back)
        if back_at is not None:
            back_at.append(address)
        return await answer


async def _bind(sock: socket.socket, port: int) -> None:
    """`sock` bound to `port` once the server that had it let it go (within a second)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    for _ in range(100):
        try:
            sock.bind(("127.0.0.1", port))
            return
        except OSError:
            await asyncio.sleep(0.01)


async def test_a_handle_whose_lease_ran_out_while_waiting_for_a_worker_is_not_sent(
    cluster,
) -> None:
    # The lease's TTL was checked when the first decode worker failed, before the router
    # waited for one to come back, and the handle went out 0.8 s past its TTL (s37diff).
    prefill, back = FakePrefill(), FakeDecode()
    result = await lapsed_while_no_decode(cluster, prefill, back)
    assert result.token_ids == [FIRST, 101, 102]
    assert [r.kv.lease_id for r in back.requests] == ["lease-2"]  # a fresh handle
    assert prefill.released[:1] == ["lease-1"]  # the lapsed one given back
    reprefills = cluster.router.orchestrator.metrics.reprefills
    assert reprefills._value.get() == 1


async def test_a_lapsed_lease_prefilled_again_decodes_where_the_ticket_was_placed_again(
    cluster,
) -> None:
    # The re-prefill for a lapsed lease ran after the decode worker was picked: when the
    # prefill pool refused it once, admission placed the ticket again, its decode blocks on
    # another worker, and the stream still went to the first pick (s38diff F1).
    registry = cluster.router.orchestrator.registry
    admission = cluster.router.orchestrator.admission
    extra, back = FakeDecode(), FakeDecode()

    class FullOnce(FakePrefill):
        async def Prefill(self, request, context):
            if len(self.requests) == 1:  # the lapsed lease's re-prefill: the pool is full
                self.requests.append(request)
                await cluster.add(Role.DECODE, extra)  # registered meanwhile, idle
                for worker in registry.workers(Role.DECODE):
                    if worker.address == back_at[0]:
                        admission._reserve(worker, 0)  # busier: the pick prefers `extra`
                await context.abort(*status_for(NoFreeBlocksError(2, 0)))
            return await super().Prefill(request, context)

    back_at: list[str] = []
    result = await lapsed_while_no_decode(cluster, FullOnce(), back, back_at)
    assert result.token_ids == [FIRST, 101, 102]
    assert (len(extra.requests), len(back.requests)) == (1, 0)  # where the blocks are reserved


class FrozenHolderDecode(BreakingDecode):
    """READs from the holders in `frozen` time out after `after_s`; others are served."""

    def __init__(self, frozen: list[str], after_s: float) -> None:
        super().__init__(None)
        self.frozen, self.after_s = frozen, after_s

    async def Decode(self, request, context):
        if request.kv.holder_address in self.frozen:
            self.requests.append(request)
            await asyncio.sleep(self.after_s)
            message = f"kv: the READ from {request.kv.holder_address} timed out; prefill again"
            await context.abort(grpc.StatusCode.ABORTED, message)
        async for response in super().Decode(request, context):
            yield response


async def test_a_holder_whose_read_timed_out_is_suspect_even_past_the_ttl(cluster) -> None:
    # A READ's timeout (30 s by default) comes back past a lease's TTL (30 s): taken for a
    # lease let go when due, the frozen holder was prefilled on again until the request
    # failed (ownfix review A, s37).
    await cluster.add(Role.ENCODER, FakeEncoder())
    frozen, good = FakePrefill(), FakePrefill()
    frozen.lease_ttl_ms = good.lease_ttl_ms = 200
    await cluster.add(Role.PREFILL, frozen)  # the only one: the first prefill is its
    await cluster.add(Role.DECODE, FrozenHolderDecode([frozen.address], 0.6))
    sampling = SamplingParams(max_tokens=4)
    answer = asyncio.ensure_future(cluster.client.generate_text(TEXT, sampling, timeout_s=20))
    while not frozen.requests:
        await asyncio.sleep(0.01)
    await cluster.add(Role.PREFILL, good)  # there for the prefill again
    assert (await answer).token_ids == [FIRST, 101, 102, 103]
    assert len(frozen.requests) == 1 and len(good.requests) == 1


@pytest.mark.parametrize(
    "said",
    [
        "kv.block_digests: 1 pulled block(s) do not match their digests; prefill again",
        "kv: the READ from the holder failed (x); prefill again",
    ],
)
async def test_a_refusal_a_lapsed_lease_does_not_explain_is_held_against_the_holder(
    cluster, said: str
) -> None:
    # Past the TTL only a timeout was (ownfix review B): bytes that changed while the holder
    # says the lease was live, or a READ that failed, sent the prompt back to it.
    await cluster.add(Role.ENCODER, FakeEncoder())
    prefill = FakePrefill()
    prefill.lease_ttl_ms = 200
    await cluster.add(Role.PREFILL, prefill)
    refusing = LateFailingDecode([], grpc.StatusCode.ABORTED, 0.4)
    refusing.message = said
    await cluster.add(Role.DECODE, refusing)
    result = await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=4), timeout_s=20)
    assert result.token_ids == [FIRST, 101, 102, 103]
    (holder,) = cluster.router.orchestrator.registry.workers(Role.PREFILL)
    assert holder.suspect
