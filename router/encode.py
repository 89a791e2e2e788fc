"""The encode stage: items' pixels to encoders picked by item-hash affinity + load,
embeddings checked and ready for the prefill request.

Each item has a home encoder: the rendezvous (highest-random-weight) choice for its content
hash (a partitioned item's: its first partition's) among the live, non-draining encoders
(`Registry.pick` with `key`), so a repeated image, or a video with frames appended, meets
the encoder cache that already holds it, and an encoder joining or leaving moves only the
items it wins or held. The home is bypassed for the least loaded encoder when its
load exceeds that one's by more than `affinity_slack` requests; a slack of 0 turns affinity
off (the whole request goes to the least loaded encoder). A request's items are grouped per
chosen encoder; the groups' `Encode` calls run concurrently (each retried on
UNAVAILABLE, on another encoder) and their outputs come back in item order.
Of a video whose leading partitions the prefill worker caches, only the partitions past
them are encoded (`encode`'s `from_partition`); `encode_partitions` asks for some
partitions of one item (for `router.overlap`). Either way only their patch rows are sent
(`EncodeItem.partition_indices`), and the embedding names the span it holds
(`ItemEmbedding.partition_start` / `partition_end`) for the prefill worker. Patch rows go
as uint8 codes (`router.encode_request`).
A whole item whose inline output the router kept (`router.embedding_cache`, setting
`embedding_cache_mb`) is not sent to an encoder at all: its kept rows go to prefill.

Outputs come back as inline bytes or NIXL handles and pass on unchanged (a prefill worker
pulls handle-held ones straight from the encoder). Each handle's lease is recorded with the
address of the encoder that produced it, for `PrefillRequest.embedding_holders`; when the
outputs are unusable, or one group fails or the request is cancelled, the leases already
granted are released here, and those of an answer that never arrived by the lease key the
router chose for the call (`PeerClient.encode`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from common.byte_lru import ENTRY_BYTES
from common.roles import Role
from common.server.peers import PeerClient
from common.wire.convert import inline_bytes
from epd.v1 import (
    encoder_service_pb2,
    multimodal_pb2,
    prefill_service_pb2,
)
from router.calls import Job, RouterError, TooLarge, WorkerCalls
from router.embedding_cache import EmbeddingCache
from router.encode_request import encode_request
from router.workers import NoWorkerError, WorkerRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Encoded:
    """The encoder's output for some items of a job, ready for the prefill request."""

    embeddings: list[multimodal_pb2.ItemEmbedding]  # one per encoded item, inline or handle
    leases: dict[str, str]  # NIXL lease id -> address of the encoder holding it


NOTHING = Encoded([], {})


