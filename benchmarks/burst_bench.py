"""A burst against a local deployment on the default settings: admission queues, not refuses.

Starts router + encoder + prefill + decode as processes (`tests/cluster.py`) with the
workers' and router's defaults (16-token blocks, 1024 KV blocks per worker, heartbeats every
second, `max_queued_requests` and `max_queue_wait_s` as shipped), waits until both KV
workers have reported their pools, then sends `--requests` concurrent text requests of
about `--prompt-tokens` tokens each (each its own from the first block: no prefix reuse) and
prints the refusals (the issue's bar: 0), the admission queue's peak and waits from
`AdminService.Status`, and latency medians (TTFT and whole request).

    .venv/bin/python benchmarks/burst_bench.py [--requests 200] [--prompt-tokens 300]
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

# `tests.cluster` (the deployment helper) lives beside the test suite, not in a package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.models.tiny import default_checkpoint
from common.processing.messages import messages_from_dicts
from common.processing.processor import Processor
from common.sampling import SamplingParams
from epd.client import Client, GenerateError, Result
from tests.cluster import Cluster, start_cluster

NUM_BLOCKS = 1024  # `KvWorkerSettings.num_blocks` default
BLOCK_SIZE = 16  # `KvWorkerSettings.block_size` default
HEARTBEAT_S = 1.0  # `RouterSettings.heartbeat_interval_s` default


def prompt(i: int, words: int) -> list[dict[str, Any]]:
    sentence = "tell me a story about the sea and the sky "
    text = f"Request {i}: " + sentence * max(1, words // 10)
    return [{"role": "user", "content": [{"type": "text", "text": text}]}]


def words_for(processor: Processor, tokens: int) -> int:
    """Words of `prompt` giving about `tokens` prompt tokens on this tokenizer."""
    words = 10
    while len(processor.process(messages_from_dicts(prompt(0, words))).prompt_token_ids) < tokens:
        words += 10
    return words


async def wait_capacity(cluster: Cluster, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = await asyncio.to_thread(cluster.status)
        if sum(w.load.kv_blocks_free + w.load.kv_blocks_used > 0 for w in status.workers) >= 2:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("KV workers did not report their pools")


async def run(args: argparse.Namespace) -> None:
    model = default_checkpoint()
    processor = Processor.from_pretrained(model)
    words = words_for(processor, args.prompt_tokens)
    tokens = len(processor.process(messages_from_dicts(prompt(0, words))).prompt_token_ids)
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="epd-burst-") as logs:
        cluster = await asyncio.to_thread(
            start_cluster,
            model,
            Path(logs),
            block_size=BLOCK_SIZE,
            num_blocks=NUM_BLOCKS,
            heartbeat_interval_s=HEARTBEAT_S,
            timeout_s=300,
        )
        try:
            await wait_capacity(cluster)
            async with Client(cluster.address, api_key=cluster.client_key) as client:

                async def one(i: int) -> Result | GenerateError:
                    try:
                        return await client.generate_text(prompt(i, words), sampling, timeout_s=300)
                    except GenerateError as exc:
                        return exc

                started = time.monotonic()
                results = await asyncio.gather(*(one(i) for i in range(args.requests)))
                wall = time.monotonic() - started
            status = await asyncio.to_thread(cluster.status)
        finally:
            cluster.stop()
    done = [r for r in results if isinstance(r, Result)]
    refused = [r for r in results if isinstance(r, GenerateError)]
    print(
        f"{args.requests} concurrent requests, {tokens} prompt tokens each "
        f"({-(-tokens // BLOCK_SIZE)} KV blocks), {args.max_tokens} new tokens; "
        f"{NUM_BLOCKS} KV blocks per worker"
    )
    print(f"finished {len(done)}, refused {len(refused)} in {wall:.1f} s")
    for exc in refused[:3]:
        print(f"  refused: {exc}")
    print(
        f"admission: queue peak {status.queued_peak}, admitted {status.admitted_requests}, "
        f"refused {status.refused_requests}, requeued after a full prefill pool "
        f"{status.requeued_requests}; wait p50 {status.queue_wait_p50_s:.2f} s, "
        f"max {status.queue_wait_max_s:.2f} s"
    )
    if done:
        ttft = statistics.median(r.ttft_s for r in done)
        total = statistics.median(r.total_s for r in done)
        worst = max(r.total_s for r in done)
        print(f"latency: TTFT median {ttft:.2f} s; request median {total:.2f} s, max {worst:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=16)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
