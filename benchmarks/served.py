"""Served throughput, distinct vs repeated images, this checkout vs a baseline checkout.

One local deployment per checkout (`tests/cluster.py`, `root=` the checkout), both started
at the outset. Each round runs, per deployment, `n` requests at `concurrency` in flight
with distinct images and `n` with `n / 4` images used 4 times each (image `k % (n / 4)`
for request k, so the first use of each misses every cache and the later ones may hit);
rounds alternate the order of deployments so background load hits them alike. Only the
deployment being measured runs: the others' processes are stopped (SIGSTOP) meanwhile, so
what one burns while idle (e.g. an older checkout's spinning transfer threads) is charged to
it alone, not to the one being measured; a resumed deployment gets a few seconds and an
untimed warm-up run before its timed ones; the first time, what it burns while idle is
printed. Every run uses images no earlier run sent.
Images are PNG-encoded before the clock starts (the client does no image work while
timed). Every worker of both deployments gets `--threads` torch threads (the issue's rule:
one thread per worker). `--stream-interval N` gives this checkout's decode workers that
setting (tokens per streamed chunk; the baseline streams as its code does). `--load N` runs
N busy-loop processes for the whole measurement (a machine busy with other work). `--temperature T`
samples every request at temperature T (0, the default: greedy). Reports medians
over rounds of req/s and TTFT p50, the CPU each process of the deployment spent per request
(user + system, every thread) and the benchmark's own client (this process, sharing the
machine), and the ratios repeated/distinct and this/baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import io
import itertools
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from timing import busy_loops, process_cpu_seconds

from common.models.tiny import default_checkpoint
from common.sampling import SamplingParams
from epd.client import Client, Result
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


@dataclass(frozen=True, slots=True)
class Run:
    """One run's throughput and where a request's time went (medians over requests)."""

    rps: float  # requests per second
    ttft_s: float  # send -> first token (processing, encode, prefill)
    pull_s: float  # first token -> first decode chunk (KV pull, admission)
    decode_s: float  # first decode chunk -> end of stream
    cpu_s: dict[str, float] = field(default_factory=dict)  # per request, by process
    client_cpu_s: float = 0.0  # per request, the benchmark's client (not the deployment's)


async def one_run(
    client: Client, prompts: list[list[dict[str, Any]]], sampling: SamplingParams, inflight: int
) -> Run:
    """`prompts` at `inflight` concurrent requests."""
    gate = asyncio.Semaphore(inflight)
    results: list[Result] = []

    async def send(prompt: list[dict[str, Any]]) -> None:
        async with gate:
            results.append(await client.generate_text(prompt, sampling))

    start = time.perf_counter()
    await asyncio.gather(*(send(p) for p in prompts))
    elapsed = time.perf_counter() - start
    times = [r.token_times_s for r in results if len(r.token_times_s) > 1]
    return Run(
        len(prompts) / elapsed,
        statistics.median(r.ttft_s for r in results),
        statistics.median(t[1] - t[0] for t in times) if times else float("nan"),
        statistics.median(r.total_s - t[1] for r, t in zip(results, times, strict=False))
        if times
        else float("nan"),
    )


async def run_served(args: argparse.Namespace) -> None:
    n, size = args.served, args.image_size
    model = args.model or default_checkpoint(args.size)
    sampling = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=args.temperature)
    roots = {"this": ROOT}
    if args.baseline is not None:
        roots["baseline"] = args.baseline.resolve()
    seeds = itertools.count(1_000_000)
    print(f"checkpoint {model}; {n} requests x {size}px, {args.tokens} tokens,")
    print(
        f"concurrency {args.concurrency}, {args.threads or 'all'} torch thread(s) a worker, "
        f"temperature {args.temperature};"
    )
    print(f"deployments: {roots}; this checkout's stream_interval {args.stream_interval}")
    print(f"{args.load} busy-loop process(es) meanwhile, load average {os.getloadavg()[0]:.1f}")
    results: dict[tuple[str, str], list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="epd-served-") as logs:
        clusters: dict[str, Cluster] = {}
        stack = contextlib.ExitStack()
        try:
            for name, root in roots.items():
                # `--threads`: every worker of both checkouts takes that many torch threads
                # (0: each its default, every core: four workers on a small machine then run
                # more busy threads than it has cores, and each step waits on the others).
                # A checkout older than the `threads` setting gets the count through the
                # environment its workers' torch reads at start.
                flag = (root / "common" / "server" / "threads.py").exists()
                threads = ("--threads", str(args.threads)) if args.threads and flag else ()
                env = {} if flag or not args.threads else _thread_env(args.threads)
                interval = ("--stream-interval", str(args.stream_interval))
                decode = threads + interval if name == "this" else threads
                with _environ(env):
                    clusters[name] = await asyncio.to_thread(
                        functools.partial(
                            start_cluster,
                            encoder_args=threads,
                            prefill_args=threads,
                            decode_args=decode,
                        ),
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
            for cluster in clusters.values():
                _signal(cluster, signal.SIGSTOP)
            stack.enter_context(busy_loops(args.load))
            for r in range(args.rounds):
                order = list(clients) if r % 2 == 0 else list(reversed(clients))
                for name in order:
                    _signal(clusters[name], signal.SIGCONT)
                    await asyncio.sleep(3.0)  # heartbeats again (or registrations)
                    # warm-up: connections, first forwards
                    warm = [messages(png(next(seeds), size), k) for k in range(args.concurrency)]
                    await one_run(clients[name], warm, sampling, args.concurrency)
                    if r == 0:
                        await _idle_burn(name, clusters[name])
                    for kind in ("distinct", "repeated"):
                        distinct = n if kind == "distinct" else max(1, n // 4)
                        images = [png(next(seeds), size) for _ in range(distinct)]
                        prompts = [messages(images[k % distinct], k) for k in range(n)]
                        before = process_cpu_seconds(clusters[name].procs)
                        mine = time.process_time()  # the client: this process
                        got = await one_run(clients[name], prompts, sampling, args.concurrency)
                        mine = time.process_time() - mine
                        after = process_cpu_seconds(clusters[name].procs)
                        cpu_s = {k: (after[k] - before[k]) / n for k in after}
                        got = replace(got, cpu_s=cpu_s, client_cpu_s=mine / n)
                        results.setdefault((name, kind), []).append(got)
                        print(f"  round {r} {name:8s} {kind:8s} {got.rps:6.2f} req/s", flush=True)
                    _signal(clusters[name], signal.SIGSTOP)
            for client in clients.values():
                await client.close()
        finally:
            stack.close()
            for cluster in clusters.values():
                _signal(cluster, signal.SIGCONT)
                await asyncio.to_thread(cluster.stop)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    report(results, list(roots))


def report(results: dict[tuple[str, str], list[Run]], names: list[str]) -> None:
    def med(name: str, kind: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in results[(name, kind)])

    print("\nmedians over rounds (per request: TTFT, first token -> first decode chunk, rest):")
    print(f"  {'code':10s} {'images':9s} {'req/s':>7s} {'TTFT':>9s} {'pull':>9s} {'decode':>9s}")
    for name in names:
        for kind in ("distinct", "repeated"):
            ms = [med(name, kind, f) * 1e3 for f in ("ttft_s", "pull_s", "decode_s")]
            print(
                f"  {name:10s} {kind:9s} {med(name, kind, 'rps'):7.2f} "
                + " ".join(f"{v:6.0f} ms" for v in ms)
            )
    print("  CPU ms per request, by process (medians over rounds):")
    for name in names:
        for kind in ("distinct", "repeated"):
            runs = results[(name, kind)]
            each = {k: statistics.median(r.cpu_s[k] for r in runs) * 1e3 for k in runs[0].cpu_s}
            parts = "  ".join(f"{k} {v:5.1f}" for k, v in each.items())
            client = statistics.median(r.client_cpu_s for r in runs) * 1e3
            print(
                f"  {name:10s} {kind:9s} {sum(each.values()):6.1f}   ({parts})   "
                f"+ the client {client:5.1f}"
            )
    for name in names:
        ratio = med(name, "repeated", "rps") / med(name, "distinct", "rps")
        print(f"  {name}: repeated / distinct req/s {ratio:.2f}x")
    if "baseline" in names:
        for kind in ("distinct", "repeated"):
            ratio = med("this", kind, "rps") / med("baseline", kind, "rps")
            print(f"  this / baseline, {kind} req/s {ratio:.2f}x")


async def _idle_burn(name: str, cluster: Cluster, seconds: float = 3.0) -> None:
    """Print the CPU the deployment uses per second while it serves nothing (the others
    are stopped meanwhile)."""
    before = process_cpu_seconds(cluster.procs)
    await asyncio.sleep(seconds)
    after = process_cpu_seconds(cluster.procs)
    used = {k: (after[k] - before[k]) / seconds for k in after}
    each = ", ".join(f"{k} {v:.2f}" for k, v in used.items())
    print(f"  {name}: {sum(used.values()):.2f} CPU s/s when idle ({each})", flush=True)


def _signal(cluster: Cluster, sig: signal.Signals) -> None:
    """Send `sig` to every running process of the deployment."""
    for proc in cluster.procs.values():
        if proc.poll() is None:
            proc.send_signal(sig)


def _thread_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """`os.environ` with `values` set while the block runs (child processes inherit it)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
