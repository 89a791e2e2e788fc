"""`image.patch_codes` reorders bytes into patch rows and `image.patch_values` maps them
through per-channel tables (two bytes at a time where it can): together they must give
exactly the bits of the reference's per-pixel arithmetic, laid out as the reference's
patchify, for any frames and any mean/std settings; the codes alone are the bytes laid out
that way."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.models.qwen3_vl.preprocessor import ProcessorSettings
from common.processing.image import as_patch_values, patch_codes, patch_values


def _per_pixel(frames: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """The reference's rescale and normalise: `(T, H, W, C)` uint8 -> `(T, C, H, W)`."""
    scaled = (frames.astype(np.float64) * (1 / 255)).astype(np.float32)
    m, d = np.asarray(mean, dtype=np.float32), np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(((scaled - m) / d).transpose(0, 3, 1, 2))


def patch_rows(frames: np.ndarray, config: ProcessorSettings) -> tuple[np.ndarray, tuple]:
    codes, grid = patch_codes(frames, config)
    return patch_values(codes, config), grid


def _hand_patchify(frames: np.ndarray, tp: int, p: int, m: int) -> np.ndarray:
    """The reference's patch rows of `(T, C, H, W)` frames, patch by patch in loops."""
    if len(frames) % tp:
        pad = tp - len(frames) % tp
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    _, _, h, w = frames.shape
    rows = []
    for t in range(0, len(frames), tp):
        for bh in range(h // (p * m)):
            for bw in range(w // (p * m)):
                for mh in range(m):
                    for mw in range(m):
                        r, c = (bh * m + mh) * p, (bw * m + mw) * p
                        patch = frames[t : t + tp, :, r : r + p, c : c + p]  # (T, C, P, P)
                        rows.append(patch.transpose(1, 0, 2, 3).reshape(-1))
    return np.stack(rows)


_stat = st.floats(0.0625, 1.0, width=32)
# Per channel, or one value for all three (mean and std both so: one table for every byte).
_stats = st.one_of(st.tuples(_stat, _stat, _stat), _stat.map(lambda v: (v, v, v)))


@settings(max_examples=40, deadline=None)
@given(
    frames_t=st.integers(1, 3),
    blocks=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    patch=st.sampled_from([(2, 1, 2), (2, 2, 2), (1, 3, 2), (3, 1, 1)]),  # tp, p, m
    seed=st.integers(0, 2**32 - 1),
    mean=_stats,
    std=_stats,
)
def test_patch_rows_give_the_per_pixel_bits_in_patch_order(
    frames_t: int,
    blocks: tuple[int, int],
    patch: tuple[int, int, int],
    seed: int,
    mean: tuple[float, float, float],
    std: tuple[float, float, float],
) -> None:
    tp, p, m = patch  # (1, 3, 2) and (3, 1, 1): odd runs of one channel (single-byte tables)
    h, w = blocks[0] * p * m, blocks[1] * p * m
    frames = np.random.default_rng(seed).integers(0, 256, (frames_t, h, w, 3), dtype=np.uint8)
    config = dataclasses.replace(
        ProcessorSettings(),
        image_mean=mean,
        image_std=std,
        temporal_patch_size=tp,
        patch_size=p,
        merge_size=m,
    )
    codes, grid = patch_codes(frames, config)
    rows = patch_values(codes, config)
    want = _hand_patchify(_per_pixel(frames, mean, std), tp, p, m)
    assert grid == (-(-frames_t // tp), h // p, w // p)
    assert codes.dtype == np.uint8 and codes.flags["C_CONTIGUOUS"]
    assert np.array_equal(codes, _hand_patchify(frames.transpose(0, 3, 1, 2), tp, p, m))
    assert rows.dtype == np.float32 and rows.flags["C_CONTIGUOUS"]
    assert np.array_equal(rows.view(np.uint32), want.view(np.uint32))
    # A slice of the codes (a partition's rows) maps to the same slice of the values.
    half = len(codes) // 2
    assert np.array_equal(patch_values(codes[half:], config), rows[half:])


def test_every_byte_value_of_a_video_batch() -> None:
    config = ProcessorSettings()
    side = config.patch_size * config.merge_size * 2
    values = np.arange(side * side * 3, dtype=np.int64) % 256
    frames = values.reshape(1, side, side, 3).astype(np.uint8)
    frames = np.concatenate([frames, frames[:, ::-1], frames[:, :, ::-1]])  # 3 frames: padded
    rows, _ = patch_rows(frames, config)
    mean, std = tuple(config.image_mean), tuple(config.image_std)
    want = _hand_patchify(_per_pixel(frames, mean, std), 2, config.patch_size, config.merge_size)
    assert np.array_equal(rows.view(np.uint32), want.view(np.uint32))


def test_channel_count_must_match_the_settings() -> None:
    with pytest.raises(ValueError, match="channels"):
        patch_codes(np.zeros((1, 32, 32, 4), dtype=np.uint8), ProcessorSettings())


def test_values_take_uint8_codes_whose_rows_hold_whole_channels() -> None:
    config = ProcessorSettings()
    with pytest.raises(ValueError, match="uint8"):
        patch_values(np.zeros((4, 1536), dtype=np.float32), config)
    with pytest.raises(ValueError, match="uint8"):
        patch_values(np.zeros((4, 1535), dtype=np.uint8), config)


def test_as_patch_values_maps_codes_and_keeps_values() -> None:
    config = ProcessorSettings()
    codes = torch.arange(2 * 1536, dtype=torch.int64).remainder(256).to(torch.uint8).view(2, -1)
    values = as_patch_values(codes, config)
    assert values.dtype == torch.float32
    assert torch.equal(values, torch.from_numpy(patch_values(codes.numpy(), config)))
    floats = torch.randn(2, 1536)
    assert as_patch_values(floats, config) is floats


def test_frame_size_must_be_a_multiple_of_a_merged_patch() -> None:
    with pytest.raises(ValueError, match="multiple"):
        patch_codes(np.zeros((1, 30, 32, 3), dtype=np.uint8), ProcessorSettings())
