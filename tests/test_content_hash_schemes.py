"""Content hash schemes: the current one is SHA-256 over length-framed fields, of uint8 patch
codes as the processor makes them; the encoder also checks hashes an older router made of
float32 values, with SHA-256 or BLAKE2b (a rolling upgrade), keys its cache by them as they
are, and still refuses any hash that neither scheme gives for the rows, and any other
dtype."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from common.models.qwen3_vl.config import VisionConfig
from common.multimodal.validation import MultimodalLayoutError
from common.processing.content_hash import (
    BLAKE2B_SCHEME,
    SCHEME,
    HashScheme,
    content_hash,
    partitioned_content_hash,
)
from common.wire.convert import tensor_to_ref
from encoder_worker.requests import parse_request
from epd.v1 import encoder_service_pb2, multimodal_pb2

FINGERPRINT = b"settings"
VISION = VisionConfig(
    depth=1,
    hidden_size=32,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=64,
    patch_size=2,
    deepstack_visual_indexes=(0,),
)
HW = 4  # patches per side of a frame


def _rows(seed: int, frames: int = 1) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    shape = (frames * HW * HW, VISION.patch_dim)
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))


def _codes(seed: int, frames: int = 1) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    shape = (frames * HW * HW, VISION.patch_dim)
    return torch.from_numpy(rng.integers(0, 256, shape, dtype=np.uint8))


def _image(pixels: torch.Tensor, scheme: HashScheme) -> encoder_service_pb2.EncodeItem:
    return encoder_service_pb2.EncodeItem(
        content_hash=content_hash(FINGERPRINT, "image", pixels, (1, HW, HW), scheme),
        modality=multimodal_pb2.MODALITY_IMAGE,
        pixel_values=tensor_to_ref(pixels),
        grid_thw=[1, HW, HW],
    )


def _video(pixels: torch.Tensor, frames: int, scheme: HashScheme) -> encoder_service_pb2.EncodeItem:
    step = HW * HW
    parts = [
        content_hash(FINGERPRINT, "video", pixels[k * step : (k + 1) * step], (1, HW, HW), scheme)
        for k in range(frames)
    ]
    grid = (frames, HW, HW)
    item = encoder_service_pb2.EncodeItem(
        content_hash=partitioned_content_hash(FINGERPRINT, "video", pixels, grid, parts, scheme),
        modality=multimodal_pb2.MODALITY_VIDEO,
        pixel_values=tensor_to_ref(pixels),
        grid_thw=list(grid),
    )
    for k, digest in enumerate(parts):
        item.partitions.add(
            input_start=k * step,
            input_end=(k + 1) * step,
            output_rows=step // VISION.merge_unit,
            content_hash=digest,
        )
    return item


def _parse(*items: encoder_service_pb2.EncodeItem) -> list[bytes]:
    """Every unit's cache key of a request of `items`."""
    jobs = parse_request(encoder_service_pb2.EncodeRequest(items=items), VISION, FINGERPRINT)
    return [unit.key for job in jobs for unit in job.units]


def test_the_current_scheme_is_sha256_over_framed_fields() -> None:
    pixels = _rows(1)
    h = hashlib.sha256()
    header = b'{"dtype":"float32","grid_thw":[1,4,4],"modality":"image","shape":[16,24]}'
    for field in (b"epd.qwen3vl.item.v2", FINGERPRINT, header):
        h.update(len(field).to_bytes(8, "little") + field)
    h.update(pixels.numpy().tobytes())
    assert content_hash(FINGERPRINT, "image", pixels, (1, HW, HW)) == h.digest()
    older = content_hash(FINGERPRINT, "image", pixels, (1, HW, HW), BLAKE2B_SCHEME)
    assert older != h.digest() and len(older) == 32


@pytest.mark.parametrize("scheme", [SCHEME, BLAKE2B_SCHEME], ids=["sha256", "blake2b"])
def test_either_schemes_hashes_are_accepted_and_key_the_cache_as_sent(
    scheme: HashScheme,
) -> None:
    image, video = _image(_rows(2), scheme), _video(_rows(3, frames=2), 2, scheme)
    keys = _parse(image, video)
    assert keys == [image.content_hash, *(p.content_hash for p in video.partitions)]


