"""The C decode-attention kernel (`common.models.native_kernels`): torch's attention to
float rounding, a sequence's bits independent of the rest of the batch and of the thread
count, the build cache, and the fallback when no kernel can be built."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.models import native_kernels
from common.models.native_kernels import DecodeAttentionKernel, decode_attention_kernel
from common.models.qwen3_vl.attention import DecodeAttention, decode_attention
from common.models.qwen3_vl.text_ops import length_mask


@pytest.fixture(scope="module")
def kernel() -> DecodeAttentionKernel:
    built = decode_attention_kernel()
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
def test_kernel_is_torchs_attention_to_rounding(
    kernel: DecodeAttentionKernel, seed: int, batch: int, kv: int, group: int, dim: int, span: int
) -> None:
    q, k, v, lengths = _case(seed, batch, kv, group, dim, span)
    assert DecodeAttentionKernel.usable(q, k, v)
    want = decode_attention(
        q.double(), k.double(), v.double(), length_mask(lengths, span, torch.float64)
    )
    got = kernel(q, k, v, lengths)
    torch_float = decode_attention(q, k, v, length_mask(lengths, span, torch.float32))
    # no further from float64 than torch's own float32 kernel is, give or take rounding
    assert (got.double() - want).abs().max() <= 2 * (torch_float.double() - want).abs().max() + 1e-6


def test_a_sequences_output_is_the_same_bits_alone_split_or_threaded(
    kernel: DecodeAttentionKernel,
) -> None:
    q, k, v, lengths = _case(7, 32, 2, 2, 64, 200)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = kernel(q, k, v, lengths)
        torch.set_num_threads(3)  # splits the batch across 3 threads (large enough)
        assert native_kernels.PARALLEL_WORK <= 32 * 2 * 200 * 64
        split = kernel(q, k, v, lengths)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, split)
    for b in (0, 5, 31):
        n = int(lengths[b])
        alone = kernel(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], None)
        assert torch.equal(alone, whole[b : b + 1])


def test_all_positions_without_lengths(kernel: DecodeAttentionKernel) -> None:
    q, k, v, _ = _case(3, 4, 2, 2, 64, 50)
    full = torch.full((4,), 50, dtype=torch.int64)
    assert torch.equal(kernel(q, k, v, None), kernel(q, k, v, full))


def test_too_many_query_heads_per_key_head_are_refused(kernel: DecodeAttentionKernel) -> None:
    q, k, v, _ = _case(1, 2, 1, 16, 16, 10)
    wide = torch.cat((q, q), dim=1)  # 32 query heads over 1 key head
    assert not DecodeAttentionKernel.usable(wide, k, v)
    with pytest.raises(ValueError, match="query heads per key head"):
        kernel(wide, k, v, None)


def test_unusable_tensors_go_to_torch(kernel: DecodeAttentionKernel) -> None:
    q, k, v, lengths = _case(2, 3, 2, 2, 64, 40)
    assert not DecodeAttentionKernel.usable(q.double(), k.double(), v.double())
    assert not DecodeAttentionKernel.usable(q, k.transpose(2, 3), v.transpose(2, 3))
    plan = DecodeAttention(lengths, lengths.tolist(), 40, torch.float64)
    assert plan.kernel is None and plan.mask is not None
    want = decode_attention(q.double(), k.double(), v.double(), plan.mask)
    assert torch.equal(plan(q.double(), k.double(), v.double()), want)


def test_a_plan_for_the_kernel_still_answers_tensors_it_does_not_take(
    kernel: DecodeAttentionKernel,
) -> None:
    q, k, v, lengths = _case(4, 3, 2, 2, 64, 40)
    plan = DecodeAttention(lengths, lengths.tolist(), 40, torch.float32)
    assert plan.kernel is kernel and plan.mask is None
    odd = k.transpose(2, 3).contiguous().transpose(2, 3)  # last dimension strided
    got = plan(q, odd, v)  # torch's kernel, under the mask of the plan's lengths
    assert torch.equal(got, decode_attention(q, odd, v, length_mask(lengths, 40, torch.float32)))


def test_lengths_outside_the_span_are_refused() -> None:
    with pytest.raises(ValueError, match="decode lengths"):
        DecodeAttention(torch.tensor([0, 3]), [0, 3], 3, torch.float32)
    with pytest.raises(ValueError, match="decode lengths"):
        DecodeAttention(torch.tensor([4, 3]), [4, 3], 3, torch.float32)


def test_the_build_is_cached_by_source_and_flags(
    kernel: DecodeAttentionKernel, tmp_path: Path
) -> None:
    first = native_kernels._build(native_kernels.SOURCE, tmp_path)
    assert first is not None and first.is_file()
    assert native_kernels._build(native_kernels.SOURCE, tmp_path) == first  # reused
    changed = tmp_path / "src" / "decode_attention.c"
    changed.parent.mkdir()
    changed.write_text(native_kernels.SOURCE.read_text() + "\n/* another build */\n")
    other = native_kernels._build(changed, tmp_path)
    assert other is not None and other != first
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".so") == sorted(
        [first.name, other.name]
    )  # no temporary files left


def test_no_compiler_or_a_failed_build_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "decode_attention.c"
    broken.write_text("this is not C")
    with caplog.at_level(logging.WARNING, logger=native_kernels.__name__):
        assert native_kernels._build(broken, tmp_path / "cache") is None
    assert "building decode_attention.c failed" in caplog.text
    assert not any((tmp_path / "cache").iterdir())  # the failed output was removed
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    assert native_kernels._build(native_kernels.SOURCE, tmp_path / "cache") is None


def test_the_kernel_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_NATIVE_KERNELS", "0")
    decode_attention_kernel.cache_clear()
    try:
        assert decode_attention_kernel() is None
        plan = DecodeAttention(torch.tensor([2, 3]), [2, 3], 3, torch.float32)
        assert plan.kernel is None and plan.mask is not None
    finally:
        monkeypatch.delenv("EPD_NATIVE_KERNELS")
        decode_attention_kernel.cache_clear()
