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

With `--packing DTYPE` the two sides are instead that dtype with its linear weights not
packed and packed for oneDNN (`packed_weights` false vs true,
`common/models/qwen3_vl/linear.py`): what packing buys on this CPU, and the share of greedy
tokens the two kernels agree on. Either way a ratio above 1 means the second side is faster.

    .venv/bin/python benchmarks/precision_bench.py [--size small|bench] [--repeats 5]
        [--packing float32|bfloat16]
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
    parser.add_argument(
        "--packing",
        choices=("float32", "bfloat16"),
        help="compare this dtype packed vs not packed instead of float32 vs bfloat16",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = default_checkpoint(args.size)
    # Side name -> (dtype, packed_weights); None packs where `packing_pays`.
    sides: dict[str, tuple[torch.dtype, bool | None]] = {
        "float32": (torch.float32, None),
        "bfloat16": (torch.bfloat16, None),
    }
    if args.packing:
        dtype = getattr(torch, args.packing)
        sides = {"plain": (dtype, False), "packed": (dtype, True)}
    engines = {
        name: Engine.from_pretrained(
            folder, num_blocks=4096, max_batch=32, dtype=d, packed_weights=packed
        )
        for name, (d, packed) in sides.items()
    }
    first, second = sides
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
    samples: dict[tuple[str, str], list[float]] = {}
    for rep in range(1, args.repeats + 1):
        for name, case in cases.items():
            for side, engine in engines.items():
                samples.setdefault((name, side), []).append(case(engine, rep))
    same = total = 0
    for i in range(8):
        want, got = (greedy(engines[side], i) for side in (first, second))
        same += sum(a == b for a, b in zip(want, got, strict=True))
        total += len(want)
    print(
        f"checkpoint {folder} ({args.size}), 1 torch thread, medians of {args.repeats}; "
        f"CPU bfloat16 features: {cpu_flags()}"
    )
    if args.packing:
        print(f"{args.packing}, packed_weights false vs true")
    ratio = f"{first}/{second}"
    print(f"{'case':26s} {first:>10s} {second:>10s} {ratio:>14s}")
    for name in cases:
        a, b = (statistics.median(samples[(name, side)]) for side in (first, second))
        print(f"{name:26s} {a:10.2f} {b:10.2f} {a / b:13.2f}x")
    print(f"greedy tokens {second} picks as {first} does: {same}/{total} ({same / total:.0%})")


if __name__ == "__main__":
    main()
