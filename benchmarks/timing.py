"""What the benchmark scripts share: interleaved timing of variants, and the bench prompt.

Run a script from the repository root (`python benchmarks/NAME.py`); its folder is on
`sys.path`, so scripts import this as `timing`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
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
