"""One decoder layer's weights of the text model (`text.TextModel`), fused at load."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from common.models.qwen3_vl.linear import Dense


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's weights, with q/k/v and gate/up fused for fewer GEMMs.

    Projections are `linear.Dense`: the weight transposed (`[in, out]` contiguous) for one
    row, where a GEMM with the weight in that layout is about a quarter faster on CPU than
    `F.linear` with the checkpoint's `[out, in]`; oneDNN's packed copy for more rows."""

    input_norm: torch.Tensor
    qkv: Dense
    qk_norm: torch.Tensor  # [H + KV, D]: q_norm for each query head, k_norm for each key head
    o_proj: Dense
    post_norm: torch.Tensor
    gate_up: Dense
    down: Dense

    @classmethod
    def load(
        cls, w: Mapping[str, torch.Tensor], p: str, heads: int, kv_heads: int, *, packed: bool
    ) -> LayerWeights:
        """Layer `p` (e.g. `layers.0.`) from checkpoint tensors named without the language
        model's prefix, fused and transposed (`packed`: with oneDNN copies, `Dense`)."""
        a = p + "self_attn."
        biases = [w.get(f"{a}{n}_proj.bias") for n in "qkv"]
        qkv_bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
        return cls(
            input_norm=w[p + "input_layernorm.weight"],
            qkv=Dense.of(
                torch.cat([w[f"{a}{n}_proj.weight"] for n in "qkv"]), qkv_bias, packed=packed
            ),
            qk_norm=torch.cat(
                [
                    w[a + "q_norm.weight"].expand(heads, -1),
                    w[a + "k_norm.weight"].expand(kv_heads, -1),
                ]
            ),
            o_proj=Dense.of(w[a + "o_proj.weight"], w.get(a + "o_proj.bias"), packed=packed),
            post_norm=w[p + "post_attention_layernorm.weight"],
            gate_up=Dense.of(
                torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
                packed=packed,
            ),
            down=Dense.of(w[p + "mlp.down_proj.weight"], packed=packed),
        )
