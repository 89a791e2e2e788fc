"""The Qwen3-VL vision tower in torch: patch rows in, LM-ready embedding rows out.

Pipeline per item with grid `(t, h, w)` (in patches): a linear patch embedding (equal to the
reference's Conv3d with stride = kernel), plus the learned position table resampled
bilinearly (align_corners) from its square grid to `h x w`; 2-D rotary embedding over
(row, column); `depth` pre-norm blocks with attention restricted to one temporal frame
(`h * w` patches); the merger turns each 2x2 block of patches into one row of the LM's
width. Deepstack mergers read the hidden states after the blocks listed in
`deepstack_visual_indexes`, one extra row set per listed block.

Patch rows arrive in the processor's order: frame-major, then 2x2 merge blocks in raster
order, then the four patches of a block. Nothing couples two frames, so a frame's output rows
depend only on that frame's pixels: encoding any subset of frames gives exactly those
frames' rows of the whole-item encoding (the exactness partial reuse relies on).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from common.models.qwen3_vl.config import Qwen3VLConfig, VisionConfig
from common.models.qwen3_vl.linear import pack_linears, use_packed
from common.models.qwen3_vl.text_ops import rotate, signed_sin
from common.models.qwen3_vl.weights import VISUAL_PREFIX

logger = logging.getLogger(__name__)

_FRAME_TABLES = 64  # frame sizes whose position tables a tower keeps


def _activation(name: str) -> nn.Module:
    if name == "gelu_pytorch_tanh":
        return nn.GELU(approximate="tanh")
    if name == "gelu":
        return nn.GELU()
    if name == "silu":
        return nn.SiLU()
    if name == "quick_gelu":
        return _QuickGELU()
    raise ValueError(f"unsupported vision activation {name!r}")


class _QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class PatchMerger(nn.Module):
    """LayerNorm + 2-layer MLP over each group of `merge_unit` consecutive patch rows.

    `postshuffle_norm` (deepstack mergers) normalises the concatenated group; otherwise
    (the final merger) each patch is normalised before concatenation.
    """

    def __init__(self, config: VisionConfig, *, postshuffle_norm: bool) -> None:
        super().__init__()
        self.merged_size = config.hidden_size * config.merge_unit
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(
            self.merged_size if postshuffle_norm else config.hidden_size, eps=1e-6
        )
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged_size, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.reshape(-1, self.merged_size))
        else:
            x = self.norm(x).reshape(-1, self.merged_size)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention within each frame, with 2-D rotary q/k."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        segments: list[tuple[int, int, int]],
    ) -> torch.Tensor:
        """`rotary`: float32 cos and signed sin (`text_ops.signed_sin`) `[n, 1, 1, head_dim]`;
        `segments`: `(row_start, frames, rows_per_frame)` per item; attention never crosses
        a frame boundary."""
        n = x.shape[0]
        qkv = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim)
        # q and k rotated together, in float32 whatever the model dtype (as the reference).
        q, k = rotate(qkv[:, :2].float(), *rotary).to(x.dtype).unbind(1)
        v = qkv[:, 2]
        out = torch.empty_like(q)
        for start, frames, per_frame in segments:
            end = start + frames * per_frame
            # (frames, heads, rows, head_dim): one batched call per item, each frame a batch.
            qs, ks, vs = (
                t[start:end].reshape(frames, per_frame, self.num_heads, -1).transpose(1, 2)
                for t in (q, k, v)
            )
            o = F.scaled_dot_product_attention(qs, ks, vs)
            out[start:end] = o.transpose(1, 2).reshape(end - start, self.num_heads, self.head_dim)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    """Two linear layers with the configured activation."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = _activation(config.hidden_act)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        segments: list[tuple[int, int, int]],
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotary, segments)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """Flattened `(C, T, P, P)` patch rows -> hidden rows.

    The weight keeps the reference's Conv3d shape; since stride equals kernel, the convolution
    is one matrix product over each flattened patch, which is what runs.
    """

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Conv3d(
            config.in_channels,
            config.hidden_size,
            kernel_size=(config.temporal_patch_size, config.patch_size, config.patch_size),
            stride=(config.temporal_patch_size, config.patch_size, config.patch_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.reshape(self.proj.out_channels, -1)
        return F.linear(x, weight, self.proj.bias)


class VisionTower(nn.Module):
    """The whole Qwen3-VL vision encoder (state-dict names = the reference's minus
    `model.visual.`)."""

    inv_freq: torch.Tensor

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        if config.hidden_size % config.num_heads:
            raise ValueError("vision hidden_size must be a multiple of num_heads")
        # Per frame size, its position embedding and rotary angles (`_frame_tables`).
        self._frame_cache: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.side = math.isqrt(config.num_position_embeddings)
        if self.side * self.side != config.num_position_embeddings:
            raise ValueError("vision num_position_embeddings must be a perfect square")
        self.patch_embed = PatchEmbed(config)
        # Given its weight, the embedding skips its random init (under the meta device that
        # init imports torch._dynamo, as `_fresh_inv_freq` says); zeros, not `empty`: a tower
        # built outside `from_weights` holds defined values (the s36diff review, s37).
        positions, width = config.num_position_embeddings, config.hidden_size
        self.pos_embed = nn.Embedding(positions, width, _weight=torch.zeros(positions, width))
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, postshuffle_norm=True) for _ in config.deepstack_visual_indexes
        )
        inv_freq = self._fresh_inv_freq(torch.get_default_device())
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def from_weights(
        cls,
        config: Qwen3VLConfig | VisionConfig,
        tensors: Mapping[str, torch.Tensor],
        *,
        device: str | torch.device | None = None,
        packed_weights: bool | None = None,
    ) -> VisionTower:
        """Build from reference-named tensors (`model.visual.*`, or already stripped).

        The tower takes the tensors' dtype (all must share it) and device unless `device` says
        otherwise; `packed_weights`: its linear layers run on oneDNN with packed copies where
        they can (`linear.pack_linears`; None: where that pays, `linear.use_packed`). Raises
        `ValueError` naming any missing or misshaped tensor.
        """
        vision = config.vision if isinstance(config, Qwen3VLConfig) else config
        if any(n.startswith(VISUAL_PREFIX) for n in tensors):
            cut = len(VISUAL_PREFIX)
            state = {n[cut:]: t for n, t in tensors.items() if n.startswith(VISUAL_PREFIX)}
        else:
            state = dict(tensors)
        with torch.device("meta"):
            tower = cls(vision)
        own = tower.state_dict()
        missing = sorted(set(own) - set(state))
        misshaped = sorted(
            f"{n} (expected {list(own[n].shape)}, got {list(state[n].shape)})"
            for n in own
            if n in state and own[n].shape != state[n].shape
        )
        problems = []
        if missing:
            problems.append("missing: " + ", ".join(VISUAL_PREFIX + m for m in missing))
        if misshaped:
            problems.append("misshaped: " + ", ".join(VISUAL_PREFIX + m for m in misshaped))
        if problems:
            raise ValueError("vision weights do not match the config: " + "; ".join(problems))
        tower.load_state_dict({n: state[n] for n in own}, assign=True)
        tower.inv_freq = tower._fresh_inv_freq(state[next(iter(own))].device)
        if device is not None:
            tower = tower.to(device)
        if use_packed(packed_weights, tower.dtype):
            pack_linears(tower)
        return tower.eval()

    def _fresh_inv_freq(self, device: torch.device) -> torch.Tensor:
        # Axial rope: a quarter of the head's dims per axis, repeated so the halves rotate
        # (row, col) pairs over the whole head. Made on the CPU and moved: made under the
        # meta device it would import torch._dynamo (~1.8 s of every encoder's start).
        head_dim = self.config.hidden_size // self.config.num_heads
        quarter = head_dim // 2
        exponent = torch.arange(0, quarter, 2, dtype=torch.float32, device="cpu") / quarter
        return (1.0 / (self.config.rope_theta**exponent)).to(device)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the tower's weights."""
        return self.pos_embed.weight.dtype

    @property
    def device(self) -> torch.device:
        """The device of the tower's weights."""
        return self.pos_embed.weight.device

    def rows_per_item(self, grid_thw: torch.Tensor) -> list[int]:
        """Merged output rows of each item: `t * h * w / merge_unit`."""
        return [int(t * h * w) // self.config.merge_unit for t, h, w in grid_thw.tolist()]

    @torch.no_grad()
    def encode(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, *, per_frame: bool = False
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Encode the patch rows of several items.

        `pixel_values`: `(sum(t*h*w), patch_dim)` patch rows of all items in order;
        `grid_thw`: `(n, 3)` integer patch grid per item. Returns the merged rows of all items
        concatenated in item order, `(sum(t*h*w) / merge_unit, out_hidden_size)`, and one
        tensor of the same shape per deepstack layer (in layer order).

        Frames never interact, so a frame's rows are the same whichever frames are encoded
        with it, up to floating-point rounding of matrix products whose kernels depend on the
        row count (about 1e-7 in float32). `per_frame=True` runs every temporal patch as its
        own forward pass, making each frame's rows bit-identical however items and frames
        are grouped (for exact partition reuse), at the cost of smaller matrix products.
        """
        cfg = self.config
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        total = sum(t * h * w for t, h, w in grids)
        if pixel_values.ndim != 2 or pixel_values.shape != (total, cfg.patch_dim):
            raise ValueError(
                f"pixel_values shape {tuple(pixel_values.shape)} does not match grid_thw "
                f"{grids}: expected ({total}, {cfg.patch_dim})"
            )
        for t, h, w in grids:
            if t < 1 or h % cfg.spatial_merge_size or w % cfg.spatial_merge_size:
                raise ValueError(
                    f"grid {(t, h, w)}: t >= 1 and h, w multiples of {cfg.spatial_merge_size}"
                )
        x = pixel_values.to(device=self.device, dtype=self.dtype)
        if not per_frame:
            return self._forward(x, grids)
        frames = [(1, h, w) for t, h, w in grids for _ in range(t)]
        outputs = []
        start = 0
        for grid in frames:
            rows = grid[1] * grid[2]
            outputs.append(self._forward(x[start : start + rows], [grid]))
            start += rows
        merged = torch.cat([rows for rows, _ in outputs])
        deepstack = [torch.cat(layer) for layer in zip(*(ds for _, ds in outputs), strict=True)]
        return merged, deepstack

    def _forward(
        self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One pass over validated patch rows of items with these grids."""
        cfg = self.config
        x = self.patch_embed(pixels)
        segments: list[tuple[int, int, int]] = []
        pos_parts: list[torch.Tensor] = []
        angle_parts: list[torch.Tensor] = []
        start = 0
        for t, h, w in grids:
            pos, angles = self._frame_tables(h, w)
            pos_parts.append(pos.repeat(t, 1))
            angle_parts.append(angles.repeat(t, 1))
            segments.append((start, t, h * w))
            start += t * h * w
        x = x + torch.cat(pos_parts).to(x.dtype)
        angles = torch.cat(angle_parts)
        # cos and signed sin ([n, 1, 1, head_dim]: over q/k and heads) for `text_ops.rotate`.
        rotary = (angles.cos()[:, None, None], signed_sin(angles.sin())[:, None, None])

        deepstack: list[torch.Tensor] = []
        for layer, block in enumerate(self.blocks):
            x = block(x, rotary, segments)
            if layer in cfg.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[cfg.deepstack_visual_indexes.index(layer)]
                deepstack.append(merger(x))
        return self.merger(x), deepstack

    def _frame_tables(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The position embedding and rotary angles of an `h x w` frame, kept for the next
        item of that size (they depend on the size and the weights only; a few hundred
        microseconds per image otherwise). At most `_FRAME_TABLES` sizes, oldest out first;
        weights changed in place or moved make new entries."""
        weight = self.pos_embed.weight
        key = (h, w, weight.device, weight.data_ptr(), weight._version)
        tables = self._frame_cache.get(key)
        if tables is None:
            tables = (self._position_embedding(h, w), self._rotary_angles(h, w))
            if len(self._frame_cache) >= _FRAME_TABLES:
                del self._frame_cache[next(iter(self._frame_cache))]
            self._frame_cache[key] = tables
        return tables

    def _merge_order(self, h: int, w: int) -> torch.Tensor:
        """Raster index of each patch in the processor's merge-block order."""
        m = self.config.spatial_merge_size
        raster = torch.arange(h * w, device=self.device).reshape(h // m, m, w // m, m)
        return raster.permute(0, 2, 1, 3).reshape(-1)

    def _position_embedding(self, h: int, w: int) -> torch.Tensor:
        """The learned `side x side` table resampled bilinearly (align_corners) to `h x w`,
        rows in merge-block order."""
        side = self.side
        table = self.pos_embed.weight.float()

        def taps(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            src = torch.arange(n, device=self.device, dtype=torch.float32) * (side - 1)
            src = src / max(n - 1, 1)
            lo = src.floor()
            frac = src - lo
            lo_i = lo.long().clamp(0, side - 1)
            return lo_i, (lo_i + 1).clamp(max=side - 1), frac

        h0, h1, fh = taps(h)
        w0, w1, fw = taps(w)
        fh, fw = fh[:, None, None], fw[None, :, None]
        emb = (
            table[h0[:, None] * side + w0[None, :]] * ((1 - fh) * (1 - fw))
            + table[h0[:, None] * side + w1[None, :]] * ((1 - fh) * fw)
            + table[h1[:, None] * side + w0[None, :]] * (fh * (1 - fw))
            + table[h1[:, None] * side + w1[None, :]] * (fh * fw)
        )
        return emb.reshape(h * w, -1)[self._merge_order(h, w)]

    def _rotary_angles(self, h: int, w: int) -> torch.Tensor:
        """Rotary angles `(h*w, head_dim)` for one frame, rows in merge-block order."""
        order = self._merge_order(h, w)
        rows = (order // w).float()
        cols = (order % w).float()
        inv_freq = self.inv_freq.to(self.device)
        half = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)
        return torch.cat([half, half], dim=-1)
