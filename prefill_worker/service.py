"""`PrefillService`: compute a prompt's KV and first token, then lend the KV by lease.

Prefill: validate the handoff (INVALID_ARGUMENT naming the field, nothing cached), pull
embeddings held by NIXL handles (then `ReleaseEmbeddings` on the encoder named for each
lease in `embedding_holders`; a video given only its partitions past the cached prefix is
computed as its pieces, `prefill_worker.partitions`), hash the prompt's full blocks under
the runner's root,
reuse the cached prefix, compute the rest, sample the first token, and answer with a
`KvHandle`: the block hashes, this worker's NIXL agent, one descriptor per prompt block
(full blocks, then the partial last block) into the registered block-major KV buffer, and
a lease, plus the prompt's digest and each block's bytes' digest, signed with the cluster
key (`common.handoff.build_handle`).

Block ownership: the prompt's blocks move from the prefill sequence to a lease
(`common.server.leases`), under the id the caller chose (`PrefillRequest.lease_id`; else a
random one). The lease holds them until `ReleaseKv(lease_id)` (the decode worker, after its
pull, or the router, for a request that ended before decode took it) or until the reaper
sees it expire; both release the blocks to the pool exactly once, and no block is freed or
reused while its lease lives. A `ReleaseKv` that comes before its lease is made (the router's
call ended without the answer) bars the id: the Prefill then gives its blocks back and
answers CANCELLED instead of leasing them to nobody until the TTL. Full prompt blocks
stay in the prefix cache afterwards (evictable). `ReleaseKv` answers whether the lease was
still live: a decode worker uses what it READ only if it was. A lease lasts `lease_ttl_s`
plus `lease_ttl_per_lease_s` for every lease already live, so a burst that backs decode up
gets longer leases, up to `MAX_LEASE_GROWTH` times `lease_ttl_s` (leases on one cached
prefix are not bounded by the pool, and a lease left by a decode worker that died pins its
blocks that long); a reader still waiting to pull extends a live lease with `RenewKv`.
Blocks a decode worker reports as failing their digest are digested again here; one whose
bytes changed since it was computed leaves the prefix cache. A request asking for a LoRA
adapter or for more than the model's context is refused before anything
(`common.handoff.check_request`).

Threads: every runner call runs on the one `ModelThread`, so the event loop keeps serving
(ReleaseKv, StreamKvEvents, health) while the model computes; NIXL pulls of embeddings run
in worker threads (`prefill_worker.embeddings`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from common.handoff import build_handle, check_request
from common.kv.digest import cache_block_digests
from common.kv.events import KvEventHub
from common.models.batching import MissingEmbeddingsError
from common.models.sequence import LmSequence
from common.multimodal.validation import MultimodalLayoutError
from common.server.kv_worker import KvWorkerParts, kv_load, stream_kv_events
from common.server.leases import Lease, LeaseIdError, LeaseTable, refusal
from common.server.peers import PeerClient
from common.server.rpc import RpcStatusError, logged, rpc_errors
from common.wire.kv import kv_event_to_proto
from common.wire.sampling import sampling_from_proto
from epd.v1 import (
    prefill_service_pb2,
    prefill_service_pb2_grpc,
    registry_service_pb2,
)
from prefill_worker.embeddings import EmbeddingPulls
from prefill_worker.packing import PrefillPacker
from prefill_worker.partitions import split_for_prefill

logger = logging.getLogger(__name__)
# A lease lasts at most this many times `lease_ttl_s`, however many are live (module doc).
MAX_LEASE_GROWTH = 10


@dataclass(frozen=True, slots=True)
class LeasedBlocks:
    """What a KV lease pins: the prompt's blocks (one pool reference each) and the digests
    of the prompt blocks' bytes the handle carries."""

    blocks: list[int]
    digests: list[bytes]


