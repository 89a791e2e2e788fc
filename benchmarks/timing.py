"""What the benchmark scripts share: interleaved timing of variants, the CPU time of a
deployment's processes, background load, and the bench prompt.

Run a script from the repository root (`python benchmarks/NAME.py`); its folder is on
`sys.path`, so scripts import this as `timing`.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image


def measure(variants: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """Seconds per run of each variant, after one warm-up run each (first use of a
    descriptor shape, page faults). Variants run round-robin within each repetition, so load
    from other processes on a shared machine hits them alike."""
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def process_cpu_seconds(procs: Mapping[str, subprocess.Popen[bytes]]) -> dict[str, float]:
    """CPU seconds (user + system, every thread) each process has used so far, by name:
    its work, which background load on a shared machine changes far less than wall time
    (Linux `/proc`; NaN where it cannot be read)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    for name, proc in procs.items():
        try:
            stat = Path(f"/proc/{proc.pid}/stat").read_text()
        except OSError:
            out[name] = math.nan
            continue
        # Fields after the command name (which may hold spaces): utime, stime are 14, 15.
        fields = stat.rsplit(")", 1)[1].split()
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """`n` processes spinning a pure-Python loop while the block runs: background load that
    takes a core each (killed on the way out, however the block ends)."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def text_prompt(i: int, n: int) -> list[int]:
    """Token ids of the `i`-th distinct `n`-token text prompt (ids below 1000: plain
    vocabulary), the engine benchmarks' text prompts."""
    return [(i * 131 + j * 7 + 3) % 1000 for j in range(n)]


def image_question() -> list[dict[str, Any]]:
    """One 224x224 random image and a long question: the engine benchmarks' prompt."""
    rng = np.random.default_rng(0)
    picture = Image.fromarray(rng.integers(0, 256, (224, 224, 3), dtype=np.uint8))
    question = "Describe the image in detail and list every object you can see. " * 8
    return [
        {
            "role": "user",
            "content": [{"type": "image", "image": picture}, {"type": "text", "text": question}],
        }
    ]
