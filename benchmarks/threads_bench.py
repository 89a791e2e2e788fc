"""Two decode engines on one node: the placement `epd serve` gives them by default (the
node's cores split between them, each pinned to its own) against every engine taking every
core (torch's default, what workers did before).

Four engine processes load once: two per variant. Each round runs one variant's pair at the
same time (each decodes `--steps` tokens at batch 1), then the other's, so background load
hits both alike; the table shows each variant's median decode tok/s per engine and the
ratio default/all-cores.

    .venv/bin/python benchmarks/threads_bench.py [--checkpoint tiny] [--steps 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

ENGINES_PER_NODE = 2


def child(checkpoint: str, threads: int, cores: list[int] | None, steps: int) -> None:
    """One engine: apply the placement, load, then on each "go" line decode `steps` tokens
    at batch 1 and print the rate."""
    from common.server.threads import CpuPlacement, apply

    apply(CpuPlacement(threads, tuple(cores) if cores else None))
    from common.engine import Engine
    from common.models.tiny import default_checkpoint
    from common.sampling import SamplingParams

    folder = default_checkpoint("bench" if checkpoint == "bench" else "tiny")
    engine = Engine.from_pretrained(folder, num_blocks=512, max_batch=4)
    p = engine.process([{"role": "user", "content": [{"type": "text", "text": "Hello " * 32}]}])
    sampling = SamplingParams(max_tokens=steps + 1, ignore_eos=True)

    def run() -> float:
        seq = engine.prefill(p.prompt_token_ids, engine.encode(p), sampling, use_prefix_cache=False)
        start = time.perf_counter()
        for _ in range(steps):
            engine.decode_step([seq])
        rate = steps / (time.perf_counter() - start)
        engine.release(seq)
        return rate

    run()  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        print(json.dumps(run()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", default="tiny", choices=("tiny", "bench"))
    parser.add_argument("--steps", type=int, default=64, help="decode steps per run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", nargs=3, metavar=("THREADS", "CORES", "STEPS"))
    args = parser.parse_args()
    if args.child:
        threads, cores, steps = args.child
        chosen = [int(c) for c in cores.split(",")] if cores != "-" else None
        child(args.checkpoint, int(threads), chosen, int(steps))
        return

    from cluster.placement import CpuPlanner
    from common.server.threads import available_cores

    cores = available_cores()
    plan = CpuPlanner.for_cluster(cores, nodes=1, workers=ENGINES_PER_NODE)
    variants: dict[str, list[tuple[int, str]]] = {"default": [], "all cores": []}
    for i in range(ENGINES_PER_NODE):
        placement, _ = plan.take(f"decode-{i}", 0)
        pinned = ",".join(map(str, placement.cores)) if placement.cores else "-"
        variants["default"].append((placement.threads, pinned))
        variants["all cores"].append((len(cores), "-"))
    print(f"{len(cores)} cores; {ENGINES_PER_NODE} decode engines; checkpoint {args.checkpoint}")
    for name, specs in variants.items():
        print(f"  {name}: " + "; ".join(f"{t} threads, CPUs {c}" for t, c in specs))
    procs: dict[str, list[subprocess.Popen[str]]] = {}
    for name, specs in variants.items():
        procs[name] = [
            subprocess.Popen(
                [sys.executable, __file__, "--checkpoint", args.checkpoint, "--child",
                 str(t), c, str(args.steps)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for t, c in specs
        ]  # fmt: skip
    for group in procs.values():
        for proc in group:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    rates: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for _ in range(args.rounds):
            for name, group in procs.items():
                for proc in group:
                    assert proc.stdin is not None
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                for proc in group:
                    assert proc.stdout is not None
                    rates[name].append(float(proc.stdout.readline()))
    finally:
        for group in procs.values():
            for proc in group:
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(timeout=30)
    default, every = (statistics.median(rates[n]) for n in ("default", "all cores"))
    head = "decode tok/s per engine (median)"
    print(f"{head:34s}{'default':>10s}{'all cores':>11s}{'ratio':>8s}")
    row = "batch 1, both engines busy"
    print(f"{row:34s}{default:10.1f}{every:11.1f}{default / every:7.2f}x")


if __name__ == "__main__":
    main()
