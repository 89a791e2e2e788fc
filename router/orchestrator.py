"""One request through the pools: encode -> prefill -> decode, streamed back.

    run(job):
      encode   items of the prompt -> least loaded encoder -> one TensorRef per item (+
               deepstack); inline bytes and NIXL handles both pass through unchanged, so a
               prefill worker pulls large embeddings straight from the encoder
      prefill  (prompt_token_ids, MultimodalParams + embeddings) -> least loaded prefill
               worker -> first token + KvHandle (a lease pins the prompt's blocks)
      stream   the first token goes to the client at once (that is the TTFT)
      decode   (prompt_token_ids, MultimodalParams without embeddings, first token,
               KvHandle) -> least loaded decode worker -> token chunks, streamed on (its
               first chunk repeats the first token, which is dropped, and carries the KV
               transfer counts blocks_pulled / blocks_reused)

Embedding leases (NIXL-held encoder outputs): the request tells the prefill worker which
encoder holds each (`embedding_holders`) and the prefill worker releases them once pulled;
if prefill is never reached or fails, the router releases them (a second release of the
same lease is ignored by the encoder).

Ownership of the KV lease: the decode worker takes it over with its first chunk (it has
pulled the blocks by then). Until that chunk arrives the router owns it: if decode is
never started, fails, or the request is cancelled or runs out of time first, the router
calls `PrefillService.ReleaseKv` (in the background, so a cancelled request still frees
it). A worker call that fails with UNAVAILABLE before any of its output was used is tried
once more on another worker of the role.

Deadlines: every worker call gets the time left until the job's deadline; cancellation of
the caller cancels the in-flight call (unary calls through task cancellation, the decode
stream explicitly), so workers free what they hold.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from common.processor import ProcessedPrompt, Processor
from common.sampling import SamplingParams, StopChecker
from common.wire import params_to_proto, tensor_to_ref
from epd.v1 import (
    decode_service_pb2,
    decode_service_pb2_grpc,
    encoder_service_pb2,
    encoder_service_pb2_grpc,
    multimodal_pb2,
    prefill_service_pb2,
    prefill_service_pb2_grpc,
    router_service_pb2,
)
from router.channels import Channels
from router.detokenize import IncrementalDetokenizer
from router.inputs import sampling_to_proto
from router.registry import NoWorkerError, Registry, Role, WorkerRecord
from router.releases import Releases

logger = logging.getLogger(__name__)

T = TypeVar("T")

_FINISH = {
    "stop": decode_service_pb2.FINISH_REASON_STOP,
    "length": decode_service_pb2.FINISH_REASON_LENGTH,
}
_MODALITY = {
    "image": multimodal_pb2.MODALITY_IMAGE,
    "video": multimodal_pb2.MODALITY_VIDEO,
    "audio": multimodal_pb2.MODALITY_AUDIO,
}
# Worker failures the client caused or should see as they are.
_PASS_THROUGH = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}


class RouterError(Exception):
    """A request failure with the gRPC status the client gets."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Job:
    """One checked request, ready to run."""

    request_id: str  # the caller's id, or one the router made
    prompt: ProcessedPrompt  # tokens, item layout and pixels
    sampling: SamplingParams  # checked sampling parameters
    cache_salt: str | None  # tenant salt for the prefix caches
    deadline: float  # `time.monotonic()` by which the request must be done

    def time_left(self, stage: str) -> float:
        """Seconds left; RouterError(DEADLINE_EXCEEDED) naming `stage` when none are."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline passed before {stage}")
        return left


@dataclass(frozen=True, slots=True)
class Encoded:
    """The encoder's output for a job, ready for the prefill request."""

    embeddings: list[multimodal_pb2.ItemEmbedding]  # one per item, inline or NIXL handle
    leases: dict[str, str]  # NIXL lease id -> address of the encoder holding it


@dataclass(slots=True)
class KvLease:
    """The prefill worker's lease on a prompt's KV blocks and who must release it."""

    lease_id: str  # from the KvHandle
    address: str  # prefill worker holding the blocks
    owned: bool = True  # False once the decode worker has taken it over (first chunk)


