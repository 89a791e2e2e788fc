"""Per-request sampling parameters, the batch sampler and the stop rule.

Sampling a row: greedy rows (temperature 0, or top_k 1) take the argmax of the raw
logits. Other rows divide by the temperature, keep the top_k highest logits (0 = all),
then keep the smallest set of the remaining tokens, highest probability first, whose
probability reaches top_p (the top token always stays), and draw from what is left.

The draw is an exponential race: token = argmax(p_i / q_i) with q_i ~ Exp(1), which picks
token i with probability p_i. For a seeded request the `vocab` exponentials of the token at
absolute position `p` of the sequence (prompt tokens count; the first generated token sits
at `len(prompt)`) come from a generator seeded with `draw_seed(seed, p)`: the draw is a pure
function of (seed, position, logits). It does not depend on the batch, on how many steps
this process ran, or on which process sampled the earlier tokens, so a stream resumed on
another worker from its tokens so far draws exactly what the original would have.
"""

from __future__ import annotations

import hashlib
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
    # Seed of the request's draws (see `draw_seed`); None draws from torch's global generator.
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


def draw_seed(seed: int, position: int) -> int:
    """The generator seed of the token at absolute `position` of a request seeded `seed`:
    the first 8 bytes of BLAKE2b over both as little-endian u64, masked to 63 bits.
    Canonical (the same in every process and on every machine)."""
    if not 0 <= position < 2**63:
        raise ValueError(f"position must be in [0, 2**63), got {position!r}")
    key = seed.to_bytes(8, "little") + position.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Logits with filtered-out tokens set to -inf, row by row.

    `logits` `[batch, vocab]` (already temperature-scaled), `top_k` `[batch]` ints
    (0 = off), `top_p` `[batch]` floats (1.0 = off). Top-k keeps exactly k tokens (ties
    broken by a stable sort, lower id first); top-p then keeps the smallest prefix of the
    remaining tokens, by descending probability, whose probability sum reaches top_p.
    """
    import torch

    batch, vocab = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
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
    """Picks the next token of every row of a batch. Stateless: a seeded row's randomness is
    a function of its seed and the position it samples (see the module docstring)."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        positions: Sequence[int],
    ) -> torch.Tensor:
        """Token ids `[batch]` (int64, on `logits`' device) for `logits` `[batch, vocab]`.

        Row `i` follows `params[i]` and samples the token at absolute position
        `positions[i]` of its sequence. Greedy rows draw nothing; unseeded rows draw from
        torch's global generator.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got {tuple(logits.shape)}")
        batch, vocab = logits.shape
        if len(params) != batch or len(positions) != batch:
            raise ValueError(
                f"{batch} logit rows, {len(params)} params, {len(positions)} positions"
            )
        # The first maximum of each row, as `argmax` gives it, in about 0.4x its time on CPU.
        tokens = logits.max(dim=-1).indices
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
            seed = params[i].seed
            generator = None
            if seed is not None:
                generator = torch.Generator(device=device)
                generator.manual_seed(draw_seed(seed, positions[i]))
            race[j].exponential_(generator=generator)
        tokens[index] = (probs / race).argmax(dim=-1)
        return tokens


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
