"""The encoder engine: cache lookups, a short batching window, one vision forward per batch.

`EncoderEngine.encode(jobs)` looks every unit (see `requests.Unit`) up in the encoder cache.
Misses are queued; a single batch task waits `batch_window_s` after the first queued unit,
takes every unit queued by then (up to `max_batch_rows` patch rows), and runs the vision
tower once per encoding mode (whole frames batched together, or frame by frame for exact
partitions) on a worker thread, so the event loop keeps serving health checks and other
requests. Results enter the cache and wake every request waiting on them. A unit already
being computed for another request is joined, not computed twice.

Failure: if the forward raises, every request of that batch gets the error and nothing is
cached. Touched only from the server's event loop, except the forward itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.models.qwen3_vl.vision import VisionTower
from encoder_worker.cache import EncodedRows, EncoderCache
from encoder_worker.requests import ItemJob, Unit

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ItemOutput:
    """Encoder output of one requested item."""

    rows: EncodedRows  # rows of the requested units, concatenated in order
    cache_hit: bool  # every unit came from the encoder cache


class EncoderEngine:
    """Cache + batcher in front of one `VisionTower`.

    Counters for load reports and tests: `forward_calls` (tower.encode calls), `rows_encoded`
    (output rows computed), `units_encoded`, `batches`; cache counters live on `cache`.
    """

    def __init__(
        self,
        tower: VisionTower,
        cache: EncoderCache,
        *,
        batch_window_s: float = 0.002,
        max_batch_rows: int = 1 << 16,
    ) -> None:
        self.tower = tower
        self.cache = cache
        self.batch_window_s = batch_window_s
        self.max_batch_rows = max_batch_rows
        self.forward_calls = 0  # tower.encode calls
        self.batches = 0  # batches run
        self.units_encoded = 0  # units computed (cache misses actually encoded)
        self.rows_encoded = 0  # output rows computed
        self._queue: list[tuple[Unit, asyncio.Future[EncodedRows]]] = []
        self._inflight: dict[bytes, asyncio.Future[EncodedRows]] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def encode(self, jobs: Sequence[ItemJob]) -> list[ItemOutput]:
        """Rows of every job, from the cache or the tower; one entry per job, same order.

        Cache writes happen only for units actually encoded. Cancelling the caller does not
        cancel the shared computation (its result is still cached).
        """
        found: dict[bytes, EncodedRows] = {}
        hit_keys: set[bytes] = set()
        waits: dict[bytes, asyncio.Future[EncodedRows]] = {}
        queued = False
        loop = asyncio.get_running_loop()
        for job in jobs:
            for unit in job.units:
                key = unit.key
                if key in found or key in waits:
                    continue
                entry = self.cache.get(key)
                if entry is not None:
                    found[key] = entry
                    hit_keys.add(key)
                elif key in self._inflight:
                    waits[key] = self._inflight[key]
                else:
                    future: asyncio.Future[EncodedRows] = loop.create_future()
                    self._inflight[key] = future
                    self._queue.append((unit, future))
                    waits[key] = future
                    queued = True
        if queued:
            self._ensure_task()
            self._wakeup.set()
        for key, future in waits.items():
            found[key] = await asyncio.shield(future)
        return [
            ItemOutput(
                _concat([found[u.key] for u in job.units]),
                all(u.key in hit_keys for u in job.units),
            )
            for job in jobs
        ]

    async def close(self) -> None:
        """Stop the batch task; queued requests fail with CancelledError."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for _, future in self._queue:
            future.cancel()
        self._queue.clear()
        self._inflight.clear()

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._batch_loop(), name="epd-encoder-batcher")

    async def _batch_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._queue:
                continue
            if self.batch_window_s > 0:
                await asyncio.sleep(self.batch_window_s)
            batch = self._take_batch()
            started = time.perf_counter()
            try:
                outputs = await asyncio.to_thread(self._forward, [u for u, _ in batch])
            except Exception as exc:
                logger.exception("vision forward failed for %d units", len(batch))
                for unit, future in batch:
                    self._inflight.pop(unit.key, None)
                    if not future.done():
                        future.set_exception(exc)
                        future.exception()  # retrieved here: waiters may be gone
            else:
                self.batches += 1
                for (unit, future), rows in zip(batch, outputs, strict=True):
                    self.cache.put(unit.key, rows)
                    self._inflight.pop(unit.key, None)
                    self.units_encoded += 1
                    self.rows_encoded += unit.output_rows
                    if not future.done():
                        future.set_result(rows)
                logger.debug(
                    "encoded %d units in %.1f ms", len(batch), 1e3 * (time.perf_counter() - started)
                )
            if self._queue:
                self._wakeup.set()

    def _take_batch(self) -> list[tuple[Unit, asyncio.Future[EncodedRows]]]:
        """Queued units up to `max_batch_rows` patch rows (always at least one)."""
        rows = 0
        count = 0
        for unit, _ in self._queue:
            if count and rows + unit.input_rows > self.max_batch_rows:
                break
            rows += unit.input_rows
            count += 1
        batch, self._queue = self._queue[:count], self._queue[count:]
        return batch

    def _forward(self, units: list[Unit]) -> list[EncodedRows]:
        """Encode `units` (worker thread): one tower call per encoding mode."""
        results: dict[int, EncodedRows] = {}
        for per_frame in (False, True):
            chosen = [i for i, u in enumerate(units) if u.per_frame == per_frame]
            if not chosen:
                continue
            pixels = torch.cat([units[i].pixels for i in chosen])
            grids = torch.tensor([units[i].grid for i in chosen], dtype=torch.int64)
            self.forward_calls += 1
            rows, deepstack = self.tower.encode(pixels, grids, per_frame=per_frame)
            sizes = [units[i].output_rows for i in chosen]
            split_rows = rows.split(sizes)
            split_deep = [layer.split(sizes) for layer in deepstack]
            for j, i in enumerate(chosen):
                # Clone: a cache entry must own its memory, not pin the whole batch output.
                results[i] = EncodedRows(
                    split_rows[j].clone(), tuple(layer[j].clone() for layer in split_deep)
                )
        return [results[i] for i in range(len(units))]


def _concat(parts: list[EncodedRows]) -> EncodedRows:
    if len(parts) == 1:
        return parts[0]
    rows = torch.cat([p.rows for p in parts])
    deepstack = tuple(torch.cat(layer) for layer in zip(*(p.deepstack for p in parts), strict=True))
    return EncodedRows(rows, deepstack)
