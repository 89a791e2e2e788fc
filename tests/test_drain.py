"""Restarts and drains lose nothing, through real processes: a worker restarted at its
address (kill -9, then the same command) registers again as a new instance and the router
drops what it knew of the old one; SIGTERM to the decode worker mid-stream lets its streams
finish, token for token, before the process exits.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import pytest

from common.models.tiny import make_tiny_checkpoint
from common.sampling import SamplingParams
from epd.client import Client
from tests.cluster import Cluster, free_port, start_cluster

pytestmark = pytest.mark.slow

LONG = SamplingParams(max_tokens=96, ignore_eos=True)


def chat(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    c = start_cluster(
        ckpt,
        tmp_path_factory.mktemp("logs"),
        prefill_args=("--port", str(free_port())),  # a restart comes back at this address
        router_args=("--worker-timeout-s", "60"),  # the restart, not expiry, replaces it
    )
    yield c
    c.stop()


def _until(check: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def test_restarted_worker_is_a_new_instance_and_old_entries_go(cluster: Cluster) -> None:
    prompt = chat("a prompt long enough to fill several KV blocks of eight tokens each")
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        first = await client.generate_text(prompt, LONG)
        second = await client.generate_text(prompt, LONG)
    assert second.token_ids == first.token_ids and second.cached_tokens > 0
    old = cluster.worker("prefill")
    cluster.procs["prefill"].send_signal(signal.SIGKILL)
    cluster.procs["prefill"].wait(10)
    cluster.respawn("prefill")

    def new_instance() -> Any:
        found = [w for w in cluster.status().workers if w.info.address == old.info.address]
        return found if found and found[0].info.instance_id != old.info.instance_id else None

    (new,) = _until(new_instance, 60, "the restarted prefill worker to register")
    assert new.worker_id != old.worker_id
    log = (cluster.log_dir / "router.log").read_text()
    assert f"worker {old.info.address} re-registered after a restart" in log
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        third = await client.generate_text(prompt, LONG, timeout_s=60)
    # The new process caches nothing yet: no prefix served from the old one's blocks.
    assert third.token_ids == first.token_ids and third.cached_tokens == 0


async def test_sigterm_to_decode_mid_stream_lets_the_streams_finish(cluster: Cluster) -> None:
    prompts = [f"drain story {i}" for i in range(2)]
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        answers = await asyncio.gather(*(client.generate_text(chat(p), LONG) for p in prompts))
        reference = [a.token_ids for a in answers]
        started = [asyncio.Event() for _ in prompts]

        async def stream(text: str, first: asyncio.Event) -> list[int]:
            tokens: list[int] = []
            async for chunk in client.generate(chat(text), LONG, timeout_s=60):
                tokens.extend(chunk.token_ids)
                if len(tokens) > 2:  # the first token is prefill's: decode runs now
                    first.set()
            return tokens

        streams = [
            asyncio.ensure_future(stream(p, e)) for p, e in zip(prompts, started, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        decode = cluster.procs["decode"]
        decode.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*streams)
    assert results == reference  # nothing cut, nothing changed
    assert decode.wait(30) == 0
    log = (cluster.log_dir / "decode.log").read_text()
    assert "drain timeout" not in log
