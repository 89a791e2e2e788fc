"""What the request's own prefill carries after overlapped steps (`OverlappedPrefill._final`),
with the encoder stage and the lease releases replaced by recorders (one component).

Pieces inside the steps' blocks carry nothing; each piece reaching past them carries its
embedding as it came (a video's partitions each as its span, `ItemEmbedding.partition_start`,
inline or held by NIXL handle: nothing is joined or encoded again); every lease not carried
is released. A video is encoded as spans of partitions, small at both ends
(`router.pieces.batched`), past the worker's cached prefix.
"""

from __future__ import annotations

import asyncio
import time
import types
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pytest
import torch

from common.processing.processor import Processor
from common.sampling import SamplingParams
from common.wire.convert import tensor_from_ref, tensor_to_ref
from epd.v1 import multimodal_pb2
from router.calls import Job, RouterError
from router.encode import Encoded, EncodeStage
from router.overlap import OverlappedPrefill
from router.pieces import LARGEST, piece_sizes, pieces_of
from router.routing import PrefillRoute
from tests.model_fixtures import write_tiny_checkpoint


class Recorder:
    """Stands in for the peer client (releases) and the encode stage (its inline limit)."""

    def __init__(self, inline_limit: int = 1 << 30) -> None:
        self.released: dict[str, str] = {}
        self.stage = EncodeStage(None, None, inline_limit)  # type: ignore[arg-type]

    def check_inline(self, embeddings: Iterable[multimodal_pb2.ItemEmbedding]) -> None:
        self.stage.check_inline(embeddings)

    def release_embeddings(self, holders: Mapping[str, str]) -> None:
        self.released.update(holders)


def span(emb: multimodal_pb2.ItemEmbedding, partition: int | None) -> multimodal_pb2.ItemEmbedding:
    """`emb` naming the one partition it holds, as `EncodeStage.encode_partitions` gives."""
    if partition is not None:
        emb.partition_start, emb.partition_end = partition, partition + 1
    return emb


def handle_embedding(
    item: int, lease: str, partition: int | None = None
) -> multimodal_pb2.ItemEmbedding:
    emb = multimodal_pb2.ItemEmbedding(item_index=item)
    emb.rows.handle.lease_id = lease
    return span(emb, partition)


def inline_embedding(
    item: int, rows: torch.Tensor, partition: int | None = None
) -> multimodal_pb2.ItemEmbedding:
    return span(multimodal_pb2.ItemEmbedding(item_index=item, rows=tensor_to_ref(rows)), partition)


@pytest.fixture(scope="module")
def processor(tmp_path_factory: pytest.TempPathFactory) -> Processor:
    return Processor.from_pretrained(write_tiny_checkpoint(tmp_path_factory.mktemp("f") / "c"))


def job_of(processor: Processor, lead: str, frames: int) -> Job:
    """A job prompting `lead` text (none if empty), an image, a video of `frames` frames
    (two per partition) and a question."""
    rng = np.random.default_rng(frames)
    content = [
        {"type": "text", "text": lead},
        {"type": "image", "image": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)},
        {
            "type": "video",
            "video": rng.integers(0, 256, (frames, 64, 64, 3), dtype=np.uint8),
            "fps": 2.0,
        },
        {"type": "text", "text": "Why?"},
    ]
    prompt = processor.process([{"role": "user", "content": content[0 if lead else 1 :]}])
    return Job("r", prompt, SamplingParams(), None, time.monotonic() + 60)


@pytest.fixture(scope="module")
def job(processor: Processor) -> Job:
    return job_of(processor, "Look: ", 6)


async def test_pieces_past_the_steps_carry_their_own_embeddings(job: Job) -> None:
    recorder = Recorder()
    overlap = OverlappedPrefill(None, recorder, recorder)  # type: ignore[arg-type]
    pieces = pieces_of(job.prompt.params.items, [0, 1])
    assert [p.partition for p in pieces] == [None, 0, 1, 2]
    video_rows = torch.randn(job.prompt.params.items[1].length, 4)
    results = [Encoded([handle_embedding(0, "image")], {"image": "encoder-a"})]
    start = 0
    for piece in pieces[1:]:
        rows = video_rows[start : start + piece.end - piece.start]
        start += piece.end - piece.start
        results.append(Encoded([inline_embedding(1, rows, piece.partition)], {}))
    # The steps cached everything before the video: the image needs nothing.
    out = await overlap._final(job, pieces, results, job.prompt.params.items[1].position)
    assert [(e.item_index, e.partition_start) for e in out.embeddings] == [(1, 0), (1, 1), (1, 2)]
    got = torch.cat([tensor_from_ref(e.rows) for e in out.embeddings])
    assert torch.equal(got, video_rows)
    assert out.leases == {} and recorder.released == {"image": "encoder-a"}
    # The steps cached the video's first partition too: the other two alone.
    out = await overlap._final(job, pieces, results, pieces[2].start)
    assert [(e.item_index, e.partition_start) for e in out.embeddings] == [(1, 1), (1, 2)]
    # Nothing cached: the image as it came (whole), its lease carried.
    out = await overlap._final(job, pieces, results, 0)
    assert [e.item_index for e in out.embeddings] == [0, 1, 1, 1]
    assert not out.embeddings[0].HasField("partition_start")
    assert out.leases == {"image": "encoder-a"}


