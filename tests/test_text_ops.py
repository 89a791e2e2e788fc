"""`common.models.qwen3_vl.text_ops.rms_norm` on torch's ops (where the C kernel of
`common.models.native_kernels` is not built or not taken; that one is the same to float
rounding, tests/test_native_kernels.py) computes the reference's RMSNorm bit for bit
(transformers' Qwen3-VL arithmetic: float32 variance of squares, rsqrt of it plus eps,
scale, weight times the result), for weights over the last dimension or broadcast over
trailing ones (the fused q/k norm), contiguous or strided input; attention given the
`additive` bias of a mask (made once per forward or step) gives the bits it gives the mask,
in the shapes prefill and decode pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.models.qwen3_vl import text_ops
from common.models.qwen3_vl.text_ops import additive, length_mask, rms_norm


@pytest.fixture(autouse=True)
def torch_ops_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """`rms_norm` as it runs without the C kernels."""
    monkeypatch.setattr(text_ops, "native_kernels", lambda: None)


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


@pytest.mark.parametrize(
    ("q_shape", "kv_shape", "mask_shape"),
    [
        ((1, 6, 256, 64), (1, 2, 512, 64), (256, 512)),  # a split causal call's second half
        ((1, 4, 37, 16), (1, 2, 300, 16), (37, 300)),  # a segment over a cached prefix
        ((32, 2, 3, 64), (32, 2, 90, 64), (32, 1, 1, 90)),  # decode, heads grouped per key
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_with_the_additive_bias_equals_the_mask(q_shape, kv_shape, mask_shape, dtype):
    gen = torch.Generator().manual_seed(len(mask_shape))
    q = torch.randn(q_shape, generator=gen).to(dtype)
    k, v = (torch.randn(kv_shape, generator=gen).to(dtype) for _ in range(2))
    mask = torch.rand(mask_shape, generator=gen) < 0.7
    mask[..., 0] = True  # no row without a key
    gqa = q_shape[1] != kv_shape[1]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=additive(mask, dtype), enable_gqa=gqa)
    assert torch.equal(got, want)


def test_length_mask_is_the_bias_of_each_sequences_length() -> None:
    bias = length_mask(torch.tensor([1, 3, 5]), 5, torch.float32)
    assert bias.shape == (3, 1, 1, 5)
    inf = float("-inf")
    assert bias.view(3, 5).tolist() == [
        [0, inf, inf, inf, inf],
        [0, 0, 0, inf, inf],
        [0, 0, 0, 0, 0],
    ]


def test_norm_rotate_and_silu_mul_on_torchs_ops_are_the_two_steps() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 6, 64, generator=gen)
    weight = torch.randn(6, 64, generator=gen)
    angle = torch.randn(5, 1, 64, generator=gen)
    cos, ssin = angle.cos(), text_ops.signed_sin(angle.sin())
    want = text_ops.rotate(rms_norm(x, weight, 1e-6), cos, ssin)
    assert torch.equal(text_ops.norm_rotate(x, weight, 1e-6, cos, ssin), want)
    gate_up = torch.randn(5, 32, generator=gen)
    gate, up = gate_up.clone().chunk(2, dim=-1)
    assert torch.equal(text_ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("wanted", [None, 3])
def test_a_long_segment_with_a_cached_prefix_runs_in_slices_to_the_same_values(
    monkeypatch: pytest.MonkeyPatch, wanted: int | None
) -> None:
    # Its offset-causal mask was made whole: [tokens, tokens] for a long prompt that reused
    # one cached block (1.5 GB at 16k tokens). Past MASK_ELEMENTS its queries run in slices.
    from common.models.qwen3_vl import attention
    from common.models.qwen3_vl.attention import PrefillAttention, SegmentSpan

    torch.manual_seed(0)
    block, start, length, heads, kv, dim = 4, 12, 28, 4, 2, 8
    end = start + length
    table = torch.randperm(12)[: end // block]
    layer_k, layer_v = torch.randn(12, block, kv, dim), torch.randn(12, block, kv, dim)
    q = torch.randn(length, heads, dim)
    fresh = slice(start, end)  # the forward's own K/V, also in the paged buffer
    keys = layer_k[table].flatten(0, 1)
    values = layer_v[table].flatten(0, 1)
    outputs = length if wanted is None else wanted
    span = SegmentSpan(offset=0, start=start, length=length, block_table=table, outputs=outputs)
    args = (q, keys[fresh], values[fresh], layer_k, layer_v)

    whole = PrefillAttention([span], block, torch.float32)
    assert whole.masks  # made once, whole
    expected = whole(*args, wanted_only=wanted is not None)
    monkeypatch.setattr(attention, "MASK_ELEMENTS", 3 * end)  # slices of 3 queries
    sliced = PrefillAttention([span], block, torch.float32)
    assert not sliced.masks
    got = sliced(*args, wanted_only=wanted is not None)
    assert got.shape == expected.shape == (outputs, heads * dim)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # And both are attention over every key up to each query's position, in float64.
    rows = torch.arange(start, end)[length - outputs :]
    reference = torch.stack(
        [
            F.scaled_dot_product_attention(
                q[r - start].double().unsqueeze(1),
                keys[: r + 1].double().repeat_interleave(heads // kv, 1).transpose(0, 1),
                values[: r + 1].double().repeat_interleave(heads // kv, 1).transpose(0, 1),
            ).flatten()
            for r in rows.tolist()
        ]
    )
    torch.testing.assert_close(got.double(), reference, rtol=0, atol=1e-5)
