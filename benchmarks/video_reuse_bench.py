"""Partial video reuse (partition keys) and the router's planning overhead, in one run.

1. Warm vs cold TTFT for a long video with frames appended (a real E/P/D deployment,
   `tests/cluster.py`): per round, a cold request (a fresh video of `frames + appended`
   frames: nothing cached) and a warm one (a video of `frames` frames served first, then the
   same video with `appended` more frames), alternating so background load hits both alike.
   Frames go as PNG files encoded before the clock starts (a client's encoding is not the
   deployment's time). `--baseline DIR`: a second deployment running another checkout's
   code (e.g. `git worktree add --detach /tmp/vw-base <commit>`), its requests interleaved
   with this one's; `--stages` prints the last round's stage times from the debug logs.
   Goal: warm TTFT <= (uncached fraction of the warm prompt + 0.05) x cold TTFT.
2. Router planning per request for a ~`--plan-tokens`-token prompt holding a video, in this
   process: process (template, video preprocessing, tokenizing), hash (`block_hashes`
   under the deployment's root) and route (`PrefillRouting.route` over `--workers` prefill
   workers whose cached prefixes are known). p50 and p99. Goal: hash + route p99 <= 1 ms.

    .venv/bin/python benchmarks/video_reuse_bench.py [--size bench|tiny] [--rounds 3]
        [--skip-planning] [--baseline /tmp/vw-base] [--stages]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

# `tests.cluster` (the deployment helper) lives beside the test suite, not in a package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.kv.hashing import block_hashes
from common.kv.layout import layout_root
from common.models.tiny import default_checkpoint
from common.processing.processor import Processor
from common.roles import SIGNED_KV, Role
from common.sampling import SamplingParams
from common.server.role import freeze_startup_heap
from common.wire.kv import layout_from_proto
from common.wire.roles import role_to_proto
from epd.client import Client
from epd.request import encode_image
from epd.v1 import kv_pb2, registry_service_pb2, tensor_pb2
from router.calls import Job
from router.prefix_index import PrefixIndex
from router.registry import Registry
from router.routing import PrefillRouting
from tests.cluster import start_cluster

BLOCK = 16
ROOT = Path(__file__).resolve().parent.parent


def clip(seed: int, frames: int, size: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (frames, size, size, 3), dtype=np.uint8)


def png_frames(video: np.ndarray) -> list[bytes]:
    """The frames as the PNG files a client sends (encoded before the clock starts: the
    client's encoding is not the deployment's time to first token)."""
    return [encode_image(frame) for frame in video]


def ask(video: Any, text: str = "What happens at the end?") -> list[dict[str, Any]]:
    part = {"type": "video", "video": video, "fps": 2.0}
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


def med(values: list[float]) -> float:
    return statistics.median(values)


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


STAGE_LINES = (  # debug lines of the router, encoder and prefill worker (`--stages`)
    re.compile(r"request (\S+) stages: (.*)$"),
    re.compile(r"request (\S+): \d+ items, (\d+ from cache; .*)$"),
    re.compile(r"request (\S+): (\d+ tokens \(\d+ cached\), handoff .* ms), lease"),
)


def stages(logs: Path, request_id: str) -> list[str]:
    """What the deployment's debug logs say about one request's stages."""
    out = []
    for name in ("router", "encoder", "prefill"):
        for line in (logs / f"{name}.log").read_text(errors="replace").splitlines():
            for pattern in STAGE_LINES:
                m = pattern.search(line)
                if m and m.group(1).split(":")[0] == request_id:
                    out.append(f"{name}: {m.group(2)}")
    return out


async def warm_vs_cold(model: Path, args: argparse.Namespace, size: int) -> None:
    """Cold and warm requests on each deployment (this checkout's, and `--baseline`'s),
    round by round, the deployments' requests interleaved."""
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    roots = {"this": ROOT} | ({"baseline": Path(args.baseline)} if args.baseline else {})
    cold: dict[str, list[float]] = {name: [] for name in roots}
    warm: dict[str, list[float]] = {name: [] for name in roots}
    uncached: list[float] = []
    debug = ("--log-level", "DEBUG") if args.stages else ()
    with tempfile.TemporaryDirectory(prefix="epd-bench-") as tmp:
        logs = Path(args.log_dir or tmp)
        clusters = {}
        try:
            for name, root in roots.items():
                clusters[name] = await asyncio.to_thread(
                    start_cluster,
                    model,
                    logs / name,
                    block_size=BLOCK,
                    num_blocks=4096,
                    heartbeat_interval_s=2.0,  # 40 s worker timeout: a loaded machine keeps them
                    timeout_s=600,
                    root=root,
                    router_args=debug,
                    encoder_args=debug,
                    prefill_args=debug,
                )
            clients = {
                name: Client(c.address, api_key=c.client_key) for name, c in clusters.items()
            }
            total = args.frames + args.appended
            for client in clients.values():
                await client.generate_text(
                    ask(png_frames(clip(9_999, total, size))), sampling, timeout_s=900
                )  # warm-up
            for r in range(args.rounds):
                for k, (name, client) in enumerate(clients.items()):
                    seed = 1000 * k + 2 * r
                    cold_video = png_frames(clip(seed, total, size))
                    c = await client.generate_text(
                        ask(cold_video), sampling, timeout_s=900, request_id=f"cold{r}"
                    )
                    cold[name].append(c.ttft_s)
                    video = png_frames(clip(seed + 1, total, size))
                    await client.generate_text(
                        ask(video[: args.frames]), sampling, timeout_s=900, request_id=f"first{r}"
                    )
                    w = await client.generate_text(
                        ask(video), sampling, timeout_s=900, request_id=f"warm{r}"
                    )
                    warm[name].append(w.ttft_s)
                    if name == "this":
                        uncached.append(1 - w.cached_tokens / w.prompt_tokens)
            prompt_tokens = w.prompt_tokens
            for client in clients.values():
                await client.close()
            if args.stages:
                await asyncio.sleep(0.5)  # the last lines reach the logs
                for name in roots:
                    for request in (f"cold{args.rounds - 1}", f"warm{args.rounds - 1}"):
                        print(f"   [{name}] {request}:")
                        for line in stages(logs / name, request):
                            print(f"      {line}")
        finally:
            for deployment in clusters.values():
                await asyncio.to_thread(deployment.stop)
    ms = 1000.0
    fraction = med(uncached)
    print(
        f"\n1. warm vs cold TTFT: {args.frames} + {args.appended} appended frames of {size}px "
        f"({prompt_tokens} prompt tokens), {args.rounds} rounds, medians:"
    )
    for name in roots:
        ratio = med(warm[name]) / med(cold[name])
        print(
            f"   {name:8s} cold {med(cold[name]) * ms:8.1f} ms   warm {med(warm[name]) * ms:8.1f} "
            f"ms   warm/cold {ratio:.3f}   goal <= {fraction + 0.05:.3f} (uncached fraction "
            f"{fraction:.3f}): {'met' if ratio <= fraction + 0.05 else 'NOT met'}"
        )
    if args.baseline:
        print(
            "   this/baseline: cold "
            f"{med(cold['this']) / med(cold['baseline']):.3f}   warm "
            f"{med(warm['this']) / med(warm['baseline']):.3f}"
        )


