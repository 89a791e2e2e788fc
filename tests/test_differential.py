"""Differential test: every answer a deployment serves equals the offline engine's, whatever
the deployment cached, reused, overlapped or streamed in chunks.

One deployment runs most serving paths at once: 2 prefill and 2 decode workers with
cache-aware routing (a request goes where its prefix is cached; decode pulls only the blocks
it lacks), `overlap_prefill` (the router encodes item by item, video partition by partition,
and the prefill worker computes the prompt as the pieces arrive), decode chunks of 3 tokens,
encoder outputs over NIXL (all but one-token items'), and a KV pool small enough that
cached blocks are evicted. A seeded workload (`workload`) of text, odd-sized images, videos
grown by appended frames, media repeated across and within requests, multi-turn chats and
bursts of requests sharing media runs `IN_FLIGHT` sessions at a time; each answer's tokens
must equal the offline `Engine`'s (greedy, one request at a time, prefix cache off). The
deployment's counters must show that prefixes, held blocks and encoder outputs were reused,
so the comparison covered the reuse paths and cannot pass vacuously.

The workload is the same on every run (fixed seed), so a mismatch names the request's index
in `workload()` (`tests/differential_workload.py`) and what it held, and `workload()`
rebuilds it. This is the bounded guard of a larger random harness that found no mismatch
over many thousands of requests.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.engine import Engine
from epd.client import Client, GenerateError, Result
from epd.v1 import admin_service_pb2
from tests.cluster import ROLES, Cluster, start_cluster
from tests.differential_workload import Request, Session, workload

pytestmark = pytest.mark.slow

BLOCK = 8
# Per KV worker: the workload's prompts fill several times this, so cached blocks are
# evicted, yet the longest request (about 28 blocks with its answer) fits.
NUM_BLOCKS = 48
# A one-token item's output (64 float32, 256 bytes) travels inline, every larger one as a
# NIXL handle.
INLINE_LIMIT_BYTES = 256
IN_FLIGHT = 4  # sessions sent at once
ONE_THREAD = ("--threads", "1")  # 6 processes share 2 cores: no oversubscribed torch pools

Answer = Result | GenerateError  # a served answer, or how its request failed


def reference(engine: Engine, request: Request) -> list[int]:
    """Greedy tokens of the offline engine, one request at a time, no prefix reuse."""
    p = engine.process(request.messages)
    seq = engine.prefill(
        p.prompt_token_ids, engine.encode(p), request.sampling, use_prefix_cache=False
    )
    while seq.finish_reason is None:
        engine.decode_step([seq])
    engine.release(seq)
    return list(seq.output)


async def serve(cluster: Cluster, sessions: list[Session]) -> dict[int, Answer]:
    """Every request's served answer (or how it failed), by index: `IN_FLIGHT` sessions at a
    time, a session's requests one after another (a burst's all at once)."""
    waiting = deque(sessions)
    served: dict[int, Answer] = {}
    async with Client(cluster.address, api_key=cluster.client_key) as client:

        async def one(request: Request) -> None:
            try:
                served[request.index] = await client.generate_text(
                    request.messages, request.sampling, timeout_s=60
                )
            except GenerateError as exc:  # reported with the request's index, not raised
                served[request.index] = exc

        async def sender() -> None:
            while waiting:
                session = waiting.popleft()
                if session.burst:
                    await asyncio.gather(*(one(r) for r in session.requests))
                    continue
                for request in session.requests:
                    await one(request)

        await asyncio.gather(*(sender() for _ in range(IN_FLIGHT)))
    return served


def cache_hits(status: admin_service_pb2.StatusResponse, role: str) -> int:
    """Cache hits the workers of `role` reported in their last heartbeats."""
    return sum(w.load.cache_hits for w in status.workers if w.info.role == ROLES[role])


def settled_status(cluster: Cluster) -> admin_service_pb2.StatusResponse:
    """Status once the workers' cache counters agree over two heartbeats (every request's
    lookups reported)."""
    last: tuple[int, ...] | None = None
    for _ in range(50):
        status = cluster.status()
        now = tuple(w.load.cache_lookups for w in status.workers)
        if now == last:
            return status
        last = now
        time.sleep(0.3)
    raise AssertionError("worker cache counters never settled")


@dataclass(frozen=True, slots=True)
class Run:
    """What the module's workload got from the deployment."""

    requests: list[Request]
    served: dict[int, Answer]  # answers by request index
    status: admin_service_pb2.StatusResponse  # the router's Status once counters settled


@pytest.fixture(scope="module")
def sessions() -> list[Session]:
    return workload()


@pytest.fixture(scope="module")
def expected(ckpt: Path, sessions: list[Session]) -> dict[int, list[int]]:
    """The offline engine's tokens of every request, by index."""
    engine = Engine.from_pretrained(ckpt, block_size=BLOCK, num_blocks=512, max_batch=1)
    return {r.index: reference(engine, r) for s in sessions for r in s.requests}


@pytest.fixture(scope="module")
def cluster(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(
        ckpt,
        tmp_path_factory.mktemp("logs"),
        block_size=BLOCK,
        num_blocks=NUM_BLOCKS,
        prefills=2,
        decodes=2,
        router_args=("--overlap-prefill", "true"),  # cache-aware routing is on by default
        encoder_args=(*ONE_THREAD, "--inline-limit-bytes", str(INLINE_LIMIT_BYTES)),
        prefill_args=ONE_THREAD,
        decode_args=(*ONE_THREAD, "--stream-interval", "3"),
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def run(cluster: Cluster, sessions: list[Session]) -> Run:
    served = asyncio.run(serve(cluster, sessions))
    cluster.check_alive()
    requests = [r for s in sessions for r in s.requests]
    return Run(requests, served, settled_status(cluster))


def test_every_served_answer_equals_the_offline_engine(
    run: Run, expected: dict[int, list[int]]
) -> None:
    assert 40 <= len(run.requests) <= 60
    wrong = []
    for r in run.requests:
        answer = run.served[r.index]
        if isinstance(answer, GenerateError):
            wrong.append(f"request {r.index} ({r.description}): failed: {answer}")
        elif answer.token_ids != expected[r.index]:
            wrong.append(
                f"request {r.index} ({r.description}): served {answer.token_ids}, "
                f"offline {expected[r.index]}"
            )
    assert not wrong, "\n".join(wrong)


def test_the_workload_reused_prefixes_held_blocks_and_encoder_outputs(run: Run) -> None:
    answers = [a for a in run.served.values() if isinstance(a, Result)]
    # Prefill reused cached prefixes (a repeat's, an overlapped step's), decode workers
    # already held blocks they would otherwise have pulled, and the encoder answered
    # repeated media from its cache.
    assert sum(a.cached_tokens for a in answers) > 0
    assert sum(a.blocks_reused for a in answers) > 0
    assert cache_hits(run.status, "prefill") > 0
    assert cache_hits(run.status, "encoder") > 0
