"""Packed prefill in the prefill worker (`[prefill] pack_tokens`): settings compared in one run.

One local deployment per `--pack-tokens` value (`tests/cluster.py`: router, encoder, prefill,
decode; every worker `--threads` torch threads), the same code. Rounds alternate the order
of the deployments, and only the one being measured runs (the others are stopped), as in
`served.py`. Per round and deployment, two workloads, each on prompts no earlier run sent:

- burst: `--bursts` times, `--burst` distinct text prompts (~`--words` words, after
  `--shared` words every prompt begins with, as a system prompt) sent at once, 4 new tokens
  each: the prefill worker finds many prompts queued;
- steady: `--served` requests at `--concurrency` in flight, each a distinct 224x224 image and
  ~30 words, `--tokens` new tokens (the served benchmark's distinct-image workload).

Prints medians over rounds: requests/s, TTFT p50, and the CPU the prefill worker spent per
request (user + system, every thread), with the ratio to the first setting.

    .venv/bin/python benchmarks/prefill_pack_bench.py [--pack-tokens 0,512] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# `tests.cluster` (the deployment helper) lives beside the test suite, not in a package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from served import _signal, messages, one_run, png
from timing import process_cpu_seconds

from common.models.tiny import default_checkpoint
from common.sampling import SamplingParams
from epd.client import Client
from tests.cluster import Cluster, start_cluster

Row = tuple[float, float, float]  # req/s, TTFT p50 s, prefill CPU s per request


def text_prompt(k: int, words: int, shared: int = 0) -> list[dict[str, Any]]:
    """~`words` words of its own after `shared` words every prompt begins with."""
    head = " ".join(f"rule{i % 89}" for i in range(shared))
    text = f"{head} Question {k}: " + " ".join(f"word{(k * 7 + i) % 97}" for i in range(words))
    return [{"role": "user", "content": [{"type": "text", "text": text}]}]


async def burst(client: Client, cluster: Cluster, args: argparse.Namespace, seeds: Any) -> Row:
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    before = process_cpu_seconds(cluster.procs)["prefill"]
    ttfts: list[float] = []
    start = time.perf_counter()
    for _ in range(args.bursts):
        prompts = [text_prompt(next(seeds), args.words, args.shared) for _ in range(args.burst)]
        results = await asyncio.gather(*(client.generate_text(p, sampling) for p in prompts))
        ttfts.extend(r.ttft_s for r in results)
    wall = time.perf_counter() - start
    n = args.bursts * args.burst
    cpu = process_cpu_seconds(cluster.procs)["prefill"] - before
    return n / wall, statistics.median(ttfts), cpu / n


async def steady(client: Client, cluster: Cluster, args: argparse.Namespace, seeds: Any) -> Row:
    sampling = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    prompts = [messages(png(next(seeds), 224), k) for k in range(args.served)]
    before = process_cpu_seconds(cluster.procs)["prefill"]
    run = await one_run(client, prompts, sampling, args.concurrency)
    cpu = process_cpu_seconds(cluster.procs)["prefill"] - before
    return run.rps, run.ttft_s, cpu / args.served


async def main(args: argparse.Namespace) -> None:
    settings = [int(v) for v in args.pack_tokens.split(",")]
    model = default_checkpoint(args.size)
    threads = ("--threads", str(args.threads))
    seeds = itertools.count(2_000_000)
    results: dict[tuple[int, str], list[Row]] = {}
    with tempfile.TemporaryDirectory(prefix="epd-pack-") as logs:
        clusters: dict[int, Cluster] = {}
        try:
            for value in settings:
                clusters[value] = await asyncio.to_thread(
                    functools.partial(
                        start_cluster,
                        encoder_args=threads,
                        prefill_args=(*threads, "--pack-tokens", str(value)),
                        decode_args=threads,
                    ),
                    model,
                    Path(logs) / f"pack{value}",
                    block_size=16,
                    num_blocks=4096,
                    timeout_s=600,
                )
                _signal(clusters[value], signal.SIGSTOP)
            clients = {v: Client(c.address, api_key=c.client_key) for v, c in clusters.items()}
            for r in range(args.rounds + 1):  # round 0 warms up
                for value in settings if r % 2 == 0 else list(reversed(settings)):
                    cluster, client = clusters[value], clients[value]
                    _signal(cluster, signal.SIGCONT)
                    await asyncio.sleep(2.0)
                    for name, workload in (("burst", burst), ("steady", steady)):
                        row = await workload(client, cluster, args, seeds)
                        if r:
                            results.setdefault((value, name), []).append(row)
                    _signal(cluster, signal.SIGSTOP)
            for client in clients.values():
                await client.close()
        finally:
            for cluster in clusters.values():
                _signal(cluster, signal.SIGCONT)
                await asyncio.to_thread(cluster.stop)
    print(
        f"checkpoint {model}; {args.rounds} rounds; burst: {args.bursts} x {args.burst} text "
        f"prompts; steady: {args.served} image requests at concurrency {args.concurrency}"
    )
    head = f"  {'pack_tokens':>11s} {'workload':8s} {'req/s':>7s} {'TTFT p50':>9s}"
    print(head + f" {'prefill CPU':>12s}")
    first = settings[0]
    for name in ("burst", "steady"):
        base = statistics.median(row[2] for row in results[(first, name)])
        for value in settings:
            rows = results[(value, name)]
            rps, ttft, cpu = (statistics.median(row[i] for row in rows) for i in range(3))
            print(
                f"  {value:11d} {name:8s} {rps:7.2f} {ttft * 1e3:6.0f} ms {cpu * 1e3:6.2f} ms/req"
                f"  ({base / cpu:.2f}x less CPU than {first})"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack-tokens", default="0,512", help="settings to compare, by commas")
    parser.add_argument("--size", choices=("bench", "small", "tiny"), default="small")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--burst", type=int, default=32, help="prompts sent at once")
    parser.add_argument("--bursts", type=int, default=3, help="bursts per round")
    parser.add_argument("--words", type=int, default=12, help="words per burst prompt")
    parser.add_argument(
        "--shared", type=int, default=0, help="words every burst prompt begins with"
    )
    parser.add_argument("--served", type=int, default=48, help="steady requests per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens, steady requests")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    asyncio.run(main(parser.parse_args()))
