"""Settings of the encoder worker (TOML file and `--flags`, see `common.settings`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.settings.base import ModelWorkerSettings
from common.settings.schema import SettingsError, setting


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
    lease_ttl_s: float = setting(30.0, "seconds a NIXL output stays readable unless released")
    output_pool_mb: int = setting(
        256,
        "MiB of device memory registered with NIXL once, at start, that large outputs are "
        "placed in (so readers load this encoder's metadata once); an output that does not "
        "fit gets a registered buffer of its own; 0: every output gets its own",
    )
    batch_window_ms: float = setting(
        2.0,
        "wait this long to batch items of concurrent requests (two calls with one request id"
        " go in separate batches, in order)",
    )
    max_batch_rows: int = setting(1 << 16, "patch rows per vision forward, at most")
    exact_partitions: bool = setting(
        True, "encode partitioned items frame by frame so partition rows are bit-exact"
    )

    def check(self) -> None:
        """Raise SettingsError naming the first unusable field."""
        ModelWorkerSettings.check(self)
        for name in (
            "threads",
            "cache_bytes",
            "inline_limit_bytes",
            "max_batch_rows",
            "output_pool_mb",
        ):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name}: must not be negative")
        if self.max_batch_rows == 0:
            raise SettingsError("max_batch_rows: must be positive")
        if self.lease_ttl_s <= 0:
            raise SettingsError("lease_ttl_s: must be positive")
        if self.batch_window_ms < 0:
            raise SettingsError("batch_window_ms: must not be negative")
