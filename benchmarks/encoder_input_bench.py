"""CPU encoder-input preparation of the encoder worker, vision tower excluded.

What is timed ("prep", the figure comparable to the reference's): `--requests` requests of
8 items each, their `ItemJob`s (units with their cache keys, as
`encoder_worker.requests.parse_request` makes them) handed to `EncoderEngine.encode_now` at
once, which runs the path `EncoderEngine.encode` runs, without the event loop: per request
the cache lookups and in-flight joins (item selection) and the misses queued; the batch
taken; per encoding mode the selected units' patch rows concatenated and their grid tensor
built (tensor slices); the tower's output copied into segments and split back into per-unit
cache entries, which are stored (output splits); each item's rows assembled (one tensor per
item, main and deepstack rows: `EncodedRows.stacked`). The items' patch rows are uint8 codes,
as the router sends them, so "prep" includes mapping the batch's codes to float32 values
(once per mode); `--pixels values` sends float32 values instead, as routers from before
codes did. The tower is replaced by one that
returns preallocated rows of the right shapes, so its cost is not in the figure. Three
shapes, as the reference engine's report:

- contiguous: 8 images per request, requested in prompt order;
- reordered: the same, requested in a shuffled order (item order differs from prompt order);
- alternating: image, video, image, ... (videos of 2 frames, one partition per frame,
  encoded frame by frame), so the batch holds both encoding modes interleaved.

Also timed, not part of the reference's figure:
- "served": the same requests as `--requests` concurrent `EncoderEngine.encode` calls, as
  the server makes them (each an asyncio task awaiting its own future; the batch task; the
  forward on a worker thread); "harness" is that many concurrent calls doing nothing, the
  event loop's own share of it;
- "parse": `parse_request` of the same requests from their protobuf form, which decodes the
  patch rows and recomputes every content hash (the encoder trusts no caller's hash,
  DESIGN §7);
- "copy": one bare `torch.stack` of as many output rows as the batch makes (main and
  deepstack, "copy MB"): the share of "prep" that is a memory copy, which the engine makes
  so that a cached unit never pins the whole batch output (`encoder_worker.batch`). It
  grows with the output's bytes, not with the units.

Differences from the reference's setting, as far as its report says: its items' order
differs from prompt order in "reordered", and it reorders outputs; epd's encoder answers in
request order (the router places rows by item metadata), so "reordered" costs here what
"contiguous" does. The per-item output is one tensor holding main and deepstack rows.
epd's cache keys are content hashes of the patch rows (of each partition, for videos),
computed and checked in `parse_request` ("parse", not "prep"), as the encoder trusts no
caller's hash; "prep" only looks them up. "prep" also writes every encoded unit into the
encoder cache and copies the output ("copy"), which a preparation step alone need not.

Times are CPU seconds of this process (`time.process_time`, every thread: the event loop and
the forward thread), not wall time, so other processes' load on a shared machine does not
count as preparation; `torch.set_num_threads(1)`. Reference (the seed's report, 64 requests
x 8 items): 0.502 ms contiguous, 0.945 ms reordered, 3.171 ms alternating (128 requests:
0.998, 1.928, 6.487), "median of 9 paired samples x 20 repetitions with executor GC
defaults"; here likewise: each sample is the
median of `--inner` (20) back-to-back runs, each on a fresh engine and cache (every unit a
miss), samples interleaved across shapes and engines, the figure the median of `--reps` (9)
samples; the garbage collector on, as by default.
With `--baseline DIR` (a checkout of the landed commit) its `encoder_worker/engine.py` runs
interleaved with this one's on the same jobs ("served", the path both have), and the ratio
is printed.

    .venv/bin/python benchmarks/encoder_input_bench.py [--requests 64] [--reps 9] [--inner 20]
        [--baseline /tmp/landed]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.models.qwen3_vl.config import VisionConfig
from common.models.qwen3_vl.preprocessor import ProcessorSettings
from common.processing.content_hash import content_hash
from common.wire.convert import tensor_to_ref
from encoder_worker.cache import EncoderCache
from encoder_worker.engine import EncoderEngine
from encoder_worker.requests import ItemJob, parse_request
from epd.v1 import encoder_service_pb2, multimodal_pb2

# The seed's report, by requests (8 items each): ms per shape.
REFERENCE_MS = {
    64: {"contiguous": 0.502, "reordered": 0.945, "alternating": 3.171},
    128: {"contiguous": 0.998, "reordered": 1.928, "alternating": 6.487},
}
FINGERPRINT = b"bench"


class NoTower:
    """Stands in for `VisionTower.encode`: rows of the right shapes, no compute."""

    def __init__(self, vision: VisionConfig, max_rows: int, layers: int) -> None:
        self.merge_unit = vision.merge_unit
        self.rows = torch.zeros(max_rows, vision.out_hidden_size)
        self.deep = [torch.zeros(max_rows, vision.out_hidden_size) for _ in range(layers)]

    def encode(
        self, pixels: torch.Tensor, grids: torch.Tensor, *, per_frame: bool = False
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        n = pixels.shape[0] // self.merge_unit
        return self.rows[:n], [d[:n] for d in self.deep]


def encode_request(
    vision: VisionConfig, seed: int, shape: str, hw: int, codes: bool = True
) -> encoder_service_pb2.EncodeRequest:
    """One request of 8 items of `shape` (see the module docstring), real hashes; patch
    rows as uint8 codes, or float32 values."""
    rng = np.random.default_rng(seed)
    request = encoder_service_pb2.EncodeRequest(request_id=f"r{seed}")
    items = []
    for k in range(8):
        video = shape == "alternating" and k % 2 == 1
        t = 2 if video else 1
        grid = (t, hw, hw)
        shape_rows = (t * hw * hw, vision.patch_dim)
        pixels = torch.from_numpy(
            rng.integers(0, 256, shape_rows, dtype=np.uint8)
            if codes
            else rng.standard_normal(shape_rows, dtype=np.float32)
        )
        modality = "video" if video else "image"
        item = encoder_service_pb2.EncodeItem(
            content_hash=content_hash(FINGERPRINT, modality, pixels, grid),
            modality=multimodal_pb2.MODALITY_VIDEO if video else multimodal_pb2.MODALITY_IMAGE,
            pixel_values=tensor_to_ref(pixels),
            grid_thw=list(grid),
        )
        if video:
            step = hw * hw
            for f in range(t):
                rows = pixels[f * step : (f + 1) * step]
                item.partitions.add(
                    input_start=f * step,
                    input_end=(f + 1) * step,
                    output_rows=step // vision.merge_unit,
                    content_hash=content_hash(FINGERPRINT, modality, rows, (1, hw, hw)),
                )
        items.append(item)
    if shape == "reordered":
        order = rng.permutation(8)
        items = [items[i] for i in order]
    request.items.extend(items)
    return request


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def baseline_engine(folder: Path) -> tuple[Any, Any]:
    """`EncoderEngine` and `EncoderCache` of another checkout's `encoder_worker/engine.py`,
    `cache.py`, `batch.py` and `common/byte_lru.py` (each imports the other's module of that
    checkout while it loads; request types are this checkout's: `Unit` only gained a field)."""
    swapped = {}
    for name, path in (
        ("common.byte_lru", folder / "common" / "byte_lru.py"),
        ("encoder_worker.cache", folder / "encoder_worker" / "cache.py"),
        ("encoder_worker.batch", folder / "encoder_worker" / "batch.py"),
    ):
        swapped[name] = sys.modules[name]
        sys.modules[name] = _load(f"baseline_{name}", path)
    cache = sys.modules["encoder_worker.cache"]
    try:
        engine = _load("baseline_engine", folder / "encoder_worker" / "engine.py")
    finally:
        sys.modules.update(swapped)
    return engine.EncoderEngine, cache.EncoderCache


def prepare_now(engine: EncoderEngine, jobs: list[list[ItemJob]]) -> list[list[torch.Tensor]]:
    """The reference's figure: every request at once, synchronously; per item its rows."""
    return [[o.rows.stacked for o in out] for out in engine.encode_now(jobs)]


async def prepare(engine: Any, jobs: list[list[ItemJob]]) -> list[list[torch.Tensor]]:
    """As the server does: one concurrent `encode` call per request; per item its rows."""
    outputs = await asyncio.gather(*(engine.encode(j) for j in jobs))
    return [[o.rows.stacked for o in out] for out in outputs]


async def _nothing(jobs: list[ItemJob]) -> list[ItemJob]:
    return jobs


async def fan_out(jobs: list[list[ItemJob]]) -> None:
    """The harness alone: `len(jobs)` concurrent calls that do nothing (as many tasks as
    concurrent Encode RPCs would make), to read the engine's share of the figures."""
    await asyncio.gather(*(_nothing(j) for j in jobs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--reps", type=int, default=9, help="samples (medians of)")
    parser.add_argument("--inner", type=int, default=20, help="back-to-back runs a sample")
    parser.add_argument("--grid", type=int, default=4, help="h = w patches of an item")
    parser.add_argument("--baseline", type=Path, help="checkout whose engine to compare")
    parser.add_argument(
        "--pixels", choices=("codes", "values"), default="codes", help="patch rows' form"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Small patches: the figure is the preparation's, not a memcpy of large pixel rows.
    vision = VisionConfig(
        depth=1,
        hidden_size=32,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=64,
        patch_size=2,
        deepstack_visual_indexes=(0, 0, 0),
    )
    shapes = ("contiguous", "reordered", "alternating")
    requests = {
        s: [
            encode_request(vision, 64 * i + j, s, args.grid, args.pixels == "codes")
            for j in range(args.requests)
        ]
        for i, s in enumerate(shapes)
    }
    jobs = {s: [parse_request(r, vision, FINGERPRINT) for r in rs] for s, rs in requests.items()}
    max_rows = sum(u.output_rows for js in jobs["alternating"] for j in js for u in j.units)
    tower = NoTower(vision, max_rows * vision.merge_unit, 3)
    engines: dict[str, tuple[Any, Any]] = {"epd": (EncoderEngine, EncoderCache)}
    if args.baseline is not None:
        engines["baseline"] = baseline_engine(args.baseline)
    times: dict[tuple[str, str], list[float]] = {(e, s): [] for e in engines for s in shapes}
    now: dict[str, list[float]] = {s: [] for s in shapes}
    parse: dict[str, list[float]] = {s: [] for s in shapes}
    copy: dict[str, list[float]] = {s: [] for s in shapes}
    out_rows = {s: sum(u.output_rows for j in jobs[s] for i in j for u in i.units) for s in shapes}
    harness: list[float] = []

    pixel_settings = dataclasses.replace(
        ProcessorSettings(), patch_size=vision.patch_size, merge_size=vision.spatial_merge_size
    )

    def make(engine_cls: Any, cache_cls: Any) -> Any:
        # A baseline from before codes takes no settings (and hands codes to the tower).
        mapping = {"settings": pixel_settings} if engine_cls is EncoderEngine else {}
        return engine_cls(
            tower,  # no compute: the tower is excluded
            cache_cls(1 << 34),
            batch_window_s=0.0,
            max_batch_rows=1 << 30,
            **mapping,
        )

    def sample(run: Any, *run_args: Any) -> float:
        """Median CPU seconds of `--inner` back-to-back runs of `run(*run_args)`."""
        spent = []
        for _ in range(args.inner):
            start = time.process_time()
            run(*run_args)
            spent.append(time.process_time() - start)
        return statistics.median(spent)

    async def sample_async(run: Any, *run_args: Any) -> float:
        spent = []
        for _ in range(args.inner):
            start = time.process_time()
            await run(*run_args)
            spent.append(time.process_time() - start)
        return statistics.median(spent)

    def prep_once(shape: str) -> None:
        prepare_now(make(EncoderEngine, EncoderCache), jobs[shape])

    def copy_once(rows: int) -> None:
        torch.stack([tower.rows[:rows], *(d[:rows] for d in tower.deep)])

    async def serve_once(engine_cls: Any, cache_cls: Any, shape: str) -> None:
        engine = make(engine_cls, cache_cls)
        await prepare(engine, jobs[shape])
        await engine.close()

    async def loop() -> None:
        for rep in range(args.reps + 1):  # the first round warms up
            for s in shapes:
                got = sample(prep_once, s)
                copied = sample(copy_once, out_rows[s])
                by_engine = {}
                for name, classes in engines.items():
                    by_engine[name] = await sample_async(serve_once, *classes, s)
                start = time.process_time()
                for r in requests[s]:
                    parse_request(r, vision, FINGERPRINT)
                parsed = time.process_time() - start
                fanned = await sample_async(fan_out, jobs[s])
                if rep:
                    now[s].append(got)
                    copy[s].append(copied)
                    for name, value in by_engine.items():
                        times[(name, s)].append(value)
                    parse[s].append(parsed)
                    harness.append(fanned)

    asyncio.run(loop())
    print(
        f"{args.requests} requests x 8 items, grid (t, {args.grid}, {args.grid}), "
        f"medians of {args.reps} samples x {args.inner} runs:"
    )
    base = "baseline" in engines
    print(
        f"  {'shape':12s} {'prep ms':>8s} {'reference':>10s} {'prep/ref':>9s}"
        f" {'served ms':>10s}"
        + (f" {'landed ms':>10s} {'landed/served':>13s}" if base else "")
        + f" {'parse ms':>9s} {'copy ms':>8s} {'copy MB':>8s}"
    )
    for s in shapes:
        prep = statistics.median(now[s]) * 1e3
        served = statistics.median(times[("epd", s)]) * 1e3
        ref = REFERENCE_MS.get(args.requests, {}).get(s)
        line = f"  {s:12s} {prep:8.3f} " + (
            f"{ref:10.3f} {prep / ref:8.2f}x" if ref else f"{'-':>10s} {'-':>9s}"
        )
        line += f" {served:10.3f}"
        if base:
            landed = statistics.median(times[("baseline", s)]) * 1e3
            line += f" {landed:10.3f} {landed / served:12.2f}x"
        mb = out_rows[s] * tower.rows.shape[1] * 4 * (1 + len(tower.deep)) / 1e6
        print(
            line + f" {statistics.median(parse[s]) * 1e3:9.2f}"
            f" {statistics.median(copy[s]) * 1e3:8.3f} {mb:8.2f}"
        )
    print(
        f"  of which the harness ({args.requests} concurrent calls doing nothing, part of "
        f"'served' only): {statistics.median(harness) * 1e3:.3f} ms; 'copy': one bare "
        f"torch.stack of the batch's output rows (copy MB), the part of 'prep' that copies "
        f"the output into cache segments"
    )


if __name__ == "__main__":
    main()
