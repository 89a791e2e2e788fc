"""The encoder engine: cache lookups, a short batching window, one vision forward per
encoding mode per batch.

`EncoderEngine.encode(jobs)` (one request) looks all its units (see `requests.Unit`) up in
the encoder cache at once. Its misses are queued together, as one `_Pending` entry (split so
none holds more than `max_batch_rows` patch rows); a unit already queued or being computed
for another request is joined, not computed twice. A single batch task waits
`batch_window_s` after the first queued entry, takes every entry queued by then (up to
`max_batch_rows` patch rows, at least one entry, one per request id), and runs the vision
tower once per encoding mode (whole items batched together, or frame by frame for exact
partitions) on a worker thread, so the event loop keeps serving health checks and other
requests.

The work per batch does not grow with futures, tensors or log lines per unit: the tensor
operations are a constant number per encoding mode and per copied output segment
(`encoder_worker.batch`), the cache is read and written a request or a segment at a time
(`get_many`, `put_many`), one map per batch holds every unit's rows, and each request waits
on one future of its own (so cancelling a request cancels nothing shared: rows another request
waits for, or that the tower has begun, are still computed and cached; queued work no request
waits for any more is dropped). What is left per unit is a few dict and list operations.

`encode_now(requests)` runs the same selection, batches, forward and completion for several
requests synchronously on the caller's thread, without the event loop (offline use, and what
`benchmarks/encoder_input_bench.py` times as the input preparation).

Failure: if the forward raises, every request of that batch gets the error and nothing is
cached. Touched only from the server's event loop (or one thread, for `encode_now`), except
the forward itself.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.models.malloc_settings import tune_malloc, wait_or_release
from common.models.qwen3_vl.preprocessor import ProcessorSettings
from common.models.qwen3_vl.vision import VisionTower
from common.processing.image import as_patch_values
from common.tasks import cancel_and_wait
from encoder_worker.batch import Segment, join, mode_inputs, split_output
from encoder_worker.cache import EncodedRows, EncoderCache
from encoder_worker.requests import ItemJob, Unit

logger = logging.getLogger(__name__)

_key = operator.attrgetter("key")
_input_rows = operator.attrgetter("input_rows")
_units = operator.attrgetter("units")


@dataclass(slots=True, eq=False)
class _Waiter:
    """One request waiting for the entries that compute its misses."""

    future: asyncio.Future[None] | None  # set when `remaining` reaches 0 (None: encode_now)
    remaining: int  # entries it waits for that have not finished


@dataclass(slots=True, eq=False)
class _Pending:
    """Units of one request queued for the tower, and the requests waiting for them."""

    units: list[Unit]  # distinct keys, none cached or in flight when queued
    input_rows: int  # patch rows of all the units
    waiters: list[_Waiter]  # the request that queued it, and those that joined it
    request_id: str = ""  # of the request that queued it ("": none given)
    result: dict[bytes, EncodedRows] | None = None  # once encoded: key -> rows, whole batch


@dataclass(slots=True, eq=False)
class _Selection:
    """Where the units of one request's jobs come from."""

    keys: list[bytes]  # every job's unit keys, in job order
    found: dict[bytes, EncodedRows]  # cache hits
    sources: list[_Pending]  # entries computing the rest: its own and the joined ones
    queued: list[_Pending]  # its own, new entries
    waiter: _Waiter  # waits for `sources`


@dataclass(slots=True)
class ItemOutput:
    """Encoder output of one requested item (not mutated once made)."""

    rows: EncodedRows  # rows of the requested units, concatenated in order
    cache_hit: bool  # every unit came from the encoder cache


