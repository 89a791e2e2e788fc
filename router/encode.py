"""The encode stage: items' pixels to the least loaded encoder, embeddings checked and
ready for the prefill request.

Outputs come back as inline bytes or NIXL handles and pass on unchanged (a prefill worker
pulls handle-held ones straight from the encoder). Each handle's lease is recorded with the
encoder's address, for `PrefillRequest.embedding_holders`; when the outputs are unusable
the leases are released here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from common.wire import tensor_to_ref
from epd.v1 import encoder_service_pb2, encoder_service_pb2_grpc, multimodal_pb2
from router.calls import Job, RouterError, WorkerCalls
from router.channels import Channels
from router.registry import Role, WorkerRecord
from router.releases import Releases

logger = logging.getLogger(__name__)

_MODALITY = {
    "image": multimodal_pb2.MODALITY_IMAGE,
    "video": multimodal_pb2.MODALITY_VIDEO,
    "audio": multimodal_pb2.MODALITY_AUDIO,
}


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
        channels: Channels,
        releases: Releases,
        max_inline_embedding_bytes: int,
    ) -> None:
        self.calls = calls
        self.channels = channels
        self.releases = releases
        self.max_inline_embedding_bytes = max_inline_embedding_bytes

    async def encode(self, job: Job, items: Sequence[int]) -> Encoded:
        """Embeddings of the job's items at indexes `items` (whole items). Raises
        RouterError (nothing left leased then)."""
        if not items:
            return NOTHING
        prompt = job.prompt
        request = encoder_service_pb2.EncodeRequest(request_id=job.request_id)
        for i in items:
            item = prompt.params.items[i]
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

        response = await self.calls.with_retry(Role.ENCODER, "encode", call)
        leases = {
            ref.handle.lease_id: encoder
            for item in response.items
            for ref in (item.rows, *item.deepstack)
            if ref.WhichOneof("data") == "handle" and ref.handle.lease_id
        }
        try:
            return Encoded(self._check(job, items, response), leases)
        except RouterError:
            self.releases.embeddings(leases)
            raise

    def _check(
        self, job: Job, items: Sequence[int], response: encoder_service_pb2.EncodeResponse
    ) -> list[multimodal_pb2.ItemEmbedding]:
        if len(response.items) != len(items):
            raise RouterError(
                grpc.StatusCode.INTERNAL,
                f"encoder answered {len(response.items)} items for {len(items)} requested",
            )
        out = []
        inline = 0
        for i, encoded in zip(items, response.items, strict=True):
            item = job.prompt.params.items[i]
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
