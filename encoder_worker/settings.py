"""Settings of the encoder worker (TOML file and `--flags`, see `common.settings`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.settings.base import ModelWorkerSettings
from common.settings.schema import (
    check_at_most,
    check_lease_ttl,
    check_not_negative,
    check_positive,
    check_threads,
    setting,
)


@dataclass(frozen=True, slots=True)
class EncoderSettings(ModelWorkerSettings):
    """Everything `encoder_worker.server.serve` needs; every field has a documented default.

    The server, registration and model fields come from `ModelWorkerSettings`.
    """

    threads: int = setting(
        0,
        "torch intra-op threads (0: auto; under `epd serve` the node's cores divided among the "
        "workers it places there, at least 1; alone, every core)",
    )
    cache_bytes: int = setting(
        256 << 20,
        "encoder cache budget in bytes (LRU; each entry counts 1 KiB of objects beside its "
        "rows); 0 disables it",
    )
    inline_limit_bytes: int = setting(
        1 << 20, "outputs of an item above this many bytes travel as a NIXL handle"
    )
    nixl: bool = setting(True, "offer large outputs over NIXL (else always inline)")
    lease_ttl_s: float = setting(
        30.0, "seconds a NIXL output stays readable unless released (at least 0.1)"
    )
    output_pool_mb: int = setting(
        256,
        "MiB of device memory registered with NIXL once, at start, that large outputs are "
        "placed in (so readers load this encoder's metadata once); an output that does not "
        "fit gets a registered buffer of its own; 0: every output gets its own",
    )
    batch_window_ms: float = setting(
        2.0,
        "wait this long to batch items of concurrent requests (two calls with one request id"
        " go in separate batches, in order); at most 1000",
    )
    max_batch_rows: int = setting(1 << 16, "patch rows per vision forward, at most")
    exact_partitions: bool = setting(
        True,
        "encode videos and partitioned items frame by frame so partition rows are bit-exact "
        "however they are batched; off: partition keys are exact only where the kernels give "
        "the same bits in any batch (docs/block-hash.md)",
    )

    def check(self) -> None:
        """Raise SettingsError naming the first unusable field."""
        ModelWorkerSettings.check(self)
        check_threads(self)
        check_not_negative(
            self,
            "cache_bytes",
            "inline_limit_bytes",
            "output_pool_mb",
            "batch_window_ms",
        )
        # Every image request waits it: 60000 (read as seconds?) added a minute to each.
        check_at_most(self, "batch_window_ms", 1000.0, "every encode waits it")
        check_positive(self, "max_batch_rows")
        check_lease_ttl(self)
