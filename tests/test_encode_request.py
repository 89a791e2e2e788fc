"""The router's `EncodeRequest` (`router.encode_request`): uint8 patch codes named by their
content hashes, checked by the real encoder's `parse_request`. Encoders still take what a
router from before codes sent (float32 values and the hashes made of them,
`old_router_request`): checked the same and encoded by a real encoder worker to the same
bits."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import torch

from common.models.qwen3_vl.config import Qwen3VLConfig
from common.multimodal.validation import MultimodalLayoutError
from common.processing.content_hash import content_hash, partitioned_content_hash
from common.processing.image import as_patch_values, patch_values
from common.processing.processor import ProcessedPrompt, Processor
from common.sampling import SamplingParams
from common.server.role import RoleServer
from common.server.rpc import channel
from common.wire.convert import fill_ref, tensor_from_ref
from encoder_worker.requests import parse_request
from encoder_worker.server import EncoderServicer, serve
from encoder_worker.settings import EncoderSettings
from epd.v1 import encoder_service_pb2, encoder_service_pb2_grpc
from router.calls import Job
from router.encode_request import encode_request
from tests.cluster import cluster_credentials, cluster_security


@pytest.fixture
async def encoder(ckpt: Path) -> AsyncIterator[RoleServer[EncoderServicer]]:
    server = await serve(EncoderSettings(model=str(ckpt), nixl=False, security=cluster_security()))
    yield server
    await server.stop(0)


def image_and_video(processor: Processor, seed: int) -> ProcessedPrompt:
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    clip = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(6)]
    content = [
        {"type": "image", "image": image},
        {"type": "video", "video": clip, "fps": 2.0},
        {"type": "text", "text": "What changes?"},
    ]
    return processor.process([{"role": "user", "content": content}])


def job_of(prompt: ProcessedPrompt) -> Job:
    return Job("r", prompt, SamplingParams(), None, time.monotonic() + 60)


def old_router_request(
    prompt: ProcessedPrompt, items: list[int], chosen: dict[int, range] | None = None
) -> tuple[encoder_service_pb2.EncodeRequest, dict[int, bytes]]:
    """What a router from before patch codes sends (encoders still take it): each item's
    rows as float32 values, and the hashes made of those values (each sent partition's, and
    the item's when its whole rows are sent; of only some partitions the item's is echoed);
    with the hash each item is answered under."""
    chosen = chosen or {}
    settings = prompt.settings
    assert settings is not None
    fingerprint = settings.fingerprint()
    request = encode_request(job_of(prompt), items, chosen)
    hashes = {}
    for sent, i in zip(request.items, items, strict=True):
        item, grid, modality = (
            prompt.params.items[i],
            prompt.grid_thw[i],
            str(prompt.params.items[i].modality),
        )
        values = as_patch_values(tensor_from_ref(sent.pixel_values), settings)
        parts = chosen.get(i) or range(len(item.partitions))
        offset = item.partitions[parts[0]].input_start if i in chosen else 0
        for p in parts:
            part = item.partitions[p]
            rows = values[part.input_start - offset : part.input_end - offset]
            frames = (part.input_end - part.input_start) // (grid[1] * grid[2])
            sent.partitions[p].content_hash = content_hash(
                fingerprint, modality, rows, (frames, grid[1], grid[2])
            )
        if i not in chosen:
            part_hashes = [part.content_hash for part in sent.partitions]
            sent.content_hash = (
                partitioned_content_hash(fingerprint, modality, values, grid, part_hashes)
                if item.partitions
                else content_hash(fingerprint, modality, values, grid)
            )
        hashes[i] = sent.content_hash
        fill_ref(sent.pixel_values, values)
    return request, hashes


def test_codes_go_as_the_processor_made_them(processor: Processor) -> None:
    prompt = image_and_video(processor, 1)
    sent = encode_request(job_of(prompt), [0, 1], {})
    for i, item in enumerate(sent.items):
        meta = prompt.params.items[i]
        assert torch.equal(tensor_from_ref(item.pixel_values), prompt.pixel_values[i])
        assert item.content_hash == meta.content_hash
        assert [p.content_hash for p in item.partitions] == [
            p.content_hash for p in meta.partitions
        ]


def test_each_request_has_an_encoder_request_id_of_its_own(processor: Processor) -> None:
    # An encoder batches at most one call per request id (so that one request's overlap
    # pieces come back one by one): two callers' requests that share an id must not lose
    # their batching, nor one caller delay another's by guessing its id.
    prompt = image_and_video(processor, 1)
    first, second = job_of(prompt), job_of(prompt)  # both the caller's id "r"
    ids = [encode_request(j, [0], {}).request_id for j in (first, second)]
    assert ids[0] != ids[1] and all(i.startswith("r#") for i in ids)
    again = encode_request(first, [1], {}).request_id  # another piece
    assert again == ids[0]


def test_an_old_routers_values_pass_an_encoders_every_check(
    ckpt: Path, processor: Processor
) -> None:
    """The values are the codes' `patch_values`, and every hash the encoder checks (the
    image's, each partition's, the video's of its partitions) is the one it computes."""
    prompt = image_and_video(processor, 2)
    assert prompt.settings is not None
    fingerprint = prompt.settings.fingerprint()
    request, hashes = old_router_request(prompt, [0, 1])
    vision = Qwen3VLConfig.from_file(ckpt).vision
    jobs = parse_request(request, vision, fingerprint)
    for i, (item, job) in enumerate(zip(request.items, jobs, strict=True)):
        values = tensor_from_ref(item.pixel_values)
        assert values.dtype == torch.float32
        expected = patch_values(prompt.pixel_values[i].numpy(), prompt.settings)
        assert np.array_equal(values.numpy(), expected)
        assert job.content_hash == hashes[i] != prompt.params.items[i].content_hash
    image_unit, video_units = jobs[0].units, jobs[1].units
    assert image_unit[0].key == content_hash(
        fingerprint, "image", tensor_from_ref(request.items[0].pixel_values), prompt.grid_thw[0]
    )
    assert len(video_units) == len(prompt.params.items[1].partitions) == 3