class EncoderEngine:
    """Cache + batcher in front of one `VisionTower` (the module docstring). Its counters
    (load reports, tests) are commented in `__init__`; the cache's live on `cache`."""

    def __init__(
        self,
        tower: VisionTower,
        cache: EncoderCache,
        *,
        batch_window_s: float = 0.002,
        max_batch_rows: int = 1 << 16,
        settings: ProcessorSettings | None = None,
    ) -> None:
        tune_malloc()  # process-wide: freed activations stay in the heap (see the module)
        self.tower = tower
        self.settings = settings  # maps patch codes to the tower's values (None: no codes)
        self.cache = cache
        self.batch_window_s = batch_window_s
        self.max_batch_rows = max_batch_rows
        self.forward_calls = 0  # tower.encode calls
        self.batches = 0  # batches run
        self.units_encoded = 0  # units computed (cache misses actually encoded)
        self.units_abandoned = 0  # queued units dropped: every request waiting went away
        self.rows_encoded = 0  # output rows computed
        self._queue: list[_Pending] = []
        self._running: list[_Pending] = []  # the batch in the tower now
        self._inflight: dict[bytes, _Pending] = {}  # key -> the queued or running entry
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def encode(self, jobs: Sequence[ItemJob], request_id: str = "") -> list[ItemOutput]:
        """Rows of every job, from the cache or the tower; one entry per job, same order.
        `request_id` (the caller's, "" for none): two calls with the same id are not batched
        together (`_take_batch`).

        Cache writes happen only for units actually encoded. Cancelling the caller does not
        cancel a computation another request waits for, or one the tower has begun (its
        result is still cached); work queued for it alone is dropped (`_abandon`), as it is
        when one of its batches failed (the request fails; its other work is not needed).
        """
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        selection = self._select(jobs, future, request_id)
        if selection.queued:
            self._ensure_task()
            self._wakeup.set()
        if selection.waiter.remaining:
            try:
                await future
            except BaseException:
                self._abandon(selection)
                raise
        return self._outputs(jobs, selection)

    def encode_now(self, requests: Sequence[Sequence[ItemJob]]) -> list[list[ItemOutput]]:
        """`encode` of every request at once, on this thread (blocking it): their misses in
        batches of at most `max_batch_rows`; per request, its outputs.

        Not while `encode` calls have work queued (RuntimeError): this call finishes only
        the work it queues itself.
        """
        if self._queue or self._inflight:
            raise RuntimeError("encode_now while encode() calls have work queued")
        selections = [self._select(jobs, None) for jobs in requests]
        while self._queue:
            batch = self._take_batch()
            try:  # caching too, as in the batch loop (its keys stayed in flight: ownfixB F3)
                self._complete(batch, self._forward(batch))
            except BaseException as exc:
                self._fail(batch + self._queue, exc)
                self._queue.clear()
                raise
        return [self._outputs(j, s) for j, s in zip(requests, selections, strict=True)]

    def _select(
        self, jobs: Sequence[ItemJob], future: asyncio.Future[None] | None, request_id: str = ""
    ) -> _Selection:
        """Look the jobs' units up in the cache, join those in flight, queue the rest."""
        units = list(itertools.chain.from_iterable(map(_units, jobs)))
        keys = list(map(_key, units))
        distinct, distinct_keys = units, keys
        if len(set(keys)) != len(keys):  # an item or partition asked for twice
            first: dict[bytes, Unit] = {}
            for unit in units:
                first.setdefault(unit.key, unit)
            distinct, distinct_keys = list(first.values()), list(first)
        entries = self.cache.get_many(distinct_keys)
        if entries.count(None) == len(entries):
            found: dict[bytes, EncodedRows] = {}
            missing, missing_keys = distinct, distinct_keys
        else:
            found = {k: e for k, e in zip(distinct_keys, entries, strict=True) if e is not None}
            missing = [u for u, e in zip(distinct, entries, strict=True) if e is None]
            missing_keys = list(map(_key, missing))
        inflight = self._inflight
        joined: list[_Pending] = []
        if inflight and not inflight.keys().isdisjoint(missing_keys):
            joined = list(dict.fromkeys(inflight[k] for k in missing_keys if k in inflight))
            missing = [u for u in missing if u.key not in inflight]
            missing_keys = list(map(_key, missing))
        queued = self._enqueue(missing, missing_keys, request_id) if missing else []
        sources = joined + queued
        waiter = _Waiter(future, len(sources))
        for entry in sources:
            entry.waiters.append(waiter)
        return _Selection(keys, found, sources, queued, waiter)

    def _abandon(self, selection: _Selection) -> None:
        """The request went away while it waited: it waits for nothing any more, and a
        queued entry no request waits for leaves the queue, unencoded (so a caller that
        sends requests and cancels them cannot queue the tower's work past what admission
        lets it hold). An entry the tower has taken is computed and cached."""
        waiter = selection.waiter
        dropped = []
        for entry in selection.sources:
            entry.waiters = [w for w in entry.waiters if w is not waiter]
            if not entry.waiters and any(e is entry for e in self._queue):
                dropped.append(entry)
        if not dropped:
            return
        self._queue = [e for e in self._queue if all(e is not d for d in dropped)]
        for entry in dropped:
            for unit in entry.units:
                if self._inflight.get(unit.key) is entry:
                    del self._inflight[unit.key]
            self.units_abandoned += len(entry.units)

    def _enqueue(self, units: list[Unit], keys: list[bytes], request_id: str) -> list[_Pending]:
        """Queue `units` (with these keys) as entries of at most `max_batch_rows` patch rows
        (a larger unit alone); the entries."""
        rows = sum(map(_input_rows, units))
        if rows <= self.max_batch_rows:
            entry = _Pending(units, rows, [], request_id=request_id)
            self._inflight.update(dict.fromkeys(keys, entry))
            self._queue.append(entry)
            return [entry]
        chunks, rows = [[units[0]]], units[0].input_rows
        for unit in units[1:]:
            if rows + unit.input_rows > self.max_batch_rows:
                chunks.append([])
                rows = 0
            chunks[-1].append(unit)
            rows += unit.input_rows
        entries = []
        for chunk in chunks:
            entry = _Pending(chunk, sum(map(_input_rows, chunk)), [], request_id=request_id)
            self._inflight.update(dict.fromkeys(map(_key, chunk), entry))
            entries.append(entry)
        self._queue.extend(entries)
        return entries

    def _outputs(self, jobs: Sequence[ItemJob], selection: _Selection) -> list[ItemOutput]:
        """Each job's rows, once every source has finished."""
        found = selection.found
        maps = [found] if found else []
        for entry in selection.sources:
            result = entry.result
            assert result is not None  # set before its waiters are woken
            if all(result is not m for m in maps):
                maps.append(result)
        keys = selection.keys
        if len(maps) == 1:
            rows = list(map(maps[0].__getitem__, keys))
        else:
            rows = [next(m[k] for m in maps if k in m) for k in keys]
        if len(rows) == len(jobs):  # one unit per job
            if not found:
                return list(map(ItemOutput, rows, itertools.repeat(False)))
            return [ItemOutput(r, k in found) for r, k in zip(rows, keys, strict=True)]
        outputs = []
        start = 0
        for job in jobs:
            end = start + len(job.units)
            hit = bool(found) and all(k in found for k in keys[start:end])
            outputs.append(ItemOutput(join(rows[start:end]), hit))
            start = end
        return outputs

    def waiting_requests(self) -> int:
        """Requests with units queued for the tower, not in it yet (a snapshot: any thread)."""
        return len({id(w) for entry in list(self._queue) for w in list(entry.waiters)})

    async def close(self) -> None:
        """Stop the batch task; queued requests fail with CancelledError."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        for entry in self._queue + self._running:
            for waiter in entry.waiters:
                if waiter.future is not None:
                    waiter.future.cancel()
        self._queue.clear()
        self._running = []
        self._inflight.clear()

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._batch_loop(), name="epd-encoder-batcher")

    async def _batch_loop(self) -> None:
        ran = False  # a batch ran since freed memory was last given back (idle)
        while True:
            if not await wait_or_release(self._wakeup, ran):
                ran = False
                continue
            self._wakeup.clear()
            if not self._queue:
                continue
            if self.batch_window_s > 0:
                await asyncio.sleep(self.batch_window_s)
                if not self._queue:  # its requests went away meanwhile
                    continue
            batch = self._running = self._take_batch()
            started = time.perf_counter()
            try:  # its caching too: failing there stopped this loop, the batch never answered
                self._complete(batch, await asyncio.to_thread(self._forward, batch))
            except Exception as exc:
                logger.exception("encoding failed for %d requests", len(batch))
                self._fail(batch, exc)
            else:
                took_ms = 1e3 * (time.perf_counter() - started)
                logger.debug("encoded %d requests in %.1f ms", len(batch), took_ms)
            self._running = []
            ran = True
            if self._queue:
                self._wakeup.set()

    def _take_batch(self) -> list[_Pending]:
        """Queued entries, in queue order, up to `max_batch_rows` patch rows (always at
        least one), at most one per request id: a caller that sends one request's pieces
        ahead (`router.overlap`: one `Encode` call encoding while the next waits) gets each
        back as soon as it is encoded, rather than two together, later; the entries passed
        over keep their place at the front of the queue."""
        rows = 0
        batch: list[_Pending] = []
        rest: list[_Pending] = []
        ids: set[str] = set()
        for i, entry in enumerate(self._queue):
            if batch and rows + entry.input_rows > self.max_batch_rows:
                rest.extend(self._queue[i:])
                break
            if entry.request_id and entry.request_id in ids:
                rest.append(entry)
                continue
            ids.add(entry.request_id)
            rows += entry.input_rows
            batch.append(entry)
        self._queue = rest
        return batch

    def _forward(self, batch: list[_Pending]) -> list[Segment]:
        """Encode the entries' units (worker thread): one tower call per encoding mode, the
        output as cache-entry segments."""
        segments = []
        units = list(itertools.chain.from_iterable(map(_units, batch)))
        for mode in mode_inputs(units, self._values):
            self.forward_calls += 1
            rows, deepstack = self.tower.encode(mode.pixels, mode.grids, per_frame=mode.per_frame)
            segments.extend(split_output(mode.units, rows, deepstack))
        return segments

    def _values(self, pixels: torch.Tensor) -> torch.Tensor:
        """The tower's float input for patch rows: codes mapped by the processor settings,
        values as they are."""
        if pixels.dtype == torch.uint8 and self.settings is None:
            raise ValueError("patch codes to encode, but the engine has no processor settings")
        return pixels if self.settings is None else as_patch_values(pixels, self.settings)

    def _complete(self, batch: list[_Pending], segments: list[Segment]) -> None:
        """Cache the batch's rows, and wake every request that has all it waited for."""
        result: dict[bytes, EncodedRows] = {}
        put = self.cache.put_many
        for segment in segments:
            put(segment.keys, segment.entries, segment.owner)
            result.update(zip(segment.keys, segment.entries, strict=True))
        inflight = self._inflight
        if len(inflight) == len(result):  # nothing else in flight (each key is queued once)
            inflight.clear()
        else:
            for key in result:
                inflight.pop(key, None)
        self.batches += 1
        self.units_encoded += len(result)
        self.rows_encoded += sum(segment.owner.stacked.shape[1] for segment in segments)
        for entry in batch:
            entry.result = result
            for waiter in entry.waiters:
                waiter.remaining -= 1
                future = waiter.future
                if not waiter.remaining and future is not None and not future.done():
                    future.set_result(None)

    def _fail(self, batch: list[_Pending], exc: BaseException) -> None:
        """The batch's requests get `exc`; nothing is cached."""
        for entry in batch:
            for unit in entry.units:
                self._inflight.pop(unit.key, None)
            for waiter in entry.waiters:
                future = waiter.future
                if future is not None and not future.done():
                    future.set_exception(exc)
                    future.exception()  # retrieved here: the waiter may be gone
