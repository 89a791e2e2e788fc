"""End to end: `python -m epd serve` in a subprocess (its own local Ray, router on 127.0.0.1).

One deployment serves every test of this module, in order:
1. an image + video prompt streams back exactly what the offline `Engine` generates;
2. prefill scales 1 -> 3 -> 1 while 8 client loops keep streaming: every stream finishes
   and each answer equals the one from before the scaling;
3. a decode actor's process is killed with SIGKILL between requests: Ray restarts it, it
   registers again, and the next requests succeed with the same answers.
Tear-down sends SIGINT and expects a clean stop (drain, router stop, Ray shut down, exit 0).
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from cluster.cli import build_parser, main
from cluster.scale import cmd_scale
from common.sampling import SamplingParams
from common.settings.api_keys import default_api_key
from epd.client import Client
from tests.cluster import listening_pid
from tests.serve_helpers import Served, admin_status, chat, of_role, read_lines, wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 400.0
DRAIN_TIMEOUT_S = 30  # [pools] drain_timeout_s
SAMPLING = SamplingParams(max_tokens=12)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    cache = tmp_path_factory.mktemp("epd-cache")
    # `epd serve` writes the deployment's token and keys under $EPD_HOME; this process's
    # clients and `epd` commands find them there by default, as in the README tour.
    home = str(tmp_path_factory.mktemp("epd-home"))
    saved_home = os.environ.get("EPD_HOME")
    os.environ["EPD_HOME"] = home
    env = {**os.environ, "EPD_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable,
        "-m",
        "epd",
        "serve",
        "--router-port=0",
        "--router-http-port=0",
        "--ray-num-cpus=2",
        f"--pools-drain-timeout-s={DRAIN_TIMEOUT_S}",
    ]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # Ctrl-C of the test run does not reach it; we stop it
    )
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=read_lines, args=(process.stdout, lines), daemon=True).start()
    result = Served(process, "", cache)

    def next_line(deadline: float) -> str | None:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        if line is not None:
            result.lines.append(line)
        return line

    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not any(line.startswith("ready in") for line in result.lines):
            line = next_line(deadline)
            if line is None:
                raise AssertionError("epd serve exited:\n" + "\n".join(result.lines))
            if line.startswith("router listening on "):
                result.address = line.removeprefix("router listening on ").strip()
            if line.startswith("OpenAI-compatible HTTP API on "):
                result.http_url = line.removeprefix("OpenAI-compatible HTTP API on ").strip()
        assert any(line.startswith("API keys for this deployment") for line in result.lines)
        yield result
    finally:
        if saved_home is None:
            os.environ.pop("EPD_HOME", None)
        else:
            os.environ["EPD_HOME"] = saved_home
        stopping = time.monotonic()
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        while True:
            try:
                line = lines.get(timeout=5)
            except queue.Empty:
                break
            if line is None:
                break
            result.lines.append(line)
    output = "\n".join(result.lines)
    assert process.returncode == 0, output
    assert "stopping the local Ray cluster" in output and result.lines[-1] == "stopped", output
    # Quiet logs (cluster.logs): piped output has no colour codes, and neither Ray's nor
    # NIXL's start-up notices nor a heartbeat warning for the prefill workers a scale-down
    # retired (the decode worker the restart test kills is rightly a warning).
    for noise in ("\x1b[", "Token authentication", "NIXL INFO", "deduplicates logs"):
        assert noise not in output, (noise, output)
    assert "dropped prefill worker" not in output, output
    # The routers stop after the workers retire: stopped first, every worker warned of a
    # failed heartbeat on its way out (docsdrift review, s37). Not where a drain ran out of
    # time on a loaded machine (the router may then go first, as the Controller is killed).
    if time.monotonic() - stopping < DRAIN_TIMEOUT_S:
        assert "heartbeat with router" not in output[output.index("\nstopping ...") :], output


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 64x96 image file and a folder of four 64x64 frames."""
    folder = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(7)
    image = folder / "image.png"
    Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(image)
    frames = folder / "frames"
    frames.mkdir()
    for i in range(4):
        frame = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(frame).save(frames / f"{i:03d}.png")
    return image, frames


# --------------------------------------------------------------------------------- tests


