"""The `EncodeRequest` for some items of a job, in the form the chosen encoder takes.

Patch rows go as the processor made them, uint8 codes (`common.processing.image`) named by
their content hashes, to an encoder that says it takes codes (`PATCH_CODES` in its
`WorkerInfo.capabilities`). An encoder from before codes takes only float32 values and
checks every hash against the rows it receives, so for it each item's rows are mapped to
values (`patch_values`: the very floats a newer encoder makes of the codes before its
tower) and the hashes it checks are made from those values: each sent partition's, and the
item's when its whole rows are sent. It answers each item under the hash it was sent
(`Sent.hashes`). What the router hands prefill is unchanged: the same rows, keyed by the
codes' hashes in the job's params. So routers and encoders can be upgraded in any order: a
new router serves through old encoders (at four times the bytes, until they are upgraded),
and new encoders take an old router's values (`encoder_worker.requests`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from common.processing.content_hash import content_hash, partitioned_content_hash
from common.processing.image import as_patch_values
from common.roles import PATCH_CODES
from common.wire.convert import fill_ref
from epd.v1 import encoder_service_pb2, multimodal_pb2, registry_service_pb2
from router.calls import Job

_MODALITY = {
    "image": multimodal_pb2.MODALITY_IMAGE,
    "video": multimodal_pb2.MODALITY_VIDEO,
    "audio": multimodal_pb2.MODALITY_AUDIO,
}


@dataclass(frozen=True, slots=True)
class Sent:
    """An `EncodeRequest` and, per item index, the content hash the item is named by in it
    (what the encoder's answer for it must carry)."""

    request: encoder_service_pb2.EncodeRequest
    hashes: dict[int, bytes]


def takes_codes(info: registry_service_pb2.WorkerInfo) -> bool:
    """Whether the encoder that registered `info` takes uint8 patch codes."""
    return PATCH_CODES in info.capabilities


def encode_request(
    job: Job, items: Sequence[int], chosen: Mapping[int, Sequence[int]], codes: bool
) -> Sent:
    """The request for `items` of `job` (of an item `i` in `chosen`, only the consecutive
    partitions `chosen[i]`, sending only their patch rows): uint8 codes where `codes`, else
    float32 values with the hashes an encoder from before codes checks."""
    prompt = job.prompt
    settings = None if codes else prompt.settings
    fingerprint = b"" if settings is None else settings.fingerprint()
    # Unique per request: an encoder batches at most one call per id (`router.overlap`'s
    # pieces of one request share it), and a caller's own id may be anyone's.
    request = encoder_service_pb2.EncodeRequest(request_id=f"{job.request_id}#{job.nonce}")
    if job.cache_salt is not None:  # the tenant's: its encoder cache entries are its own
        request.cache_salt = job.cache_salt
    hashes = {}
    for i in items:
        item = prompt.params.items[i]
        modality = str(item.modality)
        grid = prompt.grid_thw[i]
        pixels = prompt.pixel_values[i]
        partitions = chosen.get(i, ())
        if partitions:  # consecutive: one slice of the patch rows
            lo, hi = item.partitions[partitions[0]], item.partitions[partitions[-1]]
            pixels = pixels[lo.input_start : hi.input_end]
        part_hashes = [part.content_hash for part in item.partitions]
        item_hash = item.content_hash
        if settings is not None and pixels.dtype == torch.uint8:
            pixels = as_patch_values(pixels, settings)
            sent = partitions or range(len(item.partitions))
            offset = item.partitions[sent[0]].input_start if partitions else 0
            for p in sent:
                part = item.partitions[p]
                rows = pixels[part.input_start - offset : part.input_end - offset]
                frames = (part.input_end - part.input_start) // (grid[1] * grid[2])
                part_hashes[p] = content_hash(
                    fingerprint, modality, rows, (frames, grid[1], grid[2])
                )
            if not partitions:  # the whole item, which the encoder checks
                item_hash = (
                    partitioned_content_hash(fingerprint, modality, pixels, grid, part_hashes)
                    if item.partitions
                    else content_hash(fingerprint, modality, pixels, grid)
                )
            # Of only some partitions, the item's hash is echoed, not checked (nor are the
            # unsent partitions' hashes): the codes' ones stay.
        hashes[i] = item_hash
        encode_item = request.items.add(
            content_hash=item_hash,
            modality=_MODALITY.get(modality, multimodal_pb2.MODALITY_UNSPECIFIED),
            grid_thw=list(grid),
            partition_indices=list(partitions),
        )
        fill_ref(encode_item.pixel_values, pixels)
        for part, part_hash in zip(item.partitions, part_hashes, strict=True):
            encode_item.partitions.add(
                input_start=part.input_start,
                input_end=part.input_end,
                output_rows=part.output_rows,
                content_hash=part_hash,
            )
    return Sent(request, hashes)
