"""The Qwen3-VL language model, run over a paged KV buffer.

Prefill computes prompt tokens from each sequence's `start` on (earlier tokens are already in
the cache, e.g. reused prefix blocks), optionally in chunks, with multimodal rows scattered at
their exact runs and deepstack features added after the first layers at the same tokens.
Several sequences' pieces run packed in one forward (`prefill_many`, planned by
`prefill_plan`): the linear layers see all their tokens at once, attention runs per segment
on the fused kernel (`attention.PrefillAttention`). The last layer computes attention and
MLP only for the rows whose hidden states are read (a prompt's last token, unless every
token's logits are asked for); its K/V it still computes for every row.

Decode advances many sequences by one token each in a single forward: the linear layers run
batched, attention (`attention.DecodeAttention`) reads each sequence's contiguous K/V rows
(`common.models.running_kv`) or, without them, its blocks through a padded block table, up
to each sequence's own length.

The KV buffer is `common.kv.cache`'s (block-major: `[num_blocks, num_layers, 2, block_size,
kv_heads, head_dim]`); the model reads and writes a token's K/V at its `token_slots`, the
slots its block table names, and allocation belongs to the caller.

Numerics follow the reference (`transformers` Qwen3-VL text model): RMSNorm in float32 then
cast, q/k RMSNorm per head before RoPE, rotate-half RoPE with interleaved mRoPE frequencies.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from common.kv.allocator import blocks_for
from common.kv.cache import token_slots
from common.models.native_kernels import native_kernels
from common.models.qwen3_vl.attention import DecodeAttention, PrefillAttention, SegmentSpan
from common.models.qwen3_vl.config import Qwen3VLConfig, TextConfig
from common.models.qwen3_vl.linear import Dense, use_packed
from common.models.qwen3_vl.prefill_plan import PrefillRequest, plan_forwards
from common.models.qwen3_vl.rope import axis_of_frequency, inverse_frequencies, rotary_cos_sin
from common.models.qwen3_vl.text_layer import LayerWeights
from common.models.qwen3_vl.text_ops import norm_rotate, rms_norm, signed_sin, silu_mul
from common.models.qwen3_vl.visual_rows import VisualInputs, packed_visual, visual_inputs
from common.models.running_kv import new_token_slots
from common.multimodal.params import ItemEmbedding, MultimodalItemMetadata

logger = logging.getLogger(__name__)

LM_PREFIX = "model.language_model."
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True, slots=True)
class Segment:
    """Tokens `[start, start + n)` of one sequence, to compute in a packed forward."""

    block_table: torch.Tensor  # int64 [blocks]: the sequence's block ids
    token_ids: torch.Tensor  # int64 [n]
    positions: torch.Tensor  # int64 [3, n]: their mRoPE positions
    start: int  # sequence position of the first token (earlier ones are cached)
    visual: VisualInputs | None  # multimodal rows, indices local to the segment
    outputs: int | None = None  # hidden rows to return: its last `outputs` tokens' (None: all)


class TextModel:
    """Qwen3-VL decoder stack + lm_head over a paged KV buffer (inference only)."""

    def __init__(
        self,
        config: TextConfig,
        weights: Mapping[str, torch.Tensor],
        *,
        packed_weights: bool | None = None,
    ) -> None:
        """`weights` use the checkpoint's language-model names without prefix, plus
        `lm_head.weight` (absent when the embeddings are tied); `packed_weights`: keep each
        projection's oneDNN copy too (None: where it pays, `linear.use_packed`)."""
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}")
        self.config = config
        self.embed_tokens = weights["embed_tokens.weight"]
        self.norm = weights["norm.weight"]
        packed = use_packed(packed_weights, self.embed_tokens.dtype)
        self.lm_head = Dense.of(weights.get(LM_HEAD, self.embed_tokens), packed=packed)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.layers = [
            LayerWeights.load(weights, f"layers.{i}.", heads, kv_heads, packed=packed)
            for i in range(config.num_hidden_layers)
        ]
        self.inv_freq = inverse_frequencies(config.head_dim, config.rope_theta)
        self.freq_axis = axis_of_frequency(config.mrope_section, config.mrope_interleaved)
        self.q_size = config.num_attention_heads * config.head_dim
        self.kv_size = config.num_key_value_heads * config.head_dim
        if self.embed_tokens.device.type == "cpu":
            native_kernels()  # built (or found) at load rather than inside the first request

    @classmethod
    def from_weights(
        cls,
        config: Qwen3VLConfig,
        tensors: Mapping[str, torch.Tensor],
        *,
        prefix: str = LM_PREFIX,
        packed_weights: bool | None = None,
    ) -> TextModel:
        """Build from checkpoint tensors named as the reference names them."""
        weights = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if LM_HEAD in tensors and not config.tie_word_embeddings:
            weights[LM_HEAD] = tensors[LM_HEAD]
        elif not config.tie_word_embeddings:
            raise KeyError(f"{LM_HEAD} missing and embeddings are not tied")
        return cls(config.text, weights, packed_weights=packed_weights)

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights (and of the KV buffer this model expects)."""
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.embed_tokens.device

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head."""
        return self.lm_head(rms_norm(hidden, self.norm, self.config.rms_norm_eps))

    # ----------------------------------------------------------------------------- shared

    def _qkv(
        self, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project, q/k-norm and rotate `h [n, hidden]` into q `[n, H, D]`, k, v `[n, KV, D]`
        (views). `cos` and `sin_signed` (`text_ops.signed_sin`) are `[n, 1, D]`. q and k
        heads are normed and rotated together: per head the same arithmetic as apart, in half
        the ops."""
        c = self.config
        qkv = layer.qkv(h)
        split = self.q_size + self.kv_size
        heads_qk = qkv[:, :split].unflatten(-1, (-1, c.head_dim))
        qk = norm_rotate(heads_qk, layer.qk_norm, c.rms_norm_eps, cos, sin_signed)
        heads = c.num_attention_heads
        return qk[:, :heads], qk[:, heads:], qkv[:, split:].unflatten(-1, (-1, c.head_dim))

    def _finish_layer(
        self, layer: LayerWeights, x: torch.Tensor, attn: torch.Tensor
    ) -> torch.Tensor:
        """o_proj + residual, then the MLP block + residual, added to `x` in place (the
        residual stream is a tensor of the forward's own; the reference's arithmetic, without
        a fresh activation-sized buffer per op)."""
        x += layer.o_proj(attn)
        h = rms_norm(x, layer.post_norm, self.config.rms_norm_eps)
        x += layer.down(silu_mul(layer.gate_up(h)))
        return x

    # ---------------------------------------------------------------------------- prefill

    @torch.inference_mode()
    def forward_segments(self, kv: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """One forward over the packed tokens of `segments`: write their K/V of every layer
        and return the hidden rows each segment asks for (its last `outputs` tokens', in
        segment order), `[sum(outputs), hidden]`.

        Each segment's tokens before its `start` must already be in `kv` at the slots its
        `block_table` names, or be computed by an earlier segment of the same sequence in
        this call (every segment's K/V of a layer are written before any attends).

        The last layer computes attention and MLP only for the rows asked for (its K/V still
        for all): nothing else reads them. Per row the same arithmetic as a whole forward,
        up to the rounding of matrix products whose kernels depend on the row count.
        """
        c = self.config
        block_size = kv.shape[3]
        spans: list[SegmentSpan] = []
        offset = 0
        for seg in segments:
            length = int(seg.token_ids.shape[0])
            outputs = length if seg.outputs is None else min(seg.outputs, length)
            spans.append(SegmentSpan(offset, seg.start, length, seg.block_table, outputs))
            offset += length
        attention = PrefillAttention(spans, block_size, self.dtype)
        token_ids = torch.cat([seg.token_ids for seg in segments])
        x = self.embed_tokens.index_select(0, token_ids)
        visual = packed_visual([seg.visual for seg in segments], spans)
        index = None if visual is None else visual.index.to(x.device)
        if visual is not None:
            x[index] = visual.rows.to(x.device, x.dtype)
        positions = torch.cat([seg.positions for seg in segments], dim=1)
        cos, sin = rotary_cos_sin(positions, self.inv_freq, self.freq_axis, x.dtype)
        cos, sin_signed = cos.unsqueeze(1), signed_sin(sin).unsqueeze(1)
        slots = [
            token_slots(
                s.block_table, torch.arange(s.start, s.end, device=s.block_table.device), block_size
            )
            for s in spans
        ]
        blocks = torch.cat([b for b, _ in slots])
        offsets = torch.cat([o for _, o in slots])
        # The last layer runs on the wanted rows only, unless deepstack rows still follow it.
        last = len(self.layers) - 1
        trim = not attention.all_wanted and (visual is None or last >= len(visual.deepstack))
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, c.rms_norm_eps)
            q, k, v = self._qkv(layer, h, cos, sin_signed)
            kv[blocks, i, 0, offsets] = k
            kv[blocks, i, 1, offsets] = v
            if i == last and trim:
                x = x[attention.wanted_rows(x.device)]
                if x.shape[0]:
                    attn = attention(q, k, v, kv[:, i, 0], kv[:, i, 1], wanted_only=True)
                    x = self._finish_layer(layer, x, attn)
                return x
            attn = attention(q, k, v, kv[:, i, 0], kv[:, i, 1])
            x = self._finish_layer(layer, x, attn)
            if visual is not None and i < len(visual.deepstack):
                x[index] += visual.deepstack[i].to(x.device, x.dtype)
        return x if attention.all_wanted else x[attention.wanted_rows(x.device)]

    def prefill_many(
        self,
        kv: torch.Tensor,
        requests: Sequence[PrefillRequest],
        *,
        chunk_size: int | None = None,
        token_budget: int | None = None,
    ) -> list[torch.Tensor]:
        """Prefill several prompts, packed into forwards (see `prefill_plan.plan_forwards`).

        Returns per request the logits `[N - start, vocab]` of its computed tokens when it
        asks for `all_logits`, else its last token's logits `[vocab]`. Multimodal rows come
        from each request's `embeddings` at its items' runs (KeyError when one is missing).
        """
        spans = [(r.start, int(r.token_ids.shape[0])) for r in requests]
        hidden: list[list[torch.Tensor]] = [[] for _ in requests]
        for pieces in plan_forwards(spans, chunk_size, token_budget):
            segments = []
            for piece in pieces:
                r = requests[piece.request]
                visual = (
                    visual_inputs(r.items, r.embeddings, piece.lo, piece.hi) if r.items else None
                )
                segments.append(
                    Segment(
                        r.block_table,
                        r.token_ids[piece.lo : piece.hi],
                        r.positions[:, piece.lo : piece.hi],
                        piece.lo,
                        visual,
                        # Hidden rows read below: all (`all_logits`), else the prompt's last.
                        None if r.all_logits else int(piece.hi == spans[piece.request][1]),
                    )
                )
            x = self.forward_segments(kv, segments)
            wanted = [
                s.outputs if s.outputs is not None else p.hi - p.lo
                for s, p in zip(segments, pieces, strict=True)
            ]
            for piece, rows in zip(pieces, x.split(wanted), strict=True):
                hidden[piece.request].append(rows)
        with torch.inference_mode():
            lasts = [i for i, r in enumerate(requests) if not r.all_logits]
            last_logits = (
                self.logits(torch.stack([hidden[i][-1][-1] for i in lasts])) if lasts else None
            )
            out: list[torch.Tensor] = []
            for i, r in enumerate(requests):
                if r.all_logits:
                    out.append(self.logits(torch.cat(hidden[i])))
                else:
                    assert last_logits is not None
                    out.append(last_logits[lasts.index(i)])
        logger.debug("prefilled %d prompts in chunks of %s", len(requests), chunk_size)
        return out

    def prefill(
        self,
        kv: torch.Tensor,
        block_table: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        *,
        start: int = 0,
        items: Sequence[MultimodalItemMetadata] = (),
        embeddings: Mapping[int, ItemEmbedding] | None = None,
        chunk_size: int | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Prefill a whole prompt from `start` on, in chunks of at most `chunk_size` tokens
        (one forward per chunk).

        `token_ids [N]` and `positions [3, N]` cover the whole prompt; multimodal rows come
        from `embeddings` (by item index) at the items' runs. Returns logits `[N - start,
        vocab]` when `all_logits`, else the last token's logits `[vocab]`.
        """
        request = PrefillRequest(
            block_table, token_ids, positions, start, items, embeddings or {}, all_logits
        )
        return self.prefill_many(kv, [request], chunk_size=chunk_size)[0]

    # ----------------------------------------------------------------------------- decode

    @torch.inference_mode()
    def decode(
        self,
        kv: torch.Tensor,
        block_tables: torch.Tensor | None,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        rows: torch.Tensor | None = None,
        slot_blocks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode step for `B` sequences; return logits `[B, vocab]`.

        `block_tables [B, max_blocks]` (rows padded with any valid block id), `token_ids [B]`
        the new tokens, `positions [3, B]` their mRoPE positions, `seq_lens [B]` the lengths
        including the new token (its K/V go to slot `seq_len - 1`). `slot_blocks [B]`, when
        given, is the block of that slot, `block_tables[b, (seq_len - 1) // block_size]`
        (then `block_tables` may be None when `rows` is given: nothing else reads it).

        `rows [B, layers, 2, KV, capacity, D]`, when given, holds each sequence's K/V at
        positions below `seq_len - 1` contiguously (`RunningKv`): the new K/V are written
        there too and attention reads them without gathering blocks. Without it, attention
        gathers each sequence's blocks from `kv`.
        """
        c = self.config
        batch = int(token_ids.shape[0])
        block_size = kv.shape[3]
        x = self.embed_tokens.index_select(0, token_ids)
        cos, sin = rotary_cos_sin(positions, self.inv_freq, self.freq_axis, x.dtype)
        cos, sin_signed = cos.unsqueeze(1), signed_sin(sin).unsqueeze(1)
        last = seq_lens - 1
        if slot_blocks is None:
            if block_tables is None:
                raise ValueError("decode needs block_tables or slot_blocks")
            slot_blocks, offsets = token_slots(block_tables, last, block_size)
        else:
            offsets = last % block_size
        lengths = seq_lens.tolist()
        longest = max(lengths)
        heads = c.num_key_value_heads
        if rows is not None:
            span = longest
            layer_rows = [r.unbind(1) for r in rows[:, :, :, :, :span].unbind(1)]
            slots = new_token_slots(rows, last)
            flat_rows = rows.view(-1, c.head_dim)
            news: list[torch.Tensor] = []  # per layer the new K/V [B, 2, KV, D]
        else:  # keep only as many blocks as the longest sequence needs
            if block_tables is None:
                raise ValueError("decode without rows needs block_tables")
            width = blocks_for(longest, block_size)
            flat = block_tables[:, :width].reshape(-1)
            span = width * block_size
        attention = DecodeAttention(seq_lens, lengths, span, x.dtype)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, c.rms_norm_eps)
            q, k, v = self._qkv(layer, h, cos, sin_signed)
            if rows is not None:
                new = torch.stack((k, v), dim=1)
                flat_rows.index_copy_(0, slots[i], new.view(-1, c.head_dim))
                news.append(new)
                keys, values = layer_rows[i]
            else:  # [B, KV, span, D] views of one copy each
                kv[slot_blocks, i, 0, offsets] = k
                kv[slot_blocks, i, 1, offsets] = v
                keys = kv[:, i, 0].index_select(0, flat).view(batch, span, heads, -1)
                values = kv[:, i, 1].index_select(0, flat).view(batch, span, heads, -1)
                keys, values = keys.transpose(1, 2), values.transpose(1, 2)
            attn = attention(q, keys, values)
            x = self._finish_layer(layer, x, attn)
        if rows is not None:
            # Attention read only the rows, so the paged cache takes every layer's new K/V
            # in one scatter: [B, layers, 2, KV, D].
            kv[slot_blocks, :, :, offsets] = torch.stack(news, dim=1)
        return self.logits(x)
