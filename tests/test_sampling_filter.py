"""The sampler's fast paths give exactly what sorting every row gave.

`apply_top_k_top_p` ranks only a row's top k tokens when it has a top_k, and leaves rows
without filters alone; the references below are the sort-everything versions it replaced
(`reference_filter`, `reference_sample`). Seeded rows must draw the same tokens as before
(a stream resumed on a worker of another version draws what the first would have);
unseeded rows draw from torch's global generator in one block, and must still follow the
distribution.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.sampling import Sampler, SamplingParams, apply_top_k_top_p, draw_seed


def reference_filter(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k then top-p over a stable descending sort of every whole row."""
    batch, vocab = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab).expand(batch, vocab)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], -math.inf)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    p = torch.where(top_p < 1.0, top_p, math.inf).to(probs.dtype)
    drop = (before >= p[:, None]) & (rank > 0)
    sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
    return torch.full_like(logits, -math.inf).scatter(1, order, sorted_logits)


def reference_sample(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
) -> torch.Tensor:
    """Seeded rows only: filter every row, then the exponential race per row."""
    tokens = logits.max(dim=-1).indices
    for i, p in enumerate(params):
        if p.is_greedy:
            continue
        assert p.seed is not None
        scaled = logits[i : i + 1].float() / p.temperature
        probs = reference_filter(scaled, torch.tensor([p.top_k]), torch.tensor([p.top_p]))
        generator = torch.Generator().manual_seed(draw_seed(p.seed, positions[i]))
        race = torch.empty(logits.shape[1]).exponential_(generator=generator)
        tokens[i] = (probs.softmax(dim=-1)[0] / race).argmax()
    return tokens


# Values from a small set, so rows hold ties (at the top-k bound too), -0.0 beside 0.0 and
# infinities.
VALUES = st.sampled_from([-math.inf, -2.0, -0.5, -0.0, 0.0, 0.25, 0.5, 1.0, 3.0, math.inf])


@st.composite
def rows(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    vocab = draw(st.integers(1, 24))
    batch = draw(st.integers(1, 5))
    values = draw(
        st.lists(st.lists(VALUES, min_size=vocab, max_size=vocab), min_size=batch, max_size=batch)
    )
    logits = torch.tensor(values, dtype=torch.float32)
    logits += torch.randn(batch, vocab, generator=torch.Generator().manual_seed(vocab)) * draw(
        st.sampled_from([0.0, 1.0])
    )
    top_k = torch.tensor(draw(st.lists(st.integers(0, vocab + 2), min_size=batch, max_size=batch)))
    top_p = torch.tensor(
        draw(
            st.lists(
                st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.3, 0.01]), min_size=batch, max_size=batch
            )
        )
    )
    return logits, top_k, top_p


@settings(max_examples=300, deadline=None)
@given(rows())
def test_filter_equals_sorting_every_row(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    logits, top_k, top_p = case
    assert torch.equal(
        apply_top_k_top_p(logits, top_k, top_p), reference_filter(logits, top_k, top_p)
    )


def test_filter_of_a_row_with_nan_falls_back_to_the_sort() -> None:
    logits = torch.tensor([[0.5, math.nan, 2.0, 1.0, -1.0], [3.0, 2.0, 1.0, 0.0, -1.0]])
    got = apply_top_k_top_p(logits, torch.tensor([2, 2]), torch.tensor([1.0, 1.0]))
    want = reference_filter(logits, torch.tensor([2, 2]), torch.tensor([1.0, 1.0]))
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_seeded_draws_equal_the_sort_everything_sampler() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 1536, generator=generator) * 2
    logits[3, :40] = logits[3, 40]  # ties across the top-k bound
    # (temperature, top_p, top_k): plain, Qwen's defaults, top-k alone, top-p alone,
    # greedy, a top_k past the vocabulary
    settings_ = [
        (1.0, 1.0, 0),
        (0.7, 0.8, 20),
        (1.3, 1.0, 5),
        (0.9, 0.5, 0),
        (0.0, 1.0, 0),
        (2.0, 1.0, 3000),
    ]
    for step in range(4):
        params = [
            SamplingParams(
                temperature=settings_[i % 6][0],
                top_p=settings_[i % 6][1],
                top_k=int(settings_[i % 6][2]),
                seed=100 + i,
            )
            for i in range(12)
        ]
        positions = [50 + step + i for i in range(12)]
        got = Sampler().sample(logits, params, positions)
        assert torch.equal(got, reference_sample(logits, params, positions))


def test_unseeded_rows_follow_the_distribution_drawn_in_one_block() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = probs.log().expand(6000, 4).contiguous()
    torch.manual_seed(0)
    drawn = Sampler().sample(logits, [SamplingParams(temperature=1.0)] * 6000, [7] * 6000)
    counts = torch.bincount(drawn, minlength=4) / 6000
    assert counts[3] == 0  # a token of probability 0 is never drawn
    assert torch.allclose(counts, probs, atol=0.03)
    # The same with a top_p that keeps the first two (renormalized to 2/3, 1/3).
    params = [SamplingParams(temperature=1.0, top_p=0.7)] * 6000
    counts = torch.bincount(Sampler().sample(logits, params, [7] * 6000), minlength=4) / 6000
    assert torch.allclose(counts, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]), atol=0.03)
