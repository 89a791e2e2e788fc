"""The router's request preparation for a repeated image, with and without the
processed-image cache (`common.processing.image_cache`), interleaved in one run.

Prepare = `router.inputs.messages_from_proto` + `Processor.process`, as `RouterServicer`
runs them: for a PNG the cache has seen, only the header is opened and the bytes digested;
without the cache the image is decoded, resized, normalised, patchified and content-hashed
again. Times are CPU seconds (`time.process_time`, so other processes' load does not count),
medians of `--reps`, `torch.set_num_threads(1)`.

    .venv/bin/python benchmarks/image_cache_bench.py [--model DIR] [--size 224] [--reps 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from served import messages, png

from common.models.tiny import default_checkpoint
from common.processing.processor import Processor
from epd.client import build_request
from router.inputs import messages_from_proto


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: bench)")
    parser.add_argument("--size", type=int, default=224, help="image side")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = args.model or default_checkpoint("bench")
    cached = Processor.from_pretrained(model, image_cache_bytes=256 << 20)
    plain = Processor.from_pretrained(model)
    request = build_request(messages(png(3, args.size), 0))
    variants = {
        "no cache": lambda: plain.process(messages_from_proto(request.messages)),
        "cached": lambda: cached.process(messages_from_proto(request.messages, processor=cached)),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(args.reps + 1):
        for name, fn in variants.items():
            start = time.process_time()
            fn()
            if rep:  # the first round warms up (and fills the cache)
                times[name].append(time.process_time() - start)
    a, b = (statistics.median(times[n]) * 1e3 for n in variants)
    print(f"{model.name}, {args.size}px PNG, CPU ms per request, medians of {args.reps}:")
    print(f"  no cache {a:7.2f}   cached {b:7.2f}   no cache / cached {a / b:5.1f}x")


if __name__ == "__main__":
    main()
