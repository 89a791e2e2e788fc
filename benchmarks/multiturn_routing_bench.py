"""Multi-turn image chat over 2 prefill + 2 decode workers: cache-aware routing (prefill and
decode by cached prefix among the least loaded) vs least-loaded routing, in one run.

Two deployments (`tests/cluster.py`, router + 1 encoder + 2 prefill + 2 decode each) differ
only in `--cache-aware-routing`. The same workload runs on each, alternating round by round
so background load hits both alike: `--conversations` chats at once, each `--turns` turns;
the first turn carries an image and a long question, each later turn repeats the history
(with the previous answer) and asks a short new question. Every round uses fresh images.

Prints, per side, requests/s (all turns of a round / its wall time) and TTFT p50, the
ratios, and the mean share of prompt tokens prefill reused and of blocks decode reused.
Goal: cache-aware >= 1.5x the requests/s of least-loaded.

    .venv/bin/python benchmarks/multiturn_routing_bench.py [--size bench|tiny] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

# `tests.cluster` (the deployment helper) lives beside the test suite, not in a package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.models.tiny import default_checkpoint
from common.sampling import SamplingParams
from epd.client import Client, Result
from tests.cluster import Cluster, start_cluster

BLOCK = 16
QUESTION = "Describe the picture carefully: every object, its colour and where it is. " * 6


def first_turn(seed: int, size: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    picture = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    content = [{"type": "image", "image": picture}, {"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": content}]


async def conversation(
    client: Client, seed: int, turns: int, size: int, sampling: SamplingParams
) -> list[Result]:
    messages = first_turn(seed, size)
    results = []
    for k in range(turns):
        result = await client.generate_text(messages, sampling, timeout_s=600)
        results.append(result)
        messages = [
            *messages,
            {"role": "assistant", "content": result.text},
            {"role": "user", "content": f"Turn {k + 1}: and what is left of that?"},
        ]
    return results


async def one_round(
    cluster: Cluster, seeds: range, args: argparse.Namespace, size: int
) -> tuple[float, list[Result]]:
    sampling = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        start = time.perf_counter()
        chats = [conversation(client, s, args.turns, size, sampling) for s in seeds]
        done = await asyncio.gather(*chats)
        wall = time.perf_counter() - start
    return wall, [r for chat in done for r in chat]


async def run(args: argparse.Namespace) -> None:
    model = default_checkpoint(args.size)
    size = 448 if args.size == "bench" else 64
    print(f"checkpoint {model} ({args.size}); starting two deployments (2P + 2D each) ...")
    sides = {"cache-aware": "true", "least-loaded": "false"}
    stats: dict[str, dict[str, list[float]]] = {
        name: {"rps": [], "ttft": [], "cached": [], "reused": []} for name in sides
    }
    with tempfile.TemporaryDirectory(prefix="epd-bench-") as logs:
        clusters: dict[str, Cluster] = {}
        try:
            for name, flag in sides.items():
                clusters[name] = await asyncio.to_thread(
                    start_cluster,
                    model,
                    Path(logs) / name,
                    block_size=BLOCK,
                    num_blocks=4096,
                    heartbeat_interval_s=2.0,  # 40 s worker timeout: a loaded machine keeps them
                    prefills=2,
                    decodes=2,
                    router_args=("--cache-aware-routing", flag),
                    timeout_s=900,
                )
            n = args.conversations
            for name in sides:  # warm-up: first NIXL connections, first forwards
                await one_round(clusters[name], range(90_000, 90_000 + n), args, size)
            for r in range(args.rounds):
                seeds = range(1000 * (r + 1), 1000 * (r + 1) + n)
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                for name in order:
                    wall, results = await one_round(clusters[name], seeds, args, size)
                    s = stats[name]
                    s["rps"].append(len(results) / wall)
                    s["ttft"].extend(res.ttft_s for res in results)
                    later = [res for i, res in enumerate(results) if i % args.turns]
                    s["cached"].extend(res.cached_tokens / res.prompt_tokens for res in later)
                    s["reused"].extend(
                        res.blocks_reused / max(1, res.blocks_reused + res.blocks_pulled)
                        for res in later
                    )
        finally:
            for cluster in clusters.values():
                await asyncio.to_thread(cluster.stop)
    med = statistics.median
    mean = statistics.fmean
    print(
        f"\n{args.rounds} rounds x {args.conversations} concurrent chats x {args.turns} turns "
        f"({size}px image, {args.tokens} tokens per answer):"
    )
    for name, s in stats.items():
        print(
            f"  {name:12s} req/s {med(s['rps']):6.2f}   TTFT p50 {med(s['ttft']) * 1000:8.1f} ms   "
            f"later turns: prefill reused {mean(s['cached']):5.1%} of tokens, decode reused "
            f"{mean(s['reused']):5.1%} of blocks"
        )
    aware, plain = stats["cache-aware"], stats["least-loaded"]
    ratio = med(aware["rps"]) / med(plain["rps"])
    print(
        f"  cache-aware / least-loaded: req/s {ratio:.2f}x   TTFT p50 "
        f"{med(aware['ttft']) / med(plain['ttft']):.2f}x   goal req/s >= 1.5x: "
        f"{'met' if ratio >= 1.5 else 'NOT met'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("bench", "tiny"), default="bench")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=4, help="chats at once")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8, help="tokens per answer")
    args = parser.parse_args()
    torch.set_num_threads(1)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
