"""Several routers, restarts and drains, through real processes (one deployment for the
module, so the tests run in order and the last one ends the decode worker):

- two routers, every worker registered with both; a client given both sends a request that
  fails before its first chunk to the next router, and says so clearly when none answers;
- a worker restarted at its address (kill -9, then the same command) registers again as a
  new instance and the router drops what it knew of the old one;
- kill -9 one router while streams run on both: the other router's streams finish whole
  (token for token what they are unkilled); the restarted router gets every worker back;
- SIGTERM to the decode worker mid-stream lets its streams finish, token for token, before
  the process exits.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import grpc
import pytest

from common.models.tiny import make_tiny_checkpoint
from common.sampling import SamplingParams
from epd.client import Client, GenerateError
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
        routers=2,
        prefill_args=(
            *("--port", str(free_port())),  # a restart comes back at this address
            # A killed router's prefilled requests leave leases nobody pulls: they expire
            # before the teardown's drain would wait out the default 30 s.
            *("--lease-ttl-s", "4", "--lease-ttl-per-lease-s", "0"),
        ),
        router_args=("--worker-timeout-s", "60"),  # the restart, not expiry, replaces it
    )
    yield c
    c.stop()


def test_workers_register_with_every_router(cluster: Cluster) -> None:
    first, second = (cluster.status(address=a) for a in cluster.router_addresses)
    assert len(first.workers) == len(second.workers) == 3
    by_address = {w.info.address: w for w in second.workers}
    for worker in first.workers:
        other = by_address[worker.info.address]
        assert worker.worker_id != other.worker_id  # each router keeps its own registry
        assert worker.info.instance_id and worker.info.instance_id == other.info.instance_id


async def test_client_sends_a_failed_request_to_the_next_router(cluster: Cluster) -> None:
    alive = cluster.address
    nobody = f"127.0.0.1:{free_port()}"  # no router listens here
    short = SamplingParams(max_tokens=8, ignore_eos=True)
    async with Client(alive, api_key=cluster.client_key) as client:
        want = (await client.generate_text(chat("retry me"), short)).token_ids
    async with Client(f"{nobody},{alive}", api_key=cluster.client_key) as client:
        assert client.addresses == [nobody, alive]
        got = await client.generate_text(chat("retry me"), short, timeout_s=30)
        assert got.token_ids == want and client.retries == 1
        got = await client.generate_text(chat("retry me"), short, timeout_s=30)  # starts on alive
        assert got.token_ids == want and client.retries == 1
    other = f"127.0.0.1:{free_port()}"
    async with Client([nobody, other], api_key=cluster.client_key) as client:
        with pytest.raises(GenerateError) as info:
            await client.generate_text(chat("nobody home"), short, timeout_s=10)
    assert info.value.code.name == "UNAVAILABLE"
    assert "every router failed" in info.value.details
    assert nobody in info.value.details and other in info.value.details


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
    said = f"worker {old.info.name} ({old.info.address}) re-registered after a restart"
    assert said in log
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        third = await client.generate_text(prompt, LONG, timeout_s=60)
    # The new process caches nothing yet: no prefix served from the old one's blocks.
    assert third.token_ids == first.token_ids and third.cached_tokens == 0


# Streams on the router that gets killed: long enough to be mid-stream when the kill lands.
ENDLESS = SamplingParams(max_tokens=600, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=600, ignore_eos=True, temperature=1.0, seed=7)
NEVER = ("\x00never said\x00",)  # a stop string no answer contains


async def _stream(
    client: Client,
    text: str,
    got_first: asyncio.Event,
    sampling: SamplingParams,
    stop: tuple[str, ...] = (),
) -> list[int]:
    tokens: list[int] = []
    async for chunk in client.generate(chat(text), sampling, timeout_s=60, stop=stop):
        tokens.extend(chunk.token_ids)
        if tokens:
            got_first.set()
    return tokens


async def test_killing_one_router_resumes_its_streams_on_the_other(cluster: Cluster) -> None:
    """Streams on the surviving router are untouched; the killed router's streams resume
    on the survivor after the tokens the client has (greedy and seeded: token for token the
    unkilled answer); one with stop strings is not resumed and says so."""
    survivor, doomed = cluster.router_addresses
    cases = [  # (prompt, sampling, stop, on the doomed router)
        ("story number 0 about routers", LONG, (), False),
        ("story number 1 about routers", ENDLESS, (), True),
        ("story number 2 about routers", LONG, (), False),
        ("story number 3 about routers", SEEDED, (), True),
        ("story number 4 about routers", ENDLESS, NEVER, True),
    ]
    async with Client(survivor, api_key=cluster.client_key) as client:
        answers = await asyncio.gather(
            *(client.generate_text(chat(p), s, stop=stop) for p, s, stop, _ in cases)
        )
    reference = [a.token_ids for a in answers]
    clients = [
        Client([doomed, survivor] if on_doomed else survivor, api_key=cluster.client_key)
        for *_, on_doomed in cases
    ]
    started = [asyncio.Event() for _ in cases]
    try:
        streams = [
            asyncio.ensure_future(_stream(c, p, e, s, stop))
            for c, (p, s, stop, _), e in zip(clients, cases, started, strict=True)
        ]
        # Kill as soon as the doomed router's streams are under way.
        doomed_started = [e for e, case in zip(started, cases, strict=True) if case[3]]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in doomed_started)), 60)
        killed = cluster.procs.pop("router-1")
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        results = await asyncio.gather(*streams, return_exceptions=True)
    finally:
        for c in clients:
            await c.close()
    for i, (result, (_, _, stop, _)) in enumerate(zip(results, cases, strict=True)):
        if stop and isinstance(result, GenerateError):  # stop strings: not resumed, said so
            assert doomed in result.details and "not resumed" in result.details, result
        else:  # whole, and what it would have been
            assert result == reference[i], f"stream {i}: {result!r}"
    resumed = sum(c.resumes for c in clients)
    assert resumed >= 1, results  # the kill landed mid-stream on the doomed router
    assert isinstance(results[4], GenerateError)
    cluster.check_alive()  # the workers did not notice beyond their streams ending
    status = cluster.status(address=survivor)
    assert len(status.workers) == 3 and status.active_requests == 0


def test_a_restarted_router_gets_every_worker_back(cluster: Cluster) -> None:
    doomed = cluster.router_addresses[1]
    proc = cluster.procs.get("router-1")
    if proc is not None:  # run alone: kill it here
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    cluster.respawn("router-1")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        cluster.check_alive()
        try:
            if len(cluster.status(address=doomed).workers) == 3:
                break
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    else:
        raise AssertionError(f"workers did not register again\n{cluster.logs()}")


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
