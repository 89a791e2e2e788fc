"""TTFT of a long-video request with encoding overlapped with prefill on vs off, in one run.

Two deployments (`tests/cluster.py`: router + encoder + prefill + decode) differ only in
`--overlap-prefill` (`router.overlap`: while the video is encoded, the prefill worker
computes the text before it). Each request is a long document followed by a long video,
both fresh (nothing cached); requests alternate between the two deployments so background
load hits both alike. Prints median TTFT of each and the ratio. Goal: on <= 0.75x off.

What overlaps is the text before the first item: a prompt that opens with its video gains
nothing (the encoder's output is still needed whole before the rest of the prefill).

    .venv/bin/python benchmarks/overlap_bench.py [--size bench|tiny] [--requests 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

# `tests.cluster` (the deployment helper) lives beside the test suite, not in a package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.models.tiny import default_checkpoint
from common.sampling import SamplingParams
from epd.client import Client
from tests.cluster import Cluster, start_cluster

BLOCK = 16


def request(seed: int, frames: int, size: int, words: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    clip = rng.integers(0, 256, (frames, size, size, 3), dtype=np.uint8)
    document = " ".join(f"word{int(w)}" for w in rng.integers(0, 10_000, words))
    content = [
        {"type": "text", "text": f"Read this report first: {document}"},
        {"type": "video", "video": clip, "fps": 2.0},
        {"type": "text", "text": "Does the video match the report?"},
    ]
    return [{"role": "user", "content": content}]


async def ttft(cluster: Cluster, messages: Any) -> tuple[float, int]:
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        result = await client.generate_text(messages, sampling, timeout_s=900)
    return result.ttft_s, result.prompt_tokens


async def run(args: argparse.Namespace) -> None:
    model = default_checkpoint(args.size)
    size = 224 if args.size == "bench" else 64
    sides = {"on": "true", "off": "false"}
    times: dict[str, list[float]] = {name: [] for name in sides}
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
                    router_args=("--overlap-prefill", flag),
                    timeout_s=900,
                )
            for name in sides:  # warm-up
                await ttft(clusters[name], request(99_000, args.frames, size, args.words))
            prompt_tokens = 0
            for i in range(args.requests):
                order = list(sides) if i % 2 == 0 else list(reversed(sides))
                for k, name in enumerate(order):
                    seconds, prompt_tokens = await ttft(
                        clusters[name], request(2 * i + k, args.frames, size, args.words)
                    )
                    times[name].append(seconds)
        finally:
            for cluster in clusters.values():
                await asyncio.to_thread(cluster.stop)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(
        f"\n{args.requests} requests per side: ~{args.words}-word text + {args.frames} frames of "
        f"{size}px ({prompt_tokens} prompt tokens), median TTFT:"
    )
    print(f"  overlap on {on * 1000:8.1f} ms   off {off * 1000:8.1f} ms   on/off {on / off:.2f}x")
    print(f"  goal on/off <= 0.75x: {'met' if on / off <= 0.75 else 'NOT met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("bench", "tiny"), default="bench")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--words", type=int, default=600, help="words of text before the video")
    args = parser.parse_args()
    torch.set_num_threads(1)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
