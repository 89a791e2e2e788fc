"""Multimodal rotary positions (mRoPE) for Qwen3-VL, computed from exact runs.

Every prompt token gets three position ids (temporal, height, width). Text tokens get the
same running index on all three axes. A vision frame (an image, or one temporal patch of a
video) placed at running index `p` gets `t = p`, `h = p + row`, `w = p + col` over its merged
grid, and advances the running index by `max(rows, cols)`. Qwen3-VL writes a timestamp before
every video frame, so each frame is its own run and is positioned on its own (the reference
splits a video grid `(t, h, w)` into `t` grids `(1, h, w)`).

Positions are derived from `MultimodalItemMetadata.runs` + `grid_thw` only, never by scanning
the prompt for placeholder ids: every stage computes the same positions from the handoff
record. After the prompt, a token at index `i` has position `i + mrope_position_delta` on all
three axes (`delta = max prompt position + 1 - prompt length`).

`rotary_cos_sin` turns position ids into the cos/sin tables the attention applies, with the
three axes interleaved over frequencies (THWTHW...) as Qwen3-VL does, or in blocks (the
Qwen2-VL layout) when the config says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.multimodal.params import MultimodalItemMetadata


@dataclass(frozen=True, slots=True)
class MropePositions:
    """Position ids of a prompt and the offset that continues them during decode."""

    # int64 [3, num_tokens]: temporal, height and width position of every prompt token.
    positions: torch.Tensor
    # Added to a token's index past the prompt to get its (shared) position on all axes.
    delta: int


def _frames(item: MultimodalItemMetadata, spatial_merge_size: int) -> list[tuple[int, int, int]]:
    """Split an item into frames `(first_token, merged_rows, merged_cols)` via its runs."""
    if item.grid_thw is None:
        raise ValueError("a multimodal item without grid_thw cannot be given mRoPE positions")
    t, h, w = (int(x) for x in item.grid_thw)
    if min(t, h, w) < 1:  # also checked on the wire: frames of no rows never end
        raise ValueError(f"grid_thw {item.grid_thw} has an entry below 1")
    if h % spatial_merge_size or w % spatial_merge_size:
        raise ValueError(f"grid_thw {item.grid_thw} not divisible by merge {spatial_merge_size}")
    rows, cols = h // spatial_merge_size, w // spatial_merge_size
    per_frame = rows * cols
    total = sum(length for _, length in item.runs)
    if total != t * per_frame:
        raise ValueError(
            f"runs hold {total} tokens but grid_thw {item.grid_thw} needs {t * per_frame}"
        )
    frames: list[tuple[int, int, int]] = []
    consumed = 0  # item rows placed by earlier runs
    for start, length in item.runs:
        offset = 0
        while offset < length:
            if (consumed + offset) % per_frame:
                raise ValueError("a video frame is split across runs; cannot position it")
            frames.append((start + offset, rows, cols))
            offset += per_frame
        if offset != length:
            raise ValueError("a run ends in the middle of a frame; cannot position it")
        consumed += length
    return frames


def prompt_positions(
    num_tokens: int, items: Sequence[MultimodalItemMetadata], spatial_merge_size: int
) -> MropePositions:
    """mRoPE position ids of a prompt of `num_tokens` tokens holding `items` at their runs.

    Equal to the reference `get_rope_index` for text, images and timestamped videos, in any
    prompt order of items. A prompt without items gets `arange` on all axes and delta 0.
    """
    frames = sorted(f for item in items for f in _frames(item, spatial_merge_size))
    pieces: list[torch.Tensor] = []
    cursor = 0  # next prompt index to position
    running = 0  # next free position id
    for start, rows, cols in frames:
        if start < cursor:
            raise ValueError(f"multimodal runs overlap at token {start}")
        if start > cursor:
            gap = start - cursor
            pieces.append(torch.arange(running, running + gap).expand(3, gap))
            running += gap
        grid_h = torch.arange(rows).repeat_interleave(cols)
        grid_w = torch.arange(cols).repeat(rows)
        pieces.append(torch.stack([torch.zeros_like(grid_h), grid_h, grid_w]) + running)
        running += max(rows, cols)
        cursor = start + rows * cols
    if cursor > num_tokens:
        raise ValueError(f"multimodal runs end at {cursor}, past the prompt ({num_tokens})")
    if cursor < num_tokens:
        gap = num_tokens - cursor
        pieces.append(torch.arange(running, running + gap).expand(3, gap))
        running += gap
    if not pieces:
        return MropePositions(torch.zeros(3, 0, dtype=torch.long), 0)
    positions = torch.cat(pieces, dim=1).to(torch.long)
    return MropePositions(positions, int(positions.max()) + 1 - num_tokens)


def decode_positions(token_indices: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """Position ids `[3, n]` of tokens past their prompts: index + delta on every axis."""
    return (token_indices + deltas).to(torch.long).unsqueeze(0).expand(3, -1)


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """The default RoPE inverse frequencies, `head_dim // 2` of them (float32)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def axis_of_frequency(mrope_section: Sequence[int], interleaved: bool) -> torch.Tensor:
    """For each rotary frequency, which position axis (0=t, 1=h, 2=w) drives it."""
    half = sum(mrope_section)
    axis = torch.zeros(half, dtype=torch.long)
    if interleaved:
        # THWTHW...: h takes frequencies 1, 4, 7, ... and w 2, 5, 8, ... while its section
        # lasts; every other frequency stays temporal.
        for ax in (1, 2):
            axis[ax : mrope_section[ax] * 3 : 3] = ax
    else:
        axis[mrope_section[0] : mrope_section[0] + mrope_section[1]] = 1
        axis[mrope_section[0] + mrope_section[1] :] = 2
    return axis


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, axis: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables `[n, head_dim]` for position ids `[3, n]` (rotate-half layout)."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)
    index = axis.to(positions.device).view(1, 1, -1).expand(1, freqs.shape[1], -1)
    chosen = freqs.gather(0, index).squeeze(0)  # [n, head_dim // 2]
    emb = torch.cat((chosen, chosen), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
