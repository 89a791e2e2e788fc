"""Prefill worker settings: the `[prefill]` TOML table and `python -m prefill_worker` flags."""

from __future__ import annotations

from dataclasses import dataclass

from common.settings.base import KvWorkerSettings
from common.settings.schema import (
    SettingsError,
    check_lease_ttl,
    check_not_negative,
    check_positive,
    check_threads,
    setting,
)


@dataclass(frozen=True, slots=True)
class PrefillSettings(KvWorkerSettings):
    """Everything `prefill_worker.server.serve` needs; every field has a documented default.

    The server, registration, model and KV-cache fields come from `KvWorkerSettings`.
    """

    threads: int = setting(
        0,
        "torch intra-op threads (0: auto; under `epd serve` the node's cores divided among the "
        "workers it places there, at least 1; alone, every core)",
    )
    lease_ttl_s: float = setting(
        30.0,
        "how long a prompt's blocks stay pinned for a decode worker that never releases (at "
        "least 0.1)",
    )
    lease_ttl_per_lease_s: float = setting(
        0.5,
        "more lease time per lease already live: when decode falls behind, leases queue up "
        "and new ones last longer (at most 10 times lease_ttl_s)",
    )
    prefill_chunk: int | None = setting(None, "tokens per prefill chunk (None: whole prompt)")
    pack_tokens: int = setting(
        256,
        "while the prompts of queued Prefill calls hold more tokens than this, they are "
        "computed in packs of at most this many tokens (in arrival order; a longer prompt "
        "alone), each pack in one forward: more prefills per second under a backlog, at the "
        "cost of each prompt waiting for its pack; 0: one prompt at a time",
    )
    embedding_pull_timeout_s: float = setting(
        30.0, "longest NIXL pull of one embedding tensor from an encoder"
    )

    def check(self) -> None:
        """Raise SettingsError naming the first unusable field."""
        KvWorkerSettings.check(self)
        # (a negative lease_ttl_per_lease_s would shorten leases below lease_ttl_s)
        check_threads(self)
        check_not_negative(self, "pack_tokens", "lease_ttl_per_lease_s")
        check_positive(self, "embedding_pull_timeout_s")
        check_lease_ttl(self)
        if self.prefill_chunk is not None:
            if self.prefill_chunk < 1:
                raise SettingsError("prefill_chunk: must be at least 1, or unset (whole prompts)")
            check_not_negative(self, "prefill_chunk")  # (its ceiling)
