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
slot offset `p % S`; its *flat slot id* is `bt[p // S] * S + p % S`.

This module stores and moves bytes only. Which blocks a sequence owns, and who frees them,
is the `BlockPool`'s business: the cache never allocates or frees a block id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


class PagedKvCache:
    """Owns the KV buffer described by a `KvCacheSpec` and reads/writes it by block table.

    Block tables are 1-D integer tensors of block ids in sequence order (entry `i` holds
    positions `[i * block_size, (i + 1) * block_size)`). Indexing tensors may live on any
    device; they are moved to the buffer's device. No method checks that block ids belong
    to the caller: ownership is tracked by `BlockPool`.
    """

    def __init__(self, spec: KvCacheSpec, device: torch.device | str = "cpu") -> None:
        # Shape, dtype and size of the buffer.
        self.spec = spec
        # Where the buffer lives (host memory by default).
        self.device = torch.device(device)
        # The one contiguous block-major buffer; zero-filled so unused slots are defined.
        self.buffer = torch.zeros(spec.shape, dtype=spec.dtype, device=self.device)

    # ----------------------------------------------------------------- views and addresses

    def layer_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided views (no copy) `(k, v)` of one layer, each `[num_blocks, block_size,
        num_kv_heads, head_dim]`; writes through them land in the buffer."""
        self._check_layer(layer)
        return self.buffer[:, layer, 0], self.buffer[:, layer, 1]

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

    # -------------------------------------------------------------------------- writes

    def slot_ids(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat slot ids `block_table[p // S] * S + p % S` of token positions.

        `block_table` is `[num_table_blocks]` with `positions` of any shape, or
        `[batch, max_blocks]` with `positions` `[batch]` (row `i` uses its own table).
        """
        return slot_ids(block_table, positions, self.spec.block_size)

    def write(
        self,
        layer: int,
        block_table: torch.Tensor,
        start_pos: int,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store `n` new tokens' K/V (`[n, heads, head_dim]`) at positions
        `start_pos .. start_pos + n - 1` of the sequence whose blocks are `block_table`.

        The table must already cover position `start_pos + n - 1`. One scatter, no loop.
        """
        n = self._check_kv(k, v)
        if start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {start_pos}")
        table = block_table.to(self.device, torch.long)
        needed = (start_pos + n + self.spec.block_size - 1) // self.spec.block_size
        if n and table.numel() < needed:
            raise ValueError(
                f"block_table has {table.numel()} blocks; positions up to "
                f"{start_pos + n - 1} need {needed}"
            )
        positions = torch.arange(start_pos, start_pos + n, device=self.device)
        self.write_decode(layer, slot_ids(table, positions, self.spec.block_size), k, v)

    def write_decode(
        self, layer: int, slot_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store K/V `[n, heads, head_dim]` at `n` flat slot ids (one scatter).

        The batched decode path: row `i` is the new token of sequence `i`, placed at
        `slot_ids[i]` (see `slot_ids`). Slot ids must be distinct and in range (checked
        for a host buffer).
        """
        n = self._check_kv(k, v)
        slots = slot_ids.to(self.device, torch.long).reshape(-1)
        if slots.numel() != n:
            raise ValueError(f"got {slots.numel()} slot ids for {n} tokens")
        if n == 0:
            return
        total = self.spec.num_blocks * self.spec.block_size
        # Bounds are checked on host memory only: on an accelerator the check would stall the
        # stream once per layer per step, and a bad id fails there as a device-side assert.
        if slots.device.type == "cpu" and (int(slots.min()) < 0 or int(slots.max()) >= total):
            raise IndexError(f"slot id out of range [0, {total})")
        blocks = torch.div(slots, self.spec.block_size, rounding_mode="floor")
        offsets = slots % self.spec.block_size
        k_view, v_view = self.layer_view(layer)
        k_view.index_put_((blocks, offsets), k.to(device=self.device, dtype=self.spec.dtype))
        v_view.index_put_((blocks, offsets), v.to(device=self.device, dtype=self.spec.dtype))

    # --------------------------------------------------------------------------- reads

    def gather(
        self, layer: int, block_table: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions `0 .. num_tokens - 1`, each `[num_tokens, heads, head_dim]`
        (a copy, in sequence order)."""
        bs = self.spec.block_size
        n_blocks = (num_tokens + bs - 1) // bs
        table = block_table.to(self.device, torch.long).reshape(-1)
        if table.numel() < n_blocks:
            raise ValueError(
                f"block_table has {table.numel()} blocks; {num_tokens} tokens need {n_blocks}"
            )
        k_view, v_view = self.layer_view(layer)
        idx = table[:n_blocks]
        k = k_view[idx].reshape(n_blocks * bs, *k_view.shape[2:])[:num_tokens]
        v = v_view[idx].reshape(n_blocks * bs, *v_view.shape[2:])[:num_tokens]
        return k, v

    def gather_batch(
        self, layer: int, block_tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of a padded batch of tables `[batch, max_blocks]`, each
        `[batch, max_blocks * block_size, heads, head_dim]`.

        Padding entries must hold a valid block id (0 is fine); the rows they produce are
        garbage, so the caller masks every position at or past each sequence's length.
        """
        if block_tables.dim() != 2:
            raise ValueError(f"block_tables must be 2-D, got shape {tuple(block_tables.shape)}")
        batch, max_blocks = block_tables.shape
        k_view, v_view = self.layer_view(layer)
        idx = block_tables.to(self.device, torch.long)
        tokens = max_blocks * self.spec.block_size
        k = k_view[idx].reshape(batch, tokens, *k_view.shape[2:])
        v = v_view[idx].reshape(batch, tokens, *v_view.shape[2:])
        return k, v

    # ---------------------------------------------------------------------------- copies

    def copy_block(self, src: int, dst: int) -> None:
        """Copy every layer's K/V of block `src` into block `dst` (copy-on-write helper)."""
        self._check_block(src)
        self._check_block(dst)
        self.buffer[dst].copy_(self.buffer[src])

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """`copy_block` for many pairs in one indexed copy; `dst` ids must be distinct."""
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} sources for {len(dst)} destinations")
        for block_id in (*src, *dst):
            self._check_block(block_id)
        if src:
            s = torch.tensor(src, dtype=torch.long, device=self.device)
            d = torch.tensor(dst, dtype=torch.long, device=self.device)
            self.buffer.index_copy_(0, d, self.buffer.index_select(0, s))

    # --------------------------------------------------------------------------- checks

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.spec.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.spec.num_layers})")

    def _check_block(self, block_id: int) -> None:
        if not 0 <= block_id < self.spec.num_blocks:
            raise IndexError(f"block id {block_id} out of range [0, {self.spec.num_blocks})")

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor) -> int:
        want = (self.spec.num_kv_heads, self.spec.head_dim)
        if k.dim() != 3 or tuple(k.shape[1:]) != want or k.shape != v.shape:
            raise ValueError(
                f"k and v must both be [n, {want[0]}, {want[1]}], "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        return int(k.shape[0])


def slot_ids(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat slot ids `block_table[p // block_size] * block_size + p % block_size`.

    `block_table` `[num_table_blocks]` with `positions` of any shape, or `[batch,
    max_blocks]` with `positions` `[batch]`. Returns int64 on `block_table`'s device.
    """
    table = block_table.to(torch.long)
    pos = positions.to(table.device, torch.long)
    index = torch.div(pos, block_size, rounding_mode="floor")
    if table.dim() == 1:
        blocks = table[index]
    elif table.dim() == 2:
        if pos.dim() != 1 or pos.shape[0] != table.shape[0]:
            raise ValueError("a 2-D block table needs one position per row")
        blocks = table.gather(1, index[:, None])[:, 0]
    else:
        raise ValueError(f"block_table must be 1-D or 2-D, got shape {tuple(table.shape)}")
    return blocks * block_size + pos % block_size
