"""What padding oneDNN's rows to buckets (`linear.bucket_rows`) costs and saves in prefill.

In one process, one torch thread, on the "small" checkpoint (4 layers x 256 hidden): times
`Engine.prefill` of text prompts of `--lengths` tokens (no prefix reuse) with the rows
padded (this tree) and exact (as before: `EXACT_ROWS` past any row count), alternating, and
reports per length the median of `--reps` and the ratio. Two passes:
- warm: the same lengths again and again (each row count's primitive made once, before
  timing): what padding costs;
- cold: every prompt of a length not seen before in that mode (each a new row count
  exactly; padded, a new bucket only now and then): what making primitives costs.

    .venv/bin/python benchmarks/row_buckets_bench.py [--lengths 100 300 700] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.engine import Engine
from common.models.qwen3_vl import linear
from common.models.tiny import default_checkpoint
from common.multimodal.params import MultimodalParams
from common.sampling import SamplingParams

EXACT = 1 << 30  # every row count exact: the landed behaviour


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 300, 700])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = Engine.from_pretrained(default_checkpoint("small"), num_blocks=2048)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    empty = MultimodalParams((), {}, 0)
    bucketed = linear.EXACT_ROWS
    modes = {"padded": bucketed, "exact": EXACT}

    def prefill(tokens: int, seed: int) -> float:
        prompt = [(seed * 131 + j * 7 + 3) % 1000 for j in range(tokens)]
        started = time.process_time()
        engine.release(engine.prefill(prompt, empty, one, use_prefix_cache=False))
        return time.process_time() - started

    print(f"{'pass':5} {'tokens':>6} {'padded ms':>10} {'exact ms':>9} {'exact/padded':>13}")
    for warm in (True, False):
        times: dict[tuple[str, int], list[float]] = {}
        offset = {"padded": 0, "exact": 0}  # cold: each mode's own new lengths
        if warm:
            for exact_rows in modes.values():
                linear.EXACT_ROWS = exact_rows
                for tokens in args.lengths:
                    prefill(tokens, 0)
        for rep in range(args.reps):
            for mode, exact_rows in modes.items():
                linear.EXACT_ROWS = exact_rows
                for tokens in args.lengths:
                    length = tokens if warm else tokens + offset[mode] + 1
                    offset[mode] += 0 if warm else 1
                    times.setdefault((mode, tokens), []).append(prefill(length, rep))
        for tokens in args.lengths:
            padded = statistics.median(times[("padded", tokens)]) * 1000
            exact = statistics.median(times[("exact", tokens)]) * 1000
            label = "warm" if warm else "cold"
            print(f"{label:5} {tokens:>6} {padded:>10.2f} {exact:>9.2f} {exact / padded:>13.3f}")
    linear.EXACT_ROWS = bucketed


if __name__ == "__main__":
    main()
