"""The C kernels (`common.models.native_kernels`): decode attention, RMSNorm (alone and with
RoPE) and silu(gate) * up equal to torch's to float rounding, a sequence's attention bits
independent of the rest of the batch and of the thread count (their build: test_native_build)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from common.engine import Engine
from common.models import native_kernels as native
from common.models.native_kernels import NativeKernels, native_kernels
from common.models.qwen3_vl import attention as attention_module
from common.models.qwen3_vl import text_ops as text_ops_module
from common.models.qwen3_vl.attention import DecodeAttention, decode_attention
from common.models.qwen3_vl.text_ops import length_mask, rotate, signed_sin
from common.multimodal.params import MultimodalParams
from common.sampling import SamplingParams
from tests.model_fixtures import write_tiny_checkpoint


@pytest.fixture(scope="module")
def kernel() -> NativeKernels:
    built = native_kernels()
    if built is None:
        pytest.skip("no C compiler here: the kernel is not built (torch's is used)")
    return built


def _case(
    seed: int, batch: int, kv: int, group: int, dim: int, span: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    # keys and values as running K/V rows: a [B, KV, capacity, D] buffer read up to `span`
    capacity = span + 5
    k = torch.randn(batch, kv, capacity, dim, generator=g)[:, :, :span] * 2
    v = torch.randn(batch, kv, capacity, dim, generator=g)[:, :, :span]
    q = torch.randn(batch, kv * group, dim, generator=g) * 2
    lengths = torch.randint(1, span + 1, (batch,), generator=g)
    lengths[0] = span
    return q, k, v, lengths


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    batch=st.integers(1, 6),
    kv=st.integers(1, 4),
    group=st.sampled_from([1, 2, 3, 4, 8, 16]),
    dim=st.sampled_from([8, 16, 64, 80, 128]),
    span=st.integers(1, 300),
)
@example(seed=1, batch=1, kv=2, group=4, dim=128, span=2)  # values to 3.2: rounding scales
def test_kernel_is_torchs_attention_to_rounding(
    kernel: NativeKernels, seed: int, batch: int, kv: int, group: int, dim: int, span: int
) -> None:
    q, k, v, lengths = _case(seed, batch, kv, group, dim, span)
    assert NativeKernels.attention_takes(q, k, v)
    want = decode_attention(
        q.double(), k.double(), v.double(), length_mask(lengths, span, torch.float64)
    )
    got = kernel.decode_attention(q, k, v, lengths)
    torch_float = decode_attention(q, k, v, length_mask(lengths, span, torch.float32))
    # no further from float64 than torch's own float32 kernel is, give or take the rounding
    # of a float32 sum over the span, as large as the values summed (seed 94, dim 8, span
    # 158: 2.1e-6 against torch's 4e-7, past a flat 1e-6; seed 1, span 2, values to 3.4:
    # 1.02e-6 against 1.01e-6, past a bound not scaled by them)
    rounding = span * torch.finfo(torch.float32).eps * max(1.0, v.abs().max().item())
    assert (got.double() - want).abs().max() <= 2 * (
        torch_float.double() - want
    ).abs().max() + rounding


def test_a_sequences_output_is_the_same_bits_alone_split_or_threaded(
    kernel: NativeKernels,
) -> None:
    q, k, v, lengths = _case(7, 32, 2, 2, 64, 200)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = kernel.decode_attention(q, k, v, lengths)
        torch.set_num_threads(3)  # splits the batch across 3 threads (large enough)
        assert native.PARALLEL_WORK <= 32 * 2 * 200 * 64
        split = kernel.decode_attention(q, k, v, lengths)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, split)
    for b in (0, 5, 31):
        n = int(lengths[b])
        alone = kernel.decode_attention(
            q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], None
        )
        assert torch.equal(alone, whole[b : b + 1])


def test_all_positions_without_lengths(kernel: NativeKernels) -> None:
    q, k, v, _ = _case(3, 4, 2, 2, 64, 50)
    full = torch.full((4,), 50, dtype=torch.int64)
    assert torch.equal(
        kernel.decode_attention(q, k, v, None), kernel.decode_attention(q, k, v, full)
    )


def test_too_many_query_heads_per_key_head_are_refused(kernel: NativeKernels) -> None:
    q, k, v, _ = _case(1, 2, 1, 16, 16, 10)
    wide = torch.cat((q, q), dim=1)  # 32 query heads over 1 key head
    assert not NativeKernels.attention_takes(wide, k, v)
    with pytest.raises(ValueError, match="query heads per key head"):
        kernel.decode_attention(wide, k, v, None)


def test_unusable_tensors_go_to_torch(kernel: NativeKernels) -> None:
    q, k, v, lengths = _case(2, 3, 2, 2, 64, 40)
    assert not NativeKernels.attention_takes(q.double(), k.double(), v.double())
    assert not NativeKernels.attention_takes(q, k.transpose(2, 3), v.transpose(2, 3))
    plan = DecodeAttention(lengths, lengths.tolist(), 40, torch.float64)
    assert plan.kernels is None and plan.mask is not None
    want = decode_attention(q.double(), k.double(), v.double(), plan.mask)
    assert torch.equal(plan(q.double(), k.double(), v.double()), want)


def test_a_plan_for_the_kernel_still_answers_tensors_it_does_not_take(
    kernel: NativeKernels,
) -> None:
    q, k, v, lengths = _case(4, 3, 2, 2, 64, 40)
    plan = DecodeAttention(lengths, lengths.tolist(), 40, torch.float32)
    assert plan.kernels is kernel and plan.mask is None
    odd = k.transpose(2, 3).contiguous().transpose(2, 3)  # last dimension strided
    got = plan(q, odd, v)  # torch's kernel, under the mask of the plan's lengths
    assert torch.equal(got, decode_attention(q, odd, v, length_mask(lengths, 40, torch.float32)))


def test_keys_other_than_the_planned_span_are_refused(kernel: NativeKernels) -> None:
    q, k, v, lengths = _case(5, 3, 2, 2, 16, 40)
    plan = DecodeAttention(lengths, lengths.tolist(), 40, torch.float32)
    short_k, short_v = k[:, :, :30], v[:, :, :30]  # the C code would read past them
    with pytest.raises(ValueError, match="planned 40"):
        plan(q, short_k, short_v)


def test_lengths_outside_the_span_are_refused() -> None:
    with pytest.raises(ValueError, match="decode lengths"):
        DecodeAttention(torch.tensor([0, 3]), [0, 3], 3, torch.float32)
    with pytest.raises(ValueError, match="decode lengths"):
        DecodeAttention(torch.tensor([4, 3]), [4, 3], 3, torch.float32)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    rows=st.integers(1, 40),
    heads=st.sampled_from([0, 1, 3, 6]),  # 0: x is [rows, dim]
    dim=st.sampled_from([1, 7, 16, 64, 256]),
    per_head=st.booleans(),
    view=st.booleans(),
)
def test_rms_norm_is_torchs_to_rounding(
    kernel: NativeKernels,
    seed: int,
    rows: int,
    heads: int,
    dim: int,
    per_head: bool,
    view: bool,
) -> None:
    g = torch.Generator().manual_seed(seed)
    shape = (rows, dim) if heads == 0 else (rows, heads, dim)
    base = torch.randn(rows, (max(heads, 1) + 2) * dim, generator=g) * 5
    x = base[:, : max(heads, 1) * dim].view(shape) if view else torch.randn(shape, generator=g)
    weight = torch.randn(shape[1:] if per_head and heads else (dim,), generator=g)
    assert NativeKernels.rms_norm_takes(x, weight)
    got = kernel.rms_norm(x, weight, 1e-6)
    scale = torch.mean(x.double() ** 2, -1, keepdim=True).add(1e-6).rsqrt()
    want = x.double() * scale * weight.double()
    assert got.shape == x.shape and got.is_contiguous()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def test_rms_norm_takes_only_what_it_can_read(kernel: NativeKernels) -> None:
    x, w = torch.randn(4, 3, 8), torch.randn(8)
    assert NativeKernels.rms_norm_takes(x, w) and NativeKernels.rms_norm_takes(x, torch.randn(3, 8))
    assert not NativeKernels.rms_norm_takes(x.double(), w.double())
    assert not NativeKernels.rms_norm_takes(x.transpose(1, 2), w)  # last dim strided
    assert not NativeKernels.rms_norm_takes(x, torch.randn(4))  # wrong width
    assert not NativeKernels.rms_norm_takes(x, torch.randn(8, 2)[:, 0])  # weight strided
    assert not NativeKernels.rms_norm_takes(torch.randn(8), w)  # 1-D
    assert not NativeKernels.rms_norm_takes(torch.randn(2, 4, 3, 8), w)  # 4-D


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    rows=st.integers(1, 40),
    heads=st.integers(1, 8),
    dim=st.sampled_from([2, 16, 64, 128]),
    unsqueezed=st.booleans(),
)
def test_rms_norm_rotate_is_torchs_to_rounding(
    kernel: NativeKernels, seed: int, rows: int, heads: int, dim: int, unsqueezed: bool
) -> None:
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, (heads + 2) * dim, generator=g) * 3
    x = qkv[:, : heads * dim].unflatten(-1, (heads, dim))  # strided, as the fused q/k heads
    weight = torch.randn(heads, dim, generator=g)
    angle = torch.randn(rows, dim, generator=g) * 4
    cos, ssin = angle.cos(), signed_sin(angle.sin())
    if unsqueezed:
        cos, ssin = cos.unsqueeze(1), ssin.unsqueeze(1)
    assert NativeKernels.rms_norm_rotate_takes(x, weight, cos, ssin)
    got = kernel.rms_norm_rotate(x, weight, 1e-6, cos, ssin)
    c, s = (t.double().view(rows, 1, dim) for t in (cos, ssin))
    want = rotate(kernel.rms_norm(x, weight, 1e-6).double(), c, s)
    assert got.shape == x.shape
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def test_rms_norm_rotate_takes_only_what_it_can_read() -> None:
    x, w, t = torch.randn(4, 3, 8), torch.randn(3, 8), torch.randn(4, 1, 8)
    assert NativeKernels.rms_norm_rotate_takes(x, w, t, t)
    assert not NativeKernels.rms_norm_rotate_takes(torch.randn(4, 3, 7), torch.randn(7), t, t)
    assert not NativeKernels.rms_norm_rotate_takes(x.view(12, 8), torch.randn(8), t, t)  # 2-D
    assert not NativeKernels.rms_norm_rotate_takes(x, w, torch.randn(3, 1, 8), t)  # rows
    assert not NativeKernels.rms_norm_rotate_takes(x, w, t, torch.randn(4, 2, 8)[:, :1])
    assert not NativeKernels.rms_norm_rotate_takes(x, w, t.double(), t)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    rows=st.integers(1, 40),
    width=st.integers(1, 300),
    scale=st.sampled_from([1.0, 10.0, 100.0]),
)
def test_silu_mul_is_torchs_to_rounding(
    kernel: NativeKernels, seed: int, rows: int, width: int, scale: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * width + 3, generator=g)[:, : 2 * width] * scale  # strided
    assert NativeKernels.silu_mul_takes(gate_up)
    got = kernel.silu_mul(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    assert got.shape == (rows, width) and torch.isfinite(got).all()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * scale)


def test_silu_mul_takes_only_what_it_can_read() -> None:
    assert NativeKernels.silu_mul_takes(torch.randn(3, 8))
    assert not NativeKernels.silu_mul_takes(torch.randn(3, 7))
    assert not NativeKernels.silu_mul_takes(torch.randn(8, 3).t())
    assert not NativeKernels.silu_mul_takes(torch.randn(3, 8).double())
    assert not NativeKernels.silu_mul_takes(torch.randn(2, 3, 8))


def _bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal as bfloat16 values up to a unit or two in their last place (8 bits of mantissa:
    the kernels sum in another order than torch, and each bfloat16 rounding can then flip)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    g, w = got.double(), want.double()
    assert ((g - w).abs() <= w.abs() * 2**-7 + 1e-6).all()
    assert (got == want).double().mean() > 0.9  # mostly the very same bits


@pytest.mark.parametrize("heads", [1, 4])
def test_bfloat16_rms_norm_rounds_as_torchs_ops(kernel: NativeKernels, heads: int) -> None:
    g = torch.Generator().manual_seed(heads)
    x = (torch.randn(33, heads, 128, generator=g) * 3).to(torch.bfloat16)
    weight = torch.randn(heads, 128, generator=g).to(torch.bfloat16)
    want = weight * torch.nn.functional.rms_norm(x.float(), (128,), eps=1e-6).to(torch.bfloat16)
    _bf16_close(kernel.rms_norm(x, weight, 1e-6), want)
    angle = torch.randn(33, 1, 128, generator=g)
    cos, ssin = angle.cos().to(torch.bfloat16), signed_sin(angle.sin()).to(torch.bfloat16)
    assert NativeKernels.rms_norm_rotate_takes(x, weight, cos, ssin)
    _bf16_close(kernel.rms_norm_rotate(x, weight, 1e-6, cos, ssin), rotate(want, cos, ssin))


def test_bfloat16_silu_mul_rounds_as_torchs_ops(kernel: NativeKernels) -> None:
    g = torch.Generator().manual_seed(9)
    gate_up = (torch.randn(17, 600, generator=g) * 4).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    _bf16_close(kernel.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)


def test_bfloat16_decode_attention_is_torchs_to_its_precision(kernel: NativeKernels) -> None:
    q, k, v, lengths = _case(11, 8, 2, 4, 64, 150)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    assert NativeKernels.attention_takes(q, k, v)
    got = kernel.decode_attention(q, k, v, lengths)
    mask = length_mask(lengths, 150, torch.float64)
    exact = decode_attention(q.double(), k.double(), v.double(), mask)
    torchs = decode_attention(q, k, v, length_mask(lengths, 150, torch.bfloat16))
    assert got.dtype == torch.bfloat16
    # no further from float64 than torch's own bfloat16 kernel, within a rounding of bfloat16
    assert (got.double() - exact).abs().max() <= (torchs.double() - exact).abs().max() + 2**-8
    assert NativeKernels.attention_takes(q, k, v) and not NativeKernels.attention_takes(
        q, k.float(), v
    )


def _use(kernels: NativeKernels | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the text model find `kernels` (None: torch's ops) where it looks them up."""
    monkeypatch.setattr(attention_module, "native_kernels", lambda: kernels)
    monkeypatch.setattr(text_ops_module, "native_kernels", lambda: kernels)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_the_engines_decode_with_and_without_the_kernels_agree(
    kernel: NativeKernels,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    dtype: torch.dtype,
    tolerance: float,
) -> None:
    """Through the real model (prefill with RMSNorm, RoPE and silu, decode attention over the
    running rows of a batch with different lengths): the first decode step's logits with the
    kernels equal torch's ops' to the dtype's rounding."""
    engine = Engine.from_pretrained(
        write_tiny_checkpoint(tmp_path / "ckpt", size="small"), dtype=dtype, num_blocks=256
    )
    empty = MultimodalParams((), {}, 0)
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    model = engine.runner.model
    original = model.logits

    def first_step_logits(kernels: NativeKernels | None) -> torch.Tensor:
        _use(kernels, monkeypatch)
        seqs = [
            engine.prefill([(7 * i + 3 * j) % 900 + 5 for j in range(40 + 9 * i)], empty, sampling)
            for i in range(3)
        ]
        assert len({s.num_computed for s in seqs}) == 3  # the batch's lengths differ
        captured: list[torch.Tensor] = []

        def logits(hidden: torch.Tensor) -> torch.Tensor:
            captured.append(original(hidden))
            return captured[-1]

        monkeypatch.setattr(model, "logits", logits)
        try:
            engine.decode_step(seqs)
        finally:
            monkeypatch.setattr(model, "logits", original)
        for seq in seqs:
            engine.release(seq)
        return captured[0].float()

    want, got = first_step_logits(None), first_step_logits(kernel)
    assert (got - want).abs().max() <= tolerance * want.abs().max()
