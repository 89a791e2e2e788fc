"""The router's two front doors on one deployment: gRPC (`epd.client`) against the
OpenAI-compatible HTTP API (the `openai` client), streamed and not.

One local deployment (`tests/cluster.py`, router with its HTTP API + encoder + prefill +
decode, one torch thread a worker, the `small` checkpoint). Every request is one 224x224 PNG
(12 images, each sent 4 times, so most hit the router's and the encoder's caches) and ~30
words, `--tokens` tokens at temperature 1 (the HTTP API's default, OpenAI's), so both doors
ask the workers for the same work.

1. Latency, one request at a time on kept-alive connections, `--sequential` of each,
   interleaved: TTFT p50 of gRPC and of the streamed HTTP answer (first chunk the client
   sees), and the whole request's p50 for both doors unstreamed. A door that holds its first
   bytes back (a missing TCP_NODELAY, a buffering proxy) shows here.
2. Throughput, `--requests` at `--concurrency` in flight per door, rounds interleaved:
   req/s, the CPU the deployment spent per request (router and the rest) and this process's
   (the client's, sharing the machine), and each door's req/s over gRPC's.

    .venv/bin/python benchmarks/http_bench.py [--rounds 3] [--requests 48] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai

# `tests.cluster` (the deployment helper) lives beside the test suite, not in a package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from served import _WORDS, messages, png
from timing import process_cpu_seconds

from common.models.tiny import default_checkpoint
from common.sampling import SamplingParams
from epd.client import Client
from tests.cluster import Cluster, start_cluster

DOORS = ("grpc", "http", "http-stream")


def http_messages(image: bytes, k: int) -> list[dict[str, Any]]:
    """`served.messages(image, k)` as an OpenAI chat body's messages (a data URL)."""
    words = " ".join(_WORDS[(k + i) % len(_WORDS)] for i in range(30))
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": f"Request {k}: {words}?"},
            ],
        }
    ]


class Doors:
    """One request through each door; each call returns (TTFT, total) seconds."""

    def __init__(self, cluster: Cluster, model: str, tokens: int) -> None:
        assert cluster.http_url is not None
        self.grpc = Client(cluster.address, api_key=cluster.client_key)
        self.http = openai.AsyncOpenAI(
            base_url=cluster.http_url + "/v1", api_key=cluster.client_key, max_retries=0
        )
        self.model = model
        self.tokens = tokens
        self.sampling = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0)

    def call(self, door: str) -> Callable[[bytes, int], Awaitable[tuple[float, float]]]:
        return {"grpc": self._grpc, "http": self._http, "http-stream": self._stream}[door]

    async def _grpc(self, image: bytes, k: int) -> tuple[float, float]:
        result = await self.grpc.generate_text(messages(image, k), self.sampling)
        return result.ttft_s, result.total_s

    async def _http(self, image: bytes, k: int) -> tuple[float, float]:
        start = time.perf_counter()
        await self.http.chat.completions.create(**self._body(image, k))
        total = time.perf_counter() - start
        return total, total

    async def _stream(self, image: bytes, k: int) -> tuple[float, float]:
        start = time.perf_counter()
        first = None
        async for _ in await self.http.chat.completions.create(stream=True, **self._body(image, k)):
            if first is None:
                first = time.perf_counter() - start
        total = time.perf_counter() - start
        return first if first is not None else total, total

    def _body(self, image: bytes, k: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": http_messages(image, k),
            "max_tokens": self.tokens,
            "extra_body": {"ignore_eos": True},
        }

    async def close(self) -> None:
        await self.grpc.close()
        await self.http.close()


async def run(args: argparse.Namespace) -> None:
    model = default_checkpoint("small")
    threads = ("--threads", "1")
    seeds = itertools.count(2_000_000)
    with tempfile.TemporaryDirectory(prefix="epd-http-") as logs:
        cluster = await asyncio.to_thread(
            functools.partial(
                start_cluster,
                encoder_args=threads,
                prefill_args=threads,
                decode_args=threads,
                http=True,
            ),
            model,
            Path(logs),
            block_size=16,
            num_blocks=4096,
            timeout_s=600,
        )
        doors = Doors(cluster, model.name, args.tokens)
        try:
            print(f"checkpoint {model}; {args.tokens} tokens a request at temperature 1")
            await sequential(doors, args, seeds)
            await throughput(doors, cluster, args, seeds)
        finally:
            await doors.close()
            await asyncio.to_thread(cluster.stop)


async def sequential(doors: Doors, args: argparse.Namespace, seeds: Any) -> None:
    image = png(next(seeds), 224)
    got: dict[str, list[tuple[float, float]]] = {door: [] for door in DOORS}
    for k in range(args.sequential + 2):  # the first two warm up
        for door in DOORS:
            took = await doors.call(door)(image, k)
            if k >= 2:
                got[door].append(took)
    print(f"\none request at a time, {args.sequential} each, p50 ms (TTFT / whole request):")
    for door in DOORS:
        ttft = statistics.median(t for t, _ in got[door]) * 1e3
        total = statistics.median(t for _, t in got[door]) * 1e3
        shown = f"{'-':>7s}" if door == "http" else f"{ttft:7.1f}"
        print(f"  {door:12s} {shown} / {total:7.1f}")


async def throughput(doors: Doors, cluster: Cluster, args: argparse.Namespace, seeds: Any) -> None:
    rows: dict[str, list[tuple[float, float, float, float]]] = {door: [] for door in DOORS}
    for r in range(args.rounds + 1):  # round 0 warms up
        for door in DOORS if r % 2 else tuple(reversed(DOORS)):
            images = [png(next(seeds), 224) for _ in range(max(1, args.requests // 4))]
            gate = asyncio.Semaphore(args.concurrency)
            call = doors.call(door)

            async def one(k: int, call: Any = call, gate: Any = gate, images: Any = images) -> None:
                async with gate:
                    await call(images[k % len(images)], k)

            before = process_cpu_seconds(cluster.procs)
            mine = time.process_time()
            start = time.perf_counter()
            await asyncio.gather(*(one(k) for k in range(args.requests)))
            wall = time.perf_counter() - start
            mine = time.process_time() - mine
            after = process_cpu_seconds(cluster.procs)
            if r:
                n = args.requests
                router = (after["router"] - before["router"]) / n
                rest = sum(after[p] - before[p] for p in after if p != "router") / n
                rows[door].append((n / wall, router, rest, mine / n))
    print(
        f"\n{args.requests} requests at {args.concurrency} in flight, medians of "
        f"{args.rounds} rounds (CPU ms per request):"
    )
    print(
        f"  {'door':12s} {'req/s':>7s} {'/ grpc':>7s} {'router':>7s} {'workers':>8s} {'client':>7s}"
    )
    base = statistics.median(row[0] for row in rows["grpc"])
    for door in DOORS:
        rps, router, rest, client = (
            statistics.median(row[i] for row in rows[door]) for i in range(4)
        )
        print(
            f"  {door:12s} {rps:7.2f} {rps / base:6.2f}x {router * 1e3:7.1f} {rest * 1e3:8.1f} "
            f"{client * 1e3:7.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=48, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--sequential", type=int, default=20, help="one-at-a-time requests")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
