"""Attention of the text model over packed prefill segments and over decode batches.

Every call goes to `scaled_dot_product_attention` with 4-D inputs `[batch, heads, tokens,
dim]` and `enable_gqa`: on CPU that is the fused (flash) kernel, while 3-D inputs or a
repeat-kv done per call fall back to the math path (bmm, where, softmax), which was ~3x
slower for a 512-token prompt.

Prefill (`PrefillAttention`): a forward packs the tokens of one or more segments (a
segment is a slice `[start, end)` of one sequence's prompt) along one axis. A segment with
no cached prefix attends to its own fresh K/V with `is_causal`; segments of equal length
that all start at 0 run as one batched call; a segment with earlier tokens in the cache
(a reused prefix, or an earlier chunk) reads its keys from the paged buffer with an
offset-causal mask, made once per forward, or, past `MASK_ELEMENTS`, per slice of its
queries in each layer. Each segment's attention is computed exactly as if it were alone.

Causal attention over 257 to 512 fresh tokens (`causal_attention`) runs as two calls on
CPU: torch's flash kernel there skips only whole 512-key blocks above the diagonal, so
with at most 512 keys it computes the whole square; the first half of the queries over the
first half of the keys (causal), then the second half over all keys (masked), skips a
quarter of it: about 15% of a 512-token prompt's attention (3% of its prefill), the same
values (bit-identical at 512 tokens in our measurements, else to rounding). Longer prompts
gain nothing from it (the kernel skips blocks itself), shorter ones too little.

Decode (`DecodeAttention`): one query per sequence over either contiguous per-sequence
K/V rows (`common.models.running_kv.RunningKv`, no copy per step) or, without them, a
gather of each sequence's blocks from the paged buffer. On a CPU (float32 or bfloat16) it
runs the C kernel of `common.models.native_kernels` (torch's kernel spends more time there in
per-sequence call overhead than in the arithmetic); elsewhere, or where that kernel could
not be built, `decode_attention` (torch's).

Masks go in as additive biases (`text_ops.additive`: 0 where a key is attended, -inf where not),
each made once and passed to every layer's call: `scaled_dot_product_attention` turns a
boolean mask into exactly that bias on each call (two `where`s of the mask's size per
layer), so the outputs are the same bits. The second half's bias of a split causal call
is kept per shape (`_lower_half_bias`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.kv.allocator import blocks_for
from common.models.native_kernels import NativeKernels, native_kernels
from common.models.qwen3_vl.text_ops import additive, length_mask

_KEY_BLOCK = 512  # keys per block of torch's CPU flash kernel (it skips whole blocks only)
_SPLIT_ABOVE = 256  # fewer tokens gain too little from the split (measured)
# Mask elements (queries x keys) a segment with a cached prefix may have at once. Past it, its
# queries run in slices, each over the keys up to its last query with a mask made per layer:
# one mask for the whole segment grew as the prompt's square (a 16k-token prompt reusing one
# cached block held 1.5 GB of mask; 256k tokens would hold 256 GB).
MASK_ELEMENTS = 1 << 24


@dataclass(frozen=True, slots=True)
class SegmentSpan:
    """Where one segment's tokens sit: in the packed forward and in its sequence."""

    offset: int  # first row of the segment in the packed forward
    start: int  # sequence position of its first token (tokens before it are cached)
    length: int  # tokens in the segment
    block_table: torch.Tensor  # int64 [blocks]: the sequence's block ids
    outputs: int  # its last `outputs` tokens' outputs are wanted (`wanted_only` calls)

    @property
    def end(self) -> int:
        """Sequence position one past the segment's last token."""
        return self.start + self.length