async def test_image_and_video_answer_equals_offline_engine(
    served: Served, media: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert any("preparing the built-in tiny checkpoint" in line for line in served.lines)
    image, frames = media
    messages = chat("Describe the image and the video.", image, frames)
    async with Client(served.address) as client:
        chunks = [c async for c in client.generate(messages, SAMPLING)]
    tokens = [t for c in chunks for t in c.token_ids]
    assert len(chunks) > 1, "the answer should stream in several chunks"
    assert chunks[-1].finish_reason in ("stop", "length")

    from common.engine import Engine

    engine = await asyncio.to_thread(
        Engine.from_pretrained, served.cache_dir / "checkpoints" / "tiny-0"
    )
    expected = await asyncio.to_thread(engine.generate, messages, SAMPLING)
    assert tokens == expected.token_ids
    assert "".join(c.text for c in chunks) == expected.text

    # The same request through the CLI's generate, which prints the stats line.
    args = build_parser().parse_args(
        [
            "generate",
            "Describe the image and the video.",
            "--image",
            str(image),
            "--video",
            str(frames),
            "--max-tokens",
            str(SAMPLING.max_tokens),
            "--address",
            served.address,
        ]
    )
    from cluster.cli import cmd_generate

    assert await cmd_generate(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(expected.text)
    assert "TTFT" in out and "tokens/s" in out and "reused" in out and "pulled" in out


async def test_openai_client_streams_an_image_chat_with_cached_tokens_and_metrics(
    served: Served, media: tuple[Path, Path]
) -> None:
    """The issue's check: with `epd serve` running, the `openai` client streams an image
    chat, a repeated request reports cached tokens, and /metrics counts the requests."""
    import base64

    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from common.settings.api_keys import CLIENT_KEY_FILE

    assert served.http_url.startswith("http://127.0.0.1:"), served.lines
    image, _ = media
    url = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
    messages: Any = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is in the picture?"},
            ],
        }
    ]
    client = openai.AsyncOpenAI(base_url=served.http_url, api_key=default_api_key(CLIENT_KEY_FILE))
    cached: list[int] = []
    for _ in range(2):
        stream = await client.chat.completions.create(
            model=(await client.models.list()).data[0].id,
            messages=messages,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage, finish = [], None, []
        async for chunk in stream:
            usage = chunk.usage or usage
            pieces += [c.delta.content or "" for c in chunk.choices]
            finish += [c.finish_reason for c in chunk.choices if c.finish_reason]
        # The offline engine's greedy answer to this prompt is six tokens, the first "very".
        assert usage is not None and usage.completion_tokens > 0 and "".join(pieces), (
            usage,
            pieces,
            finish,
        )
        details = usage.prompt_tokens_details
        cached.append((details.cached_tokens or 0) if details is not None else 0)
    assert cached[1] > 0, cached
    base = served.http_url.removesuffix("/v1")
    metrics = await asyncio.to_thread(
        lambda: (
            urllib.request.urlopen(
                urllib.request.Request(
                    f"{base}/metrics",
                    headers={"Authorization": f"Bearer {default_api_key('admin_key')}"},
                ),
                timeout=10,
            )
            .read()
            .decode()
        )
    )
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    count = next(
        s.value
        for s in families["vllm:e2e_request_latency_seconds"].samples
        if s.name.endswith("_count")
    )
    assert count >= 2


async def test_scale_prefill_up_and_down_while_streams_run(
    served: Served, media: tuple[Path, Path]
) -> None:
    image, _ = media
    prompts = [
        chat(f"Question {i}: what is in the picture?", image if i % 2 == 0 else None)
        for i in range(8)
    ]
    async with Client(served.address) as client:
        reference = [
            r.token_ids
            for r in await asyncio.gather(*(client.generate_text(p, SAMPLING) for p in prompts))
        ]

    done = asyncio.Event()
    answers: list[list[list[int]]] = [[] for _ in prompts]

    async def stream(i: int) -> None:
        async with Client(served.address) as client:
            while not done.is_set():
                result = await client.generate_text(prompts[i], SAMPLING, timeout_s=120)
                assert result.finish_reason in ("stop", "length")
                answers[i].append(result.token_ids)

    loops = [asyncio.create_task(stream(i)) for i in range(len(prompts))]
    prefill = 2  # registry_service_pb2.WORKER_ROLE_PREFILL
    try:
        args = build_parser().parse_args(
            ["scale", "--role", "prefill", "--replicas", "2", "--address", served.address]
        )
        assert await cmd_scale(args) == 0
        await wait_for(
            served.address,
            lambda s: len(of_role(s, prefill)) == 2,
            180,
            "2 prefill workers registered",
        )
        served_by = await wait_for(
            served.address,
            lambda s: sum(w.load.cache_lookups > 0 for w in of_role(s, prefill)) >= 2,
            60,
            "requests on a new prefill worker",
        )
        assert len(of_role(served_by, prefill)) == 2
        during_up = sum(map(len, answers))

        args = build_parser().parse_args(
            ["scale", "--role", "prefill", "--replicas", "1", "--address", served.address]
        )
        assert await cmd_scale(args) == 0  # returns once the retired worker has left
        status = await admin_status(served.address)
        assert len(of_role(status, prefill)) == 1
        assert not any(w.draining for w in status.workers)
    finally:
        done.set()
        results = await asyncio.gather(*loops, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    assert during_up > 0 and sum(map(len, answers)) > during_up
    for i, got in enumerate(answers):
        assert got, f"stream {i} finished no request"
        assert all(tokens == reference[i] for tokens in got), f"stream {i} answers changed"


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")
async def test_killed_decode_actor_is_restarted_and_registers_again(served: Served) -> None:
    decode = 3  # registry_service_pb2.WORKER_ROLE_DECODE
    messages = chat("Count the apples on the table.")
    async with Client(served.address) as client:
        before = await client.generate_text(messages, SAMPLING)
    status = await admin_status(served.address)
    (worker,) = of_role(status, decode)
    old_address = worker.info.address
    pid = listening_pid(int(old_address.rsplit(":", 1)[1]))
    assert pid != served.process.pid
    os.kill(pid, signal.SIGKILL)

    await wait_for(
        served.address,
        lambda s: (
            [w.info.address for w in of_role(s, decode)] not in ([], [old_address])
            and len(of_role(s, decode)) == 1
        ),
        240,
        "the restarted decode worker registered (and the dead one dropped)",
    )
    status = await admin_status(served.address)
    (restarted,) = of_role(status, decode)
    assert restarted.info.name == worker.info.name  # same actor, new process and port
    async with Client(served.address) as client:
        for _ in range(2):
            after = await client.generate_text(messages, SAMPLING, timeout_s=120)
            assert after.token_ids == before.token_ids

    assert await asyncio.to_thread(main, ["status", "--address", served.address]) == 0