def test_a_video_under_the_older_scheme_with_only_some_partitions_sent() -> None:
    pixels = _rows(4, frames=3)
    video = _video(pixels, 3, BLAKE2B_SCHEME)
    video.partition_indices.extend([1])
    video.pixel_values.CopyFrom(tensor_to_ref(pixels[HW * HW : 2 * HW * HW]))
    assert _parse(video) == [video.partitions[1].content_hash]


def test_a_hash_neither_scheme_gives_is_refused() -> None:
    image = _image(_rows(5), SCHEME)
    image.content_hash = _image(_rows(6), BLAKE2B_SCHEME).content_hash  # another image's
    with pytest.raises(MultimodalLayoutError, match="content_hash"):
        _parse(image)
    video = _video(_rows(7, frames=2), 2, BLAKE2B_SCHEME)
    video.partitions[1].content_hash = content_hash(
        FINGERPRINT, "video", _rows(8), (1, HW, HW), BLAKE2B_SCHEME
    )
    with pytest.raises(MultimodalLayoutError, match=r"partitions\[1\]\.content_hash"):
        _parse(video)


def test_an_item_hash_mixing_schemes_is_refused() -> None:
    """Partitions hashed by the older scheme, the item hash derived by the current one:
    not what any router makes, and not the hash of the rows by either scheme."""
    pixels = _rows(9, frames=2)
    video = _video(pixels, 2, BLAKE2B_SCHEME)
    parts = [p.content_hash for p in video.partitions]
    video.content_hash = partitioned_content_hash(
        FINGERPRINT, "video", pixels, (2, HW, HW), parts, SCHEME
    )
    with pytest.raises(MultimodalLayoutError, match="content_hash"):
        _parse(video)


def test_codes_hash_as_uint8_with_the_same_framing() -> None:
    codes = _codes(10)
    h = hashlib.sha256()
    header = b'{"dtype":"uint8","grid_thw":[1,4,4],"modality":"image","shape":[16,24]}'
    for field in (b"epd.qwen3vl.item.v2", FINGERPRINT, header):
        h.update(len(field).to_bytes(8, "little") + field)
    h.update(codes.numpy().tobytes())
    assert content_hash(FINGERPRINT, "image", codes, (1, HW, HW)) == h.digest()
    # The same bytes read as values are another input: the dtype keeps the hashes apart.
    same_bytes = codes.numpy().view(np.float32)  # (16, 6): another shape too
    assert content_hash(FINGERPRINT, "image", same_bytes, (1, HW, HW)) != h.digest()


def test_codes_images_and_videos_are_accepted_and_keep_their_dtype() -> None:
    image, video = _image(_codes(11), SCHEME), _video(_codes(12, frames=2), 2, SCHEME)
    jobs = parse_request(
        encoder_service_pb2.EncodeRequest(items=[image, video]), VISION, FINGERPRINT
    )
    keys = [unit.key for job in jobs for unit in job.units]
    assert keys == [image.content_hash, *(p.content_hash for p in video.partitions)]
    assert all(unit.pixels.dtype == torch.uint8 for job in jobs for unit in job.units)


def test_codes_are_checked_by_the_current_scheme_only() -> None:
    """No router ever hashed codes with BLAKE2b: such a hash is refused, not looked up."""
    with pytest.raises(MultimodalLayoutError, match="content_hash"):
        _parse(_image(_codes(13), BLAKE2B_SCHEME))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32])
def test_other_pixel_dtypes_are_refused_naming_the_field(dtype: torch.dtype) -> None:
    image = _image(_rows(14), SCHEME)
    image.pixel_values.CopyFrom(tensor_to_ref(_rows(14).to(dtype)))
    with pytest.raises(MultimodalLayoutError, match="pixel_values"):
        _parse(image)


def test_the_hash_header_is_made_once_per_grid_and_shape() -> None:
    # Its cache went to another function by an edit: 10.6 us per header instead of 0.13,
    # about 4% of hashing each video partition.
    from common.processing import content_hash

    assert hasattr(content_hash._header, "cache_info")
    assert not hasattr(content_hash.settings_digest, "cache_info")
