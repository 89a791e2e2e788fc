"""Prometheus `/metrics` on every process: a real router, encoder, prefill and decode worker
in this process, each with its own registry and endpoint; one request through the router
shows up in every scrape (docs/metrics.md)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import logging
import socket
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from common.engine import Engine
from common.models.tiny import make_tiny_checkpoint
from common.sampling import SamplingParams
from common.server.metrics import MetricsEndpoint, counter, scrape_registry
from common.server.role import RoleServer
from common.settings.base import ServerSettings
from common.settings.schema import SettingsError
from decode_worker.server import serve as serve_decode
from decode_worker.settings import DecodeSettings
from encoder_worker.server import serve as serve_encoder
from encoder_worker.settings import EncoderSettings
from epd.answers import GenerateError
from epd.client import Client
from prefill_worker.server import serve as serve_prefill
from prefill_worker.settings import PrefillSettings
from router.server import RunningRouter
from router.server import serve as serve_router
from router.settings import RouterSettings
from tests.cluster import CLIENT_KEY, cluster_security

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

BLOCK = 8
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclasses.dataclass
class Deployment:
    router: RunningRouter
    encoder: RoleServer[Any]
    prefill: RoleServer[Any]
    decode: RoleServer[Any]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def dep(ckpt: Path) -> AsyncIterator[Deployment]:
    security = cluster_security()
    metrics: dict[str, Any] = {"metrics_port": 0}
    router = await serve_router(
        RouterSettings(
            model=str(ckpt),
            port=0,
            http_port=-1,  # not the default 8000: another server may hold it
            heartbeat_interval_s=0.1,
            security=security,
            **metrics,
        )
    )
    kw: dict[str, Any] = {
        "model": str(ckpt),
        "router_address": router.address,
        "security": security,
        **metrics,
    }
    kv: dict[str, Any] = {"block_size": BLOCK, "num_blocks": 128}
    encoder = await serve_encoder(EncoderSettings(name="e0", **kw))
    prefill = await serve_prefill(PrefillSettings(name="p0", **kw, **kv))
    decode = await serve_decode(DecodeSettings(name="d0", **kw, **kv))
    workers: list[RoleServer[Any]] = [encoder, prefill, decode]
    for worker in workers:
        assert worker.registrar is not None
        await worker.registrar.wait_registered(30)
    yield Deployment(router, encoder, prefill, decode)
    for server in [*reversed(workers), router]:
        await server.stop(0)


def chat(seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
    text = f"Metrics test {seed}: describe this picture in great detail, every colour and shape."
    content = [{"type": "image", "image": buf.getvalue()}, {"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def fetch(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


async def scrape(server: RoleServer[Any]) -> Samples:
    """Every sample of `server`'s endpoint, by (name, sorted labels)."""
    assert server.metrics_endpoint is not None
    text = await asyncio.to_thread(fetch, server.metrics_endpoint.address)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def one(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def test_one_request_shows_up_in_every_scrape(dep: Deployment) -> None:
    async with Client(dep.router.address, api_key=CLIENT_KEY) as client:
        result = await client.generate_text(chat(1), GREEDY, timeout_s=60)
    assert len(result.token_ids) == 4
    router, encoder = await scrape(dep.router), await scrape(dep.encoder)
    prefill, decode = await scrape(dep.prefill), await scrape(dep.decode)

    assert one(router, "vllm:time_to_first_token_seconds_count") == 1
    assert one(router, "vllm:e2e_request_latency_seconds_count") == 1
    assert one(router, "vllm:inter_token_latency_seconds_count") == 3  # tokens after the first
    assert one(router, "epd:router_planning_seconds_count", step="hash") == 1
    assert one(router, "epd:router_planning_seconds_count", step="route") == 1
    assert one(router, "epd:admission_admitted_total") == 1
    assert one(router, "epd:admission_refused_total", reason="queue_full") == 0
    assert one(router, "epd:reprefills_total") == 0
    assert one(router, "epd:retries_total", stage="decode") == 0
    assert one(router, "epd:workers_suspect", role="prefill") == 0
    for role in ("encoder", "prefill", "decode"):
        assert one(router, "epd:workers", role=role, state="serving") == 1
        assert one(router, "epd:workers", role=role, state="draining") == 0
    # Below vLLM's lowest buckets too: a small model's gaps all fell in the first.
    assert ("vllm:inter_token_latency_seconds_bucket", (("le", "0.001"),)) in router
    assert ("vllm:e2e_request_latency_seconds_bucket", (("le", "0.025"),)) in router
    assert one(router, "vllm:num_requests_running") == 0
    assert one(router, "vllm:num_requests_waiting") == 0
    assert one(router, "process_cpu_seconds_total") > 0  # every endpoint: process_* too

    assert one(encoder, "epd:encoder_cache_queries_total") >= 1
    assert one(encoder, "vllm:num_requests_running") == 0

    # Tokens, as vLLM's (they counted blocks: operator2 review L5, s44): the prompt's full
    # blocks', none cached yet.
    full = result.prompt_tokens // BLOCK * BLOCK
    assert one(prefill, "vllm:prefix_cache_queries_total") == full > 0
    assert one(prefill, "vllm:prefix_cache_hits_total") == 0
    assert one(prefill, "epd:prefill_requests_total") == 1
    assert one(prefill, "epd:prefills_dropped_total") == 0
    assert 0 <= one(prefill, "vllm:kv_cache_usage_perc") <= 1

    assert one(decode, "epd:kv_blocks_pulled_total") > 0
    assert one(decode, "epd:kv_bytes_pulled_total") > 0
    assert one(decode, "epd:kv_pull_seconds_total") > 0
    assert one(decode, "epd:kv_digest_failures_total") == 0
    assert one(decode, "epd:kv_leases_lost_total") == 0
    assert one(decode, "epd:decode_requests_total") == 1
    assert one(decode, "vllm:prefix_cache_queries_total") > 0
    steps = one(decode, "epd:decode_steps_total")
    assert steps == len(result.token_ids) - 1  # one stream (its first token from prefill)
    assert one(decode, "epd:decode_step_sequences_total") == steps  # each step it alone
    wall = one(decode, "epd:decode_step_seconds_total")
    assert 0 < one(decode, "epd:decode_step_cpu_seconds_total") <= wall + 1e-3


async def test_workers_by_state_show_a_role_with_none_serving(dep: Deployment) -> None:
    # Every decode worker drained: /health said 503, the metrics page said nothing.
    address = dep.decode.address
    assert dep.router.registry.drain(address)
    try:
        router = await scrape(dep.router)
        assert one(router, "epd:workers", role="decode", state="serving") == 0
        assert one(router, "epd:workers", role="decode", state="draining") == 1
    finally:
        dep.router.registry.undrain(address)
    assert one(await scrape(dep.router), "epd:workers", role="decode", state="serving") == 1


async def test_each_request_is_counted_and_logged_once_by_how_it_ended(
    dep: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    # Nothing counted how requests ended (300 refused and 41 cancelled moved no metric), a
    # cancelled one left no log line, and a refused gRPC one left two.
    caplog.set_level(logging.INFO, logger="router.server")
    before = await scrape(dep.router)
    async with Client(dep.router.address, api_key=CLIENT_KEY) as client:
        await client.generate_text(chat(1), GREEDY, timeout_s=60, request_id="m-done")
        with pytest.raises(GenerateError):
            too_long = "x" * 300  # a stop string past 256 characters
            await client.generate_text(chat(2), GREEDY, request_id="m-bad", stop=too_long)
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = client.generate(chat(3), long, timeout_s=60, request_id="m-gone")
        async for _ in stream:
            break  # the first chunk, then the client goes
        await stream.aclose()  # type: ignore[attr-defined]  # an async generator

    def counted(samples: Samples, outcome: str) -> float:
        name = "epd:requests_finished_total"
        return one(samples, name, outcome=outcome) - one(before, name, outcome=outcome)

    for _ in range(100):
        after = await scrape(dep.router)
        if counted(after, "cancelled") >= 1:
            break
        await asyncio.sleep(0.1)
    assert {o: counted(after, o) for o in ("length", "invalid", "cancelled", "error")} == {
        "length": 1,
        "invalid": 1,
        "cancelled": 1,
        "error": 0,
    }
    lines = [r.getMessage() for r in caplog.records if r.name == "router.server"]
    for rid, how in (("m-done", "length:"), ("m-bad", "invalid after"), ("m-gone", "cancelled")):
        mine = [line for line in lines if f"request {rid} " in line]
        assert len(mine) == 1 and how in mine[0], (rid, mine)


async def test_a_repeated_request_hits_the_caches(dep: Deployment) -> None:
    messages = chat(2)
    async with Client(dep.router.address, api_key=CLIENT_KEY) as client:
        await client.generate_text(messages, GREEDY, timeout_s=60)
        before = await scrape(dep.prefill), await scrape(dep.decode)
        await client.generate_text(messages, GREEDY, timeout_s=60)
    prefill, decode = await scrape(dep.prefill), await scrape(dep.decode)
    hits = "vllm:prefix_cache_hits_total"
    assert one(prefill, hits) > one(before[0], hits)
    reused = "epd:kv_blocks_reused_total"
    assert one(decode, reused) > one(before[1], reused)
    router = await scrape(dep.router)
    # The image lay in the cached prefix (when the router had seen the KV events), or its
    # output came from the router's or the encoder's cache: the tower did not run again.
    encoder = await scrape(dep.encoder)
    assert (
        one(router, "epd:items_skipped_total")
        + one(router, "epd:embedding_cache_hits_total")
        + one(encoder, "epd:encoder_cache_hits_total")
        >= 1
    )


async def test_servers_have_their_own_registries() -> None:
    a = scrape_registry(lambda: [counter("epd:test_thing", "A thing.", 1)])
    b = scrape_registry(lambda: [counter("epd:test_thing", "A thing.", 2)])
    assert a.get_sample_value("epd:test_thing_total") == 1
    assert b.get_sample_value("epd:test_thing_total") == 2


async def test_endpoint_serves_its_registry_and_frees_its_port(caplog) -> None:
    registry = scrape_registry(lambda: [counter("epd:test_thing", "A thing.", 3)])
    with caplog.at_level(logging.INFO, "common.server.metrics"):
        endpoint = MetricsEndpoint.start(registry, "127.0.0.1", 0, "prefill epd-prefill-1")
    # Whose it is: several workers' free ports were told apart only by scraping each.
    assert f"EPD_METRICS_ADDRESS={endpoint.address} (prefill epd-prefill-1)" in caplog.text
    text = await asyncio.to_thread(fetch, endpoint.address)
    assert "epd:test_thing_total 3.0" in text
    await endpoint.close()
    await endpoint.close()  # idempotent
    port = int(endpoint.address.rsplit(":", 1)[1])
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the scrape's TIME_WAIT
        s.bind(("127.0.0.1", port))  # free again
        s.listen()
        with pytest.raises(SettingsError, match="metrics_port"):
            MetricsEndpoint.start(registry, "127.0.0.1", port)  # taken now


async def test_silent_connections_hold_a_bounded_number_of_threads(monkeypatch) -> None:
    # 400 silent connections held a worker's 370 threads, each until its peer closed it
    # (metrics review, s33): at most MAX_SCRAPERS at once, each closed once idle.
    import common.server.metrics as metrics

    monkeypatch.setattr(metrics, "MAX_SCRAPERS", 2)
    monkeypatch.setattr(metrics._Scrape, "limit_s", 0.5)
    registry = scrape_registry(lambda: [counter("epd:test_thing", "A thing.", 3)])
    endpoint = MetricsEndpoint.start(registry, "127.0.0.1", 0)
    host, port = endpoint.address.rsplit(":", 1)
    silent = [socket.create_connection((host, int(port)), timeout=5) for _ in range(3)]
    try:
        assert silent[2].recv(1) == b""  # one past the cap: closed as it opens
        assert silent[0].recv(1) == b""  # closed by the server in time (else a 5 s timeout)
        # A client trickling its head a byte at a time is cut as well (a per-read timeout
        # let it keep its place for good: own-fix review).
        started = time.monotonic()
        with contextlib.suppress(OSError):
            for _ in range(50):
                silent[1].sendall(b"G")
                await asyncio.sleep(0.05)
        assert silent[1].recv(1) == b"" and time.monotonic() - started < 2.0
        text = await asyncio.to_thread(fetch, endpoint.address)  # their slots are free
        assert "epd:test_thing_total 3.0" in text
    finally:
        for s in silent:
            s.close()
        await endpoint.close()


async def test_metrics_port_is_checked() -> None:
    assert ServerSettings().metrics_port is None  # off unless asked for
    with pytest.raises(SettingsError, match="metrics_port"):
        ServerSettings(metrics_port=70000).check()


async def test_a_repeated_image_with_new_text_needs_no_encode_call(
    dep: Deployment, ckpt: Path
) -> None:
    """The image's last rows share a block with the text after it, so the prefill worker
    computes them again and needs the embedding: the router sends the rows it kept
    (`embedding_cache_mb`) instead of asking the encoder, and the answer is the engine's."""
    image = chat(5)[0]["content"][0]

    def ask(question: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [image, {"type": "text", "text": question}]}]

    async with Client(dep.router.address, api_key=CLIENT_KEY) as client:
        await client.generate_text(ask("What is in this picture?"), GREEDY, timeout_s=60)
        before = await scrape(dep.router), await scrape(dep.encoder)
        again = ask("Which colours does it have, and where?")
        result = await client.generate_text(again, GREEDY, timeout_s=60)
    router, encoder = await scrape(dep.router), await scrape(dep.encoder)
    hits = "epd:embedding_cache_hits_total"
    assert one(router, hits) == one(before[0], hits) + 1
    # What the two caches hold, so that a router's memory filling them is not taken for a
    # leak (soak review, s33).
    assert one(router, "epd:embedding_cache_bytes") > 0
    assert one(router, "epd:processed_image_cache_bytes") > 0
    queries = "epd:encoder_cache_queries_total"
    assert one(encoder, queries) == one(before[1], queries)  # no Encode call
    assert result.cached_tokens > 0  # the image's leading blocks came from the prefix cache
    engine = Engine.from_pretrained(ckpt, block_size=BLOCK)
    assert result.token_ids == engine.generate(again, GREEDY).token_ids
