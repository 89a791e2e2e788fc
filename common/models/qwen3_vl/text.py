"""The Qwen3-VL language model, run over a paged KV buffer.

Prefill computes one sequence's prompt tokens from `start` on (earlier tokens are already in
the cache, e.g. reused prefix blocks), optionally in chunks, with multimodal rows scattered at
their exact runs and deepstack features added after the first layers at the same tokens.
Decode advances many sequences by one token each in a single forward: the linear layers run
batched, attention reads each sequence's blocks through a padded block table and a length
mask.

The KV buffer is one tensor `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`
(block-major, so a block's layers are one contiguous range). The model only reads and
writes the slots its block tables name; allocation belongs to the caller.

Numerics follow the reference (`transformers` Qwen3-VL text model): RMSNorm in float32 then
cast, q/k RMSNorm per head before RoPE, rotate-half RoPE with interleaved mRoPE frequencies.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.models.qwen3_vl.config import Qwen3VLConfig, TextConfig
from common.models.qwen3_vl.rope import axis_of_frequency, inverse_frequencies, rotary_cos_sin
from common.multimodal.params import ItemEmbedding, MultimodalItemMetadata

logger = logging.getLogger(__name__)

LM_PREFIX = "model.language_model."
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True, slots=True)
class VisualInputs:
    """Multimodal rows to place inside one prefill chunk."""

    # int64 [R]: chunk-local token indices that receive a row.
    index: torch.Tensor
    # [R, hidden]: replaces the token embedding at `index`.
    rows: torch.Tensor
    # One [R, hidden] per early layer: added to that layer's output at `index`.
    deepstack: tuple[torch.Tensor, ...]


def visual_inputs(
    items: Sequence[MultimodalItemMetadata],
    embeddings: Mapping[int, ItemEmbedding],
    start: int,
    end: int,
) -> VisualInputs | None:
    """Gather the rows of every run overlapping prompt tokens `[start, end)`.

    `embeddings` is keyed by item index; an item whose runs miss the range needs none (it may
    lie wholly in a reused prefix). Raises KeyError when a needed embedding is missing.
    """
    index: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []
    deep: list[list[torch.Tensor]] = []
    for i, item in enumerate(items):
        placed = 0  # item rows placed by earlier runs
        for run_start, length in item.runs:
            lo, hi = max(start, run_start), min(end, run_start + length)
            if lo < hi:
                if i not in embeddings:
                    raise KeyError(
                        f"item {i} overlaps tokens [{start}, {end}) but has no embedding"
                    )
                emb = embeddings[i]
                first = placed + lo - run_start
                index.append(torch.arange(lo - start, hi - start))
                rows.append(emb.rows[first : first + hi - lo])
                if not deep:
                    deep = [[] for _ in emb.deepstack]
                if len(emb.deepstack) != len(deep):
                    raise ValueError("items disagree on the number of deepstack layers")
                for layer, feat in enumerate(emb.deepstack):
                    deep[layer].append(feat[first : first + hi - lo])
            placed += length
    if not index:
        return None
    return VisualInputs(torch.cat(index), torch.cat(rows), tuple(torch.cat(d) for d in deep))


@dataclass(frozen=True, slots=True)
class _Layer:
    """One decoder layer's weights, with q/k/v and gate/up fused for fewer GEMMs."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TextModel:
    """Qwen3-VL decoder stack + lm_head over a paged KV buffer (inference only)."""

    def __init__(self, config: TextConfig, weights: Mapping[str, torch.Tensor]) -> None:
        """`weights` use the checkpoint's language-model names without prefix, plus
        `lm_head.weight` (absent when the embeddings are tied)."""
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}")
        self.config = config
        self.embed_tokens = weights["embed_tokens.weight"]
        self.norm = weights["norm.weight"]
        self.lm_head = weights.get(LM_HEAD, self.embed_tokens)
        self.layers = [
            self._layer(weights, f"layers.{i}.") for i in range(config.num_hidden_layers)
        ]
        self.inv_freq = inverse_frequencies(config.head_dim, config.rope_theta)
        self.freq_axis = axis_of_frequency(config.mrope_section, config.mrope_interleaved)
        self.q_size = config.num_attention_heads * config.head_dim
        self.kv_size = config.num_key_value_heads * config.head_dim

    @staticmethod
    def _layer(w: Mapping[str, torch.Tensor], p: str) -> _Layer:
        a = p + "self_attn."
        biases = [w.get(f"{a}{n}_proj.bias") for n in "qkv"]
        qkv_bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
        return _Layer(
            input_norm=w[p + "input_layernorm.weight"],
            qkv=torch.cat([w[f"{a}{n}_proj.weight"] for n in "qkv"]).contiguous(),
            qkv_bias=qkv_bias,
            q_norm=w[a + "q_norm.weight"],
            k_norm=w[a + "k_norm.weight"],
            o_proj=w[a + "o_proj.weight"],
            o_bias=w.get(a + "o_proj.bias"),
            post_norm=w[p + "post_attention_layernorm.weight"],
            gate_up=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
            down=w[p + "mlp.down_proj.weight"],
        )

    @classmethod
    def from_weights(
        cls, config: Qwen3VLConfig, tensors: Mapping[str, torch.Tensor], *, prefix: str = LM_PREFIX
    ) -> TextModel:
        """Build from checkpoint tensors named as the reference names them."""
        weights = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if LM_HEAD in tensors and not config.tie_word_embeddings:
            weights[LM_HEAD] = tensors[LM_HEAD]
        elif not config.tie_word_embeddings:
            raise KeyError(f"{LM_HEAD} missing and embeddings are not tied")
        return cls(config.text, weights)

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights (and of the KV buffer this model expects)."""
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.embed_tokens.device

    def kv_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of the paged KV buffer this model reads and writes."""
        c = self.config
        return (num_blocks, c.num_hidden_layers, 2, block_size, c.num_key_value_heads, c.head_dim)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head."""
        return F.linear(_rms_norm(hidden, self.norm, self.config.rms_norm_eps), self.lm_head)

    # ----------------------------------------------------------------------------- shared

    def _qkv(
        self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project, q/k-norm and rotate `h [n, hidden]` into q `[n, H, D]`, k, v `[n, KV, D]`."""
        c = self.config
        qkv = F.linear(h, layer.qkv, layer.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        n = h.shape[0]
        q = _rms_norm(q.view(n, -1, c.head_dim), layer.q_norm, c.rms_norm_eps)
        k = _rms_norm(k.view(n, -1, c.head_dim), layer.k_norm, c.rms_norm_eps)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v.reshape(n, -1, c.head_dim)

    def _finish_layer(self, layer: _Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """o_proj + residual, then the MLP block + residual."""
        x = x + F.linear(attn, layer.o_proj, layer.o_bias)
        h = _rms_norm(x, layer.post_norm, self.config.rms_norm_eps)
        gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.down)

    @staticmethod
    def _slots(
        block_table: torch.Tensor, positions: torch.Tensor, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return block_table[positions // block_size], positions % block_size

    # ---------------------------------------------------------------------------- prefill

    @torch.inference_mode()
    def prefill_chunk(
        self,
        kv: torch.Tensor,
        block_table: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        start: int,
        visual: VisualInputs | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Compute prompt tokens `[start, start + n)` of one sequence; return hidden `[n, hidden]`.

        `token_ids [n]` and `positions [3, n]` describe the chunk; tokens before `start` must
        already be in `kv` at the slots `block_table` names. The chunk's K/V are written there.
        `inputs_embeds [n, hidden]`, when given, replaces the token embedding lookup.
        """
        c = self.config
        n = int(token_ids.shape[0]) if inputs_embeds is None else int(inputs_embeds.shape[0])
        end = start + n
        block_size = kv.shape[3]
        x = self.embed_tokens[token_ids] if inputs_embeds is None else inputs_embeds.to(self.dtype)
        index = None if visual is None else visual.index.to(x.device)
        if visual is not None:
            x = x.clone()
            x[index] = visual.rows.to(x.device, x.dtype)
        cos, sin = rotary_cos_sin(positions, self.inv_freq, self.freq_axis, x.dtype)
        blocks, offsets = self._slots(
            block_table, torch.arange(start, end, device=block_table.device), block_size
        )
        used = block_table[: (end + block_size - 1) // block_size]
        mask = None
        if start > 0:
            q_pos = torch.arange(start, end, device=x.device).unsqueeze(1)
            mask = torch.arange(end, device=x.device).unsqueeze(0) <= q_pos
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.input_norm, c.rms_norm_eps)
            q, k, v = self._qkv(layer, h, cos, sin)
            kv[blocks, i, 0, offsets] = k
            kv[blocks, i, 1, offsets] = v
            keys = kv[:, i, 0].index_select(0, used).flatten(0, 1)[:end].transpose(0, 1)
            values = kv[:, i, 1].index_select(0, used).flatten(0, 1)[:end].transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                keys,
                values,
                attn_mask=mask,
                is_causal=mask is None,
                enable_gqa=True,
            )
            x = self._finish_layer(layer, x, attn.transpose(0, 1).reshape(n, -1))
            if visual is not None and i < len(visual.deepstack):
                x[index] += visual.deepstack[i].to(x.device, x.dtype)
        return x

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
        """Prefill a whole prompt from `start` on, in chunks of at most `chunk_size` tokens.

        `token_ids [N]` and `positions [3, N]` cover the whole prompt; multimodal rows come
        from `embeddings` (by item index) at the items' runs. Returns logits `[N - start,
        vocab]` when `all_logits`, else the last token's logits `[vocab]`.
        """
        total = int(token_ids.shape[0])
        if not 0 <= start < total:
            raise ValueError(f"start {start} outside a prompt of {total} tokens")
        step = chunk_size or total
        hidden: list[torch.Tensor] = []
        for lo in range(start, total, step):
            hi = min(total, lo + step)
            visual = visual_inputs(items, embeddings or {}, lo, hi) if items else None
            x = self.prefill_chunk(
                kv, block_table, token_ids[lo:hi], positions[:, lo:hi], lo, visual
            )
            hidden.append(x if all_logits else x[-1:])
        with torch.inference_mode():
            out = self.logits(torch.cat(hidden) if all_logits else hidden[-1][-1])
        logger.debug("prefilled tokens [%d, %d) in chunks of %d", start, total, step)
        return out

    # ----------------------------------------------------------------------------- decode

    @torch.inference_mode()
    def decode(
        self,
        kv: torch.Tensor,
        block_tables: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """One decode step for `B` sequences; return logits `[B, vocab]`.

        `block_tables [B, max_blocks]` (rows padded with any valid block id), `token_ids [B]`
        the new tokens, `positions [3, B]` their mRoPE positions, `seq_lens [B]` the lengths
        including the new token (its K/V go to slot `seq_len - 1`).
        """
        c = self.config
        batch = int(token_ids.shape[0])
        block_size = kv.shape[3]
        x = self.embed_tokens[token_ids]
        cos, sin = rotary_cos_sin(positions, self.inv_freq, self.freq_axis, x.dtype)
        rows = torch.arange(batch, device=block_tables.device)
        last = seq_lens - 1
        blocks = block_tables[rows, last // block_size]
        offsets = last % block_size
        # Keep only as many blocks as the longest sequence needs.
        width = (int(seq_lens.max()) + block_size - 1) // block_size
        flat = block_tables[:, :width].reshape(-1)
        span = width * block_size
        mask = torch.arange(span, device=seq_lens.device).unsqueeze(0) < seq_lens.unsqueeze(1)
        mask = mask.view(batch, 1, 1, span)
        heads = c.num_key_value_heads
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.input_norm, c.rms_norm_eps)
            q, k, v = self._qkv(layer, h, cos, sin)
            kv[blocks, i, 0, offsets] = k
            kv[blocks, i, 1, offsets] = v
            # [B, KV, span, D] views of one copy each; SDPA takes the strides as they are.
            keys = kv[:, i, 0].index_select(0, flat).view(batch, span, heads, -1).transpose(1, 2)
            values = kv[:, i, 1].index_select(0, flat).view(batch, span, heads, -1).transpose(1, 2)
            attn = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True
            )
            x = self._finish_layer(layer, x, attn.reshape(batch, -1))
        return self.logits(x)
