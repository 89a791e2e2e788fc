"""What one request holds on the KV workers (`Need`), for admission (`router.admission`),
and the request that can never fit.

Need: `blocks_for(prompt)` on a prefill worker, held from prefill until the decode worker
has pulled them (its first chunk); `blocks_for(prompt + max_tokens - 1)` on a decode worker,
held until the stream ends; no decode worker at all for an answer of one token (prefill
makes it; no decode runs: `Need.roles`). That is what the workers allocate, before prefix
reuse, so the estimate never falls short.

Never fits: a request needing more blocks than the largest worker of a role has in all is
refused at once (`TooLarge`: RESOURCE_EXHAUSTED naming the sizes; waiting cannot help),
naming `sampling.max_tokens`, or the prompt's field where no length would fit. A worker that
has not heartbeated its capacity yet may be larger: no such refusal for its role.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from common.kv.allocator import blocks_for
from common.kv.block_pool import WHOLE_POOL
from common.roles import KV_ROLES, Role
from router.calls import TooLarge

if TYPE_CHECKING:  # admission imports this module
    from common.sampling import SamplingParams
    from router.admission import Admission


def kv_roles(max_tokens: int) -> tuple[Role, ...]:
    """The KV roles a request of `max_tokens` needs a worker of: a one-token answer is the
    prefill worker's alone, and is served while no decode worker is up."""
    return KV_ROLES if max_tokens > 1 else (Role.PREFILL,)


@dataclass(frozen=True, slots=True)
class Need:
    """What one request holds on each KV role's worker."""

    prompt_tokens: int  # tokens of the prompt
    max_tokens: int  # most tokens it generates
    block_size: int  # tokens per KV block (the deployment's)
    prompt_field: str = "messages"  # the request field the prompt came in (`prompt`)
    default_length: bool = False  # `max_tokens` is the router's default: the request set none

    @property
    def roles(self) -> tuple[Role, ...]:
        """The KV roles whose worker the request is placed on (`kv_roles`)."""
        return kv_roles(self.max_tokens)

    def blocks(self, role: Role) -> int:
        """KV blocks the request holds on a worker of `role` (see the module docstring)."""
        if role == Role.PREFILL:
            return blocks_for(self.prompt_tokens, self.block_size)
        if role not in self.roles:  # one token: the prefill worker's is the answer
            return 0
        return blocks_for(self.prompt_tokens + self.max_tokens - 1, self.block_size)

    def too_large(self, role: Role, capacities: Sequence[int | None]) -> TooLarge | None:
        """The refusal when the request needs more blocks on `role` than the largest of
        `capacities` (its workers' pools; None: not heartbeated yet) holds; None where it
        fits, or may (a capacity unknown, or none given). A default length is said to be one
        where the refusal names it."""
        if not capacities or None in capacities:
            return None
        largest = max(c for c in capacities if c is not None)
        if self.blocks(role) <= largest:
            return None
        # The prompt where it leaves no room for a token of decode's, else the length asked.
        alone = (
            role == Role.PREFILL or blocks_for(self.prompt_tokens + 1, self.block_size) > largest
        )
        if alone:  # no length would fit: name none (it may be a default the caller never sent)
            blocks = blocks_for(self.prompt_tokens + (role == Role.DECODE), self.block_size)
            what = f"its prompt of {self.prompt_tokens} tokens"
            what += " and one generated token" if role == Role.DECODE else ""
        else:
            blocks = self.blocks(role)
            what = f"its prompt of {self.prompt_tokens} tokens and max_tokens {self.max_tokens}"
            what += " (the default: the request set none)" if self.default_length else ""
        refusal = TooLarge(
            f"the request needs {blocks} KV blocks of {self.block_size} tokens on a {role} "
            f"worker for {what}; the largest {role} worker has {largest} in all",
            context=True,
        )
        field = self.prompt_field if alone else "sampling.max_tokens"
        refusal.trailing_metadata = (("epd-field", field),)
        return refusal

    def as_admission_would(self, error: TooLarge) -> TooLarge:
        """A KV worker's own refusal of a request its whole pool cannot hold, as admission
        words it for that pool (`too_large`: the prompt's field or `sampling.max_tokens`
        named, which the worker's words did not): admission let it through because the
        worker had not heartbeated its pool yet. Any other refusal as it is. A default
        length (a chat's, which admission would have cut to the pool had it known it:
        `fit_to_decode`) is said to be one."""
        said = _WORKER_WHOLE_POOL.search(str(error))
        if said is None or error.stage not in KV_ROLES:
            return error
        refusal = self.too_large(Role(error.stage), [int(said.group(1))])
        if refusal is None:  # the worker counts otherwise (an older one): its words
            return error
        refusal.address, refusal.stage = error.address, error.stage
        return refusal


# What a KV worker's `PoolTooSmallError` says, its pool's blocks in all captured.
_WORKER_WHOLE_POOL = re.compile(re.escape(WHOLE_POOL) + r" \((\d+), its num_blocks setting\)")


def fit_to_decode(
    max_tokens: int, prompt_tokens: int, block_size: int, capacities: Sequence[int | None]
) -> int:
    """A default `max_tokens` (the caller set none) cut to what the largest of the decode
    workers' pools (`capacities`, in blocks; None: not heartbeated: unchanged then) holds
    beside the prompt: a chat that sets no length is answered as far as it can be, not
    refused for a length it never asked for. Not cut to the room free now: under load that
    would cut ordinary answers short, where waiting for blocks serves them whole (one that
    needs the whole pool waits for it, as an asked-for length would). A prompt that leaves
    no pool room for a token of decode's keeps its length, and is refused naming `messages`
    (`Need.too_large`): cut to one token, it was answered by prefill alone with that token
    (ownfix review B)."""
    if not capacities or None in capacities:
        return max_tokens
    largest = max(c for c in capacities if c is not None)
    room = largest * block_size - prompt_tokens + 1  # the prefill's token and decode's
    return max_tokens if room <= 1 else min(max_tokens, room)


def fitted_to_decode(
    admission: Admission, sampling: SamplingParams, prompt_tokens: int
) -> SamplingParams:
    """`sampling` with its default `max_tokens` cut to the largest serving decode worker's
    pool, as `fit_to_decode` says (unchanged before any KV worker registered)."""
    layout = admission.registry.reference_layout
    if layout is None:
        return sampling
    workers = admission.registry.workers(Role.DECODE)
    capacities = [admission.capacity(w) for w in workers if not w.draining]
    fitted = fit_to_decode(sampling.max_tokens, prompt_tokens, layout.block_size, capacities)
    return replace(sampling, max_tokens=fitted)
