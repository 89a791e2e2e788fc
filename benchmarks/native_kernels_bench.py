"""The text model's C kernels on vs off, one engine, interleaved in one process.

One engine (`--size`, `--dtype`, one torch thread) runs every case twice per repetition:
once with `common.models.native_kernels` (decode attention, RMSNorm, RMSNorm with RoPE,
silu * up) and once with torch's ops for the same operations (the kernels swapped out
where the model looks them up, as `EPD_NATIVE_KERNELS=0` does for a whole process). Cases:
decode steps at batch 1, 4 and 32 (100-102-token prompts, the batch's lengths differing so
attention takes its per-sequence lengths), and prefill of one 512-token text prompt. CPU
time of this process (`time.process_time`), medians of `--repeats` repetitions; a ratio
above 1 means the C kernels are faster.

    .venv/bin/python benchmarks/native_kernels_bench.py [--size small|bench]
        [--dtype float32|bfloat16] [--repeats 5] [--steps 16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from timing import text_prompt

import common.models.qwen3_vl.attention as attention
import common.models.qwen3_vl.text_ops as text_ops
from common.engine import Engine
from common.models.native_kernels import NativeKernels, native_kernels
from common.models.tiny import default_checkpoint
from common.multimodal.params import MultimodalParams
from common.sampling import SamplingParams

SIDES = ("torch", "C kernels")


def _use(kernels: NativeKernels | None) -> None:
    """Make the text model find `kernels` (None: torch's ops) from now on."""

    def found() -> NativeKernels | None:
        return kernels

    attention.native_kernels = found  # type: ignore[assignment]
    text_ops.native_kernels = found  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=("small", "bench"), default="small")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per sample")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kernels = native_kernels()
    if kernels is None:
        raise SystemExit("the C kernels are not built here (no compiler, or turned off)")
    engine = Engine.from_pretrained(
        default_checkpoint(args.size),
        num_blocks=8192,
        max_batch=32,
        dtype=getattr(torch, args.dtype),
    )
    empty = MultimodalParams((), {}, 0)
    many = SamplingParams(max_tokens=args.steps + 2, ignore_eos=True)
    one = SamplingParams(max_tokens=1, ignore_eos=True)

    def decode(batch: int, rep: int) -> float:
        seqs = [
            engine.prefill(
                text_prompt(rep * 64 + i, 100 + i % 3), empty, many, use_prefix_cache=False
            )
            for i in range(batch)
        ]
        engine.decode_step(seqs)  # the rows of the running batch are loaded
        times = []
        for _ in range(args.steps):
            start = time.process_time()
            engine.decode_step(seqs)
            times.append(time.process_time() - start)
        for seq in seqs:
            engine.release(seq)
        return statistics.median(times)

    def prefill(rep: int) -> float:
        start = time.process_time()
        seq = engine.prefill(text_prompt(rep, 512), empty, one, use_prefix_cache=False)
        elapsed = time.process_time() - start
        engine.release(seq)
        return elapsed

    cases: dict[str, Callable[[int], float]] = {
        "decode step b=1 (ms)": lambda rep: decode(1, rep),
        "decode step b=4 (ms)": lambda rep: decode(4, rep),
        "decode step b=32 (ms)": lambda rep: decode(32, rep),
        "prefill 512 text (ms)": prefill,
    }
    results: dict[tuple[str, str], list[float]] = {}
    for rep in range(args.repeats + 1):  # the first is a warm-up
        for side in SIDES if rep % 2 == 0 else reversed(SIDES):
            _use(kernels if side == "C kernels" else None)
            for name, case in cases.items():
                value = case(rep)
                if rep:
                    results.setdefault((name, side), []).append(value)
    print(
        f"checkpoint {args.size}, {args.dtype}, 1 torch thread, CPU time, medians of "
        f"{args.repeats}; kernels {kernels.library.name}"
    )
    print(f"{'case':26s}{'torch':>10s}{'C kernels':>12s}{'ratio':>9s}")
    for name in cases:
        base, fast = (statistics.median(results[(name, side)]) * 1e3 for side in SIDES)
        print(f"{name:26s}{base:10.2f}{fast:12.2f}{base / fast:8.2f}x")


if __name__ == "__main__":
    main()
