"""The encoder engine: cache lookups, a short batching window, one vision forward per batch.

`EncoderEngine.encode(jobs)` looks every unit (see `requests.Unit`) up in the encoder cache.
A request's misses are queued together, as one `_Pending` entry (split so none holds more
than `max_batch_rows` patch rows) with one future; a single batch task waits
`batch_window_s` after the first queued entry, takes every entry queued by then (up to
`max_batch_rows` patch rows, at least one entry), and runs the vision tower once per
encoding mode (whole frames batched together, or frame by frame for exact partitions) on a
worker thread, so the event loop keeps serving health checks and other requests. Each
entry's rows of a mode are copied out of the batch output once, as one segment its units'
cache entries are views of (`cache.EncodedRows.owner`), so the work per request does not
grow with futures, copies and waits per unit. Results enter the cache and wake every request
waiting on them. A unit already being computed for another request is joined, not computed
twice.

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


@dataclass(slots=True, eq=False)
class _Pending:
    """Units of one request queued for the tower, and the future their rows arrive on."""

    units: list[Unit]  # distinct keys, none cached or in flight when queued
    future: asyncio.Future[dict[bytes, EncodedRows]]  # key -> rows, for these units
    input_rows: int  # patch rows of all the units


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
        self._queue: list[_Pending] = []
        # key -> the future of the queued or running entry computing it
        self._inflight: dict[bytes, asyncio.Future[dict[bytes, EncodedRows]]] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def encode(self, jobs: Sequence[ItemJob]) -> list[ItemOutput]:
        """Rows of every job, from the cache or the tower; one entry per job, same order.

        Cache writes happen only for units actually encoded. Cancelling the caller does not
        cancel the shared computation (its result is still cached).
        """
        found: dict[bytes, EncodedRows] = {}  # cache hits
        waits: dict[int, asyncio.Future[dict[bytes, EncodedRows]]] = {}  # id -> future
        missing: list[Unit] = []
        pending: set[bytes] = set()
        get, inflight = self.cache.get, self._inflight
        for job in jobs:
            for unit in job.units:
                key = unit.key
                if key in found or key in pending:
                    continue
                entry = get(key)
                if entry is not None:
                    found[key] = entry
                    continue
                pending.add(key)
                future = inflight.get(key)
                if future is None:
                    missing.append(unit)
                else:
                    waits[id(future)] = future
        if missing:
            for future in self._enqueue(missing):
                waits[id(future)] = future
            self._ensure_task()
            self._wakeup.set()
        hits = set(found)
        for future in waits.values():
            rows = await asyncio.shield(future)
            found.update((key, rows[key]) for key in pending.intersection(rows))
        return [
            ItemOutput(
                _concat([found[u.key] for u in job.units]),
                all(u.key in hits for u in job.units),
            )
            for job in jobs
        ]

    def _enqueue(self, units: list[Unit]) -> list[asyncio.Future[dict[bytes, EncodedRows]]]:
        """Queue `units` as entries of at most `max_batch_rows` patch rows (a larger unit
        alone); their futures."""
        loop = asyncio.get_running_loop()
        futures = []
        start = 0
        while start < len(units):
            rows = units[start].input_rows
            end = start + 1
            while end < len(units) and rows + units[end].input_rows <= self.max_batch_rows:
                rows += units[end].input_rows
                end += 1
            future: asyncio.Future[dict[bytes, EncodedRows]] = loop.create_future()
            chunk = units[start:end]
            for unit in chunk:
                self._inflight[unit.key] = future
            self._queue.append(_Pending(chunk, future, rows))
            futures.append(future)
            start = end
        return futures

    async def close(self) -> None:
        """Stop the batch task; queued requests fail with CancelledError."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for entry in self._queue:
            entry.future.cancel()
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
                outputs = await asyncio.to_thread(self._forward, batch)
            except Exception as exc:
                logger.exception("vision forward failed for %d requests", len(batch))
                for entry in batch:
                    for unit in entry.units:
                        self._inflight.pop(unit.key, None)
                    if not entry.future.done():
                        entry.future.set_exception(exc)
                        entry.future.exception()  # retrieved here: waiters may be gone
            else:
                self.batches += 1
                put, inflight = self.cache.put, self._inflight
                for entry, rows in zip(batch, outputs, strict=True):
                    for unit in entry.units:
                        put(unit.key, rows[unit.key])
                        inflight.pop(unit.key, None)
                        self.rows_encoded += unit.output_rows
                    self.units_encoded += len(entry.units)
                    if not entry.future.done():
                        entry.future.set_result(rows)
                logger.debug(
                    "encoded %d requests in %.1f ms",
                    len(batch),
                    1e3 * (time.perf_counter() - started),
                )
            if self._queue:
                self._wakeup.set()

    def _take_batch(self) -> list[_Pending]:
        """Queued entries up to `max_batch_rows` patch rows (always at least one)."""
        rows = 0
        count = 0
        for entry in self._queue:
            if count and rows + entry.input_rows > self.max_batch_rows:
                break
            rows += entry.input_rows
            count += 1
        batch, self._queue = self._queue[:count], self._queue[count:]
        return batch

    def _forward(self, batch: list[_Pending]) -> list[dict[bytes, EncodedRows]]:
        """Encode the entries' units (worker thread): one tower call per encoding mode;
        per entry, its units' rows by key."""
        results: list[dict[bytes, EncodedRows]] = [{} for _ in batch]
        for per_frame in (False, True):
            segments = [
                (i, [u for u in entry.units if u.per_frame == per_frame])
                for i, entry in enumerate(batch)
            ]
            segments = [(i, units) for i, units in segments if units]
            if not segments:
                continue
            units = [u for _, seg in segments for u in seg]
            pixels = torch.cat([u.pixels for u in units])
            grids = torch.tensor([u.grid for u in units], dtype=torch.int64)
            self.forward_calls += 1
            rows, deepstack = self.tower.encode(pixels, grids, per_frame=per_frame)
            tensors = (rows, *deepstack)
            start = 0
            for i, seg in segments:
                # One copy per entry (its segment, main and deepstack rows stacked), never a
                # view of the whole batch output.
                n = sum(u.output_rows for u in seg)
                owner = EncodedRows(torch.stack([t.narrow(0, start, n) for t in tensors]))
                start += n
                if len(seg) == 1:
                    results[i][seg[0].key] = owner
                    continue
                views = owner.stacked.split([u.output_rows for u in seg], dim=1)
                for unit, view in zip(seg, views, strict=True):
                    results[i][unit.key] = EncodedRows(view, owner)
        return results


def _concat(parts: list[EncodedRows]) -> EncodedRows:
    if len(parts) == 1:
        return parts[0]
    return EncodedRows(torch.cat([p.stacked for p in parts], dim=1))