def kv_layout(block_bytes: int) -> kv_pb2.KvLayout:
    return kv_pb2.KvLayout(
        model="bench",
        dtype=tensor_pb2.ELEMENT_TYPE_FLOAT32,
        block_size=BLOCK,
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        layout="block-major/layer,kv,token,head,dim",
        block_bytes=block_bytes,
    )


def planning(model: Path, args: argparse.Namespace, size: int) -> None:
    processor = Processor.from_pretrained(model)
    text = "Describe every scene of this long video in order, with times. " * 4
    frames = args.plan_frames
    video = clip(7, frames, size)
    words = 0
    for _ in range(3):  # pad the question to about `plan_tokens` prompt tokens
        messages = ask(video, text + " detail" * words)
        prompt = processor.process(messages)
        words = max(0, words + args.plan_tokens - len(prompt.prompt_token_ids))
    registry = Registry(worker_timeout_s=1e9, heartbeat_interval_s=1.0)  # never expire
    layout = kv_layout(block_bytes=8192)
    for port in range(args.workers):
        info = registry_service_pb2.WorkerInfo(
            role=role_to_proto(Role.PREFILL),
            address=f"127.0.0.1:{20_000 + port}",
            model="bench",
            protocol_version="epd.v1",
            name=f"prefill-{port}",
            capabilities=[SIGNED_KV],
        )
        info.kv_layout.CopyFrom(layout)
        registry.register(info)
    root = layout_root(layout_from_proto(layout))
    hashes = block_hashes(prompt.prompt_token_ids, BLOCK, prompt.params, root=root)
    # As a router does once serving (`freeze_startup_heap`); the prefix index filled below
    # stays in the collector's reach, as KV events that arrive later do.
    freeze_startup_heap()
    prefix = PrefixIndex(channels=None)  # type: ignore[arg-type]  # never follows a stream
    for k, worker in enumerate(registry.workers(Role.PREFILL)):
        # Each worker caches a different share of the prompt (and other blocks).
        cached = hashes[: len(hashes) * (k + 1) // (args.workers + 1)]
        other = [bytes([k]) * 16 + i.to_bytes(16, "little") for i in range(20_000)]
        event = kv_pb2.KvEvent(kind=kv_pb2.KV_EVENT_KIND_STORED, block_hashes=cached + other)
        prefix._apply(worker.address, [event])
    routing = PrefillRouting(registry, prefix, cache_aware=True)
    job = Job("bench", prompt, SamplingParams(), None, time.monotonic() + 3600)
    proc_t, hash_t, route_t = [], [], []
    for _ in range(args.plan_reps):
        t0 = time.perf_counter()
        fresh = processor.process(messages)  # hashed and routed as a new request's prompt
        t1 = time.perf_counter()
        got = block_hashes(fresh.prompt_token_ids, BLOCK, fresh.params, root=root)
        t2 = time.perf_counter()
        fresh_job = dataclasses.replace(job, prompt=fresh)  # a router has its job: untimed
        t3 = time.perf_counter()
        routing.route(fresh_job, got, None)
        t4 = time.perf_counter()
        proc_t.append(t1 - t0)
        hash_t.append(t2 - t1)
        route_t.append(t4 - t3)
    both = [h + r for h, r in zip(hash_t, route_t, strict=True)]
    ms = 1000.0
    print(
        f"\n2. router planning: {len(prompt.prompt_token_ids)} prompt tokens ({frames} frames of "
        f"{size}px, partition keys {prompt.params.items[0].partition_keys}), {args.workers} "
        f"prefill workers, {args.plan_reps} requests:"
    )
    for name, values in (("process", proc_t), ("hash", hash_t), ("route", route_t)):
        print(f"   {name:13s} p50 {med(values) * ms:8.3f} ms   p99 {p99(values) * ms:8.3f} ms")
    verdict = "met" if p99(both) <= 1e-3 else "NOT met"
    print(
        f"   hash + route  p50 {med(both) * ms:8.3f} ms   p99 {p99(both) * ms:8.3f} ms   "
        f"goal p99 <= 1 ms: {verdict}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("bench", "tiny"), default="bench")
    parser.add_argument("--frames", type=int, default=32, help="frames of the served video")
    parser.add_argument("--appended", type=int, default=4, help="frames appended to it")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plan-tokens", type=int, default=8192)
    parser.add_argument("--plan-frames", type=int, default=64)
    parser.add_argument("--plan-reps", type=int, default=200)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--skip-cluster", action="store_true", help="only the planning part")
    parser.add_argument("--skip-planning", action="store_true", help="only warm vs cold")
    parser.add_argument(
        "--baseline", help="another checkout (e.g. a git worktree): its deployment too, interleaved"
    )
    parser.add_argument(
        "--stages", action="store_true", help="debug logs; print the last round's stage times"
    )
    parser.add_argument("--log-dir", help="keep the deployments' logs here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = default_checkpoint(args.size)
    size = 224 if args.size == "bench" else 64
    print(f"checkpoint {model} ({args.size})")
    if not args.skip_planning:
        planning(model, args, size)
    if not args.skip_cluster:
        asyncio.run(warm_vs_cold(model, args, size))


if __name__ == "__main__":
    main()
