"""What the request's own prefill carries after overlapped steps (`OverlappedPrefill._final`),
with the encoder stage and the lease releases replaced by recorders (one component).

Items inside the steps' blocks carry nothing; an item reaching past them carries its whole
embedding: a piece as it came, a video's inline partitions joined, or, when a partition came
by NIXL handle, the video encoded again whole; every lease not carried is released.
"""

from __future__ import annotations

import time
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
from router.pieces import pieces_of
from tests.model_fixtures import write_tiny_checkpoint


class Recorder:
    """Stands in for the peer client (releases) and the encode stage (whole items)."""

    def __init__(self, inline_limit: int = 1 << 30) -> None:
        self.released: dict[str, str] = {}
        self.encoded: list[list[int]] = []
        self.stage = EncodeStage(None, None, inline_limit)  # type: ignore[arg-type]

    def check_inline(self, embeddings: Iterable[multimodal_pb2.ItemEmbedding]) -> None:
        self.stage.check_inline(embeddings)

    def release_embeddings(self, holders: Mapping[str, str]) -> None:
        self.released.update(holders)

    async def encode(self, job: Job, items: Sequence[int]) -> Encoded:
        self.encoded.append(list(items))
        embs = [handle_embedding(i, f"whole-{i}") for i in items]
        return Encoded(embs, {f"whole-{i}": "encoder-a" for i in items})


def handle_embedding(item: int, lease: str) -> multimodal_pb2.ItemEmbedding:
    emb = multimodal_pb2.ItemEmbedding(item_index=item)
    emb.rows.handle.lease_id = lease
    return emb


def inline_embedding(item: int, rows: torch.Tensor) -> multimodal_pb2.ItemEmbedding:
    return multimodal_pb2.ItemEmbedding(item_index=item, rows=tensor_to_ref(rows))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    processor = Processor.from_pretrained(write_tiny_checkpoint(tmp_path_factory.mktemp("f") / "c"))
    rng = np.random.default_rng(3)
    content = [
        {"type": "text", "text": "Look: "},
        {"type": "image", "image": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)},
        {
            "type": "video",
            "video": rng.integers(0, 256, (6, 64, 64, 3), dtype=np.uint8),
            "fps": 2.0,
        },
        {"type": "text", "text": "Why?"},
    ]
    prompt = processor.process([{"role": "user", "content": content}])
    return Job("r", prompt, SamplingParams(), None, time.monotonic() + 60)


async def test_items_past_the_steps_carry_whole_embeddings_inline_partitions_joined(
    job: Job,
) -> None:
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
        results.append(Encoded([inline_embedding(1, rows)], {}))
    # The steps cached everything before the video: the image needs nothing.
    out = await overlap._final(job, pieces, results, job.prompt.params.items[1].position)
    assert [e.item_index for e in out.embeddings] == [1]
    assert torch.equal(tensor_from_ref(out.embeddings[0].rows), video_rows)
    assert out.leases == {} and recorder.released == {"image": "encoder-a"}
    assert recorder.encoded == []
    # Nothing cached: the image as it came, its lease carried.
    out = await overlap._final(job, pieces, results, 0)
    assert [e.item_index for e in out.embeddings] == [0, 1]
    assert out.leases == {"image": "encoder-a"}


async def test_a_video_with_a_partition_held_by_handle_is_encoded_again_whole(job: Job) -> None:
    recorder = Recorder()
    overlap = OverlappedPrefill(None, recorder, recorder)  # type: ignore[arg-type]
    pieces = pieces_of(job.prompt.params.items, [1])
    results = [
        Encoded([handle_embedding(1, f"part-{p.partition}")], {f"part-{p.partition}": "enc"})
        for p in pieces
    ]
    out = await overlap._final(job, pieces, results, 0)
    assert recorder.encoded == [[1]]
    assert [e.rows.handle.lease_id for e in out.embeddings] == ["whole-1"]
    assert out.leases == {"whole-1": "encoder-a"}
    assert recorder.released == {f"part-{p.partition}": "enc" for p in pieces}


async def test_joined_rows_past_the_routers_inline_limit_are_refused_and_released(
    job: Job,
) -> None:
    recorder = Recorder(inline_limit=64)
    overlap = OverlappedPrefill(None, recorder, recorder)  # type: ignore[arg-type]
    pieces = pieces_of(job.prompt.params.items, [0, 1])
    results = [Encoded([handle_embedding(0, "image")], {"image": "encoder-a"})]
    results += [
        Encoded([inline_embedding(1, torch.zeros(p.end - p.start, 4))], {}) for p in pieces[1:]
    ]
    with pytest.raises(RouterError, match="inline embeddings"):
        await overlap._final(job, pieces, results, 0)
    assert recorder.released == {"image": "encoder-a"}
