"""Block hashing speed: a 100k-token prompt holding an 8-frame video with timestamp gaps,
against the same prompt hashed as text only, in one process.

    python benchmarks/hash_bench.py [--tokens 100000] [--block-size 16] [--repeats 9]

Prints the median tokens/s of both and the time ratio (run-based / text-only). Targets:
>= 5 M tokens/s with runs, ratio <= 1.10.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from common.kv.hashing import block_hashes
from common.multimodal.params import MultimodalParams, runs_from_mask

FRAMES, ROWS_PER_FRAME, GAP = 8, 258, 13  # the seed's 8 runs x 258 with 13-token gaps


def video_prompt(num_tokens: int) -> tuple[np.ndarray, MultimodalParams]:
    """Random text with one 8-frame video item placed a tenth of the way in."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 150_000, num_tokens, dtype=np.int64)
    mask = np.zeros(num_tokens, dtype=bool)
    start = num_tokens // 10
    for frame in range(FRAMES):
        s = start + frame * (ROWS_PER_FRAME + GAP)
        mask[s : s + ROWS_PER_FRAME] = True
    tokens[mask] = 151_656
    cu, pos, lens = runs_from_mask(mask, [FRAMES * ROWS_PER_FRAME])
    params = MultimodalParams.from_flat(
        [b"\x5a" * 32], [int(pos[0])], [FRAMES * ROWS_PER_FRAME], None, cu, pos, lens
    )
    return tokens, params


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    tokens, params = video_prompt(args.tokens)
    # Interleave the two so machine noise hits both alike.
    runs_t, text_t = [], []
    for _ in range(args.repeats):
        runs_t.append(median_seconds(lambda: block_hashes(tokens, args.block_size, params), 1))
        text_t.append(median_seconds(lambda: block_hashes(tokens, args.block_size), 1))
    runs_s, text_s = statistics.median(runs_t), statistics.median(text_t)
    print(
        f"prompt: {args.tokens} tokens, block_size {args.block_size}, "
        f"video {FRAMES} runs x {ROWS_PER_FRAME} rows, gaps {GAP}; median of {args.repeats}"
    )
    print(f"run-based : {runs_s * 1e3:8.2f} ms  {args.tokens / runs_s / 1e6:6.2f} M tokens/s")
    print(f"text-only : {text_s * 1e3:8.2f} ms  {args.tokens / text_s / 1e6:6.2f} M tokens/s")
    print(f"ratio run-based / text-only: {runs_s / text_s:.3f}")


if __name__ == "__main__":
    main()
