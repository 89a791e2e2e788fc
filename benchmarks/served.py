"""Served throughput, distinct vs repeated images, this checkout vs a baseline checkout.

One local deployment per checkout (`tests/cluster.py`, `root=` the checkout), both up for
the whole run. Each round runs, per deployment, `n` requests at `concurrency` in flight
with distinct images and `n` with `n / 4` images used 4 times each (image `k % (n / 4)`
for request k, so the first use of each misses every cache and the later ones may hit);
rounds alternate the order of deployments so background load hits them alike. Every run
uses images no earlier run sent. Images are PNG-encoded before the clock starts (the
client does no image work while timed). Reports medians over rounds of req/s and TTFT p50,
and the ratios repeated/distinct and this/baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from common.models.tiny import default_checkpoint
from common.sampling import SamplingParams
from epd.client import Client
from tests.cluster import ROOT, Cluster, start_cluster

_TEXT = (
    "please describe this picture carefully and tell me which objects colours shapes and "
    "textures you can see in it and where each of them is placed relative to the others"
)
_WORDS = _TEXT.split(" ")


def png(seed: int, size: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def messages(image: bytes, k: int) -> list[dict[str, Any]]:
    words = " ".join(_WORDS[(k + i) % len(_WORDS)] for i in range(30))
    return [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image},
                {"type": "text", "text": f"Request {k}: {words}?"},
            ],
        }
    ]


async def one_run(
    client: Client, prompts: list[list[dict[str, Any]]], sampling: SamplingParams, inflight: int
) -> tuple[float, float]:
    """(req/s, TTFT p50 seconds) of `prompts` at `inflight` concurrent requests."""
    gate = asyncio.Semaphore(inflight)
    ttfts: list[float] = []

    async def send(prompt: list[dict[str, Any]]) -> None:
        async with gate:
            result = await client.generate_text(prompt, sampling)
            ttfts.append(result.ttft_s)

    start = time.perf_counter()
    await asyncio.gather(*(send(p) for p in prompts))
    return len(prompts) / (time.perf_counter() - start), statistics.median(ttfts)


async def run_served(args: argparse.Namespace) -> None:
    n, size = args.served, args.image_size
    model = args.model or default_checkpoint(args.size)
    sampling = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    roots = {"this": ROOT}
    if args.baseline is not None:
        roots["baseline"] = args.baseline.resolve()
    seeds = itertools.count(1_000_000)
    print(f"checkpoint {model}; {n} requests x {size}px, {args.tokens} tokens,")
    print(f"concurrency {args.concurrency}; deployments: {roots}")
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="epd-served-") as logs:
        clusters: dict[str, Cluster] = {}
        try:
            for name, root in roots.items():
                clusters[name] = await asyncio.to_thread(
                    start_cluster,
                    model,
                    Path(logs) / name,
                    block_size=16,
                    num_blocks=4096,
                    timeout_s=600,
                    root=root,
                )
            clients = {
                name: Client(c.address, api_key=c.client_key) for name, c in clusters.items()
            }
            for client in clients.values():  # warm-up: connections, first forwards
                warm = [messages(png(next(seeds), size), k) for k in range(args.concurrency)]
                await one_run(client, warm, sampling, args.concurrency)
            for r in range(args.rounds):
                order = list(clients) if r % 2 == 0 else list(reversed(clients))
                for name in order:
                    for kind in ("distinct", "repeated"):
                        distinct = n if kind == "distinct" else max(1, n // 4)
                        images = [png(next(seeds), size) for _ in range(distinct)]
                        prompts = [messages(images[k % distinct], k) for k in range(n)]
                        got = await one_run(clients[name], prompts, sampling, args.concurrency)
                        results.setdefault((name, kind), []).append(got)
                        print(f"  round {r} {name:8s} {kind:8s} {got[0]:6.2f} req/s", flush=True)
            for client in clients.values():
                await client.close()
        finally:
            for cluster in clusters.values():
                await asyncio.to_thread(cluster.stop)
    report(results, list(roots))


def report(results: dict[tuple[str, str], list[tuple[float, float]]], names: list[str]) -> None:
    def rps(name: str, kind: str) -> float:
        return statistics.median(r for r, _ in results[(name, kind)])

    def ttft(name: str, kind: str) -> float:
        return statistics.median(t for _, t in results[(name, kind)])

    print("\nmedians over rounds:")
    print(f"  {'code':10s} {'images':9s} {'req/s':>7s} {'TTFT p50':>10s}")
    for name in names:
        for kind in ("distinct", "repeated"):
            print(f"  {name:10s} {kind:9s} {rps(name, kind):7.2f} {ttft(name, kind) * 1e3:8.1f} ms")
    for name in names:
        ratio = rps(name, "repeated") / rps(name, "distinct")
        print(f"  {name}: repeated / distinct req/s {ratio:.2f}x")
    if "baseline" in names:
        for kind in ("distinct", "repeated"):
            ratio = rps("this", kind) / rps("baseline", kind)
            print(f"  this / baseline, {kind} req/s {ratio:.2f}x")
