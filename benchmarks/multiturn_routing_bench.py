"""Multi-turn image chat over 2 prefill + 2 decode workers: cache-aware routing (prefill and
decode by cached prefix among the least loaded) vs least-loaded routing, in one run.

Two deployments (`tests/cluster.py`, router + 1 encoder + 2 prefill + 2 decode each, every
worker with `--threads` torch threads) differ only in `--cache-aware-routing`. The same
workload runs on each, alternating round by round so background load hits both alike:
`--conversations` chats at once, each `--turns` turns; the first turn carries an image and a
long question, each later turn repeats the history (with the previous answer) and asks a
short new question. Every round uses fresh images. With `--steady`, a round is instead a
steady-state window: `--conversations` clients start `--stagger-s` apart and each runs chats
back to back (fresh images) until `--duration-s` has passed.

Prints, per side, requests/s (all answers of a round / its wall time), TTFT p50 and the
deployment's CPU seconds per request (its processes' user + system time: the work, which a
shared machine's background load changes far less than the wall time; what each side
burns when idle is printed after the warm-up), the ratios, the
mean share of prompt tokens prefill reused and of blocks decode reused in later turns, then
per turn the p50 TTFT (router, encode, prefill) and decode time (after the first token),
the share of a chat's time its first turn takes, the mean chat time of each side and the
bound on their ratio were cache-aware's later turns to reach their first token at once
(their decoding, which routing does not change, kept), and (rounds) the ceiling: the ratio
cache-aware would reach if its later turns took no time at all, since a round lasts at
least its slowest first turn, which is a cold encode + prefill on either side.
Goal: cache-aware >= 1.5x the requests/s of least-loaded.

    .venv/bin/python benchmarks/multiturn_routing_bench.py [--size bench|tiny] [--rounds 2]
        [--turns 4] [--steady --duration-s 120] [--log-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

# `tests.cluster` (the deployment helper) lives beside the test suite, not in a package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from timing import process_cpu_seconds

from common.models.tiny import default_checkpoint
from common.sampling import SamplingParams
from epd.client import Client, Result
from epd.request import encode_image
from tests.cluster import Cluster, start_cluster

BLOCK = 16
QUESTION = "Describe the picture carefully: every object, its colour and where it is. " * 6


def first_turn(seed: int, size: int, media: str, frames: int) -> list[dict[str, Any]]:
    """A chat's first message: a fresh image (`media` "image"), a fresh `frames`-frame video
    ("video", sent as PNG frames) or, by the seed's parity, either ("mixed"), then the
    question."""
    rng = np.random.default_rng(seed)
    if media == "video" or (media == "mixed" and seed % 2):
        clip = rng.integers(0, 256, (frames, size, size, 3), dtype=np.uint8)
        part = {"type": "video", "video": [encode_image(f) for f in clip], "fps": 2.0}
    else:
        picture = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
        part = {"type": "image", "image": picture}
    return [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]


async def conversation(
    client: Client,
    seed: int,
    turns: int,
    size: int,
    sampling: SamplingParams,
    media: str = "image",
    frames: int = 4,
    deadline: float = math.inf,
) -> list[Result]:
    """One chat's turns (none started after `deadline`, a `time.perf_counter()` value)."""
    messages = first_turn(seed, size, media, frames)
    results = []
    for k in range(turns):
        if time.perf_counter() >= deadline:
            break
        result = await client.generate_text(
            messages, sampling, timeout_s=600, request_id=f"chat{seed}-turn{k}"
        )
        results.append(result)
        messages = [
            *messages,
            {"role": "assistant", "content": result.text},
            {"role": "user", "content": f"Turn {k + 1}: and what is left of that?"},
        ]
    return results


async def one_round(
    cluster: Cluster, seeds: range, args: argparse.Namespace, size: int
) -> tuple[float, list[list[Result]]]:
    """Wall seconds of one round and each chat's results, turn by turn."""
    sampling = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        start = time.perf_counter()
        chats = [
            conversation(client, s, args.turns, size, sampling, args.media, args.frames)
            for s in seeds
        ]
        done = await asyncio.gather(*chats)
        wall = time.perf_counter() - start
    return wall, list(done)


async def steady(
    cluster: Cluster, base: int, args: argparse.Namespace, size: int
) -> tuple[float, list[list[Result]]]:
    """`--conversations` clients, client i starting `i * --stagger-s` late, each running
    chats back to back (fresh images) and starting no turn after `--duration-s`: wall
    seconds until the last answer, and every chat's results."""
    sampling = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        start = time.perf_counter()
        deadline = start + args.duration_s

        async def user(i: int) -> list[list[Result]]:
            await asyncio.sleep(i * args.stagger_s)
            chats: list[list[Result]] = []
            for j in itertools.count():
                if time.perf_counter() >= deadline:
                    break
                seed = base + 100 * i + j
                chat = conversation(
                    client, seed, args.turns, size, sampling, args.media, args.frames, deadline
                )
                chats.append(await chat)
            return chats

        done = await asyncio.gather(*(user(i) for i in range(args.conversations)))
        wall = time.perf_counter() - start
    return wall, [chat for chats in done for chat in chats if chat]


