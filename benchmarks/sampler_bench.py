"""The batch sampler's time per decode step: this checkout's `Sampler` against another's.

Per batch size (1, 8, 32 rows of a 1536-token vocabulary, the built-in checkpoints') and
per setting, `Sampler.sample` of this checkout and of `--baseline` (a checkout of the
landed commit, e.g. `git worktree add --detach /tmp/landed HEAD`) run interleaved on the
same logits: `--pool` different logit batches in turn (the same batch over and over lets
the CPU's branch predictor learn a sort's comparisons, which flatters sorting), `--reps`
passes, the median call. One torch thread. Settings: greedy; temperature 1 (what an
OpenAI-style request gets when it sets nothing); Qwen3-VL's recommended temperature 0.7,
top_p 0.8, top_k 20; top_p 0.9 alone; and the first two seeded.

    .venv/bin/python benchmarks/sampler_bench.py --baseline /tmp/landed [--pool 50] [--reps 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import sampling

SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": {},
    "temperature 1": {"temperature": 1.0},
    "t 0.7, top_p 0.8, top_k 20": {"temperature": 0.7, "top_p": 0.8, "top_k": 20},
    "top_p 0.9": {"temperature": 1.0, "top_p": 0.9},
    "temperature 1, seeded": {"temperature": 1.0, "seed": 3},
    "t 0.7, p 0.8, k 20, seeded": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "seed": 3},
}


def load(folder: Path) -> Any:
    """Another checkout's `common/sampling.py` as a module of its own."""
    spec = importlib.util.spec_from_file_location(
        "baseline_sampling", folder / "common" / "sampling.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_sampling"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="checkout to compare")
    parser.add_argument("--pool", type=int, default=50, help="different logit batches")
    parser.add_argument("--reps", type=int, default=3, help="passes over the pool")
    parser.add_argument("--vocab", type=int, default=1536)
    args = parser.parse_args()
    torch.set_num_threads(1)
    modules = {"this": sampling, "baseline": load(args.baseline)}
    generator = torch.Generator().manual_seed(0)
    pool = [torch.randn(32, args.vocab, generator=generator) * 3 for _ in range(args.pool)]
    print(f"median us per Sampler.sample call, {args.pool} logit batches x {args.reps} passes")
    print(f"  {'rows':>4s}  {'setting':28s} {'baseline':>10s} {'this':>10s} {'speed-up':>9s}")
    for rows in (1, 8, 32):
        positions = list(range(100, 100 + rows))
        for name, setting in SETTINGS.items():
            spent: dict[str, list[float]] = {side: [] for side in modules}
            samplers = {side: m.Sampler() for side, m in modules.items()}
            params = {side: [m.SamplingParams(**setting)] * rows for side, m in modules.items()}
            for _ in range(args.reps):
                for logits in pool:
                    for side in modules:
                        start = time.perf_counter()
                        samplers[side].sample(logits[:rows], params[side], positions)
                        spent[side].append(time.perf_counter() - start)
            base, this = (statistics.median(spent[s]) * 1e6 for s in ("baseline", "this"))
            print(f"  {rows:4d}  {name:28s} {base:10.1f} {this:10.1f} {base / this:8.2f}x")


if __name__ == "__main__":
    main()
