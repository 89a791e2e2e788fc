"""TTFT of a long-video request with encoding overlapped with prefill on vs off, in one run.

Two deployments (`tests/cluster.py`: router + encoder + prefill + decode) differ only in
`--overlap-prefill` (`router.overlap`: the router encodes the video as spans of partitions
and, as each arrives, the prefill worker computes the prompt up to the next one). Each
request is a document followed by a video, both fresh (nothing cached), its frames PNG
files encoded before the clock starts (`--client-encoding`: the client encodes arrays while
timed, as earlier runs did: ~6 ms a 224px frame, which both sides pay); requests alternate
between the two deployments so background load hits both alike. `--baseline DIR`: a third
deployment, overlap on, runs the code of the checkout at DIR (an earlier version), in the
same rotation. Prints median TTFT of each and the ratio, and the CPU seconds each process
used per request (not changed by other load, unlike TTFT). Goal: on <= 0.75x off.

For the bound, the bench process also times the two halves offline (the offline engine,
one thread, medians): encoding the video, and prefilling the whole prompt. Off pays about
their sum, on approaches their max plus one partition's prefill. Overlap needs the encoder
and the prefill worker to compute at the same time: each worker gets `--worker-threads`
torch threads (default 1), so the two fit on two cores; on a machine whose cores are taken
by other work, what overlaps is bounded by the cores left.

The default prompt (600 words, then 16 frames) is text-heavy: its prefill is about three
times its encoding, so even perfect overlap gives only about 0.73x, or 0.75x counting what
off pays besides the two halves (the bound's second line). A long-video request
(`--frames 48 --words 150`) is encode-heavy, where the per-partition steps matter.

With `--log-dir` each deployment logs at debug level and the medians of each request's
timeline are printed (`benchmarks/overlap_timeline.py DIR/on` prints every request's).

    .venv/bin/python benchmarks/overlap_bench.py [--size bench|tiny] [--requests 4]
        [--frames 16] [--words 600] [--worker-threads 1] [--log-dir DIR] [--baseline DIR]
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

from overlap_timeline import medians
from timing import measure, process_cpu_seconds

from common.engine import Engine
from common.models.tiny import default_checkpoint
from common.sampling import SamplingParams
from epd.client import Client
from epd.request import encode_image
from tests.cluster import ROOT, Cluster, start_cluster

BLOCK = 16


def request(
    seed: int, frames: int, size: int, words: int, png: bool = False
) -> list[dict[str, Any]]:
    """A document, then a video of `frames` random frames (`png`: as PNG files, what the
    client sends, so that sending them needs no encoding), then a question."""
    rng = np.random.default_rng(seed)
    clip = rng.integers(0, 256, (frames, size, size, 3), dtype=np.uint8)
    video: Any = [encode_image(frame) for frame in clip] if png else clip
    document = " ".join(f"word{int(w)}" for w in rng.integers(0, 10_000, words))
    content = [
        {"type": "text", "text": f"Read this report first: {document}"},
        {"type": "video", "video": video, "fps": 2.0},
        {"type": "text", "text": "Does the video match the report?"},
    ]
    return [{"role": "user", "content": content}]


ROLES = ("router", "encoder", "prefill", "decode")


def cpu_seconds(cluster: Cluster) -> dict[str, float]:
    """CPU seconds each process of `cluster` used so far, by role (`timing`): unlike wall
    time, other sessions' load does not change them."""
    used = process_cpu_seconds(cluster.procs)
    return {role: used[role] for role in ROLES}


async def ttft(cluster: Cluster, messages: Any) -> tuple[float, int]:
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        result = await client.generate_text(messages, sampling, timeout_s=900)
    return result.ttft_s, result.prompt_tokens


def offline_halves(model: Path, messages: Any) -> tuple[float, float]:
    """Median seconds (3 runs, one thread) of encoding the prompt's items frame by frame
    (as the encoder worker does for exact partitions) and of prefilling the whole prompt,
    in the offline engine: the two halves the overlap runs together."""
    engine = Engine.from_pretrained(model, block_size=BLOCK, num_blocks=4096, max_batch=1)
    prompt = engine.process(messages)
    params = engine.encode(prompt)
    pixels, grids = prompt.vision_inputs()

    def prefill() -> None:
        seq = engine.prefill(
            prompt.prompt_token_ids, params, SamplingParams(max_tokens=1), use_prefix_cache=False
        )
        engine.release(seq)

    def encode() -> None:
        engine.vision.encode(pixels, grids, per_frame=True)

    times = measure({"encode": encode, "prefill": prefill}, reps=3)
    return statistics.median(times["encode"]), statistics.median(times["prefill"])


