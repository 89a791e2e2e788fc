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
in `workload()` and what it held, and `workload()` rebuilds it. This is the bounded guard of
a larger random harness that found no mismatch over many thousands of requests.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from common.engine import Engine
from common.sampling import SamplingParams
from epd.client import Client, GenerateError, Result
from epd.v1 import admin_service_pb2
from tests.cluster import ROLES, Cluster, start_cluster

pytestmark = pytest.mark.slow

SEED = 20240607
BLOCK = 8
# Per KV worker: the workload's prompts fill several times this, so cached blocks are
# evicted, yet the longest request (about 28 blocks with its answer) fits.
NUM_BLOCKS = 48
# A one-token item's output (64 float32, 256 bytes) travels inline, every larger one as a
# NIXL handle.
INLINE_LIMIT_BYTES = 256
IN_FLIGHT = 4  # sessions sent at once
ONE_THREAD = ("--threads", "1")  # 6 processes share 2 cores: no oversubscribed torch pools

# Words of the prompts' text, accents, CJK and an emoji among them.
VOCABULARY = (
    "the a cat dog video frame image what where why describe colour shape left right moves "
    "first last tell me about this picture quickly please ok yes no red blue green car tree "
    "house sky 12 7 3.5 , . ? ! ü é 漢字 🙂"
)
FPS = (0.5, 1.0, 2.0, 2.0, 3.0, 7.3, 24.0)  # 2.0 is the processor's sampling rate
# (width, height, mode) of the shared images: tiny, wide and tall near the aspect limit (200),
# ordinary, larger than the processor's most pixels, with alpha and grey.
IMAGE_SIZES = (
    (1, 1, "RGB"),
    (5, 3, "RGB"),
    (600, 4, "RGB"),
    (2, 390, "RGB"),
    (64, 48, "RGB"),
    (131, 97, "RGB"),
    (300, 220, "RGB"),
    (40, 30, "RGBA"),
    (33, 65, "L"),
)
# (frames, width, height) of the shared videos.
VIDEO_SHAPES = ((9, 64, 48), (4, 32, 32), (1, 80, 6), (6, 40, 56))
# Session kinds and how many of each the workload holds (about 50 requests in all).
KINDS = {"text": 8, "images": 12, "video": 6, "grow": 3, "chat": 3, "burst": 2}


Answer = Result | GenerateError  # a served answer, or how its request failed


@dataclass(frozen=True, slots=True)
class Request:
    """One chat request of the workload."""

    index: int  # position in the workload, which a mismatch names
    description: str  # what the request holds, for a mismatch message
    messages: list[dict[str, Any]]
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class Session:
    """Requests one client sends one after another, or all at once (`burst`)."""

    requests: list[Request]
    burst: bool = False


@dataclass(frozen=True, slots=True)
class Media:
    """A chat part and how a mismatch message names it."""

    part: dict[str, Any]
    name: str


