"""Fault injection through real processes: a worker frozen (SIGSTOP) under load.

A frozen process keeps its connections open (its kernel still answers TCP), so nothing
fails on its own: before keepalive, a request inside a frozen prefill worker waited for its
deadline and then got no answer at all (the router dropped the worker and closed its
channel, which cancelled the call). Now an unanswered HTTP/2 ping fails the router's calls
on it with UNAVAILABLE within 2 x `worker_keepalive_s`, and they are tried on the other
worker of the role (a decode stream resumes there). Every request ends with the tokens it
gets without the freeze.

(A request whose KV a prefill worker already holds when it freezes waits longer: the decode
worker cannot confirm that lease, refuses what it pulled after `release_timeout_s`, and the
prompt is prefilled again elsewhere.)
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from typing import Any

import pytest

from common.models.tiny import make_tiny_checkpoint
from common.sampling import SamplingParams
from epd.client import Client
from epd.v1 import registry_service_pb2
from tests.cluster import start_cluster

pytestmark = pytest.mark.slow

KEEPALIVE_S = 0.5  # the router's worker_keepalive_s here
# Workers drop after this long silent: far past the pings' failover, so a loaded machine's
# slower failover is not taken for a wait on the registry (4.06 s against 5 s failed once).
WORKER_TIMEOUT_S = 20.0
SAMPLING = SamplingParams(max_tokens=200, ignore_eos=True)  # streams still going at the freeze


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    c = start_cluster(
        ckpt,
        tmp_path_factory.mktemp("logs"),
        prefills=2,
        decodes=2,
        router_args=(
            *("--worker-keepalive-s", str(KEEPALIVE_S)),
            *("--worker-timeout-s", str(WORKER_TIMEOUT_S)),
        ),
    )
    yield c
    for proc in c.procs.values():
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
    c.stop()


def chat(i: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Request {i}: say something about {i * 7}."}]


async def answer(client: Client, i: int) -> list[int]:
    tokens: list[int] = []
    async for chunk in client.generate(chat(i), SAMPLING, timeout_s=60):
        tokens.extend(chunk.token_ids)
    return tokens


async def busiest_decode_worker(cluster) -> str:
    """The name of the decode worker with the most requests (by its heartbeats)."""
    for _ in range(100):
        status = await asyncio.to_thread(cluster.status)
        decode = [
            w for w in status.workers if w.info.role == registry_service_pb2.WORKER_ROLE_DECODE
        ]
        busiest = max(decode, key=lambda w: w.load.active_requests)
        if busiest.load.active_requests:
            return str(busiest.info.name)
        await asyncio.sleep(0.05)
    raise AssertionError("no decode worker got a request")


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_requests_on_a_frozen_worker_fail_over(cluster, role) -> None:
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        want = [await answer(client, i) for i in range(6)]  # nothing frozen
        if role == "prefill":
            # Frozen first: the registry lists it for WORKER_TIMEOUT_S more, so requests are
            # sent to it until its calls fail.
            victim = "prefill"
            os.kill(cluster.procs[victim].pid, signal.SIGSTOP)
            tasks = [asyncio.ensure_future(answer(client, i)) for i in range(6)]
        else:
            # Frozen while it streams.
            tasks = [asyncio.ensure_future(answer(client, i)) for i in range(6)]
            victim = await busiest_decode_worker(cluster)
            os.kill(cluster.procs[victim].pid, signal.SIGSTOP)
        started = time.monotonic()
        try:
            got = await asyncio.gather(*tasks)
            waited = time.monotonic() - started
        finally:
            os.kill(cluster.procs[victim].pid, signal.SIGCONT)
    assert got == want
    log = (cluster.log_dir / "router.log").read_text(errors="replace")
    address = re.search(rf"registered {role} worker {victim} at (\S+)", log)
    assert address is not None
    moved = [
        line
        for line in log.splitlines()
        if f"on {victim} ({address[1]})" in line and ("failed" in line or "broke" in line)
    ]
    assert moved  # some requests were on the victim, and moved
    # Not the requests' 60 s deadline: the calls on the frozen worker fail after the pings'
    # 2 x 0.5 s (a decode stream resumes elsewhere); none waits for the registry to drop it.
    assert waited < WORKER_TIMEOUT_S / 2, waited