class Orchestrator:
    """Runs jobs across the registered workers; see the module docstring."""

    def __init__(
        self,
        registry: Registry,
        channels: Channels,
        processor: Processor,
        *,
        max_inline_embedding_bytes: int,
        release_timeout_s: float = 5.0,
        attempts: int = 2,
    ) -> None:
        self.registry = registry
        self.channels = channels
        self.processor = processor
        self.max_inline_embedding_bytes = max_inline_embedding_bytes
        self.release_timeout_s = release_timeout_s
        self.attempts = attempts
        self.stop = StopChecker(frozenset(processor.eos_token_ids))
        self.releases = Releases(channels, release_timeout_s)

    async def run(self, job: Job) -> AsyncIterator[router_service_pb2.GenerateResponse]:
        """Stream the answer to `job`. The first chunk carries the first token with
        prompt_tokens and cached_tokens (it is sent before decode starts, so TTFT is the
        prefill's); the next chunk, the decode worker's first, carries blocks_pulled and
        blocks_reused (and possibly no tokens); the last one a finish reason. Raises
        RouterError."""
        encoded = await self._encode(job) if job.prompt.params.items else Encoded([], {})
        handoff = params_to_proto(job.prompt.params)
        try:
            prefill, holder = await self._prefill(job, handoff, encoded)
        except BaseException:
            # Prefill releases what it pulled; leases it never reached are freed here.
            self.releases.embeddings(encoded.leases)
            raise
        detok = IncrementalDetokenizer(self.processor.decode)
        first = prefill.first_token_id
        finish = self.stop.check(job.sampling, first, 1)
        chunk = router_service_pb2.GenerateResponse(
            token_ids=[first],
            text=detok.add([first]),
            prompt_tokens=len(job.prompt.prompt_token_ids),
            cached_tokens=prefill.cached_tokens,
        )
        lease = KvLease(prefill.kv.lease_id, prefill.kv.holder_address or holder)
        try:
            if finish is not None:
                chunk.text += detok.flush()
                chunk.finish_reason = _FINISH[finish]
                yield chunk
                return
            yield chunk
            async for out in self._decode(job, handoff, prefill, lease, detok):
                yield out
        finally:
            # Also when the client goes away at a `yield`, before decode ever starts.
            if lease.owned:
                self.releases.kv(lease.lease_id, lease.address)

    # -------------------------------------------------------------------------- stages

    async def _encode(self, job: Job) -> Encoded:
        prompt = job.prompt
        request = encoder_service_pb2.EncodeRequest(request_id=job.request_id)
        for i, item in enumerate(prompt.params.items):
            encode_item = request.items.add(
                content_hash=item.content_hash,
                modality=_MODALITY.get(str(item.modality), multimodal_pb2.MODALITY_UNSPECIFIED),
                pixel_values=tensor_to_ref(prompt.pixel_values[i]),
                grid_thw=list(prompt.grid_thw[i]),
            )
            for part in item.partitions:
                encode_item.partitions.add(
                    input_start=part.input_start,
                    input_end=part.input_end,
                    output_rows=part.output_rows,
                    content_hash=part.content_hash,
                )

        encoder = ""

        async def call(worker: WorkerRecord) -> encoder_service_pb2.EncodeResponse:
            nonlocal encoder
            stub = encoder_service_pb2_grpc.EncoderServiceStub(self.channels.get(worker.address))
            response: encoder_service_pb2.EncodeResponse = await stub.Encode(
                request, timeout=job.time_left("encode")
            )
            encoder = worker.address
            return response

        response = await self._with_retry(Role.ENCODER, "encode", call)
        leases = {
            ref.handle.lease_id: encoder
            for item in response.items
            for ref in (item.rows, *item.deepstack)
            if ref.WhichOneof("data") == "handle" and ref.handle.lease_id
        }
        try:
            return Encoded(self._check_encoded(job, response), leases)
        except RouterError:
            self.releases.embeddings(leases)
            raise

    def _check_encoded(
        self, job: Job, response: encoder_service_pb2.EncodeResponse
    ) -> list[multimodal_pb2.ItemEmbedding]:
        items = job.prompt.params.items
        if len(response.items) != len(items):
            raise RouterError(
                grpc.StatusCode.INTERNAL,
                f"encoder answered {len(response.items)} items for {len(items)} requested",
            )
        out = []
        inline = 0
        for i, (item, encoded) in enumerate(zip(items, response.items, strict=True)):
            if encoded.content_hash != item.content_hash or (
                tuple(encoded.rows.shape[:1]) != (item.length,)
            ):
                raise RouterError(
                    grpc.StatusCode.INTERNAL,
                    f"encoder output for item {i} does not match it (hash or "
                    f"{tuple(encoded.rows.shape)} rows for {item.length} placeholders)",
                )
            emb = multimodal_pb2.ItemEmbedding(item_index=i, rows=encoded.rows)
            emb.deepstack.extend(encoded.deepstack)
            inline += len(encoded.rows.inline_data) + sum(
                len(d.inline_data) for d in encoded.deepstack
            )
            out.append(emb)
        if inline > self.max_inline_embedding_bytes:
            raise RouterError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request carries {inline} bytes of inline embeddings, more than the router's "
                f"limit of {self.max_inline_embedding_bytes}",
            )
        return out

    async def _prefill(
        self,
        job: Job,
        handoff: multimodal_pb2.MultimodalParams,
        encoded: Encoded,
    ) -> tuple[prefill_service_pb2.PrefillResponse, str]:
        multimodal = multimodal_pb2.MultimodalParams()
        multimodal.CopyFrom(handoff)
        multimodal.embeddings.extend(encoded.embeddings)
        request = prefill_service_pb2.PrefillRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt.prompt_token_ids,
            multimodal=multimodal,
            sampling=sampling_to_proto(job.sampling),
            embedding_holders=encoded.leases,
        )
        if job.cache_salt is not None:
            request.cache_salt = job.cache_salt
        holder = ""

        async def call(worker: WorkerRecord) -> prefill_service_pb2.PrefillResponse:
            nonlocal holder
            stub = prefill_service_pb2_grpc.PrefillServiceStub(self.channels.get(worker.address))
            response: prefill_service_pb2.PrefillResponse = await stub.Prefill(
                request, timeout=job.time_left("prefill")
            )
            holder = worker.address
            return response

        response = await self._with_retry(Role.PREFILL, "prefill", call)
        return response, holder

    async def _decode(
        self,
        job: Job,
        handoff: multimodal_pb2.MultimodalParams,
        prefill: prefill_service_pb2.PrefillResponse,
        lease: KvLease,
        detok: IncrementalDetokenizer,
    ) -> AsyncIterator[router_service_pb2.GenerateResponse]:
        request = decode_service_pb2.DecodeRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt.prompt_token_ids,
            multimodal=handoff,
            sampling=sampling_to_proto(job.sampling),
            first_token_id=prefill.first_token_id,
            kv=prefill.kv,
        )
        if job.cache_salt is not None:
            request.cache_salt = job.cache_salt
        tried: set[str] = set()
        while True:
            worker = self._pick(Role.DECODE, tried)
            tried.add(worker.address)
            stub = decode_service_pb2_grpc.DecodeServiceStub(self.channels.get(worker.address))
            with self.registry.using(worker):
                call = stub.Decode(request, timeout=job.time_left("decode"))
                try:
                    async for response in call:
                        if lease.owned:
                            lease.owned = False  # the decode worker has it now
                            _drop_echo(response, prefill.first_token_id)
                        yield self._chunk(response, detok)
                    return
                except grpc.aio.AioRpcError as exc:
                    if not lease.owned or not self._retryable(exc, len(tried)):
                        raise self._error("decode", worker, exc) from None
                    logger.warning(
                        "decode on %s failed (%s); trying another", worker.address, exc.code()
                    )
                finally:
                    call.cancel()

    def _chunk(
        self, response: decode_service_pb2.DecodeResponse, detok: IncrementalDetokenizer
    ) -> router_service_pb2.GenerateResponse:
        text = detok.add(response.token_ids)
        if response.finish_reason != decode_service_pb2.FINISH_REASON_UNSPECIFIED:
            text += detok.flush()
        return router_service_pb2.GenerateResponse(
            token_ids=response.token_ids,
            text=text,
            finish_reason=response.finish_reason,
            blocks_pulled=response.blocks_pulled,
            blocks_reused=response.blocks_reused,
        )

    # ------------------------------------------------------------------------- helpers

    def _pick(self, role: Role, tried: set[str]) -> WorkerRecord:
        try:
            return self.registry.pick(role, exclude=frozenset(tried))
        except NoWorkerError as exc:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None

    def _retryable(self, exc: grpc.aio.AioRpcError, tries: int) -> bool:
        return exc.code() == grpc.StatusCode.UNAVAILABLE and tries < self.attempts

    def _error(self, stage: str, worker: WorkerRecord, exc: grpc.aio.AioRpcError) -> RouterError:
        code = exc.code()
        if code not in _PASS_THROUGH and code != grpc.StatusCode.UNAVAILABLE:
            code = grpc.StatusCode.INTERNAL
        return RouterError(code, f"{stage} on {worker.address} failed: {exc.details()}")

    async def _with_retry(
        self, role: Role, stage: str, call: Callable[[WorkerRecord], Awaitable[T]]
    ) -> T:
        tried: set[str] = set()
        while True:
            worker = self._pick(role, tried)
            tried.add(worker.address)
            with self.registry.using(worker):
                try:
                    return await call(worker)
                except grpc.aio.AioRpcError as exc:
                    if not self._retryable(exc, len(tried)):
                        raise self._error(stage, worker, exc) from None
                    logger.warning(
                        "%s on %s failed (%s); trying another", stage, worker.address, exc.code()
                    )

    async def close(self) -> None:
        """Wait for background lease releases (bounded by their own deadline)."""
        await self.releases.close()


def _drop_echo(response: decode_service_pb2.DecodeResponse, first_token_id: int) -> None:
    """The decode worker's first chunk repeats the prefill's first token (so its stream alone
    is the whole answer); the router already sent that token, so it is dropped here."""
    if response.token_ids and response.token_ids[0] == first_token_id:
        del response.token_ids[0]
    else:
        logger.warning("decode stream did not start with the first token %d", first_token_id)
