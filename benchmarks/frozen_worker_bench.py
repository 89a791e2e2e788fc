"""A frozen prefill worker: how long the requests sent to it take, on this checkout and on
another (`--baseline DIR`, e.g. the landed commit), one after the other.

Each side starts router + encoder + two prefill workers + decode as processes
(`tests/cluster.py`, the tiny checkpoint, that checkout's own code and client), answers one
warm-up request, freezes one prefill worker with SIGSTOP (its kernel keeps its connections
open, so nothing fails by itself), sends `--requests` text requests at once, and prints each
one's outcome and latency: those the router sent to the frozen worker show how it detects
it (before keepalive: they waited for the client's deadline and got no answer at all).
`--router-args` are given to this checkout's router (e.g. `--worker-keepalive-s 1`).

    .venv/bin/python benchmarks/frozen_worker_bench.py --baseline /tmp/landed \
        [--requests 4] [--timeout-s 60] [--router-args="--worker-keepalive-s 1"]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in a process of its own with the checkout's code first on the path (`sys.argv[1]`),
# so that each side uses its own client and cluster helper; prints one JSON line per request.
SIDE = """
import asyncio, json, os, signal, sys, time
from pathlib import Path
root, requests, timeout_s = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
router_args = sys.argv[4:]
sys.path.insert(0, str(root))
from common.models.tiny import make_tiny_checkpoint
from common.sampling import SamplingParams
from epd.client import Client
from tests.cluster import start_cluster

work = Path(os.environ["EPD_BENCH_DIR"])
cluster = start_cluster(
    make_tiny_checkpoint(work / "tiny"), work / "logs", prefills=2, root=root,
    router_args=tuple(router_args),
)
victim = cluster.procs["prefill"].pid

async def one(client, i, started):
    chat = [{"role": "user", "content": f"Request {i}: tell me about {i * 7}."}]
    try:
        async for _ in client.generate(chat, SamplingParams(max_tokens=4), timeout_s=timeout_s):
            pass
        outcome = "answered"
    except Exception as exc:
        outcome = str(exc).split(":")[0]
    return {"request": i, "outcome": outcome, "seconds": round(time.monotonic() - started, 2)}

async def main():
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        warm = [{"role": "user", "content": "hi"}]
        async for _ in client.generate(warm, SamplingParams(max_tokens=2)):
            pass
        os.kill(victim, signal.SIGSTOP)
        started = time.monotonic()
        for row in await asyncio.gather(*(one(client, i, started) for i in range(requests))):
            print(json.dumps(row), flush=True)

try:
    asyncio.run(main())
finally:
    os.kill(victim, signal.SIGCONT)
    cluster.stop()
"""


def side(root: Path, args: argparse.Namespace, router_args: list[str]) -> list[dict[str, object]]:
    """One side's rows (request, outcome, seconds after the freeze)."""
    with tempfile.TemporaryDirectory(prefix="epd-frozen-") as work:
        env = {**os.environ, "EPD_BENCH_DIR": work}
        command = [sys.executable, "-c", SIDE, str(root), str(args.requests), str(args.timeout_s)]
        done = subprocess.run(
            [*command, *router_args], env=env, capture_output=True, text=True, check=False
        )
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise RuntimeError(f"{root}: no result\n{done.stderr[-2000:]}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="checkout to compare")
    parser.add_argument("--requests", type=int, default=4, help="sent at once after the freeze")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="each request's deadline")
    parser.add_argument("--router-args", default="", help="this checkout's router flags")
    args = parser.parse_args()
    sides = [("this", ROOT, shlex.split(args.router_args))]
    if args.baseline is not None:
        sides.insert(0, ("baseline", args.baseline, []))
    print(f"{'side':9s} {'request':>7s}  {'outcome':20s} {'seconds after the freeze':>25s}")
    for name, root, router_args in sides:
        for row in side(root, args, router_args):
            print(f"{name:9s} {row['request']:>7}  {row['outcome']!s:20s} {row['seconds']:>25}")


if __name__ == "__main__":
    main()
