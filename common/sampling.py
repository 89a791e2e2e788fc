"""Per-request sampling parameters, the batch sampler and the stop rule.

Sampling a row: greedy rows (temperature 0, or top_k 1) take the argmax of the raw
logits. Other rows divide by the temperature, keep the top_k highest logits (0 = all),
then keep the smallest set of the remaining tokens, highest probability first, whose
probability reaches top_p (the top token always stays), and draw from what is left.

The draw is an exponential race: token = argmax(p_i / q_i) with q_i ~ Exp(1) drawn from the
row's own generator, which picks token i with probability p_i. Each sampled row consumes
exactly `vocab` exponential draws from its generator regardless of the other rows, so a
seeded request yields the same tokens alone or in any batch.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens and when it stops. Validated on construction."""

    # 0.0 means greedy; otherwise logits are divided by it before sampling.
    temperature: float = 0.0
    # Nucleus: keep the smallest top set whose probability reaches top_p (1.0 = off).
    top_p: float = 1.0
    # Keep only the top_k highest logits (0 = off).
    top_k: int = 0
    # Seed of the request's own generator; None draws from torch's global generator.
    seed: int | None = None
    # Most tokens to generate (the prefill's first token included).
    max_tokens: int = 16
    # Tokens that end the request (reported as "stop"; the token is kept in the output).
    stop_token_ids: tuple[int, ...] = ()
    # Keep generating past the model's end-of-sequence token.
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        stop = tuple(self.stop_token_ids)
        if not all(_is_int(t) and t >= 0 for t in stop):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the row takes the argmax (no randomness is drawn)."""
        return self.temperature == 0.0 or self.top_k == 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator for `seed` (None for an unseeded request).

    Create it once per request and pass it to every `Sampler.sample` call of that request.
    """
    if seed is None:
        return None
    import torch

    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Logits with filtered-out tokens set to -inf, row by row.

    `logits` `[batch, vocab]` (already temperature-scaled), `top_k` `[batch]` ints
    (0 = off), `top_p` `[batch]` floats (1.0 = off). Top-k keeps exactly k tokens (ties
    broken by a stable sort, lower id first); top-p then keeps the smallest prefix of the
    remaining tokens, by descending probability, whose probability sum reaches top_p.
    """
    batch, vocab = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    import torch

    rank = torch.arange(vocab, device=logits.device).expand(batch, vocab)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab).to(logits.device)
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], -math.inf)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability of the strictly higher-ranked tokens
    # top_p == 1 is "off": float rounding must not drop tail tokens then.
    p = torch.where(top_p < 1.0, top_p, math.inf).to(logits.device, probs.dtype)
    drop = (before >= p[:, None]) & (rank > 0)
    sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
    return torch.full_like(logits, -math.inf).scatter(1, order, sorted_logits)


class Sampler:
    """Picks the next token of every row of a batch. Stateless; the randomness lives in
    the per-request generators the caller owns (advanced by each sampled row)."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """Token ids `[batch]` (int64, on `logits`' device) for `logits` `[batch, vocab]`.

        Row `i` follows `params[i]` and draws from `generators[i]` (torch's global
        generator when None). Greedy rows draw nothing.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got {tuple(logits.shape)}")
        batch, vocab = logits.shape
        if len(params) != batch or len(generators) != batch:
            raise ValueError(
                f"{batch} logit rows, {len(params)} params, {len(generators)} generators"
            )
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not rows:
            return tokens
        import torch

        device = logits.device
        index = torch.tensor(rows, device=device)
        temperature = torch.tensor([params[i].temperature for i in rows], device=device)
        top_k = torch.tensor([params[i].top_k for i in rows], device=device)
        top_p = torch.tensor([params[i].top_p for i in rows], device=device)
        scaled = logits[index].float() / temperature[:, None]
        probs = apply_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)
        race = torch.empty(len(rows), vocab, dtype=torch.float32, device=device)
        for j, i in enumerate(rows):
            race[j] = _exponential(vocab, generators[i]).to(device)
        tokens[index] = (probs / race).argmax(dim=-1)
        return tokens


def _exponential(vocab: int, generator: torch.Generator | None) -> torch.Tensor:
    import torch

    device = generator.device if generator is not None else torch.device("cpu")
    return torch.empty(vocab, dtype=torch.float32, device=device).exponential_(generator=generator)


def finish_reason(
    params: SamplingParams,
    token_id: int,
    num_output_tokens: int,
    eos_token_ids: Collection[int] = (),
) -> FinishReason | None:
    """Why a request ends after emitting `token_id`, or None to continue.

    `num_output_tokens` counts the generated tokens including `token_id`. A stop token, or
    an EOS token unless `ignore_eos`, gives "stop" (checked first); reaching `max_tokens`
    gives "length".
    """
    if token_id in params.stop_token_ids:
        return "stop"
    if not params.ignore_eos and token_id in eos_token_ids:
        return "stop"
    if num_output_tokens >= params.max_tokens:
        return "length"
    return None


@dataclass(frozen=True, slots=True)
class StopChecker:
    """`finish_reason` bound to a model's end-of-sequence token ids."""

    # The model's EOS token ids (generation_config may list several).
    eos_token_ids: frozenset[int] = frozenset()

    def check(
        self, params: SamplingParams, token_id: int, num_output_tokens: int
    ) -> FinishReason | None:
        """See `finish_reason`."""
        return finish_reason(params, token_id, num_output_tokens, self.eos_token_ids)
