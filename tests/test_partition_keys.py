"""Partition keys through the real processor (docs/block-hash.md, "Partition keys").

A video V and V with frames appended share every block of their common token prefix; a
video differing first in frame k shares exactly the blocks before frame k's first
placeholder; where the processor does not allow partition keys, only the blocks before the
video are shared.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from common.kv.hashing import block_hashes
from common.models.qwen3_vl.preprocessor import ProcessorSettings, partition_keys_exact
from common.processing.processor import ProcessedPrompt, Processor
from common.roles import EMBEDDING_DIGESTS, PATCH_CODES, Role
from common.sampling import SamplingParams
from common.wire.roles import role_to_proto
from epd.v1 import registry_service_pb2
from router.calls import Job, WorkerCalls
from router.encode import EncodeStage
from router.registry import Registry
from tests.model_fixtures import write_tiny_checkpoint

BLOCK_SIZES = [1, 4, 16]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("partkeys") / "ckpt")


@pytest.fixture(scope="module")
def processor(ckpt: Path) -> Processor:
    return Processor.from_pretrained(ckpt)


def without_partition_keys(processor: Processor) -> Processor:
    """The same checkpoint with `video_partition_keys` off."""
    settings = dataclasses.replace(processor.settings, video_partition_keys=False)
    return Processor(
        processor.tokenizer, processor.config, settings, processor.template, processor.generation
    )


def frames(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(n)]


def video_prompt(processor: Processor, video: list[np.ndarray]) -> ProcessedPrompt:
    part = {"type": "video", "video": video, "fps": 2.0}
    return processor.process([{"role": "user", "content": [part, {"type": "text", "text": "Q"}]}])


def shared_blocks(a: ProcessedPrompt, b: ProcessedPrompt, block_size: int) -> int:
    """Leading blocks whose hashes agree (the chain never rejoins once it differs)."""
    ha = block_hashes(a.prompt_token_ids, block_size, a.params)
    hb = block_hashes(b.prompt_token_ids, block_size, b.params)
    count = 0
    for x, y in zip(ha, hb, strict=False):
        if x != y:
            break
        count += 1
    return count


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_processor_sets_partition_keys_for_videos_only(processor: Processor) -> None:
    video = video_prompt(processor, frames(8, seed=1)).params.items[0]
    assert video.partition_keys and len(video.partitions) == 4
    image = np.zeros((64, 64, 3), dtype=np.uint8)
    prompt = processor.process([{"role": "user", "content": [{"type": "image", "image": image}]}])
    assert not prompt.params.items[0].partition_keys
    off = video_prompt(without_partition_keys(processor), frames(8, seed=1)).params.items[0]
    assert not off.partition_keys and off.partitions == video.partitions


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_appended_frames_reuse_every_block_of_the_shared_frames(
    processor: Processor, block_size: int
) -> None:
    clip = frames(12, seed=1)
    v = video_prompt(processor, clip[:8])
    longer = video_prompt(processor, clip)
    assert [p.content_hash for p in longer.params.items[0].partitions[:4]] == [
        p.content_hash for p in v.params.items[0].partitions
    ]
    prefix = common_prefix(v.prompt_token_ids, longer.prompt_token_ids)
    v_end = v.params.items[0].end
    assert prefix > v_end  # the shared tokens run past V's last placeholder
    assert shared_blocks(v, longer, block_size) == prefix // block_size
    # Keyed by the whole item, only the blocks before the video are shared.
    plain = without_partition_keys(processor)
    first_run = v.params.items[0].position
    shared = shared_blocks(video_prompt(plain, clip[:8]), video_prompt(plain, clip), block_size)
    assert shared == first_run // block_size


@pytest.mark.parametrize("frame", [0, 2, 5])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_video_differing_in_frame_k_shares_exactly_the_blocks_before_it(
    processor: Processor, frame: int, block_size: int
) -> None:
    clip = frames(8, seed=1)
    changed = list(clip)
    changed[frame] = frames(1, seed=9)[0]
    a, b = video_prompt(processor, clip), video_prompt(processor, changed)
    assert a.prompt_token_ids == b.prompt_token_ids  # same timestamps, same placeholders
    run_start = a.params.items[0].runs[frame // 2][0]  # temporal patch = 2 frames
    assert shared_blocks(a, b, block_size) == run_start // block_size


def test_partition_keys_exact_needs_one_run_per_partition() -> None:
    settings = ProcessorSettings()
    assert partition_keys_exact(settings, [(3, 4), (10, 4)], [4, 4])
    # frames merged into one run, or a partition spanning runs: the item's keys
    assert not partition_keys_exact(settings, [(3, 8)], [4, 4])
    assert not partition_keys_exact(settings, [(3, 2), (8, 6)], [4, 4])
    off = dataclasses.replace(settings, video_partition_keys=False)
    assert not partition_keys_exact(off, [(3, 4), (10, 4)], [4, 4])


def test_setting_is_read_from_the_checkpoint_and_not_fingerprinted(
    ckpt: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for path in ckpt.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    config = folder / "preprocessor_config.json"
    raw = json.loads(config.read_text())
    config.write_text(json.dumps({**raw, "video_partition_keys": False}))
    off = Processor.from_pretrained(folder)
    assert off.settings.video_partition_keys is False
    on = Processor.from_pretrained(ckpt)
    assert off.settings.fingerprint() == on.settings.fingerprint()
    assert not video_prompt(off, frames(4, seed=1)).params.items[0].partition_keys
    config.write_text(json.dumps({**raw, "video_partition_keys": "no"}))
    with pytest.raises(ValueError, match="video_partition_keys"):
        Processor.from_pretrained(folder)


def test_a_video_with_frames_appended_meets_the_same_encoder(processor: Processor) -> None:
    """The encode stage homes a video by its first partition, so appended frames do not move
    it off the encoder caching the shared ones (with eight encoders, by item hash the two
    would part in most cases)."""
    registry = Registry(worker_timeout_s=1e9, heartbeat_interval_s=1.0)
    for port in range(8):
        registry.register(
            registry_service_pb2.WorkerInfo(
                role=role_to_proto(Role.ENCODER),
                address=f"127.0.0.1:{9100 + port}",
                model="m",
                protocol_version="epd.v1",
                name=f"encoder-{port}",
                capabilities=[PATCH_CODES, EMBEDDING_DIGESTS],
            )
        )
    stage = EncodeStage(WorkerCalls(registry), channels=None, max_inline_embedding_bytes=0)  # type: ignore[arg-type]
    clip = frames(16, seed=5)
    homes = set()
    for count in (4, 8, 12, 16):
        job = Job("r", video_prompt(processor, clip[:count]), SamplingParams(), None, 1e18)
        ((worker, items),) = stage._assign(job, [0])
        assert worker is not None and items == [0]
        homes.add(worker.address)
    assert len(homes) == 1