def cpu_seconds(cluster: Cluster) -> dict[str, float]:
    """CPU seconds the deployment's processes have used so far, by role (router, encoder,
    prefill, decode: a role's workers together)."""
    roles: dict[str, float] = {}
    for name, seconds in process_cpu_seconds(cluster.procs).items():
        role = name.rstrip("-0123456789")
        roles[role] = roles.get(role, 0.0) + seconds
    return roles


@dataclass(slots=True)
class Side:
    """What one deployment measured, over the measured rounds."""

    rps: list[float] = field(default_factory=list)  # requests/s of each round
    ttft: list[float] = field(default_factory=list)  # seconds, every request
    by_turn: list[list[Result]] = field(default_factory=list)  # results per turn index
    cached: list[float] = field(default_factory=list)  # later turns: prefill-reused share
    reused: list[float] = field(default_factory=list)  # later turns: decode-reused share
    first_share: list[float] = field(default_factory=list)  # turn 0's share of a chat's time
    ceiling: list[float] = field(default_factory=list)  # requests/s if later turns were free
    chat_s: list[float] = field(default_factory=list)  # each chat's time (its turns' total)
    # Each chat's time were its later turns' TTFT zero (turn 0 and all decoding kept).
    floor_s: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # deployment CPU seconds per request
    roles: list[dict[str, float]] = field(default_factory=list)  # the same, by role
    idle: float = 0.0  # deployment CPU seconds per second when it serves nothing

    def add(
        self, wall: float, cpu_s: dict[str, float], chats: list[list[Result]], rounds: bool = True
    ) -> None:
        """One round (`rounds`; else a steady-state window) of `wall` seconds in which the
        deployment's roles used `cpu_s` CPU seconds: `chats`, each its turns' results in
        order."""
        results = [r for chat in chats for r in chat]
        self.rps.append(len(results) / wall)
        self.cpu.append(sum(cpu_s.values()) / len(results))
        self.roles.append({role: v / len(results) for role, v in cpu_s.items()})
        self.ttft.extend(r.ttft_s for r in results)
        for chat in chats:
            for k, r in enumerate(chat):
                while len(self.by_turn) <= k:
                    self.by_turn.append([])
                self.by_turn[k].append(r)
            later = chat[1:]
            self.cached.extend(r.cached_tokens / r.prompt_tokens for r in later)
            self.reused.extend(
                r.blocks_reused / max(1, r.blocks_reused + r.blocks_pulled) for r in later
            )
            self.first_share.append(chat[0].total_s / sum(r.total_s for r in chat))
            self.chat_s.append(sum(r.total_s for r in chat))
            self.floor_s.append(chat[0].total_s + sum(r.total_s - r.ttft_s for r in later))
        if rounds:  # A round cannot end before its slowest first turn, whatever comes later.
            self.ceiling.append(len(results) / max(chat[0].total_s for chat in chats))


async def run(args: argparse.Namespace) -> None:
    model = default_checkpoint(args.size)
    size = 448 if args.size == "bench" else 64
    print(f"checkpoint {model} ({args.size}); starting two deployments (2P + 2D each) ...")
    sides = {"cache-aware": "true", "least-loaded": "false"}
    # Each worker gets `--threads` torch threads: ten workers each taking every core (the
    # default) would oversubscribe the machine, on both sides alike.
    threads = ("--threads", str(args.threads))
    stats = {name: Side() for name in sides}
    with tempfile.TemporaryDirectory(prefix="epd-bench-") as tmp:
        logs = Path(args.log_dir or tmp)
        clusters: dict[str, Cluster] = {}
        try:
            for name, flag in sides.items():
                clusters[name] = await asyncio.to_thread(
                    start_cluster,
                    model,
                    logs / name,
                    block_size=BLOCK,
                    num_blocks=4096,
                    heartbeat_interval_s=2.0,  # 40 s worker timeout: a loaded machine keeps them
                    encoder_args=threads,
                    prefill_args=(*threads, "--num-blocks", str(args.prefill_blocks)),
                    decode_args=threads,
                    prefills=2,
                    decodes=2,
                    router_args=("--cache-aware-routing", flag),
                    timeout_s=900,
                )
            n = args.conversations
            for name in sides:  # warm-up: first NIXL connections, first forwards
                await one_round(clusters[name], range(90_000, 90_000 + n), args, size)
            for name in sides:  # what the deployment burns doing nothing (heartbeats, polls)
                idle = sum(cpu_seconds(clusters[name]).values())
                await asyncio.sleep(5.0)
                stats[name].idle = (sum(cpu_seconds(clusters[name]).values()) - idle) / 5.0
                print(f"  {name}: {stats[name].idle:.2f} CPU s/s when idle")
            for r in range(args.rounds):
                seeds = range(1000 * (r + 1), 1000 * (r + 1) + n)
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                for name in order:
                    cpu = cpu_seconds(clusters[name])
                    if args.steady:
                        wall, chats = await steady(clusters[name], seeds.start, args, size)
                    else:
                        wall, chats = await one_round(clusters[name], seeds, args, size)
                    after = cpu_seconds(clusters[name])
                    used = {role: after[role] - cpu[role] for role in after}
                    stats[name].add(wall, used, chats, rounds=not args.steady)
        finally:
            for cluster in clusters.values():
                await asyncio.to_thread(cluster.stop)
    report(args, size, stats)