def test_an_old_routers_values_of_some_partitions_key_them_as_the_whole_item_does(
    ckpt: Path, processor: Processor
) -> None:
    """Of the video's last two partitions only: the encoder checks those two partitions'
    hashes, which equal the ones it checks of the whole item, and echoes the item hash."""
    prompt = image_and_video(processor, 3)
    assert prompt.settings is not None
    fingerprint = prompt.settings.fingerprint()
    vision = Qwen3VLConfig.from_file(ckpt).vision
    whole, _ = old_router_request(prompt, [1])
    (whole_job,) = parse_request(whole, vision, fingerprint)
    part, hashes = old_router_request(prompt, [1], {1: range(1, 3)})
    (job,) = parse_request(part, vision, fingerprint)
    assert [u.key for u in job.units] == [u.key for u in whole_job.units[1:]]
    assert job.content_hash == hashes[1] == prompt.params.items[1].content_hash


async def test_an_old_routers_values_encode_to_the_rows_of_codes(
    encoder: RoleServer[EncoderServicer], processor: Processor
) -> None:
    """A real encoder worker: the values form's rows (main and deepstack) are the codes
    form's, bit for bit, and each answer carries the hash its item was sent under."""
    prompt = image_and_video(processor, 4)
    ch = channel(encoder.address, credentials=cluster_credentials())
    try:
        stub = encoder_service_pb2_grpc.EncoderServiceStub(ch)
        answers = {}
        for codes in (True, False):
            if codes:
                request = encode_request(job_of(prompt), [0, 1], {})
                hashes = {i: prompt.params.items[i].content_hash for i in (0, 1)}
            else:
                request, hashes = old_router_request(prompt, [0, 1])
            response: encoder_service_pb2.EncodeResponse = await stub.Encode(request, timeout=60)
            assert [it.content_hash for it in response.items] == [hashes[0], hashes[1]]
            answers[codes] = [
                [tensor_from_ref(ref) for ref in (it.rows, *it.deepstack)] for it in response.items
            ]
    finally:
        await ch.close()
    for with_codes, with_values in zip(answers[True], answers[False], strict=True):
        assert len(with_codes) == len(with_values) > 1
        for a, b in zip(with_codes, with_values, strict=True):
            assert torch.equal(a, b)


