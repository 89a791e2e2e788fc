"""Offline engine speed: this checkout vs a checkout of the landed commit vs `transformers`.

Three worker processes (one torch thread each) load the same "small" checkpoint (text 4 x
256, vision depth 2): `epd` imports this checkout, `landed` imports `--landed` (a checkout
of the code before the change, made with `git worktree add --detach /tmp/landed 51e99ae`),
`ref` runs `transformers`' Qwen3-VL. The parent sends every case to the three in turn,
`--repeats` times, so background load hits them alike, and prints medians and ratios:

- decode tok/s at batch 1, 4 (a served deployment's usual batch) and 32 (batch / median
  step time over `--steps` steps, after prefilling 100-token prompts without prefix reuse),
  and at batch 32 after 512-token ones;
- prefill tok/s of one 512-token text prompt, and of a 224x224 image prompt (processing,
  vision tower and language model);
- wall seconds for 32 prompts x 16 tokens with 1 new token (landed: one prefill each, as its
  `generate_batch` admits them; epd: `Engine.prefill_many`; ref: one batched `generate`).

`--load N` adds N busy-loop processes for the whole run (to compare loaded vs quiet);
`--threads N` gives each worker N torch threads (1 by default); `--cases "decode b=1,prefill"`
runs only the cases whose names start so (more repeats of a few cases in the same time).

    .venv/bin/python benchmarks/engine_vs_landed.py [--landed /tmp/landed] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from timing import busy_loops, text_prompt

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("landed", "epd", "ref")
# (case, unit, higher is better)
CASES = (
    ("decode b=1", "tok/s", True),
    ("decode b=4", "tok/s", True),
    ("decode b=32", "tok/s", True),
    ("decode b=32, 512 ctx", "tok/s", True),
    ("prefill 512 text", "tok/s", True),
    ("prefill 224^2 image", "tok/s", True),
    ("32 x 16 tok, 1 new", "s", False),
)


# ------------------------------------------------------------------------------ worker


class Stamp:
    """Wall and CPU time of this process at one moment; `b - a` is the pair of durations.

    On a loaded machine the wall time of a one-thread worker mostly counts the time it waits
    for a core; its CPU time counts the work, so the report gives both."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = time.process_time()

    def __sub__(self, other: Stamp) -> tuple[float, float]:
        return self.wall - other.wall, self.cpu - other.cpu


Pair = tuple[float, float]  # a value by wall time, and by CPU time


def _rate(work: float, durations: list[Pair] | Pair) -> Pair:
    """`work` per median duration, for wall and CPU time."""
    spans = durations if isinstance(durations, list) else [durations]
    return (
        work / statistics.median(d[0] for d in spans),
        work / statistics.median(d[1] for d in spans),
    )


def _engine_cases(steps: int) -> dict[str, Callable[[int], Pair]]:
    import torch

    from common.engine import Engine
    from common.models.tiny import default_checkpoint
    from common.multimodal.params import MultimodalParams
    from common.sampling import SamplingParams

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from timing import image_question

    engine = Engine.from_pretrained(default_checkpoint("small"), num_blocks=4096, max_batch=32)
    empty = MultimodalParams((), {}, 0)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    many = SamplingParams(max_tokens=steps + 1, ignore_eos=True)

    def decode(batch: int, rep: int, context: int = 100) -> Pair:
        seqs = [
            engine.prefill(text_prompt(rep * 64 + i, context), empty, many, use_prefix_cache=False)
            for i in range(batch)
        ]
        times = []
        for _ in range(steps):
            start = Stamp()
            engine.decode_step(seqs)
            times.append(Stamp() - start)
        for s in seqs:
            engine.release(s)
        return _rate(batch, times)

    def prefill_text(rep: int) -> Pair:
        start = Stamp()
        seq = engine.prefill(text_prompt(rep, 512), empty, one, use_prefix_cache=False)
        elapsed = Stamp() - start
        engine.release(seq)
        return _rate(512, elapsed)

    def prefill_image(rep: int) -> Pair:
        start = Stamp()
        processed = engine.process(image_question())
        params = engine.encode(processed)
        seq = engine.prefill(processed.prompt_token_ids, params, one, use_prefix_cache=False)
        elapsed = Stamp() - start
        engine.release(seq)
        return _rate(len(processed.prompt_token_ids), elapsed)

    def short(rep: int) -> Pair:
        prompts = [(text_prompt(rep * 32 + i, 16), empty) for i in range(32)]
        start = Stamp()
        if hasattr(engine, "prefill_many"):
            seqs = engine.prefill_many(prompts, one, use_prefix_cache=False)
        else:  # the landed engine prefills one prompt at a time
            seqs = [engine.prefill(t, p, one, use_prefix_cache=False) for t, p in prompts]
        elapsed = Stamp() - start
        for s in seqs:
            engine.release(s)
        return elapsed

    torch.manual_seed(0)
    return {
        "decode b=1": lambda rep: decode(1, rep),
        "decode b=4": lambda rep: decode(4, rep),
        "decode b=32": lambda rep: decode(32, rep),
        "decode b=32, 512 ctx": lambda rep: decode(32, rep, 512),
        "prefill 512 text": prefill_text,
        "prefill 224^2 image": prefill_image,
        "32 x 16 tok, 1 new": short,
    }


