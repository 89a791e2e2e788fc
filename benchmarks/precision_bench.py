"""Offline engine in float32 vs bfloat16 on this CPU, interleaved in one process.

Two engines load the same checkpoint (`--size`), one per dtype, one torch thread. Each
repetition runs every case on both in turn, so background load hits them alike:

- prefill of one 512-token text prompt (no prefix reuse), CPU ms;
- the vision tower over one 448x448 image (784 patches), CPU ms;
- decode step at batch 1, 4 and 32 (100-token prompts), CPU ms, median of `--steps` steps;
- greedy agreement: the share of the first 32 greedy tokens of 8 prompts that bfloat16
  picks the same as float32 (bfloat16 rounds every weight and activation to 8 bits of
  mantissa, so its answers are its own, not float32's).

Prints medians and float32/bfloat16 speed ratios, with the CPU's bfloat16 features
(`amx_bf16`: Intel AMX tiles, which oneDNN's bfloat16 GEMMs use; `avx512_bf16`). The
issue benchmarks and the parity tests are float32; this says what `dtype = "bfloat16"`
(a worker setting) buys or costs on the machine at hand.

    .venv/bin/python benchmarks/precision_bench.py [--size small|bench] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from common.engine import Engine
from common.models.tiny import default_checkpoint
from common.multimodal.params import MultimodalParams
from common.sampling import SamplingParams

DTYPES = (torch.float32, torch.bfloat16)
EMPTY = MultimodalParams((), {}, 0)


def prompt(i: int, n: int) -> list[int]:
    """Token ids of a distinct text prompt (ids below 1000: plain vocabulary)."""
    return [(i * 7919 + j * 31) % 900 + 10 for j in range(n)]


def prefill_ms(engine: Engine, rep: int) -> float:
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    start = time.thread_time()
    seq = engine.prefill(prompt(rep, 512), EMPTY, one, use_prefix_cache=False)
    elapsed = time.thread_time() - start
    engine.release(seq)
    return elapsed * 1e3


def encode_ms(engine: Engine, rep: int) -> float:
    rng = np.random.default_rng(rep)
    picture = Image.fromarray(rng.integers(0, 256, (448, 448, 3), dtype=np.uint8))
    content = [{"type": "image", "image": picture}, {"type": "text", "text": "What is it?"}]
    pixels, grids = engine.process([{"role": "user", "content": content}]).vision_inputs()
    pixels = pixels.to(engine.vision.dtype)
    start = time.thread_time()
    with torch.inference_mode():
        engine.vision.encode(pixels, grids)
    return (time.thread_time() - start) * 1e3


def step_ms(engine: Engine, batch: int, rep: int, steps: int) -> float:
    many = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    seqs = [
        engine.prefill(prompt(1000 + rep * 64 + i, 100), EMPTY, many, use_prefix_cache=False)
        for i in range(batch)
    ]
    times = []
    for _ in range(steps):
        start = time.thread_time()
        engine.decode_step(seqs)
        times.append(time.thread_time() - start)
    for seq in seqs:
        engine.release(seq)
    return statistics.median(times) * 1e3


def greedy(engine: Engine, i: int, tokens: int = 32) -> list[int]:
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    seq = engine.prefill(prompt(5000 + i, 64), EMPTY, sampling, use_prefix_cache=False)
    while len(seq.output) < tokens:
        engine.decode_step([seq])
    out = list(seq.output)
    engine.release(seq)
    return out


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "").split()
    found = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    return ", ".join(found) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("small", "bench"), default="small")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = default_checkpoint(args.size)
    engines = {
        d: Engine.from_pretrained(folder, num_blocks=4096, max_batch=32, dtype=d) for d in DTYPES
    }
    cases = {
        "prefill 512 text (ms)": lambda e, r: prefill_ms(e, r),
        "vision tower 448^2 (ms)": lambda e, r: encode_ms(e, r),
        "decode step b=1 (ms)": lambda e, r: step_ms(e, 1, r, args.steps),
        "decode step b=4 (ms)": lambda e, r: step_ms(e, 4, r, args.steps),
        "decode step b=32 (ms)": lambda e, r: step_ms(e, 32, r, args.steps),
    }
    for engine in engines.values():  # warm-up: first use of each shape
        prefill_ms(engine, 0)
        step_ms(engine, 4, 0, 2)
    samples: dict[tuple[str, torch.dtype], list[float]] = {}
    for rep in range(1, args.repeats + 1):
        for name, case in cases.items():
            for dtype, engine in engines.items():
                samples.setdefault((name, dtype), []).append(case(engine, rep))
    same = total = 0
    for i in range(8):
        want, got = (greedy(engines[d], i) for d in DTYPES)
        same += sum(a == b for a, b in zip(want, got, strict=True))
        total += len(want)
    print(
        f"checkpoint {folder} ({args.size}), 1 torch thread, medians of {args.repeats}; "
        f"CPU bfloat16 features: {cpu_flags()}"
    )
    print(f"{'case':26s} {'float32':>10s} {'bfloat16':>10s} {'fp32/bf16':>10s}")
    for name in cases:
        fp32, bf16 = (statistics.median(samples[(name, d)]) for d in DTYPES)
        print(f"{name:26s} {fp32:10.2f} {bf16:10.2f} {fp32 / bf16:9.2f}x")
    print(f"greedy tokens bfloat16 picks as float32 does: {same}/{total} ({same / total:.0%})")


if __name__ == "__main__":
    main()