async def run(args: argparse.Namespace) -> None:
    model = default_checkpoint(args.size)
    size = 224 if args.size == "bench" else 64
    threads: tuple[str, ...] = ("--threads", str(args.worker_threads))
    if args.log_dir is not None:  # the stage timelines (router, encoder, prefill debug lines)
        threads += ("--log-level", "DEBUG")
    # name -> (--overlap-prefill, the checkout the deployment runs)
    sides = {"on": ("true", ROOT), "off": ("false", ROOT)}
    if args.baseline is not None:
        sides["base"] = ("true", args.baseline.resolve())
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in sides}
    # name -> role -> CPU seconds of each request
    cpu: dict[str, dict[str, list[float]]] = {name: {r: [] for r in ROLES} for name in sides}
    with tempfile.TemporaryDirectory(prefix="epd-bench-") as tmp:
        logs = tmp if args.log_dir is None else args.log_dir
        clusters: dict[str, Cluster] = {}
        try:
            for name, (flag, root) in sides.items():
                clusters[name] = await asyncio.to_thread(
                    start_cluster,
                    model,
                    Path(logs) / name,
                    block_size=BLOCK,
                    num_blocks=4096,
                    heartbeat_interval_s=2.0,  # 40 s worker timeout: a loaded machine keeps them
                    router_args=("--overlap-prefill", flag, *threads[2:]),
                    encoder_args=threads,
                    prefill_args=threads,
                    decode_args=threads,
                    timeout_s=900,
                    root=root,
                )
            # The client's own PNG encoding of the frames (about 6 ms a frame) is done before
            # the clock starts, as in `served.py`, unless --client-encoding.
            png = not args.client_encoding
            for name in sides:  # warm-up
                await ttft(clusters[name], request(99_000, args.frames, size, args.words, png))
            prompt_tokens = 0
            for i in range(args.requests):
                order = names[i % len(names) :] + names[: i % len(names)]
                for k, name in enumerate(order):
                    messages = request(len(names) * i + k, args.frames, size, args.words, png)
                    before = cpu_seconds(clusters[name])
                    seconds, prompt_tokens = await ttft(clusters[name], messages)
                    after = cpu_seconds(clusters[name])
                    times[name].append(seconds)
                    for role in ROLES:
                        cpu[name][role].append(after[role] - before[role])
        finally:
            for cluster in clusters.values():
                await asyncio.to_thread(cluster.stop)
    encode, prefill = offline_halves(model, request(98_000, args.frames, size, args.words))
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(
        f"\n{args.requests} requests per side: ~{args.words}-word text + {args.frames} frames of "
        f"{size}px ({prompt_tokens} prompt tokens), {args.worker_threads} thread(s) per worker,"
        " median TTFT:"
    )
    print(f"  overlap on {on * 1000:8.1f} ms   off {off * 1000:8.1f} ms   on/off {on / off:.2f}x")
    print("  on  (ms):", " ".join(f"{t * 1000:.0f}" for t in times["on"]))
    print("  off (ms):", " ".join(f"{t * 1000:.0f}" for t in times["off"]))
    if "base" in times:
        base = statistics.median(times["base"])
        print(
            f"  baseline ({args.baseline}, overlap on) {base * 1000:8.1f} ms   base/off "
            f"{base / off:.2f}x   on/base {on / base:.2f}x"
        )
        print("  base (ms):", " ".join(f"{t * 1000:.0f}" for t in times["base"]))
    print("  CPU seconds per request (median; the whole answer, heartbeats included):")
    for name in sides:
        used = {r: statistics.median(cpu[name][r]) for r in ROLES}
        print(
            f"    {name:4}",
            " ".join(f"{r} {used[r]:.2f}" for r in ROLES),
            f"total {sum(used.values()):.2f}",
        )
    bound = max(encode, prefill) / (encode + prefill)
    print(
        f"  offline halves: encode {encode * 1000:.0f} ms, prefill {prefill * 1000:.0f} ms; "
        f"max/sum {bound:.2f}x (the ratio perfect overlap would give)"
    )
    # Off also pays what no overlap hides (processing, RPCs, the first token's return):
    # perfect overlap saves at most the smaller half, so on/off >= (off - min) / off.
    hidden = (off - min(encode, prefill)) / off
    print(
        f"  with off's other costs: (off - min(encode, prefill)) / off = {hidden:.2f}x "
        "(the ratio if overlap hid the smaller half and cost nothing)"
    )
    print(f"  goal on/off <= 0.75x: {'met' if on / off <= 0.75 else 'NOT met'}")
    if args.log_dir is not None:  # benchmarks/overlap_timeline.py DIR/on: each request's
        print("  timelines (ms from the router's receipt, medians):")
        for name in sides:
            print("   ", medians(args.log_dir / name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("bench", "tiny"), default="bench")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--words", type=int, default=600, help="words of text before the video")
    parser.add_argument(
        "--worker-threads", type=int, default=1, help="torch threads of each worker process"
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        help="keep the processes' logs here, at debug level (each step's timeline)",
    )
    parser.add_argument(
        "--client-encoding",
        action="store_true",
        help="time the client's PNG encoding of the frames too (earlier runs did)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a checkout of an earlier version: a third deployment, overlap on, runs its code",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
