"""Decode worker settings: the `[decode]` TOML table and `python -m decode_worker` flags."""

from __future__ import annotations

from dataclasses import dataclass

from common.settings.base import KvWorkerSettings
from common.settings.schema import (
    check_positive,
    check_threads,
    setting,
)


@dataclass(frozen=True, slots=True)
class DecodeSettings(KvWorkerSettings):
    """Everything `decode_worker.server.serve` needs; every field has a documented default.

    The server, registration, model and KV-cache fields come from `KvWorkerSettings`.
    """

    threads: int = setting(
        0,
        "torch intra-op threads (0: auto; under `epd serve` the node's cores divided among the "
        "workers it places there, at least 1; alone, every core)",
    )
    max_batch: int = setting(32, "most sequences decoded together in one step")
    stream_interval: int = setting(
        1,
        "tokens a stream's chunk carries after the first token (its last chunk may carry "
        "fewer): 1 streams every step's token at once; more sends fewer, larger messages "
        "(less CPU per token on this worker, the router and the client, burstier output)",
    )
    pull_timeout_s: float = setting(30.0, "longest NIXL READ of one request's KV blocks")
    release_timeout_s: float = setting(5.0, "deadline of the ReleaseKv call after a pull")
    renew_leases: bool = setting(
        True, "keep a prefill lease alive (RenewKv) while the request waits for free blocks"
    )

    def check(self) -> None:
        """Raise SettingsError naming the first unusable field."""
        KvWorkerSettings.check(self)
        check_threads(self)
        check_positive(self, "max_batch", "pull_timeout_s", "release_timeout_s")
        check_positive(self, "stream_interval")
