"""`tune_malloc`: the process's glibc malloc thresholds, set once, by each engine that runs
forwards on the CPU."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from common.models.malloc_settings import tune_malloc
from common.models.qwen3_vl.vision import VisionTower
from common.processing.processor import Processor
from encoder_worker import engine as encoder_engine
from encoder_worker.cache import EncoderCache
from encoder_worker.server import load_tower
from encoder_worker.settings import EncoderSettings
from tests.test_encoder_engine import tower

__all__ = ["tower"]  # a fixture


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_the_thresholds_and_a_second_call_changes_nothing() -> None:
    assert tune_malloc()
    assert tune_malloc()


def test_the_encoder_engine_tunes_malloc_when_it_starts(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[None] = []

    def record() -> bool:
        calls.append(None)
        return True

    monkeypatch.setattr(encoder_engine, "tune_malloc", record)
    tower = load_tower(ckpt, EncoderSettings())[1]
    encoder_engine.EncoderEngine(tower, EncoderCache(1 << 20))
    assert len(calls) == 1


ARENAS_SCRIPT = """
import ctypes
import sys
import threading
import torch
from common.models.malloc_settings import tune_malloc

torch.set_num_threads(1)  # as a worker runs
assert tune_malloc()
def burst():  # a forward's activations: 120 MB live in 3 MB tensors, then freed
    live = [torch.ones(768 * 1024) for _ in range(40)]
    del live
threads = [threading.Thread(target=burst) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
out = libc.fopen(sys.argv[1].encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(out))
libc.fclose(ctypes.c_void_p(out))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_threads_share_few_malloc_arenas(tmp_path: Path) -> None:
    # The trim threshold holds per malloc arena and glibc makes up to eight a core: a
    # prefill worker under load kept 12 arenas of 38-62 MB (850 MB resident after 150 s
    # idle, 290 MB at start); eight threads each using and freeing 120 MB, 560 MB more.
    import subprocess
    import sys

    from common.models.malloc_settings import ARENA_MAX
    from tests.cluster import ROOT

    info = tmp_path / "malloc.xml"
    done = subprocess.run(
        [sys.executable, "-c", ARENAS_SCRIPT, str(info)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    arenas = info.read_text().count("<heap nr=")
    assert 1 <= arenas <= ARENA_MAX, info.read_text()[:2000]


REST_SCRIPT = """
import asyncio, io
import numpy as np
from PIL import Image
from common.models.tiny import default_checkpoint
from common.processing.limits import InputLimits
from common.processing.processor import Processor
from epd.v1 import router_service_pb2
from router.inputs import messages_from_proto
from router.prepare_threads import PrepareThreads

threads = PrepareThreads()  # as a router starts
processor = Processor.from_pretrained(default_checkpoint("tiny"))
rng = np.random.default_rng(0)
photos = []
for _ in range(4):
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (1536, 2048, 3), np.uint8)).save(buf, "JPEG")
    photos.append(buf.getvalue())

def resident():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

def answer(k):
    request = router_service_pb2.GenerateRequest()
    message = request.messages.add(role="user")
    for data in photos[k % 4 :] + photos[: k % 4]:
        message.content.add().image.data = data
    message.content.add().text = "What is there?"
    reserved = []
    limits = InputLimits()
    processor.process(messages_from_proto(request.messages, limits, reserve=reserved.append))
    return reserved[0]

async def main():
    answer(0)
    start = resident()
    for _ in range(3):  # bursts of six requests of four photos, on the router's threads
        runs = [threads.run(True, None, answer, k) for k in range(6)]
        reserved = sum(await asyncio.gather(*runs))
    await asyncio.sleep(1.0)  # idle: what they freed is given back
    print(resident() - start, reserved)

asyncio.run(main())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_router_gives_back_what_a_burst_of_photos_took(tmp_path: Path) -> None:
    # Under glibc's adaptive mmap threshold a router kept 0.6-1.4 GB after bursts of photos
    # (here 323 MB after one of 302 MB reserved), and peaked at twice its in-flight bound
    # above idle (burstmem review). With the MEDIA profile and the trim once idle: ~0.
    import subprocess
    import sys

    from tests.cluster import ROOT

    done = subprocess.run(
        [sys.executable, "-c", REST_SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    kept, reserved = (int(v) for v in done.stdout.split())
    assert kept < 0.25 * reserved, (kept, reserved)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_forwards_win_over_media_in_a_process_that_runs_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Tests run routers and model runners in one process: whichever came first stayed, so
    # forwards ran 10-15% slower under MEDIA, and tune_malloc said True (ownfix review).
    from common.models import malloc_settings
    from common.models.malloc_settings import FORWARDS, MEDIA

    monkeypatch.setattr(malloc_settings, "_tuned", None)
    assert tune_malloc(MEDIA)
    assert tune_malloc(FORWARDS) and malloc_settings._tuned == FORWARDS
    assert not tune_malloc(MEDIA) and malloc_settings._tuned == FORWARDS
    assert tune_malloc()


async def test_the_preparing_threads_give_memory_back_once_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio
    import time

    from router import prepare_threads

    released: list[None] = []
    monkeypatch.setattr(prepare_threads, "release_free_memory", lambda: released.append(None))
    monkeypatch.setattr(prepare_threads, "IDLE_RELEASE_S", 0.05)
    threads = prepare_threads.PrepareThreads()
    try:
        await threads.run(False, None, sum, [1, 2])  # light work frees no media
        await asyncio.sleep(0.3)
        assert released == []
        await threads.run(True, None, sum, [1, 2])
        await asyncio.sleep(0.3)
        assert len(released) == 1
        running = asyncio.ensure_future(threads.run(True, None, time.sleep, 0.2))
        await asyncio.sleep(0.05)
        await threads.close()  # work running as it closes: no trim after (ownfix review)
        await running
        await asyncio.sleep(0.3)
        assert len(released) == 1
    finally:
        await threads.close()


async def test_memory_is_given_back_once_the_encoder_is_idle(
    processor: Processor, tower: VisionTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    # The cache's entries, which live on, pin the heap's holes a burst's batches freed: an
    # encoder rested 0.9-1.0 GB beyond its cache after bursts (workermem review).
    from common.models import malloc_settings
    from tests.test_encoder_engine import make_engine, shape_jobs

    released: list[None] = []
    monkeypatch.setattr(malloc_settings, "release_free_memory", lambda: released.append(None))
    monkeypatch.setattr(malloc_settings, "IDLE_RELEASE_S", 0.05)
    engine = make_engine(tower, EncoderCache(1 << 30), batch_window_s=0.0)
    await asyncio.sleep(0.2)
    assert released == []  # nothing ran: nothing to give back
    await engine.encode(shape_jobs(processor, "contiguous", 2))
    await asyncio.sleep(0.3)
    assert len(released) == 1  # once a batch ran and it stayed idle, not again while idle
    await engine.close()