async def test_handle_held_partitions_are_carried_as_they_came(job: Job) -> None:
    recorder = Recorder()
    overlap = OverlappedPrefill(None, recorder, recorder)  # type: ignore[arg-type]
    pieces = pieces_of(job.prompt.params.items, [1])
    results = [
        Encoded(
            [handle_embedding(1, f"part-{p.partition}", p.partition)],
            {f"part-{p.partition}": "enc"},
        )
        for p in pieces
    ]
    out = await overlap._final(job, pieces, results, pieces[1].start)
    assert [e.rows.handle.lease_id for e in out.embeddings] == ["part-1", "part-2"]
    assert out.leases == {"part-1": "enc", "part-2": "enc"}
    assert recorder.released == {"part-0": "enc"}


async def test_rows_past_the_routers_inline_limit_are_refused_and_released(job: Job) -> None:
    recorder = Recorder(inline_limit=64)
    overlap = OverlappedPrefill(None, recorder, recorder)  # type: ignore[arg-type]
    pieces = pieces_of(job.prompt.params.items, [0, 1])
    results = [Encoded([handle_embedding(0, "image")], {"image": "encoder-a"})]
    results += [
        Encoded([inline_embedding(1, torch.zeros(p.end - p.start, 4), p.partition)], {})
        for p in pieces[1:]
    ]
    with pytest.raises(RouterError, match="inline embeddings"):
        await overlap._final(job, pieces, results, 0)
    assert recorder.released == {"image": "encoder-a"}


class SpanStage(Recorder):
    """Also stands in for `EncodeStage.encode_partitions`: records each call's
    `(item, partitions)` and answers zero rows inline, naming its span."""

    def __init__(self, job: Job) -> None:
        super().__init__()
        self.job = job
        self.calls: list[tuple[int, list[int]]] = []

    async def encode_partitions(self, job: Job, item: int, partitions: Sequence[int]) -> Encoded:
        self.calls.append((item, list(partitions)))
        meta = job.prompt.params.items[item]
        rows = sum(meta.partitions[p].output_rows for p in partitions) or meta.length
        emb = multimodal_pb2.ItemEmbedding(
            item_index=item, rows=tensor_to_ref(torch.zeros(rows, 4))
        )
        if partitions:
            emb.partition_start, emb.partition_end = partitions[0], partitions[-1] + 1
        return Encoded([emb], {})


@pytest.fixture(scope="module")
def long_job(processor: Processor) -> Job:
    return job_of(processor, "", 16)


@pytest.mark.parametrize("cached_partitions", [0, 2])
async def test_a_video_is_encoded_as_spans_small_at_both_ends(
    long_job: Job, monkeypatch: pytest.MonkeyPatch, cached_partitions: int
) -> None:
    async def no_steps(
        self: OverlappedPrefill, job: Job, worker: object, pieces: object, tasks: list, cached: int
    ) -> int:
        await asyncio.gather(*tasks)
        return cached

    monkeypatch.setattr(OverlappedPrefill, "_steps", no_steps)
    stage = SpanStage(long_job)
    overlap = OverlappedPrefill(None, stage, stage)  # type: ignore[arg-type]
    video = long_job.prompt.params.items[1]
    assert len(video.partitions) == 8
    # A worker (block size 1) caching the prompt up to the video's partition `cached_partitions`.
    covered = video.runs[cached_partitions][0] if cached_partitions else 0
    worker = types.SimpleNamespace(address="prefill", layout=types.SimpleNamespace(block_size=1))
    route = PrefillRoute(worker, frozenset(), covered)  # type: ignore[arg-type]
    out = await overlap.encode(long_job, route, [0, 1])
    spans = [parts for item, parts in stage.calls if item == 1]
    assert [len(s) for s in spans] == piece_sizes(8 - cached_partitions, LARGEST)
    assert [p for s in spans for p in s] == list(range(cached_partitions, 8))
    # The image is encoded whole, unless the cached prefix holds it.
    assert [c for c in stage.calls if c[0] == 0] == ([] if cached_partitions else [(0, [])])
    # The request's own prefill gets each span as it came.
    got = [(e.partition_start, e.partition_end) for e in out.embeddings if e.item_index == 1]
    assert got == [(s[0], s[-1] + 1) for s in spans]
