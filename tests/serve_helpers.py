"""Helpers of `tests/test_serve.py`: its `epd serve` subprocess, chats and Status polls."""

from __future__ import annotations

import asyncio
import queue
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.settings.api_keys import default_api_key
from epd.client import Client


@dataclass
class Served:
    """A running `epd serve` subprocess."""

    process: subprocess.Popen[str]
    address: str  # router host:port
    cache_dir: Path  # its EPD_CACHE_DIR
    http_url: str = ""  # the OpenAI-compatible API's base URL (ends in /v1)
    lines: list[str] = field(default_factory=list)  # its output so far


def read_lines(stream: Any, out: queue.Queue[str | None]) -> None:
    for line in stream:
        out.put(line.rstrip("\n"))
    out.put(None)


def chat(text: str, image: Path | None = None, frames: Path | None = None) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = []
    if image is not None:
        content.append({"type": "image", "image": image.read_bytes()})
    if frames is not None:
        video = [p.read_bytes() for p in sorted(frames.iterdir())]
        content.append({"type": "video", "video": video, "fps": 2.0})
    content.append({"type": "text", "text": text})
    return [{"role": "user", "content": content}]


async def admin_status(address: str) -> Any:
    async with Client(address, api_key=default_api_key("admin_key")) as client:
        return await client.status()


async def wait_for(address: str, check: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        status = await admin_status(address)
        if check(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s:.0f}s: {status}")
        await asyncio.sleep(0.25)


def of_role(status: Any, role: int) -> list[Any]:
    return [w for w in status.workers if w.info.role == role]
