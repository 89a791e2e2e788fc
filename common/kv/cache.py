"""The paged KV cache: one contiguous, block-major buffer per worker.

Byte layout (DESIGN §4). The buffer is one torch tensor of shape

    [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]    (C-contiguous)

so the element for (block b, layer l, kv i (0 = K, 1 = V), token slot t, head h, dim d)
lives at byte offset

    ((((b * L + l) * 2 + i) * S + t) * H + h) * D + d) * itemsize

with L = num_layers, S = block_size, H = num_kv_heads, D = head_dim. One block — every layer,
both K and V, every token slot — is the contiguous range
`[data_ptr + b * block_bytes, data_ptr + (b + 1) * block_bytes)`, so a block moves between
workers with ONE transfer descriptor, and a run of adjacent block ids merges into one bigger
descriptor (`merged_descriptors`). A layer-major layout would instead cut a block into
`num_layers` small descriptors, which NIXL moves several times slower.

Token position `p` of a sequence whose block table is `bt` lives in block `bt[p // S]` at
slot offset `p % S` (`token_slots`).

This module stores and moves bytes only. Which blocks a sequence owns, and who frees them,
is the `BlockPool`'s business: the cache never allocates or frees a block id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.host_memory import host_bytes_free
from common.settings.schema import SettingsError

#: Dimension order of the buffer, outermost first (see the module docstring).
KV_LAYOUT = "block-major/layer,kv,token,head,dim"


@dataclass(frozen=True, slots=True)
class KvCacheSpec:
    """Shape and dtype of a worker's KV buffer.

    Prefill and decode workers must agree on everything except `num_blocks` before they
    exchange blocks; `layout_key` is what they compare.
    """

    # Transformer layers whose K/V the cache holds.
    num_layers: int
    # KV heads per layer (after grouped-query sharing, not query heads).
    num_kv_heads: int
    # Width of one head.
    head_dim: int
    # Tokens per block; also the granularity of prefix hashing.
    block_size: int
    # Element type of the buffer (K/V written in another dtype are cast).
    dtype: torch.dtype
    # Blocks in the buffer; block ids are 0 .. num_blocks - 1.
    num_blocks: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KvCacheSpec.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KvCacheSpec.dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def layout(self) -> str:
        """The buffer's dimension order, outermost first."""
        return KV_LAYOUT

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """Shape of the whole buffer."""
        return (
            self.num_blocks,
            self.num_layers,
            2,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: all layers, K and V, all token slots."""
        return (
            self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        ) * self.itemsize

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole buffer."""
        return self.block_bytes * self.num_blocks

    @property
    def layout_key(self) -> tuple[object, ...]:
        """What two workers must share to exchange blocks (everything but `num_blocks`)."""
        return (
            self.layout,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            str(self.dtype),
        )


class KvPoolTooLarge(SettingsError):
    """A KV pool the device cannot hold (its message names `num_blocks`): a worker started
    with it exits with that one line."""

    @classmethod
    def of(cls, spec: KvCacheSpec, device: torch.device, why: str) -> KvPoolTooLarge:
        return cls(
            f"num_blocks: a KV pool of {spec.num_blocks} blocks of {spec.block_size} tokens "
            f"({spec.total_bytes / 2**30:.1f} GiB) cannot be allocated on {device} ({why}): "
            "lower num_blocks (or block_size)"
        )


class PagedKvCache:
    """Owns the KV buffer described by a `KvCacheSpec`, and gives its blocks' addresses.

    The model writes and reads the buffer itself, at `token_slots`; no method checks that
    block ids belong to the caller: ownership is tracked by `BlockPool`.
    """

    def __init__(self, spec: KvCacheSpec, device: torch.device | str = "cpu") -> None:
        # Shape, dtype and size of the buffer.
        self.spec = spec
        # Where the buffer lives (host memory by default).
        self.device = torch.device(device)
        # The one contiguous block-major buffer; zero-filled so unused slots are defined.
        # On the host, zeroing touches every page: a pool past the memory free was killed
        # by the kernel (no line said why) where the allocator had let it through.
        free = host_bytes_free() if self.device.type == "cpu" else None
        if free is not None and spec.total_bytes > free:
            free_gib = f"{free / 2**30:.1f} GiB of host memory free"
            raise KvPoolTooLarge.of(spec, self.device, free_gib)
        try:
            self.buffer = torch.zeros(spec.shape, dtype=spec.dtype, device=self.device)
        except RuntimeError as exc:  # torch's own words named no setting (edges review)
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
            raise KvPoolTooLarge.of(spec, self.device, why) from exc

    # ---------------------------------------------------------------------------- addresses

    def block_address(self, block_id: int) -> tuple[int, int]:
        """`(address, nbytes)` of one block, for a transfer descriptor.

        Valid while this cache is alive; the buffer is never reallocated.
        """
        self._check_block(block_id)
        nbytes = self.spec.block_bytes
        return self.buffer.data_ptr() + block_id * nbytes, nbytes

    def merged_descriptors(self, block_ids: list[int]) -> list[tuple[int, int]]:
        """`(address, nbytes)` per maximal run of consecutive ids, in the given order.

        `[4, 5, 6, 9]` gives two descriptors: blocks 4..6 as one range, then block 9. The
        bytes of the descriptors, concatenated, are the blocks in the given order.
        """
        out: list[tuple[int, int]] = []
        prev = -2
        for block_id in block_ids:
            addr, nbytes = self.block_address(block_id)
            if out and block_id == prev + 1:
                start, size = out[-1]
                out[-1] = (start, size + nbytes)
            else:
                out.append((addr, nbytes))
            prev = block_id
        return out

    # --------------------------------------------------------------------------- checks

    def _check_block(self, block_id: int) -> None:
        if not 0 <= block_id < self.spec.num_blocks:
            raise IndexError(f"block id {block_id} out of range [0, {self.spec.num_blocks})")


def token_slots(
    block_table: torch.Tensor, positions: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(blocks, offsets)`: where the K/V of token `positions` live, block
    `block_table[p // block_size]` at slot offset `p % block_size` (the module docstring).

    `block_table` `[num_table_blocks]` with `positions` of any shape, or `[batch,
    max_blocks]` with `positions` `[batch]` (row `b` in its own table). The model writes and
    reads KV at these (`kv[blocks, layer, k_or_v, offsets]`).
    """
    index = torch.div(positions, block_size, rounding_mode="floor")
    if block_table.dim() == 1:
        blocks = block_table[index]
    elif block_table.dim() == 2 and positions.dim() == 1 and len(positions) == len(block_table):
        blocks = block_table[torch.arange(len(block_table), device=block_table.device), index]
    else:
        raise ValueError(
            f"token_slots: a block table of shape {tuple(block_table.shape)} with positions "
            f"of shape {tuple(positions.shape)}"
        )
    return blocks, positions % block_size
