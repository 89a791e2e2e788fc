"""Clients that give up, end to end (real processes, NIXL over UCX): requests cancelled at
random moments, many while their encode or prefill is in flight, leave no lease behind,
although leases here last a minute: every KV block is back in its pool and every encoder
output released within seconds, no lease expires, and the requests that finished answered
exactly as the offline engine.

The race this pins: a worker makes a lease and answers just as the router's call is
cancelled, so the answer, and the lease id in it, never reaches the router. The router
chooses the lease ids of each Prefill and Encode call itself and releases them when the call
ends without its answer; a release that overtakes the lease bars its id
(`common.server.leases`)."""

from __future__ import annotations

import asyncio
import random
import urllib.request
from typing import Any

import pytest

from common.engine import Engine
from common.models.tiny import make_tiny_checkpoint
from common.sampling import SamplingParams
from epd.client import Client
from epd.v1 import registry_service_pb2
from tests.cluster import free_port, start_cluster
from tests.test_e2e import img, reference, user, vid, wait_for

pytestmark = pytest.mark.slow

BLOCK = 8
NUM_BLOCKS = 256
REQUESTS = 96
IN_FLIGHT = 8
PORTS: dict[str, int] = {}  # the encoder's metrics port, picked by the cluster fixture


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cluster(ckpt, tmp_path_factory):
    PORTS["encoder metrics"] = free_port()
    c = start_cluster(
        ckpt,
        tmp_path_factory.mktemp("logs"),
        block_size=BLOCK,
        num_blocks=NUM_BLOCKS,
        # A leaked lease would outlive the test; image outputs go by NIXL handle.
        encoder_args=(
            *("--lease-ttl-s", "60", "--inline-limit-bytes", "2048"),
            *("--metrics-port", str(PORTS["encoder metrics"])),
        ),
        prefill_args=("--lease-ttl-s", "60"),
    )
    yield c
    c.stop()


def prompt(i: int) -> list[dict[str, Any]]:
    words = "about the sea and the ships " * (1 + i % 5)
    if i % 3 == 0:
        return user(img(700 + i % 4), f"Request {i}: tell me {words}")
    if i % 3 == 1:
        return user(vid(800 + i % 2, frames=4 + 2 * (i % 3)), f"Request {i}: tell me {words}")
    return user(f"Request {i}: tell me {words}")


def encoder_metric(name: str) -> float:
    """One sample of the encoder's metrics page."""
    url = f"http://127.0.0.1:{PORTS['encoder metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as page:
        for line in page.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not on the encoder's metrics page")


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
    # Every other request is given up within 80 ms: while encoded, prefilled or decoded.
    plans = [
        (prompt(i), SamplingParams(max_tokens=1 + i % 8, ignore_eos=True), rng.uniform(0, 0.08))
        for i in range(REQUESTS)
    ]
    finished: list[tuple[Any, SamplingParams, list[int]]] = []

    async def one(client: Client, messages: Any, sampling: SamplingParams, give_up: float) -> None:
        async with gate:
            call = client.generate_text(messages, sampling, timeout_s=60)
            try:
                result = await (asyncio.wait_for(call, give_up) if give_up > 0.04 else call)
            except TimeoutError:
                return
            finished.append((messages, sampling, result.token_ids))

    async with Client(cluster.address, api_key=cluster.client_key) as client:
        await asyncio.gather(*(one(client, *plan) for plan in plans))
    await wait_for(idle, cluster, timeout_s=20)
    for _ in range(100):  # released in the background
        if await asyncio.to_thread(encoder_metric, "epd:encoder_output_leases") == 0:
            break
        await asyncio.sleep(0.1)
    assert await asyncio.to_thread(encoder_metric, "epd:encoder_output_leases") == 0
    assert await asyncio.to_thread(encoder_metric, "epd:encoder_output_leases_expired_total") == 0
    for name in ("prefill", "encoder"):
        log = (cluster.log_dir / f"{name}.log").read_text(errors="replace")
        assert "expired unreleased" not in log
    assert REQUESTS // 4 <= len(finished) < REQUESTS  # some finished, some were given up
    engine = Engine.from_pretrained(ckpt, block_size=BLOCK, num_blocks=512)
    wrong = [m for m, s, tokens in finished if tokens != reference(engine, m, s)]
    assert wrong == []
