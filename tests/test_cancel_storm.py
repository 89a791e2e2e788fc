"""Clients that give up, end to end (real processes, NIXL over UCX): requests cancelled at
random moments, many while their prefill is in flight, leave no KV lease behind, although
prefill leases here last a minute: every block is back in its pool within seconds, no lease
expires, and the requests that finished answered exactly as the offline engine.

The race this pins: the prefill worker makes a lease and answers just as the router's call
is cancelled, so the answer, and the lease id in it, never reaches the router. The router
chooses each Prefill's lease id itself and releases it when the call ends without its
answer; a release that overtakes the lease bars its id (`common.server.leases`)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from common.engine import Engine
from common.models.tiny import make_tiny_checkpoint
from common.sampling import SamplingParams
from epd.client import Client
from epd.v1 import registry_service_pb2
from tests.cluster import start_cluster
from tests.test_e2e import img, reference, user, wait_for

pytestmark = pytest.mark.slow

BLOCK = 8
NUM_BLOCKS = 256
REQUESTS = 48
IN_FLIGHT = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cluster(ckpt, tmp_path_factory):
    c = start_cluster(
        ckpt,
        tmp_path_factory.mktemp("logs"),
        block_size=BLOCK,
        num_blocks=NUM_BLOCKS,
        prefill_args=("--lease-ttl-s", "60"),  # a leaked lease would outlive the test
    )
    yield c
    c.stop()


def prompt(i: int) -> list[dict[str, Any]]:
    words = "about the sea and the ships " * (1 + i % 5)
    if i % 3 == 0:
        return user(img(700 + i % 4), f"Request {i}: tell me {words}")
    return user(f"Request {i}: tell me {words}")


def idle(status: Any) -> bool:
    kv_roles = (registry_service_pb2.WORKER_ROLE_PREFILL, registry_service_pb2.WORKER_ROLE_DECODE)
    kv = [w for w in status.workers if w.info.role in kv_roles]
    return status.active_requests == 0 and all(
        w.load.kv_blocks_free == NUM_BLOCKS
        and w.load.active_requests == 0
        and w.router_reserved_kv_blocks == 0
        for w in kv
    )


async def test_cancelled_requests_leave_no_lease_behind(cluster, ckpt):
    rng = random.Random(7)
    gate = asyncio.Semaphore(IN_FLIGHT)
    # Every other request is given up within 50 ms: before, during or just after prefill.
    plans = [
        (prompt(i), SamplingParams(max_tokens=1 + i % 8, ignore_eos=True), rng.uniform(0, 0.05))
        for i in range(REQUESTS)
    ]
    finished: list[tuple[Any, SamplingParams, list[int]]] = []

    async def one(client: Client, messages: Any, sampling: SamplingParams, give_up: float) -> None:
        async with gate:
            call = client.generate_text(messages, sampling, timeout_s=60)
            try:
                result = await (asyncio.wait_for(call, give_up) if give_up > 0.025 else call)
            except TimeoutError:
                return
            finished.append((messages, sampling, result.token_ids))

    async with Client(cluster.address, api_key=cluster.client_key) as client:
        await asyncio.gather(*(one(client, *plan) for plan in plans))
    await wait_for(idle, cluster, timeout_s=20)
    log = (cluster.log_dir / "prefill.log").read_text(errors="replace")
    assert "expired unreleased" not in log
    assert REQUESTS // 4 <= len(finished) < REQUESTS  # some finished, some were given up
    engine = Engine.from_pretrained(ckpt, block_size=BLOCK, num_blocks=512)
    wrong = [m for m, s, tokens in finished if tokens != reference(engine, m, s)]
    assert wrong == []