class EncodeStage:
    """Runs `Encode` for a job's items; see the module docstring."""

    def __init__(
        self,
        calls: WorkerCalls,
        channels: PeerClient,
        max_inline_embedding_bytes: int,
        affinity_slack: int = 2,
        embedding_cache_bytes: int = 0,
    ) -> None:
        self.calls = calls
        self.channels = channels  # worker channels, and embedding lease releases
        self.max_inline_embedding_bytes = max_inline_embedding_bytes
        self.affinity_slack = affinity_slack  # requests; 0: no affinity, least loaded only
        # Whole items' inline outputs, for items seen again (None: off).
        self.embeddings = (
            EmbeddingCache(embedding_cache_bytes, ENTRY_BYTES) if embedding_cache_bytes else None
        )

    async def encode(
        self, job: Job, items: Sequence[int], from_partition: Mapping[int, int] | None = None
    ) -> Encoded:
        """Embeddings of the job's items at indexes `items`, in that order: whole items,
        except an item `i` in `from_partition`, whose embedding holds only its partitions
        from `from_partition[i]` on (`ItemEmbedding.partition_start`; the prefill worker
        caches the others). Raises RouterError (nothing left leased then)."""
        if not items:
            return NOTHING
        chosen = {
            i: range(first, len(job.prompt.params.items[i].partitions))
            for i, first in (from_partition or {}).items()
        }
        kept, keys = self._kept(job, items, chosen)
        if len(kept) == len(items):  # nothing to ask an encoder for
            self.check_inline(kept.values())
            return Encoded([kept[i] for i in items], {})
        groups = self._assign(job, [i for i in items if i not in kept])
        if len(groups) == 1:
            ((worker, group),) = groups
            parts = [await self._encode_on(job, group, worker, chosen)]
        else:
            tasks = [
                asyncio.ensure_future(self._encode_on(job, group, worker, chosen))
                for worker, group in groups
            ]
            try:
                parts = list(await asyncio.gather(*tasks))
            except BaseException:
                # A group failed or the request was cancelled: stop the others and free
                # what any of them got (now or when it finishes).
                for task in tasks:
                    task.cancel()
                    task.add_done_callback(self._release_result)
                raise
        leases = {lease: address for part in parts for lease, address in part.leases.items()}
        by_index = {emb.item_index: emb for part in parts for emb in part.embeddings}
        if self.embeddings is not None:
            for i, key in keys.items():
                if i in by_index:
                    self.embeddings.put(key, by_index[i])
        by_index.update(kept)
        try:
            self.check_inline(by_index.values())
        except RouterError:
            self.channels.release_embeddings(leases)
            raise
        return Encoded([by_index[i] for i in items], leases)

    def _kept(
        self, job: Job, items: Sequence[int], chosen: Mapping[int, Sequence[int]]
    ) -> tuple[dict[int, multimodal_pb2.ItemEmbedding], dict[int, bytes]]:
        """The embeddings `self.embeddings` holds of the whole items among `items`, and the
        keys of the others (to keep what the encoder answers for them)."""
        model = self.calls.registry.expected_model
        if self.embeddings is None or model is None:
            return {}, {}
        model += f"/{self.calls.registry.dtype_now()}"  # another dtype's rows are others
        kept: dict[int, multimodal_pb2.ItemEmbedding] = {}
        keys: dict[int, bytes] = {}
        for i in items:
            if i in chosen:
                continue
            key = self.embeddings.key(
                job.prompt.params.items[i].content_hash, job.cache_salt, model
            )
            found = self.embeddings.get(key, i)
            if found is None:
                keys[i] = key
            else:
                kept[i] = found
        return kept, keys

    async def encode_partitions(self, job: Job, item: int, partitions: Sequence[int]) -> Encoded:
        """One `Encode` call for item `item`'s partitions at indexes `partitions` (empty:
        the whole item) on the item's home encoder: one embedding whose rows are those
        partitions' rows in order (`router.overlap` encodes a video piece by piece). Raises
        RouterError (nothing left leased then)."""
        ((worker, _),) = self._assign(job, [item])
        return await self._encode_on(job, [item], worker, {item: partitions} if partitions else {})

    def _assign(
        self, job: Job, items: Sequence[int]
    ) -> list[tuple[WorkerRecord | None, list[int]]]:
        """Items per chosen encoder, each group in item order; with affinity off, all to
        None (the least loaded encoder, picked by the call)."""
        if self.affinity_slack <= 0:
            return [(None, list(items))]
        groups: dict[str, tuple[WorkerRecord, list[int]]] = {}
        registry = self.calls.registry
        for i in items:
            item = job.prompt.params.items[i]
            # A partitioned item (video) is homed by its first partition, so the same video
            # with frames appended meets the encoder caching its shared partitions.
            key = item.partitions[0].content_hash if item.partitions else item.content_hash
            try:
                worker = registry.pick(Role.ENCODER, key=key, slack=self.affinity_slack)
            except NoWorkerError as exc:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
            groups.setdefault(worker.address, (worker, []))[1].append(i)
        return list(groups.values())

    def _release_result(self, task: asyncio.Future[Encoded]) -> None:
        if not task.cancelled() and task.exception() is None:
            self.channels.release_embeddings(task.result().leases)

    async def _encode_on(
        self,
        job: Job,
        items: Sequence[int],
        first: WorkerRecord | None,
        chosen: Mapping[int, Sequence[int]],
    ) -> Encoded:
        """One `Encode` call for `items` on `first` (None: the least loaded encoder), once
        more elsewhere on UNAVAILABLE; of an item `i` in `chosen` just the consecutive
        partitions `chosen[i]`, sending only their patch rows. Raises RouterError (nothing
        left leased then)."""
        request = encode_request(job, items, chosen)

        async def call(worker: WorkerRecord) -> tuple[str, encoder_service_pb2.EncodeResponse]:
            timeout = job.time_left("encode")
            return worker.address, await self.channels.encode(worker.address, request, timeout)

        encoder, response = await self.calls.with_retry(
            Role.ENCODER, "encode", call, first=first, deadline=job.deadline
        )
        leases = {
            ref.handle.lease_id: encoder
            for item in response.items
            for ref in (item.rows, *item.deepstack)
            if ref.WhichOneof("data") == "handle" and ref.handle.lease_id
        }
        try:
            return Encoded(self._check(job, items, response, chosen), leases)
        except RouterError:
            self.channels.release_embeddings(leases)
            raise

    def _check(
        self,
        job: Job,
        items: Sequence[int],
        response: encoder_service_pb2.EncodeResponse,
        chosen: Mapping[int, Sequence[int]],
    ) -> list[multimodal_pb2.ItemEmbedding]:
        """The answer's items as embeddings for prefill, each checked to be the one asked
        for (named by its content hash) with a row per placeholder."""
        if len(response.items) != len(items):
            raise RouterError(
                grpc.StatusCode.INTERNAL,
                f"encoder answered {len(response.items)} items for {len(items)} requested",
            )
        out = []
        for i, encoded in zip(items, response.items, strict=True):
            item = job.prompt.params.items[i]
            partitions = chosen.get(i, ())
            rows = sum(item.partitions[p].output_rows for p in partitions) or item.length
            if encoded.content_hash != item.content_hash or (
                tuple(encoded.rows.shape[:1]) != (rows,)
            ):
                raise RouterError(
                    grpc.StatusCode.INTERNAL,
                    f"encoder output for item {i} does not match it (hash or "
                    f"{tuple(encoded.rows.shape)} rows for {rows} placeholders)",
                )
            emb = multimodal_pb2.ItemEmbedding(item_index=i, rows=encoded.rows)
            emb.deepstack.extend(encoded.deepstack)
            if partitions:  # consecutive: the span the rows hold
                emb.partition_start, emb.partition_end = partitions[0], partitions[-1] + 1
            out.append(emb)
        return out

    def check_inline(self, embeddings: Iterable[multimodal_pb2.ItemEmbedding]) -> None:
        """`TooLarge` (RESOURCE_EXHAUSTED for good) when the inline bytes of `embeddings`
        exceed the router's limit for one request."""
        inline = sum(inline_bytes((emb.rows, *emb.deepstack)) for emb in embeddings)
        if inline > self.max_inline_embedding_bytes:
            raise TooLarge(
                f"request carries {inline} bytes of inline embeddings, more than the router's "
                f"limit of {self.max_inline_embedding_bytes}",
            )


def log_stages(
    job: Job,
    encoded: Encoded,
    encode_s: float,
    prefill_start: float,
    response: prefill_service_pb2.PrefillResponse,
) -> None:
    """Debug log of where a request's time to first token went (benchmarks read it)."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    inline = sum(inline_bytes((emb.rows, *emb.deepstack)) for emb in encoded.embeddings)
    logger.debug(
        "request %s stages: encode %.1f ms (%d embeddings, %d inline bytes), prefill %.1f ms "
        "(%d cached, %d computed tokens)",
        job.request_id,
        encode_s * 1000,
        len(encoded.embeddings),
        inline,
        (time.perf_counter() - prefill_start) * 1000,
        response.cached_tokens,
        response.computed_tokens,
    )