def test_a_one_patch_video_is_encoded_one_way_whether_partitioned_or_not(
    ckpt: Path, processor: Processor
) -> None:
    """A video of one temporal patch sent whole and as its one partition has one key (the
    hash of the same rows and grid): both must be encoded in one mode, frame by frame, or
    the cache would hand one the other's rows, which differ in their last bits."""
    clip = [np.full((64, 64, 3), 40 * k, np.uint8) for k in range(2)]  # 2 frames: one patch
    prompt = processor.process(
        [{"role": "user", "content": [{"type": "video", "video": clip, "fps": 2.0}]}]
    )
    assert prompt.settings is not None and prompt.grid_thw[0][0] == 1
    fingerprint = prompt.settings.fingerprint()
    vision = Qwen3VLConfig.from_file(ckpt).vision
    sent, _ = old_router_request(prompt, [0])
    (partitioned,) = parse_request(sent, vision, fingerprint)
    item = sent.items[0]
    rows = tensor_from_ref(item.pixel_values)
    del item.partitions[:]  # as a router from before partitions sends it
    item.content_hash = content_hash(fingerprint, "video", rows, tuple(item.grid_thw))
    (whole,) = parse_request(sent, vision, fingerprint)
    assert [u.key for u in whole.units] == [u.key for u in partitioned.units]
    assert [u.per_frame for u in whole.units] == [u.per_frame for u in partitioned.units] == [True]


def test_a_video_sent_whole_is_encoded_as_one_partition_spanning_it(
    ckpt: Path, processor: Processor
) -> None:
    """A video of two temporal patches sent whole, and one partition spanning both (a
    caller may send one), have one key: the cache held whichever came first, made frame by
    frame or whole (partition review). Both are encoded frame by frame."""
    clip = [np.full((64, 64, 3), 40 * k, np.uint8) for k in range(4)]  # 4 frames: 2 patches
    prompt = processor.process(
        [{"role": "user", "content": [{"type": "video", "video": clip, "fps": 2.0}]}]
    )
    assert prompt.settings is not None and prompt.grid_thw[0][0] == 2
    fingerprint = prompt.settings.fingerprint()
    vision = Qwen3VLConfig.from_file(ckpt).vision
    sent, _ = old_router_request(prompt, [0])
    item = sent.items[0]
    rows = tensor_from_ref(item.pixel_values)
    grid = tuple(item.grid_thw)
    whole_key = content_hash(fingerprint, "video", rows, grid)
    del item.partitions[:]
    item.content_hash = whole_key
    (whole,) = parse_request(sent, vision, fingerprint)
    item.partitions.add(
        input_start=0,
        input_end=rows.shape[0],
        output_rows=rows.shape[0] // 4,
        content_hash=whole_key,
    )
    item.content_hash = partitioned_content_hash(fingerprint, "video", rows, grid, [whole_key])
    (spanning,) = parse_request(sent, vision, fingerprint)
    assert [u.key for u in whole.units] == [u.key for u in spanning.units] == [whole_key]
    assert [u.per_frame for u in whole.units] == [u.per_frame for u in spanning.units] == [True]


def test_an_image_sent_with_partitions_is_refused(ckpt: Path, processor: Processor) -> None:
    """One partition spanning an image has the image's key, and was encoded frame by frame
    where the image whole is not: the cache held whichever came first (ownfix review).
    Only a video's items are partitioned."""
    pixels = np.full((64, 64, 3), 90, np.uint8)
    prompt = processor.process([{"role": "user", "content": [{"type": "image", "image": pixels}]}])
    assert prompt.settings is not None
    fingerprint = prompt.settings.fingerprint()
    vision = Qwen3VLConfig.from_file(ckpt).vision
    sent, _ = old_router_request(prompt, [0])
    item = sent.items[0]
    rows = tensor_from_ref(item.pixel_values)
    item.partitions.add(
        input_start=0,
        input_end=rows.shape[0],
        output_rows=rows.shape[0] // 4,
        content_hash=item.content_hash,
    )
    with pytest.raises(MultimodalLayoutError) as refused:
        parse_request(sent, vision, fingerprint)
    assert refused.value.field == "partitions"


def test_a_wrong_item_hash_of_a_whole_partitioned_video_is_refused(
    ckpt: Path, processor: Processor
) -> None:
    # Of a video sent whole with its partitions, the item's hash is checked against the
    # partitions' too, never echoed unchecked: nothing pinned it (mutation review, s36).
    prompt = image_and_video(processor, 3)
    assert prompt.settings is not None
    fingerprint = prompt.settings.fingerprint()
    vision = Qwen3VLConfig.from_file(ckpt).vision
    sent = encode_request(job_of(prompt), [1], {})
    assert sent.items[0].partitions  # the video, all its rows, with partitions
    parse_request(sent, vision, fingerprint)  # as sent: taken
    sent.items[0].content_hash = b"\x11" * 32
    with pytest.raises(MultimodalLayoutError) as refused:
        parse_request(sent, vision, fingerprint)
    assert refused.value.field == "content_hash"