def report(args: argparse.Namespace, size: int, stats: dict[str, Side]) -> None:
    """The summary table, the per-turn breakdown and the ratios."""
    med = statistics.median
    mean = statistics.fmean
    how = (
        f"steady state: {args.duration_s:.0f} s windows, chats started {args.stagger_s} s apart"
        if args.steady
        else "all chats start together"
    )
    print(
        f"\n{args.rounds} rounds ({how}) x {args.conversations} concurrent chats x "
        f"{args.turns} turns ({size}px {media_words(args)}, {args.tokens} tokens per answer, "
        f"{args.threads} thread(s) a worker, {args.prefill_blocks} KV blocks of {BLOCK} "
        "tokens a prefill worker):"
    )
    for name, s in stats.items():
        print(
            f"  {name:12s} req/s {med(s.rps):6.2f}   TTFT p50 {med(s.ttft) * 1000:8.1f} ms   "
            f"CPU {med(s.cpu):5.2f} s/request   "
            f"later turns: prefill reused {mean(s.cached):5.1%} of tokens, decode reused "
            f"{mean(s.reused):5.1%} of blocks"
        )
    aware, plain = stats["cache-aware"], stats["least-loaded"]
    ratio = med(aware.rps) / med(plain.rps)
    print(
        f"  cache-aware / least-loaded: req/s {ratio:.2f}x   TTFT p50 "
        f"{med(aware.ttft) / med(plain.ttft):.2f}x   goal req/s >= 1.5x: "
        f"{'met' if ratio >= 1.5 else 'NOT met'}"
    )
    work = med(plain.cpu) / med(aware.cpu)
    print(
        f"  CPU per request, least-loaded / cache-aware: {work:.2f}x (idle burn included: it "
        "takes what the work leaves, so it cannot be subtracted)"
    )
    for name, s in stats.items():
        each = {role: med(r[role] for r in s.roles) * 1e3 for role in s.roles[0]}
        parts = "  ".join(f"{role} {v:5.1f}" for role, v in each.items())
        print(f"  CPU ms per request, {name:12s} ({parts})")
    print("\n  per turn, p50 ms: TTFT (router + encode + prefill) / decode (after the TTFT)")
    print("  turn  " + "".join(f"{name:>26s}" for name in stats))
    for k in range(min(len(s.by_turn) for s in stats.values())):
        cells = []
        for s in stats.values():
            turn = s.by_turn[k]
            decode = med(r.total_s - r.ttft_s for r in turn) * 1000
            cells.append(f"{med(r.ttft_s for r in turn) * 1000:9.0f} / {decode:7.0f} ms")
        print(f"  {k:4d}  " + "".join(f"{c:>26s}" for c in cells))
    shares = ", ".join(f"{mean(s.first_share):.0%} ({n})" for n, s in stats.items())
    print(f"  turn 0 (a fresh image, cold on either side) takes {shares} of a chat's time")
    print(
        f"  mean chat time: cache-aware {mean(aware.chat_s):.2f} s, least-loaded "
        f"{mean(plain.chat_s):.2f} s ({mean(plain.chat_s) / mean(aware.chat_s):.2f}x); with "
        f"its later turns' TTFT zero (turn 0 and every answer's decoding kept, which routing "
        f"does not change) cache-aware's would be {mean(aware.floor_s):.2f} s, at most "
        f"{mean(plain.chat_s) / mean(aware.floor_s):.2f}x"
    )
    if not aware.ceiling:
        return
    ceiling = med(aware.ceiling) / med(plain.rps)
    print(
        f"  ceiling: even with later turns free, cache-aware could reach {ceiling:.2f}x "
        "(a round ends after its slowest first turn)"
    )


def media_words(args: argparse.Namespace) -> str:
    video = f"{args.frames}-frame video"
    return {"image": "image", "video": video, "mixed": f"image or {video}"}[args.media]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("bench", "tiny"), default="bench")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=4, help="chats at once")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8, help="tokens per answer")
    parser.add_argument(
        "--steady",
        action="store_true",
        help="steady state instead of rounds: each chat client runs chats back to back",
    )
    parser.add_argument("--duration-s", type=float, default=120.0, help="steady window")
    parser.add_argument("--stagger-s", type=float, default=2.0, help="steady: start offsets")
    parser.add_argument(
        "--media",
        choices=("image", "video", "mixed"),
        default="image",
        help="what a chat's first turn carries (mixed: image and video chats alternate)",
    )
    parser.add_argument("--frames", type=int, default=4, help="frames of a video chat's video")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument(
        "--prefill-blocks",
        type=int,
        default=4096,
        help="KV blocks of each prefill worker (small: the live chats outgrow one worker's cache)",
    )
    parser.add_argument("--log-dir", help="keep the deployments' logs here (default: dropped)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
