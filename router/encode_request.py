"""The `EncodeRequest` for some items of a job, in the form encoders take.

Patch rows go as the processor made them, uint8 codes (`common.processing.image`) named by
their content hashes, under which the encoder answers each.
(Every encoder a router registers takes codes: those from before them lend digest-less
handles and are refused, docs/compatibility.md. Encoders still take an old router's float32
values, `encoder_worker.requests`.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from common.wire.convert import fill_ref
from epd.v1 import encoder_service_pb2, multimodal_pb2
from router.calls import Job

_MODALITY = {
    "image": multimodal_pb2.MODALITY_IMAGE,
    "video": multimodal_pb2.MODALITY_VIDEO,
    "audio": multimodal_pb2.MODALITY_AUDIO,
}


def encode_request(
    job: Job, items: Sequence[int], chosen: Mapping[int, Sequence[int]]
) -> encoder_service_pb2.EncodeRequest:
    """The request for `items` of `job` (of an item `i` in `chosen`, only the consecutive
    partitions `chosen[i]`, sending only their patch rows)."""
    prompt = job.prompt
    # Unique per request: an encoder batches at most one call per id (`router.overlap`'s
    # pieces of one request share it), and a caller's own id may be anyone's.
    request = encoder_service_pb2.EncodeRequest(request_id=f"{job.request_id}#{job.nonce}")
    if job.cache_salt is not None:  # the tenant's: its encoder cache entries are its own
        request.cache_salt = job.cache_salt
    for i in items:
        item = prompt.params.items[i]
        pixels = prompt.pixel_values[i]
        partitions = chosen.get(i, ())
        if partitions:  # consecutive: one slice of the patch rows
            lo, hi = item.partitions[partitions[0]], item.partitions[partitions[-1]]
            pixels = pixels[lo.input_start : hi.input_end]
        encode_item = request.items.add(
            content_hash=item.content_hash,
            modality=_MODALITY.get(str(item.modality), multimodal_pb2.MODALITY_UNSPECIFIED),
            grid_thw=list(prompt.grid_thw[i]),
            partition_indices=list(partitions),
        )
        fill_ref(encode_item.pixel_values, pixels)
        for part in item.partitions:
            encode_item.partitions.add(
                input_start=part.input_start,
                input_end=part.input_end,
                output_rows=part.output_rows,
                content_hash=part.content_hash,
            )
    return request
