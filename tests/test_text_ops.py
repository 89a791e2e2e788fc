"""`common.models.qwen3_vl.text_ops.rms_norm` computes the reference's RMSNorm bit for bit
(transformers' Qwen3-VL arithmetic: float32 variance of squares, rsqrt of it plus eps,
scale, weight times the result), for weights over the last dimension or broadcast over
trailing ones (the fused q/k norm), contiguous or strided input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.models.qwen3_vl.text_ops import rms_norm


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(x.dtype)


@pytest.mark.parametrize("rows", [1, 7, 32, 513])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_equals_the_reference_and_the_fused_op(rows: int, eps: float) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=gen) * 3
    weight = torch.randn(256, generator=gen)
    got = rms_norm(x, weight, eps)
    assert torch.equal(got, reference(x, weight, eps))
    assert torch.equal(got, F.rms_norm(x, (256,), weight, eps))


def test_strided_heads_with_a_broadcast_weight() -> None:
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(32, 512, generator=gen)
    heads = qkv[:, :384].unflatten(-1, (6, 64))  # q and k heads of a fused projection
    weight = torch.randn(6, 64, generator=gen)  # per-head norm weights
    assert not heads.is_contiguous()
    assert torch.equal(rms_norm(heads, weight, 1e-6), reference(heads, weight, 1e-6))


def test_bfloat16_normalizes_in_float32() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 128, generator=gen).to(torch.bfloat16)
    weight = torch.randn(128, generator=gen).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, weight, 1e-6), reference(x, weight, 1e-6))
