"""`image.normalize` maps bytes through a per-channel table: it must give exactly the bits
of the reference's per-pixel arithmetic, for any frames and any mean/std settings."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.models.qwen3_vl.preprocessor import ProcessorSettings
from common.processing.image import normalize


def _per_pixel(frames: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    scaled = (frames.astype(np.float64) * (1 / 255)).astype(np.float32)
    m, d = np.asarray(mean, dtype=np.float32), np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(((scaled - m) / d).transpose(0, 3, 1, 2))


_stats = st.tuples(*[st.floats(0.0625, 1.0, width=32)] * 3)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 9), st.integers(1, 9)),
    seed=st.integers(0, 2**32 - 1),
    mean=_stats,
    std=_stats,
)
def test_table_gives_the_per_pixel_bits(
    shape: tuple[int, int, int],
    seed: int,
    mean: tuple[float, float, float],
    std: tuple[float, float, float],
) -> None:
    frames = np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)
    config = dataclasses.replace(ProcessorSettings(), image_mean=mean, image_std=std)
    got = normalize(frames, config)
    want = _per_pixel(frames, mean, std)
    assert got.dtype == np.float32 and got.flags["C_CONTIGUOUS"]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_every_byte_value_of_a_video_batch() -> None:
    frames = np.arange(256 * 3, dtype=np.int64).reshape(1, 16, 16, 3).astype(np.uint8)
    frames = np.concatenate([frames, frames[:, ::-1]])
    config = ProcessorSettings()
    want = _per_pixel(frames, tuple(config.image_mean), tuple(config.image_std))
    assert np.array_equal(normalize(frames, config).view(np.uint32), want.view(np.uint32))


def test_channel_count_must_match_the_settings() -> None:
    with pytest.raises(ValueError, match="channels"):
        normalize(np.zeros((1, 4, 4, 4), dtype=np.uint8), ProcessorSettings())
