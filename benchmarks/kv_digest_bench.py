"""Block payload digests (`common.kv.digest`): raw throughput, and their cost to a prefill.

1. Throughput, on a block-major cache of the "bench" checkpoint's layout (bf16, 16-token
   blocks = 128 KiB per block), per batch size: a plain torch copy of the blocks' bytes,
   `block_digests` of the same `[n, block_bytes]` rows, and `cache_block_digests` of `n`
   contiguous and of `n` scattered block ids. GB/s = median.
2. Prefill of the bench checkpoint (bf16, an image + text prompt, no prefix reuse), without
   and with `cache_block_digests` of the prompt's blocks afterwards (what the prefill worker
   does before it lends them). The two alternate; reports the medians and the median
   per-repetition ratio with / without.

Torch threads are pinned to 1 (`--threads` to change).

    .venv/bin/python benchmarks/kv_digest_bench.py [--blocks 1 8 64 256] [--reps 9]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import numpy as np
import torch
from timing import image_question, measure

from common.engine import Engine
from common.kv.cache import KvCacheSpec, PagedKvCache
from common.kv.digest import block_digests, cache_block_digests
from common.models.tiny import default_checkpoint
from common.sampling import SamplingParams


def throughput(engine: Engine, sizes: list[int], reps: int) -> None:
    spec = engine.runner.kv.spec
    total = 2 * max(sizes)
    cache = PagedKvCache(
        KvCacheSpec(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size, spec.dtype, total
        )
    )
    cache.buffer.copy_(torch.randn(cache.spec.shape).to(cache.spec.dtype))
    rows = cache.buffer.view(-1).view(torch.uint8).view(total, -1)
    rng = np.random.default_rng(0)
    nbytes = cache.spec.block_bytes
    print(f"block {nbytes // 1024} KiB ({spec.dtype}, {spec.block_size} tokens); GB/s = median")
    print(f"{'blocks':>6} {'MiB':>6} {'copy':>7} {'rows':>7} {'contig':>7} {'scatter':>7}")
    for n in sizes:
        dst = torch.empty(n, nbytes, dtype=torch.uint8)
        scattered = rng.permutation(total)[:n].tolist()
        times = measure(
            {
                "copy": functools.partial(dst.copy_, rows[:n]),
                "rows": functools.partial(block_digests, rows[:n]),
                "contig": functools.partial(cache_block_digests, cache, range(n)),
                "scatter": functools.partial(cache_block_digests, cache, scattered),
            },
            reps,
        )
        gbps = {k: n * nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
        print(
            f"{n:>6} {n * nbytes / 2**20:>6.1f} {gbps['copy']:>7.2f} {gbps['rows']:>7.2f} "
            f"{gbps['contig']:>7.2f} {gbps['scatter']:>7.2f}",
            flush=True,
        )


def prefill_cost(engine: Engine, reps: int) -> None:
    p = engine.process(image_question())
    n = len(p.prompt_token_ids)
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    block_size = engine.runner.block_size
    digested: list[int] = []

    def run(digest: bool) -> None:
        params = engine.encode(p)
        seq = engine.prefill(p.prompt_token_ids, params, sampling, use_prefix_cache=False)
        if digest:
            blocks = seq.blocks[: -(-n // block_size)]
            digested.append(len(cache_block_digests(engine.runner.kv, blocks)))
        engine.release(seq)

    times = measure({"prefill": lambda: run(False), "prefill+digest": lambda: run(True)}, reps)
    plain, with_digest = (statistics.median(times[k]) for k in ("prefill", "prefill+digest"))
    ratio = statistics.median(
        d / p for d, p in zip(times["prefill+digest"], times["prefill"], strict=True)
    )
    kib = digested[-1] * engine.runner.kv.spec.block_bytes // 1024
    print(f"prefill of {n} tokens (encode + prefill), {digested[-1]} blocks = {kib} KiB digested")
    print(f"{'prefill ms':>12} {'+digest ms':>12} {'ratio':>7}")
    print(f"{plain * 1e3:>12.1f} {with_digest * 1e3:>12.1f} {ratio:>7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    engine = Engine.from_pretrained(
        default_checkpoint("bench"), dtype=torch.bfloat16, num_blocks=256, max_batch=1
    )
    throughput(engine, args.blocks, args.reps)
    print()
    prefill_cost(engine, args.reps)


if __name__ == "__main__":
    main()
