"""Settings of the encoder worker (TOML file and `--flags`, see `common.settings`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.settings.schema import SettingsError, setting

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class EncoderSettings:
    """Everything `encoder_worker.server.serve` needs; every field has a documented default."""

    model: str | None = setting(
        None, "Hugging Face-format Qwen3-VL checkpoint folder; unset = built-in tiny checkpoint"
    )
    dtype: str = setting("float32", "vision tower dtype: float32, bfloat16 or float16")
    device: str = setting("cpu", "torch device of the vision tower and its outputs")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(0, "port to listen on; 0 picks a free one")
    advertise_address: str | None = setting(
        None, "host:port given to the router; unset = the bound address"
    )
    router_address: str | None = setting(None, "router host:port to register with; unset = none")
    name: str = setting("", "stable worker name (actor or pod name); empty = encoder-<pid>")
    cache_bytes: int = setting(256 << 20, "encoder cache budget in bytes (LRU); 0 disables it")
    inline_limit_bytes: int = setting(
        1 << 20, "outputs of an item above this many bytes travel as a NIXL handle"
    )
    nixl: bool = setting(True, "offer large outputs over NIXL (else always inline)")
    lease_ttl_s: float = setting(30.0, "seconds a NIXL output stays readable unless released")
    batch_window_ms: float = setting(2.0, "wait this long to batch items of concurrent requests")
    max_batch_rows: int = setting(1 << 16, "patch rows per vision forward, at most")
    exact_partitions: bool = setting(
        True, "encode partitioned items frame by frame so partition rows are bit-exact"
    )
    max_message_mb: int = setting(256, "largest gRPC message, in MiB")
    drain_timeout_s: float = setting(30.0, "on SIGTERM: seconds in-flight requests may finish")

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype` as a torch dtype; SettingsError when unknown."""
        try:
            return _DTYPES[self.dtype]
        except KeyError:
            raise SettingsError(
                f"dtype: expected one of {', '.join(_DTYPES)}, got {self.dtype!r}"
            ) from None

    def check(self) -> None:
        """Raise SettingsError naming the first unusable field."""
        _ = self.torch_dtype
        for name in ("cache_bytes", "inline_limit_bytes", "max_batch_rows", "port"):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name}: must not be negative")
        if self.max_batch_rows == 0:
            raise SettingsError("max_batch_rows: must be positive")
        for name in ("lease_ttl_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name}: must be positive")
        if self.batch_window_ms < 0:
            raise SettingsError("batch_window_ms: must not be negative")