def _ref_cases(steps: int) -> dict[str, Callable[[int], Pair]]:
    import torch
    import transformers

    from common.engine import Engine
    from common.models.tiny import default_checkpoint

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from engine_bench import ref_inputs
    from timing import image_question

    folder = default_checkpoint("small")
    engine = Engine.from_pretrained(folder, num_blocks=64)  # its processor only
    ref = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32
    ).eval()
    ref.generation_config.eos_token_id = None

    class Clock(transformers.LogitsProcessor):
        """Stamps the time at every generation step."""

        def __init__(self) -> None:
            self.stamps: list[Stamp] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.stamps.append(Stamp())
            return scores

    def generate(inputs: dict[str, torch.Tensor], new: int, clock: Clock | None = None) -> None:
        with torch.no_grad():
            ref.generate(
                **inputs,
                max_new_tokens=new,
                do_sample=False,
                logits_processor=transformers.LogitsProcessorList([clock] if clock else []),
            )

    def text_inputs(ids: list[list[int]]) -> dict[str, torch.Tensor]:
        t = torch.tensor(ids)
        return {"input_ids": t, "attention_mask": torch.ones_like(t)}

    def decode(batch: int, rep: int, context: int = 100) -> Pair:
        clock = Clock()
        prompts = [text_prompt(rep * 64 + i, context) for i in range(batch)]
        generate(text_inputs(prompts), steps + 1, clock)
        gaps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:], strict=False)]
        return _rate(batch, gaps)

    def timed(fn: Callable[[], object]) -> Pair:
        start = Stamp()
        fn()
        return Stamp() - start

    def prefill_image(rep: int) -> Pair:
        start = Stamp()
        processed = engine.process(image_question())
        generate(ref_inputs(engine, processed, 1), 1)
        return _rate(len(processed.prompt_token_ids), Stamp() - start)

    return {
        "decode b=1": lambda rep: decode(1, rep),
        "decode b=4": lambda rep: decode(4, rep),
        "decode b=32": lambda rep: decode(32, rep),
        "decode b=32, 512 ctx": lambda rep: decode(32, rep, 512),
        "prefill 512 text": lambda rep: _rate(
            512, timed(lambda: generate(text_inputs([text_prompt(rep, 512)]), 1))
        ),
        "prefill 224^2 image": prefill_image,
        "32 x 16 tok, 1 new": lambda rep: timed(
            lambda: generate(text_inputs([text_prompt(rep * 32 + i, 16) for i in range(32)]), 1)
        ),
    }


def worker(side: str, steps: int, threads: int) -> None:
    """Answer case names read from stdin with one JSON line each (the measured value)."""
    import torch

    torch.set_num_threads(threads)
    cases = _ref_cases(steps) if side == "ref" else _engine_cases(steps)
    for fn in cases.values():  # warm-up: first use of each shape
        fn(999)
    print("ready", flush=True)
    for line in sys.stdin:
        name, rep = json.loads(line)
        print(json.dumps(cases[name](rep)), flush=True)


# ------------------------------------------------------------------------------ parent


def _spawn(side: str, landed: Path, steps: int, threads: int) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = str(landed if side == "landed" else ROOT)
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--worker",
            side,
            "--steps",
            str(steps),
            "--threads",
            str(threads),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=landed if side == "landed" else ROOT,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "ready":
        raise RuntimeError(f"{side} worker failed to start (got {line!r})")
    return proc


def _ask(proc: subprocess.Popen[str], name: str, rep: int) -> Pair:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps([name, rep]) + "\n")
    proc.stdin.flush()
    wall, cpu = json.loads(proc.stdout.readline())
    return float(wall), float(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--landed", type=Path, default=Path("/tmp/landed"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per sample")
    parser.add_argument("--load", type=int, default=0, help="busy-loop processes meanwhile")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument(
        "--cases", help="only the cases whose names start with one of these (comma-separated)"
    )
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.threads)
        return
    if not (args.landed / "common" / "engine.py").is_file():
        sys.exit(f"no checkout at {args.landed}: git worktree add --detach {args.landed} 51e99ae")
    sys.path.insert(0, str(ROOT))
    from common.models.tiny import default_checkpoint

    default_checkpoint("small")  # made here: the landed code does not know the size
    args.load_before = os.getloadavg()[0]
    procs: dict[str, subprocess.Popen[str]] = {}
    with busy_loops(args.load):
        try:
            for side in SIDES:
                procs[side] = _spawn(side, args.landed, args.steps, args.threads)
            samples: dict[tuple[str, str], list[Pair]] = {}
            wanted = tuple(args.cases.split(",")) if args.cases else ("",)
            args.names = [name for name, _, _ in CASES if name.startswith(wanted)]
            for rep in range(args.repeats):
                for name in args.names:
                    for side in SIDES:
                        samples.setdefault((name, side), []).append(_ask(procs[side], name, rep))
            report(samples, args)
        finally:
            for proc in procs.values():
                proc.kill()
                proc.wait()


def report(samples: dict[tuple[str, str], list[Pair]], args: Any) -> None:
    """Medians per case and side, and the speed-ups of epd (>1: epd faster), by wall time
    and by CPU time."""
    print(
        f"medians of {args.repeats}, {args.threads} torch thread(s) each, {args.load} busy-loop "
        f"processes, load average {args.load_before:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end"
    )
    for clock, which in (("wall time", 0), ("CPU time", 1)):
        print(f"-- by {clock}")
        head = f"{'case':30s}{'landed':>10s}{'epd':>10s}{'transf.':>10s}"
        print(f"{head}{'epd/landed':>12s}{'epd/transf.':>12s}")
        for name, unit, higher in CASES:
            if name not in args.names:
                continue
            med = {s: statistics.median(v[which] for v in samples[(name, s)]) for s in SIDES}

            def speedup(other: str, med: dict[str, float] = med, higher: bool = higher) -> float:
                return med["epd"] / med[other] if higher else med[other] / med["epd"]

            cells = "".join(f"{med[s]:10.4g}" for s in SIDES)
            label = f"{name} ({unit})"
            print(f"{label:30s}{cells}{speedup('landed'):11.2f}x{speedup('ref'):11.2f}x")


if __name__ == "__main__":
    main()