class WorkloadBuilder:
    """Builds the seeded sessions. Media objects are shared between requests (and sometimes
    copied: same pixels, another object), so repeats find what earlier requests cached."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.count = 0  # requests built so far: the next one's index
        self.words = VOCABULARY.split()
        self.images = [self.image(w, h, mode) for w, h, mode in IMAGE_SIZES]
        self.videos = [self.pixels((t, h, w, 3)) for t, w, h in VIDEO_SHAPES]

    def pixels(self, shape: tuple[int, ...]) -> np.ndarray:
        """Random uint8 pixels of `shape`, from the workload's seed."""
        return np.random.default_rng(self.rng.randrange(1 << 30)).integers(0, 256, shape, np.uint8)

    def image(self, width: int, height: int, mode: str) -> Image.Image:
        channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
        arr = self.pixels((height, width, channels))
        return Image.fromarray(arr[..., 0] if mode == "L" else arr, mode)

    def text(self, lo: int = 1, hi: int = 10) -> str:
        return " ".join(self.rng.choice(self.words) for _ in range(self.rng.randint(lo, hi)))

    def sampling(self) -> SamplingParams:
        """Greedy; up to 16 tokens; stopping at the end-of-sequence token half the time."""
        return SamplingParams(
            max_tokens=self.rng.randint(1, 16), ignore_eos=self.rng.random() < 0.5
        )

    def pick_image(self) -> Media:
        """A shared image: itself, or a copy of its pixels (the content hash must match)."""
        i = self.rng.randrange(len(self.images))
        w, h, mode = IMAGE_SIZES[i]
        image, name = self.images[i], f"img{i} {w}x{h} {mode}"
        if self.rng.random() < 0.2:
            image, name = image.copy(), name + " (copy)"
        return Media({"type": "image", "image": image}, name)

    def video(self, frames: np.ndarray, fps: float, name: str) -> Media:
        """A video part: the frames as one array or as a list of images."""
        as_list = self.rng.random() < 0.5
        video: Any = [Image.fromarray(f) for f in frames] if as_list else frames
        form = "list" if as_list else "array"
        return Media({"type": "video", "video": video, "fps": fps}, f"{name} @{fps}fps {form}")

    def pick_video(self) -> Media:
        i = self.rng.randrange(len(self.videos))
        frames = self.videos[i]
        return self.video(frames, self.rng.choice(FPS), f"vid{i} {len(frames)} frames")

    def grown(self, frames: np.ndarray, most: int = 9) -> np.ndarray:
        """`frames` with 1 to 3 new frames appended (at most `most` in all)."""
        extra = self.pixels((self.rng.randint(1, 3), *frames.shape[1:]))
        return np.concatenate([frames, extra])[:most]

    def content(self, media: list[Media]) -> tuple[list[dict[str, Any]], list[str]]:
        """User content: `media` in order, random text before some and after the last."""
        parts: list[dict[str, Any]] = []
        for m in media:
            if self.rng.random() < 0.6:
                parts.append({"type": "text", "text": self.text()})
            parts.append(m.part)
        if not media or self.rng.random() < 0.8:
            parts.append({"type": "text", "text": self.text()})
        return parts, [m.name for m in media]

    def user_turn(self) -> tuple[Any, list[str]]:
        """A user message's content: text only, images, or a video with maybe an image."""
        kind = self.rng.random()
        if kind < 0.3:
            return self.text(1, 20), []
        if kind < 0.65:
            return self.content([self.pick_image() for _ in range(self.rng.randint(1, 2))])
        return self.content([self.pick_image(), self.pick_video()][self.rng.randint(0, 1) :])

    def request(self, kind: str, messages: list[dict[str, Any]], media: list[str]) -> Request:
        sampling = self.sampling()
        held = ", ".join(media) if media else "text only"
        description = (
            f"{kind}: {held}; max_tokens {sampling.max_tokens}, ignore_eos {sampling.ignore_eos}"
        )
        self.count += 1
        return Request(self.count - 1, description, messages, sampling)

    def session(self, kind: str) -> Session:
        if kind == "text":
            messages = [{"role": "user", "content": self.text(1, 24)}]
            if self.rng.random() < 0.4:
                messages.insert(0, {"role": "system", "content": self.text()})
            return Session([self.request(kind, messages, [])])
        if kind == "images":
            chosen = [self.pick_image() for _ in range(self.rng.randint(1, 3))]
            if self.rng.random() < 0.3:
                chosen.append(chosen[0])  # the same image twice in one request
            parts, names = self.content(chosen)
            return Session([self.request(kind, [{"role": "user", "content": parts}], names)])
        if kind == "video":
            media = [self.pick_video()]
            if self.rng.random() < 0.4:
                media.insert(0, self.pick_image())
            parts, names = self.content(media)
            return Session([self.request(kind, [{"role": "user", "content": parts}], names)])
        if kind == "grow":
            return self.grow_session()
        if kind == "chat":
            return self.chat_session()
        return self.burst_session()

    def grow_session(self) -> Session:
        """A new video asked about, then asked about again with frames appended."""
        height = self.rng.randint(8, 80)
        frames = self.pixels((self.rng.randint(1, 5), height, 40, 3))
        fps, before, question = self.rng.choice(FPS), self.text(), self.text()
        requests = []
        for step in range(self.rng.randint(2, 3)):
            name = f"new video 40x{height} {len(frames)} frames (step {step})"
            video = self.video(frames, fps, name)
            parts = [{"type": "text", "text": before}, video.part]
            parts.append({"type": "text", "text": question})
            requests.append(
                self.request("grow", [{"role": "user", "content": parts}], [video.name])
            )
            frames = self.grown(frames)
        return Session(requests)

    def chat_session(self) -> Session:
        """2 to 3 turns, each request the whole conversation so far."""
        messages: list[dict[str, Any]] = []
        if self.rng.random() < 0.5:
            messages.append({"role": "system", "content": self.text()})
        requests, names = [], []
        for turn in range(self.rng.randint(2, 3)):
            content, media = self.user_turn()
            names += media
            messages = [*messages, {"role": "user", "content": content}]
            requests.append(self.request(f"chat turn {turn}", list(messages), list(names)))
            messages = [*messages, {"role": "assistant", "content": self.text(1, 12)}]
        return Session(requests)

    def burst_session(self) -> Session:
        """3 to 4 requests on the same video (and maybe image), sent at once: identical,
        with more text, or with frames appended."""
        i = self.rng.randrange(len(self.videos))
        frames, fps = self.videos[i], self.rng.choice(FPS)
        image = self.pick_image() if self.rng.random() < 0.5 else None
        lead = self.text()
        requests = []
        for _ in range(self.rng.randint(3, 4)):
            variant = self.rng.choice(("same", "more text", "grown"))
            video = frames if variant != "grown" else self.grown(frames, most=12)
            v = self.video(video, fps, f"vid{i} {len(video)} frames")
            media = [v] if image is None else [image, v]
            parts = [{"type": "text", "text": lead}, *(m.part for m in media)]
            if variant == "more text":
                parts.append({"type": "text", "text": self.text()})
            names = [m.name for m in media]
            messages = [{"role": "user", "content": parts}]
            requests.append(self.request(f"burst ({variant})", messages, names))
        return Session(requests, burst=True)


def workload(seed: int = SEED) -> list[Session]:
    """The sessions of the test, in the order they are started; requests are numbered
    0, 1, ... in that order."""
    builder = WorkloadBuilder(seed)
    kinds = [kind for kind, n in KINDS.items() for _ in range(n)]
    builder.rng.shuffle(kinds)
    return [builder.session(kind) for kind in kinds]


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
