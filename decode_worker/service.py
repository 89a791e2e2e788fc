"""`DecodeService.Decode`: verify the KV handle, pull what is missing, stream the answer.

Per request:
1. validate the handoff (INVALID_ARGUMENT naming the field) and the handle against this
   worker (`common.handoff.check_handle`: a different KV layout is FAILED_PRECONDITION);
2. recompute the block hashes from the handoff under this worker's root; a handle whose
   hashes differ is refused with FAILED_PRECONDITION and nothing enters the cache;
3. take blocks (`KvAllocator.plan_import`): full prompt blocks whose hashes this worker caches
   are reused, the others plus the partial last block are pulled by one NIXL READ, then the
   lease is released on the prefill worker (`holder_address`), and the pulled full blocks
   enter this worker's prefix cache;
4. join the continuous-batching loop and stream `DecodeResponse` chunks of token ids (the
   router owns the text). The stream never repeats the prefill's first token, which the
   caller already has: the first chunk carries `blocks_pulled` / `blocks_reused` and the
   tokens after the first one (possibly none); the last carries `finish_reason`. When the
   first token already ends the answer, the stream is one chunk with no tokens and the
   finish reason.

Leases: once this worker starts pulling it owns the duty to release the lease (after the
READ, whether it succeeded or not). A request refused before that (bad handoff, foreign
layout, hash mismatch) leaves the lease to the caller (the router releases it, or it
expires on the prefill worker).

Cancellation (client cancel, deadline): blocks taken for the request go back to the pool —
at once before the READ starts, after the READ finishes if it is in flight, and at the
decode loop's next step once the sequence is running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from common.handoff import check_handle, pull, read_handoff
from common.kv.allocator import ImportPlan
from common.kv.block_pool import NoFreeBlocksError
from common.models import batching
from common.models.batching import DecodeBatcher
from common.models.model_thread import ModelThread
from common.models.runner import LmRunner
from common.models.sequence import LmSequence
from common.sampling import SamplingParams
from common.server.kv_worker import kv_load
from common.server.lifecycle import ServerLifecycle
from common.server.peers import PeerClient
from common.server.rpc import RpcStatusError, rpc_errors
from common.transfer.agent import TransferAgent
from common.transfer.types import TransferTimeoutError
from common.wire.convert import sampling_from_proto
from common.wire.sampling import finish_reason_to_proto
from epd.v1 import (
    decode_service_pb2,
    decode_service_pb2_grpc,
    registry_service_pb2,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DecodeCounters:
    """What the decode worker did since start (tests, heartbeats, logs)."""

    requests: int = 0  # Decode streams admitted (past validation)
    blocks_pulled: int = 0  # prompt blocks READ from prefill workers
    bytes_pulled: int = 0  # bytes READ from prefill workers
    blocks_reused: int = 0  # full prompt blocks found in this worker's prefix cache
    hash_mismatches: int = 0  # handles refused because their hashes differ
    pull_seconds: float = 0.0  # wall time spent in READs


class DecodeServicer(decode_service_pb2_grpc.DecodeServiceServicer):
    """The decode worker's RPC; see the module docstring for the contracts.

    Registers the runner's KV buffer with `agent` once, here (the READ destination).
    """

    def __init__(
        self,
        runner: LmRunner,
        model: ModelThread,
        agent: TransferAgent,
        lifecycle: ServerLifecycle,
        *,
        max_batch: int = 32,
        pull_timeout_s: float = 30.0,
        release_timeout_s: float = 5.0,
    ) -> None:
        self.runner = runner
        self.model = model
        self.agent = agent
        self.lifecycle = lifecycle
        self.pull_timeout_s = pull_timeout_s
        self.release_timeout_s = release_timeout_s
        self.batcher = DecodeBatcher(runner, model)
        self.counters = DecodeCounters()
        self.active = 0  # Decode RPCs in flight
        self._slots = asyncio.Semaphore(max_batch)
        self._peers = PeerClient(release_timeout_s=release_timeout_s)  # ReleaseKv to prefill
        agent.register(runner.kv.buffer)

    # -------------------------------------------------------------------------- Decode

    @rpc_errors
    async def Decode(
        self, request: decode_service_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_service_pb2.DecodeResponse]:
        async with self.lifecycle.track():
            self.active += 1
            try:
                async for chunk in self._decode(request, context.time_remaining()):
                    yield chunk
            finally:
                self.active -= 1

    async def _decode(
        self, request: decode_service_pb2.DecodeRequest, time_left_s: float | None
    ) -> AsyncIterator[decode_service_pb2.DecodeResponse]:
        runner = self.runner
        tokens = list(request.prompt_token_ids)
        sampling = sampling_from_proto(request.sampling)
        handoff = await asyncio.to_thread(
            read_handoff, runner, tokens, request.multimodal, with_embeddings=False
        )
        first = request.first_token_id
        if not 0 <= first < runner.config.text.vocab_size:
            raise RpcStatusError(
                grpc.StatusCode.INVALID_ARGUMENT, f"first_token_id: {first} outside the vocab"
            )
        if not request.HasField("kv"):
            raise RpcStatusError(grpc.StatusCode.INVALID_ARGUMENT, "kv: missing")
        handle = request.kv
        check_handle(handle, runner, len(tokens))
        hashes = runner.allocator.hashes(
            tokens,
            handoff.params,
            cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
            lora_id=request.lora_id if request.HasField("lora_id") else None,
        )
        if (hashes or []) != list(handle.block_hashes):
            self.counters.hash_mismatches += 1
            raise RpcStatusError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"kv.block_hashes: the handle's {len(handle.block_hashes)} block hashes differ "
                f"from the {len(hashes or [])} recomputed from the handoff; refusing the KV",
            )
        self.counters.requests += 1
        # From here on this worker owns releasing the lease (once, whatever happens).
        release = self._lease_releaser(handle.holder_address, handle.lease_id)
        reason = runner.stop.check(sampling, first, 1)
        if reason is not None:
            # The first token already ends the answer: nothing to pull, nothing to add.
            release()
            yield decode_service_pb2.DecodeResponse(finish_reason=finish_reason_to_proto(reason))
            return
        async with self._slots:
            try:
                pull_timeout_s = min(self.pull_timeout_s, time_left_s or self.pull_timeout_s)
                seq, plan = await self._admit(
                    request,
                    tokens,
                    handoff.positions.delta,
                    sampling,
                    hashes,
                    max(pull_timeout_s, 1e-3),
                )
            finally:
                release()
            entry = self.batcher.add(seq)
            finished = False
            try:
                # Sent before any new token so the caller learns at once that this worker
                # has the KV (and the lease) now.
                yield decode_service_pb2.DecodeResponse(
                    blocks_pulled=len(plan.pull), blocks_reused=len(plan.reused)
                )
                while not finished:
                    chunk = await entry.queue.get()
                    finished = chunk.finish_reason is not None
                    yield decode_service_pb2.DecodeResponse(
                        token_ids=chunk.token_ids,
                        finish_reason=finish_reason_to_proto(chunk.finish_reason),
                    )
            finally:
                if not finished:
                    self.batcher.cancel(entry)

    async def _admit(
        self,
        request: decode_service_pb2.DecodeRequest,
        tokens: list[int],
        mrope_delta: int,
        sampling: SamplingParams,
        hashes: list[bytes] | None,
        pull_timeout_s: float,
    ) -> tuple[LmSequence, ImportPlan]:
        """Take blocks, pull the missing ones, make the sequence (owning the blocks).

        On failure or cancellation every block taken goes back to the pool (after the READ
        has finished, if one is in flight), except after an uncancellable READ timeout: NIXL
        may still write those blocks, so they are quarantined (never handed out again).
        """
        runner = self.runner
        allocator = runner.allocator
        total = len(tokens) + sampling.max_tokens - 1
        plan = await self._plan(hashes, len(tokens), total)
        try:
            stats = await pull(
                self.agent,
                runner,
                request.kv,
                plan,
                timeout_s=pull_timeout_s,
                on_orphan=lambda: self.model.submit(allocator.abort_import, plan),
            )
        except asyncio.CancelledError:
            raise  # on_orphan gives the blocks back once the READ is over
        except TransferTimeoutError as exc:
            if exc.cancelled:
                await self.model.call(allocator.abort_import, plan)
            else:
                logger.error(
                    "KV READ timed out and could not be cancelled; quarantining %d blocks",
                    len(plan.blocks),
                )
            raise
        except BaseException:
            await self.model.call(allocator.abort_import, plan)
            raise
        c = self.counters
        c.blocks_pulled += len(plan.pull)
        c.blocks_reused += len(plan.reused)
        if stats is not None:
            c.bytes_pulled += stats.nbytes
            c.pull_seconds += stats.seconds
        seq = await self.model.call(
            self._start,
            plan,
            hashes,
            tokens,
            mrope_delta,
            sampling,
            request.first_token_id,
            on_orphan=lambda s: self.model.submit(batching.release, runner, s),
        )
        return seq, plan

    def _start(
        self,
        plan: ImportPlan,
        hashes: list[bytes] | None,
        tokens: list[int],
        mrope_delta: int,
        sampling: SamplingParams,
        first: int,
    ) -> LmSequence:
        """Model thread: cache the pulled blocks, then the running sequence owning them."""
        self.runner.allocator.finish_import(plan, hashes)
        return self.runner.resume(tokens, sampling, plan.blocks, first, mrope_delta=mrope_delta)

    async def _plan(self, hashes: list[bytes] | None, n: int, total: int) -> ImportPlan:
        """`plan_import`, waiting for running sequences to free blocks when the pool is full;
        RESOURCE_EXHAUSTED (NoFreeBlocksError) when nothing runs that could free any."""
        while True:
            try:
                return await self.model.call(
                    self.runner.allocator.plan_import,
                    hashes,
                    n,
                    total,
                    on_orphan=lambda p: self.model.submit(self.runner.allocator.abort_import, p),
                )
            except NoFreeBlocksError:
                if not self.batcher.running:
                    raise
                await self.batcher.wait_freed()

    # ----------------------------------------------------------------------- releases

    def _lease_releaser(self, address: str, lease_id: str) -> Callable[[], None]:
        """A callable that tells the prefill worker, once and in the background, to unpin
        the lease; later calls do nothing."""
        done = False

        def release() -> None:
            nonlocal done
            if done:
                return
            done = True
            if not address or not lease_id:
                logger.warning("KV handle names no holder or lease; the lease will expire")
                return
            self._peers.release_kv(address, lease_id)

        return release

    async def close(self) -> None:
        """Stop the decode loop (freeing running sequences), finish releases, close channels."""
        await self.batcher.stop()
        await self._peers.close()

    # --------------------------------------------------------------------------- load

    def load(self) -> registry_service_pb2.WorkerLoad:
        """Heartbeat load: streams in flight, KV blocks, prefix-cache hits and lookups."""
        return kv_load(self.runner, self.active, self.lifecycle)