class PrefillAttention:
    """The attention of one packed prefill forward, planned once and run per layer."""

    def __init__(self, spans: Sequence[SegmentSpan], block_size: int, dtype: torch.dtype) -> None:
        self.spans = list(spans)
        self.block_size = block_size
        fresh = [s for s in self.spans if s.start == 0]
        # All segments fresh and of one length: one batched call over [segments, ...].
        self.uniform = len(fresh) == len(self.spans) and len({s.length for s in fresh}) == 1
        # Every row's output is wanted (`wanted_only` changes nothing).
        self.all_wanted = all(s.outputs == s.length for s in self.spans)
        # Offset-causal biases of the segments with a cached prefix ([n, end], `additive`).
        self.masks: dict[int, torch.Tensor] = {}
        self.dtype = dtype
        for j, s in enumerate(self.spans):
            if s.start > 0 and s.length * s.end <= MASK_ELEMENTS:
                device = s.block_table.device
                q_pos = torch.arange(s.start, s.end, device=device).unsqueeze(1)
                self.masks[j] = additive(torch.arange(s.end, device=device) <= q_pos, dtype)

    def wanted_rows(self, device: torch.device) -> torch.Tensor:
        """Rows of the packed forward whose outputs are wanted: each segment's last
        `outputs`, in order."""
        ends = [(s.offset + s.length - s.outputs, s.offset + s.length) for s in self.spans]
        return torch.cat([torch.arange(lo, hi, device=device) for lo, hi in ends])

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_k: torch.Tensor,
        layer_v: torch.Tensor,
        *,
        wanted_only: bool = False,
    ) -> torch.Tensor:
        """Attention output `[N, heads * dim]` of packed `q [N, H, D]`, `k`, `v [N, KV, D]`;
        with `wanted_only`, of the `wanted_rows` only (`[len(wanted_rows), heads * dim]`,
        each row as in the whole output).

        `layer_k`, `layer_v` are the layer's paged views `[num_blocks, block_size, KV, D]`,
        already holding this forward's K/V (needed by segments with a cached prefix).
        """
        n = q.shape[0]
        every = not wanted_only or self.all_wanted
        last_only = all(s.outputs == 1 for s in self.spans)
        if self.uniform and (every or last_only):
            b = len(self.spans)
            queries, keys, values = (
                t.view(b, n // b, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)
            )
            if every:
                out = causal_attention(queries, keys, values)
            else:  # one query per segment, its last: it attends to every key
                out = F.scaled_dot_product_attention(
                    queries[:, :, -1:], keys, values, enable_gqa=True
                )
            return out.transpose(1, 2).reshape(-1, q.shape[1] * q.shape[2])
        outs = []
        for j, s in enumerate(self.spans):
            first = 0 if every else s.length - s.outputs  # first wanted row of the segment
            if first == s.length:
                continue
            rows = slice(s.offset, s.offset + s.length)
            query = q[s.offset + first : s.offset + s.length].transpose(0, 1).unsqueeze(0)
            if s.start == 0:
                keys, values = k[rows], v[rows]
            else:
                used = s.block_table[: blocks_for(s.end, self.block_size)]
                keys = layer_k.index_select(0, used).flatten(0, 1)[: s.end]
                values = layer_v.index_select(0, used).flatten(0, 1)[: s.end]
            keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
            if s.start > 0 and j not in self.masks:
                out = self._sliced(query, keys, values, s, first)
                outs.append(out[0].transpose(0, 1).reshape(s.length - first, -1))
                continue
            mask = self._mask(j, s, first)
            if mask is None and first == 0 and s.start == 0:
                out = causal_attention(query, keys, values)
            else:
                out = F.scaled_dot_product_attention(
                    query, keys, values, attn_mask=mask, enable_gqa=True
                )
            outs.append(out[0].transpose(0, 1).reshape(s.length - first, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _sliced(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        s: SegmentSpan,
        first: int,
    ) -> torch.Tensor:
        """Segment `s`'s queries from its row `first` on (`query [1, H, rows, D]`) over its
        keys (`[1, KV, end, D]`), in slices of at most `MASK_ELEMENTS` mask elements."""
        rows = max(1, MASK_ELEMENTS // s.end)
        device = query.device
        parts = []
        for a in range(first, s.length, rows):
            b = min(a + rows, s.length)
            stop = s.start + b  # keys up to the slice's last query
            q_pos = torch.arange(s.start + a, stop, device=device).unsqueeze(1)
            bias = additive(torch.arange(stop, device=device) <= q_pos, self.dtype)
            parts.append(
                F.scaled_dot_product_attention(
                    query[:, :, a - first : b - first],
                    keys[:, :, :stop],
                    values[:, :, :stop],
                    attn_mask=bias,
                    enable_gqa=True,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def _mask(self, j: int, s: SegmentSpan, first: int) -> torch.Tensor | None:
        """The mask of segment `j`'s queries from its row `first` on (None: causal from the
        segment's start, or, for its last row alone, every key)."""
        if first == s.length - 1 and first > 0:
            return None  # the last token attends to every key before it
        if s.start > 0:
            return self.masks[j][first:]
        if first == 0:
            return None
        q_pos = torch.arange(first, s.length, device=s.block_table.device).unsqueeze(1)
        return torch.arange(s.length, device=s.block_table.device).unsqueeze(0) <= q_pos


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention of `q [b, H, n, D]` over `k`, `v [b, KV, n, D]` (see
    the module docstring for the split of 257 to 512 tokens on CPU)."""
    n = q.shape[2]
    if q.device.type != "cpu" or not _SPLIT_ABOVE < n <= _KEY_BLOCK:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    half = n // 2
    first = F.scaled_dot_product_attention(
        q[:, :, :half], k[:, :, :half], v[:, :, :half], is_causal=True, enable_gqa=True
    )
    bias = _lower_half_bias(n, q.dtype, q.device)
    second = F.scaled_dot_product_attention(q[:, :, half:], k, v, attn_mask=bias, enable_gqa=True)
    return torch.cat((first, second), dim=2)


@functools.lru_cache(maxsize=8)
def _lower_half_bias(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Causal bias `[n - n // 2, n]` of the last queries of `n` over all `n` keys (kept:
    the same for every layer and every prompt of this length)."""
    with torch.inference_mode(False):  # usable inside inference mode and outside it
        rows = torch.arange(n // 2, n, device=device).unsqueeze(1)
        return additive(torch.arange(n, device=device) <= rows, dtype)


class DecodeAttention:
    """The attention of one decode step, planned once and run per layer: sequence `b`'s
    query over its first `lengths[b]` positions of the layer's `keys`, `values` `[B, KV,
    span, D]`."""

    def __init__(
        self, seq_lens: torch.Tensor, lengths: list[int], span: int, dtype: torch.dtype
    ) -> None:
        """`seq_lens [B]` and `lengths` (the same, as a list) are the positions each
        sequence attends to, at most `span`; `dtype` is the queries'."""
        if min(lengths) < 1 or max(lengths) > span:
            raise ValueError(
                f"decode lengths must be in 1..{span}, got {min(lengths)}..{max(lengths)}"
            )
        self.span = span
        every = min(lengths) == span
        native = seq_lens.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
        self.kernels = native_kernels() if native else None
        # The kernel's lengths, else torch's additive mask (None: every position attended).
        kernel_lengths = not every and self.kernels is not None
        self.lengths = seq_lens.to(torch.int64).contiguous() if kernel_lengths else None
        self.mask = None if every or self.kernels else length_mask(seq_lens, span, dtype)

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """`[B, H * D]` of `q [B, H, D]` (see `decode_attention` for the rest)."""
        if keys.shape[2] != self.span:  # the lengths were checked against it
            raise ValueError(f"decode keys hold {keys.shape[2]} positions, planned {self.span}")
        if self.kernels is not None and NativeKernels.attention_takes(q, keys, values):
            return self.kernels.decode_attention(q, keys, values, self.lengths)
        if self.mask is None and self.lengths is not None:  # planned for the kernel, not taken
            self.mask = length_mask(self.lengths, self.span, q.dtype)
        return decode_attention(q, keys, values, self.mask)


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """One query per sequence: `q [B, H, D]` over `keys`, `values` `[B, KV, T, D]` (any
    strides with a contiguous last dimension) where `mask [B, 1, 1, T]` is True (None: all
    T positions). Returns `[B, H * D]`.

    The `H / KV` query heads that share a key head go in as that head's queries (`[B, KV,
    H / KV, D]`), so each key head's K/V is read once for its group rather than once per
    query head: the same softmax per query row, a quarter less time at batch 32 on CPU."""
    batch, heads, dim = q.shape
    groups = q.view(batch, keys.shape[1], heads // keys.shape[1], dim)
    out = F.scaled_dot_product_attention(groups, keys, values, attn_mask=mask)
    return out.reshape(batch, -1)
