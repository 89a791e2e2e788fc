"""Disaggregated E/P/D serving vs the offline `Engine`, measured in one run.

Starts a local deployment (router + encoder + prefill + decode as processes, NIXL over UCX
between them; `tests/cluster.py`) and an in-process `Engine` on the same checkpoint, then:

1. TTFT and inter-token latency (ITL), E/P/D vs Engine: `--requests` image + text prompts,
   each with a fresh image (no cache hits on either side), run one at a time and
   alternating between the two so background load hits both alike. Engine TTFT = process +
   encode + prefill; Engine ITL = one `decode_step`. E/P/D TTFT = client send -> first token;
   E/P/D ITL = the time between token chunks after the first decode chunk (that one waits
   for the KV pull, reported separately as "pull + admit").
2. Warm vs cold TTFT for the same video with a new question (E/P/D): per video, a cold
   request (encoder and prefix caches miss) and then the same video with another question
   (encoder cache hit, prefill reuses the video's blocks).
3. Served throughput (`--served`, see `served.py`): req/s and TTFT p50 of `--served`
   requests at concurrency 8, each one image + ~30 words, with distinct images and with
   images repeated 4 times, interleaved, on this checkout and (`--baseline DIR`, a
   `git worktree` of the landed commit) on another one's code, in the same run.

Prints medians and ratios.

    .venv/bin/python benchmarks/epd_bench.py [--size bench|tiny] [--requests 6] [--tokens 24]
    .venv/bin/python benchmarks/epd_bench.py --served 48 --baseline /tmp/landed [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

# `tests.cluster` (the deployment helper) lives beside the test suite, not in a package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.engine import Engine
from common.models.tiny import default_checkpoint
from common.sampling import SamplingParams
from epd.client import Client, Result
from tests.cluster import start_cluster


def image_prompt(seed: int, size: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    picture = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    question = f"Request {seed}: describe the image in detail and list every object you see."
    return [
        {
            "role": "user",
            "content": [{"type": "image", "image": picture}, {"type": "text", "text": question}],
        }
    ]


def video_prompt(seed: int, frames: int, size: int, question: str) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1000 + seed)
    clip = rng.integers(0, 256, (frames, size, size, 3), dtype=np.uint8)
    return [
        {
            "role": "user",
            "content": [
                {"type": "video", "video": clip, "fps": 2.0},
                {"type": "text", "text": question},
            ],
        }
    ]


def engine_request(
    engine: Engine, messages: Any, sampling: SamplingParams
) -> tuple[float, list[float]]:
    """(TTFT seconds, seconds of each decode step) of one request alone in the engine."""
    start = time.perf_counter()
    prompt = engine.process(messages)
    seq = engine.prefill(prompt.prompt_token_ids, engine.encode(prompt), sampling)
    ttft = time.perf_counter() - start
    steps = []
    while seq.finish_reason is None:
        t = time.perf_counter()
        engine.decode_step([seq])
        steps.append(time.perf_counter() - t)
    engine.release(seq)
    return ttft, steps


def itl(result: Result) -> list[float]:
    """Intervals between token arrivals after the first decode chunk (which waits for the
    KV pull)."""
    times = result.token_times_s[1:]
    return [b - a for a, b in itertools.pairwise(times)]


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def run(args: argparse.Namespace) -> None:
    model = default_checkpoint(args.size)
    image_size = 448 if args.size == "bench" else 64
    video_size = 224 if args.size == "bench" else 64
    sampling = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    print(f"checkpoint {model} ({args.size}); starting the deployment and the engine ...")
    engine = await asyncio.to_thread(Engine.from_pretrained, model, block_size=16)
    with tempfile.TemporaryDirectory(prefix="epd-bench-") as logs:
        cluster = await asyncio.to_thread(
            start_cluster, model, Path(logs), block_size=16, num_blocks=2048, timeout_s=600
        )
        try:
            async with Client(cluster.address, api_key=cluster.client_key) as client:
                # Warm-up: first NIXL connections, first forwards.
                await client.generate_text(image_prompt(10_000, image_size), sampling)
                engine_request(engine, image_prompt(10_001, image_size), sampling)
                e_ttft: list[float] = []
                e_itl: list[float] = []
                d_ttft: list[float] = []
                d_itl: list[float] = []
                d_pull: list[float] = []
                for i in range(args.requests):
                    ttft, steps = engine_request(engine, image_prompt(2 * i, image_size), sampling)
                    e_ttft.append(ttft)
                    e_itl.extend(steps)
                    r = await client.generate_text(image_prompt(2 * i + 1, image_size), sampling)
                    d_ttft.append(r.ttft_s)
                    d_itl.extend(itl(r))
                    d_pull.append(r.token_times_s[1] - r.token_times_s[0])
                cold: list[float] = []
                warm: list[float] = []
                cached: list[int] = []
                for v in range(args.videos):
                    a = video_prompt(v, args.frames, video_size, "What happens in this video?")
                    b = video_prompt(v, args.frames, video_size, "Which color appears most?")
                    cold.append((await client.generate_text(a, sampling)).ttft_s)
                    warm_result = await client.generate_text(b, sampling)
                    warm.append(warm_result.ttft_s)
                    cached.append(warm_result.cached_tokens)
                prompt_len = warm_result.prompt_tokens
        finally:
            await asyncio.to_thread(cluster.stop)
    ms = 1000.0
    print(f"\n{args.requests} image requests ({image_size}px, {args.tokens} tokens), medians:")
    print(
        f"  TTFT   engine {med(e_ttft) * ms:8.1f} ms   E/P/D {med(d_ttft) * ms:8.1f} ms   "
        f"ratio {med(d_ttft) / med(e_ttft):5.2f}x"
    )
    print(
        f"  ITL    engine {med(e_itl) * ms:8.1f} ms   E/P/D {med(d_itl) * ms:8.1f} ms   "
        f"ratio {med(d_itl) / med(e_itl):5.2f}x"
    )
    print(f"  E/P/D first token -> first decode chunk (KV pull + admit): {med(d_pull) * ms:.1f} ms")
    print(
        f"\n{args.videos} videos ({args.frames} frames {video_size}px, {prompt_len} prompt "
        f"tokens), same video + new question, medians:"
    )
    print(
        f"  TTFT   cold {med(cold) * ms:8.1f} ms   warm {med(warm) * ms:8.1f} ms   "
        f"warm/cold {med(warm) / med(cold):5.2f}x   (warm prefill reused "
        f"{int(med([float(c) for c in cached]))} tokens)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("bench", "small", "tiny"), default="bench")
    parser.add_argument(
        "--served", type=int, default=0, help="served throughput only: requests per run"
    )
    parser.add_argument("--baseline", type=Path, help="checkout to compare (--served)")
    parser.add_argument("--model", type=Path, help="checkpoint folder (--served; default --size)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (--served)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per worker, both checkouts (--served; 0: every core each)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="this checkout's decode stream_interval (tokens per streamed chunk; --served)",
    )
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument(
        "--load", type=int, default=0, help="busy-loop processes while measuring (--served)"
    )
    parser.add_argument("--image-size", type=int, default=224, help="image side (--served)")
    parser.add_argument("--requests", type=int, default=6, help="image requests per side")
    parser.add_argument("--tokens", type=int, default=24, help="tokens per request")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of the served requests (--served; 0: greedy)",
    )
    parser.add_argument("--videos", type=int, default=4, help="videos for warm vs cold")
    parser.add_argument("--frames", type=int, default=16, help="frames per video")
    args = parser.parse_args()
    if args.served:
        from served import run_served

        asyncio.run(run_served(args))
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
