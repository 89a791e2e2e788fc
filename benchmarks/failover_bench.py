"""Mid-decode failover: the inter-token gap of a migrated stream and the tokens recomputed.

Starts router + encoder + prefill + two decode workers as processes (`tests/cluster.py`) on
the default tiny checkpoint. For a text and a video request (greedy, `--max-tokens` new
tokens), each repetition runs, round-robin:

  steady    the stream undisturbed (no other request in flight)
  migrated  the same request; once `--kill-after` tokens arrived, the decode worker
            serving it is killed -9, the router resumes the stream on the other one
            (fresh prefill handle + `resume_tokens`), and the killed worker is started
            again afterwards

and reports per request kind the median inter-token gap of the steady stream, the median
largest gap of the migrated stream (the migration: detection, re-prefill, KV pull, the
recompute of the tokens already sent), their ratio, the tokens recomputed (read from the
router's log), over the repetitions whose stream did migrate (`migrated` counts them: the
serving worker is found from heartbeats, so a stream may end before its kill), and whether
every stream of the kill runs equals the steady one token for token.

    .venv/bin/python benchmarks/failover_bench.py [--reps 5] [--max-tokens 512] [--kill-after 24]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
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

from common.models.tiny import default_checkpoint
from common.sampling import SamplingParams
from epd.client import Client
from epd.v1 import registry_service_pb2
from tests.cluster import Cluster, kill, start_cluster

DECODE = registry_service_pb2.WORKER_ROLE_DECODE
_BROKE = re.compile(r"broke after (\d+) tokens")


def requests() -> dict[str, list[dict[str, Any]]]:
    rng = np.random.default_rng(0)
    video = rng.integers(0, 256, (8, 96, 96, 3), dtype=np.uint8)
    return {
        "text": [{"role": "user", "content": [{"type": "text", "text": "Tell me a long story."}]}],
        "video": [
            {
                "role": "user",
                "content": [
                    {"type": "video", "video": video, "fps": 2.0},
                    {"type": "text", "text": "What happens in this video?"},
                ],
            }
        ],
    }


async def decode_workers(cluster: Cluster) -> dict[str, Any]:
    status = await asyncio.to_thread(cluster.status)
    return {w.info.name: w for w in status.workers if w.info.role == DECODE}


async def wait_decoders(cluster: Cluster, dead_address: str, timeout_s: float = 60) -> bool:
    """Until both decode workers are registered and the killed one's old record is gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = await decode_workers(cluster)
        addresses = {w.info.address for w in workers.values()}
        if len(workers) == 2 and dead_address not in addresses:
            return True
        await asyncio.sleep(0.2)
    return False


async def stream(
    client: Client, messages: Any, sampling: SamplingParams, cluster: Cluster | None, after: int
) -> tuple[list[int], list[float], str]:
    """Tokens and chunk arrival times; with `cluster`, a separate task kills the serving
    decode worker once `after` tokens arrived (its name is returned, "" otherwise), so the
    kill itself never delays the reading of chunks."""
    tokens: list[int] = []
    times: list[float] = []
    enough = asyncio.Event()
    killed = ""

    async def killer() -> None:
        nonlocal killed
        assert cluster is not None
        await enough.wait()
        # Heartbeats tell which worker serves the stream (within an interval or two).
        for _ in range(50):
            workers = await decode_workers(cluster)
            busy = [n for n, w in workers.items() if w.load.active_requests]
            if busy:
                killed = busy[0]
                await asyncio.to_thread(kill, cluster, killed)
                return
            await asyncio.sleep(0.02)

    task = asyncio.ensure_future(killer()) if cluster is not None else None
    async for chunk in client.generate(messages, sampling, timeout_s=300):
        if chunk.token_ids:
            times.append(time.perf_counter())
            tokens.extend(chunk.token_ids)
            if len(tokens) >= after:
                enough.set()
    if task is not None:
        enough.set()
        await task
    return tokens, times, killed


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


async def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    model = default_checkpoint()
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="epd-failover-") as logs:
        cluster = await asyncio.to_thread(
            start_cluster,
            model,
            Path(logs),
            block_size=16,
            num_blocks=1024,
            decodes=2,
            encoder_args=("--inline-limit-bytes", "2048"),
            timeout_s=300,
        )
        rows: dict[str, dict[str, list[float]]] = {}
        identical: dict[str, list[bool]] = {}
        try:
            if not await wait_decoders(cluster, ""):
                raise RuntimeError("two decode workers did not register")
            async with Client(cluster.address, api_key=cluster.client_key) as client:
                for kind, messages in requests().items():
                    await stream(client, messages, sampling, None, 0)  # warm-up
                    row = rows.setdefault(kind, {"steady": [], "migrated": [], "recomputed": []})
                    for _ in range(args.reps):
                        want, times, _ = await stream(client, messages, sampling, None, 0)
                        row["steady"].append(statistics.median(gaps(times)))
                        log = Path(logs) / "router.log"
                        before = len(_BROKE.findall(log.read_text(errors="replace")))
                        addresses = {
                            n: w.info.address for n, w in (await decode_workers(cluster)).items()
                        }
                        got, times, killed = await stream(
                            client, messages, sampling, cluster, args.kill_after
                        )
                        broke = _BROKE.findall(log.read_text(errors="replace"))[before:]
                        identical.setdefault(kind, []).append(got == want)
                        if len(broke) == 1:  # the stream really migrated (once)
                            row["migrated"].append(max(gaps(times)))
                            row["recomputed"].append(int(broke[0]) - 1)
                        if killed:
                            dead = addresses[killed]
                            await asyncio.to_thread(cluster.respawn, killed)
                            if not await wait_decoders(cluster, dead):
                                raise RuntimeError(f"{killed} did not come back")
        finally:
            cluster.stop()
    print(
        f"{args.max_tokens} new tokens, kill -9 of the serving decode worker after "
        f"{args.kill_after}; {args.reps} reps; medians"
    )
    print(
        f"{'request':8} {'steady gap ms':>14} {'migration gap ms':>17} {'ratio':>7} "
        f"{'recomputed':>10} {'migrated':>9} {'identical':>10}"
    )
    for kind, row in rows.items():
        steady = statistics.median(row["steady"]) * 1e3
        nan = float("nan")
        migrated = statistics.median(row["migrated"]) * 1e3 if row["migrated"] else nan
        recomputed = statistics.median(row["recomputed"]) if row["recomputed"] else nan
        same = f"{sum(identical[kind])}/{len(identical[kind])}"
        print(
            f"{kind:8} {steady:14.2f} {migrated:17.1f} {migrated / steady:7.1f} "
            f"{recomputed:10.0f} {len(row['migrated']):>6}/{args.reps} {same:>10}"
        )
    for kind, row in rows.items():
        each = ", ".join(f"{g * 1e3:.0f}" for g in row["migrated"])
        print(f"  {kind}: migration gaps per rep (ms): {each}; recomputed {row['recomputed']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--kill-after", type=int, default=24)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
