"""Prefill worker settings: the `[prefill]` TOML table and `python -m prefill_worker` flags."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.settings.schema import setting

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class PrefillSettings:
    """Everything `prefill_worker.server.serve` needs; every field has a documented default."""

    model: str | None = setting(None, "checkpoint folder (None: the built-in tiny model)")
    dtype: str = setting("float32", "weights and KV cache dtype: float32, bfloat16 or float16")
    device: str = setting("cpu", "torch device of the model and the KV cache (cpu, cuda:0)")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(0, "port to listen on (0: pick a free one)")
    advertise_address: str | None = setting(
        None, "host:port peers use to reach this worker (None: the bound address)"
    )
    router_address: str | None = setting(None, "router to register with (None: no registration)")
    name: str = setting("", "stable worker name for the router (actor or pod name)")
    block_size: int = setting(16, "tokens per KV block (must match the decode workers)")
    num_blocks: int = setting(1024, "KV blocks in this worker's cache")
    lease_ttl_s: float = setting(
        30.0, "how long a prompt's blocks stay pinned for a decode worker that never releases"
    )
    prefill_chunk: int | None = setting(None, "tokens per prefill chunk (None: whole prompt)")
    embedding_pull_timeout_s: float = setting(
        30.0, "longest NIXL pull of one embedding tensor from an encoder"
    )
    drain_timeout_s: float = setting(30.0, "how long in-flight work may finish on shutdown")

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype` as a torch dtype; ValueError for an unknown name."""
        try:
            return DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}") from None