@dataclass(frozen=True, slots=True)
class PrefillCounters:
    """What the prefill worker did since start, and holds now (tests, logs)."""

    requests: int  # Prefill RPCs answered with a handle
    active: int  # Prefill RPCs in flight
    leases: int  # live KV leases
    leases_expired: int  # leases the reaper freed
    leases_released: int  # leases released by ReleaseKv
    kv_blocks_used: int  # pool blocks referenced
    kv_blocks_free: int  # pool blocks free
    prefix_hits: int  # prompt blocks found in the prefix cache
    prefix_lookups: int  # prompt blocks looked up
    digest_mismatches: int  # cached blocks found changed since computed (then recomputed)


class PrefillServicer(prefill_service_pb2_grpc.PrefillServiceServicer):
    """The prefill worker's RPCs; see the module docstring for the contracts.

    Registers the runner's whole KV buffer with `agent` once, here; the agent metadata sent
    in every handle is the snapshot taken right after.
    """

    def __init__(
        self,
        parts: KvWorkerParts,
        *,
        lease_ttl_s: float,
        lease_ttl_per_lease_s: float = 0.0,
        embedding_pull_timeout_s: float = 30.0,
        release_timeout_s: float = 5.0,
        pack_tokens: int = 0,
    ) -> None:
        self.runner = runner = parts.runner
        self.model = parts.model
        self.agent = agent = parts.agent
        self.lifecycle = parts.lifecycle
        self.key = parts.key  # signs every KvHandle; None: insecure, handles go unsigned
        credentials = parts.credentials
        # Lease id -> the blocks pinned for a decode worker, with their digests.
        self.leases: LeaseTable[LeasedBlocks] = LeaseTable(lease_ttl_s)
        self.lease_ttl_per_lease_s = lease_ttl_per_lease_s
        self.hub = KvEventHub(runner.allocator)
        self.release_timeout_s = release_timeout_s  # deadline of ReleaseEmbeddings calls
        # Releases to encoders, presenting `credentials` (the cluster bearer).
        self._peers = PeerClient(release_timeout_s=release_timeout_s, credentials=credentials)
        self.embeddings = EmbeddingPulls(runner, agent, self._peers, embedding_pull_timeout_s)
        # Prompts of concurrent Prefill calls, computed together on the model thread.
        self.packer = PrefillPacker(runner, self.model, pack_tokens=pack_tokens)
        # gRPC address of this worker, put in handles for ReleaseKv; set once bound.
        self.holder_address = ""
        self.active = 0  # Prefill RPCs in flight
        self._settling: set[asyncio.Task[None]] = set()  # released leases not yet freed
        self.requests = 0  # Prefill RPCs answered with a handle
        agent.register(runner.kv.buffer)
        self._metadata = agent.metadata()

    # ------------------------------------------------------------------------- Prefill

    @rpc_errors
    async def Prefill(
        self, request: prefill_service_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_service_pb2.PrefillResponse:
        async with self.lifecycle.track():
            self.active += 1
            try:
                return await self._prefill(request, context.time_remaining())
            finally:
                self.active -= 1

    async def _prefill(
        self, request: prefill_service_pb2.PrefillRequest, time_left_s: float | None
    ) -> prefill_service_pb2.PrefillResponse:
        tokens = list(request.prompt_token_ids)
        sampling = sampling_from_proto(request.sampling)
        check_request(self.runner, tokens, sampling, request)
        if request.lease_id:  # the caller's: refused before any work if it cannot be used
            try:
                self.leases.check(request.lease_id)
            except LeaseIdError as exc:
                raise refusal(exc, "lease_id") from None
        lease_id = request.lease_id or uuid.uuid4().hex
        started = time.perf_counter()
        # A video given only some partitions' rows is computed as its pieces; the hashes
        # and digest stay the whole prompt's (`prefill_worker.partitions`).
        whole, multimodal, origins = split_for_prefill(request.multimodal)
        try:
            handoff = await self.embeddings.read_handoff(
                tokens, multimodal, request.embedding_holders, time_left_s
            )
        except MultimodalLayoutError as exc:
            if origins is None or exc.item is None:
                raise
            raise MultimodalLayoutError(exc.field, exc.reason, origins[exc.item]) from None
        params = handoff.params
        prompt = params if whole is None else whole
        salt = request.cache_salt if request.HasField("cache_salt") else None
        lora = request.lora_id if request.HasField("lora_id") else None
        allocator = self.runner.allocator
        hashes = allocator.hashes(tokens, prompt, cache_salt=salt, lora_id=lora)
        computing = time.perf_counter()
        try:
            seq, digests = await self.packer.prefill(
                tokens, params, sampling, hashes, handoff.positions
            )
        except MissingEmbeddingsError as exc:
            raise RpcStatusError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        ttl_s = self.leases.ttl_s + self.lease_ttl_per_lease_s * len(self.leases)
        ttl_s = min(ttl_s, MAX_LEASE_GROWTH * self.leases.ttl_s)
        try:  # no await inside: the blocks end up leased, or back in the pool
            digest = allocator.prompt_digest(tokens, prompt, cache_salt=salt, lora_id=lora)
            response = self._answer(seq, len(tokens), hashes, digests, digest, lease_id, ttl_s)
            lease = self.leases.add(
                LeasedBlocks(seq.blocks, digests), request.request_id, ttl_s, lease_id
            )
        except BaseException as exc:  # the id was released (or taken) while it computed
            await self.model.call(allocator.release, seq.blocks)
            if isinstance(exc, LeaseIdError):
                raise refusal(exc, "lease_id") from None
            raise
        self.requests += 1
        logger.debug(
            "request %s: %d tokens (%d cached), handoff and hashes %.1f ms, compute %.1f ms, "
            "lease %s for %.1f s",
            logged(request.request_id),
            len(tokens),
            seq.cached_tokens,
            (computing - started) * 1000,
            (time.perf_counter() - computing) * 1000,
            lease.lease_id,
            ttl_s,
        )
        return response

    def _answer(
        self,
        seq: LmSequence,
        num_tokens: int,
        hashes: list[bytes] | None,
        block_digests: list[bytes],
        prompt_digest: bytes,
        lease_id: str,
        ttl_s: float,
    ) -> prefill_service_pb2.PrefillResponse:
        """The answer to a computed prompt: its first token and its signed KV handle."""
        return prefill_service_pb2.PrefillResponse(
            first_token_id=seq.output[0],
            kv=build_handle(
                self.runner,
                seq.blocks,
                hashes or [],
                num_tokens=num_tokens,
                prompt_digest=prompt_digest,
                block_digests=block_digests,
                agent=self.agent,
                agent_metadata=self._metadata,
                lease_id=lease_id,
                lease_ttl_s=ttl_s,
                holder_address=self.holder_address,
                key=self.key,
            ),
            cached_tokens=seq.cached_tokens,
            computed_tokens=num_tokens - seq.cached_tokens,
        )

    async def close(self) -> None:
        """Shutdown, after gRPC stopped: stop the reaper, free every leased block, finish
        background releases and close their channels."""
        await self.leases.stop_reaper()
        await self.release_all_leases()
        await self._peers.close()

    # -------------------------------------------------------------------------- leases

    @rpc_errors
    async def ReleaseKv(
        self, request: prefill_service_pb2.ReleaseKvRequest, context: grpc.aio.ServicerContext
    ) -> prefill_service_pb2.ReleaseKvResponse:
        lease = self.leases.pop_or_bar(request.lease_id)  # a Prefill computing it makes none
        if lease is None:
            return prefill_service_pb2.ReleaseKvResponse(released=False)
        # The answer needs only the pop: the lease was live until now, so the reader's READ
        # saw the leased bytes. The recheck and the freeing wait for the model thread (~20
        # ms on a busy worker, on the decode worker's path), so they follow the answer.
        settle = self._settle(lease, list(request.mismatched_blocks))
        task = asyncio.get_running_loop().create_task(settle)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        return prefill_service_pb2.ReleaseKvResponse(released=True)

    async def _settle(self, lease: Lease[LeasedBlocks], mismatched: list[int]) -> None:
        """A released lease: recheck the blocks its reader says failed their digest, then
        give every block back."""
        try:
            if mismatched:
                await self.model.call(self._recheck, lease.held, mismatched)
        except Exception:
            logger.exception("lease %s: rechecking blocks %s failed", lease.lease_id, mismatched)
        finally:
            await self._free(lease)

    @rpc_errors
    async def RenewKv(
        self, request: prefill_service_pb2.RenewKvRequest, context: grpc.aio.ServicerContext
    ) -> prefill_service_pb2.RenewKvResponse:
        lease = self.leases.renew(request.lease_id)
        if lease is None:
            return prefill_service_pb2.RenewKvResponse(renewed=False)
        left = max(lease.expires_at - self.leases.clock(), 0.0)
        return prefill_service_pb2.RenewKvResponse(renewed=True, lease_ttl_ms=int(left * 1000))

    def _recheck(self, held: LeasedBlocks, indices: list[int]) -> None:
        """Model thread: digest again the leased prompt blocks a reader says failed their
        digest; uncache those whose bytes changed since they were computed (a reader's
        word alone changes nothing)."""
        picked = sorted({i for i in indices if 0 <= i < len(held.digests)})
        now = cache_block_digests(self.runner.kv, [held.blocks[i] for i in picked])
        changed = [held.blocks[i] for i, d in zip(picked, now, strict=True) if d != held.digests[i]]
        if changed:
            logger.error("leased KV blocks %s changed after they were computed", changed)
            self.runner.allocator.digest_mismatches += len(changed)
            self.runner.allocator.uncache(changed)

    def reap_leases(self, interval_s: float | None = None) -> None:
        """Start the lease table's reaper: expired leases' blocks go back to the pool."""
        self.leases.start_reaper(self._free, interval_s)

    async def release_all_leases(self) -> None:
        """Free every leased block (shutdown), released leases' included."""
        for lease in self.leases.pop_all():
            await self._free(lease)
        await self.settle_releases()

    async def settle_releases(self) -> None:
        """Return once every lease released so far has its blocks back in the pool."""
        await asyncio.gather(*self._settling, return_exceptions=True)

    async def _free(self, lease: Lease[LeasedBlocks]) -> None:
        """Release a popped lease's block references to the pool (on the model thread)."""
        await self.model.call(self.runner.allocator.release, lease.held.blocks)

    # ---------------------------------------------------------------------- KV events

    @rpc_errors
    async def StreamKvEvents(
        self,
        request: prefill_service_pb2.StreamKvEventsRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[prefill_service_pb2.StreamKvEventsResponse]:
        async for events in stream_kv_events(self.hub, self.model, request.subscriber):
            yield prefill_service_pb2.StreamKvEventsResponse(
                events=[kv_event_to_proto(e) for e in events]
            )

    # --------------------------------------------------------------------------- load

    def load(self) -> registry_service_pb2.WorkerLoad:
        """Heartbeat load: requests in flight, KV blocks, prefix-cache hits and lookups."""
        return kv_load(self.runner, self.active, self.lifecycle)

    @property
    def counters(self) -> PrefillCounters:
        """A snapshot of the counters (see PrefillCounters)."""
        pool = self.runner.allocator.pool
        return PrefillCounters(
            requests=self.requests,
            active=self.active,
            leases=len(self.leases),
            leases_expired=self.leases.expired,
            leases_released=self.leases.released,
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_free=pool.num_free_blocks,
            prefix_hits=pool.hits,
            prefix_lookups=pool.lookups,
            digest_mismatches=self.runner.allocator.digest_mismatches,
        )
