"""The settings every role shares, as one frozen inheritance chain (mini-sglang style):

    ServerSettings          host, port, max_message_mb, drain_timeout_s,   (router, workers)
                            metrics_host, metrics_port,
                            [security] (common.settings.security)
      WorkerSettings        + advertise_address, router_address,           (registers)
                            router_addresses, router_dns, name; `routers`
        ModelWorkerSettings + model, dtype, device; `torch_dtype`          (encoder)
          KvWorkerSettings  + block_size, num_blocks                       (prefill, decode)

A field is declared once, in the class that introduces it; derived values are properties.
Subclasses append their own fields (so a role's TOML table lists the shared keys first).
`check()` raises SettingsError naming the first unusable field; subclasses extend it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from common.address import bracketed, check_address
from common.settings.schema import SettingsError, check_not_negative, check_positive, setting
from common.settings.security import SecuritySettings

if TYPE_CHECKING:
    import torch

# The settings dtype names, each the name of its torch dtype; `torch_dtype` maps them. Names,
# not torch objects: loading settings (the `epd` CLI, `epd config`) must not import torch.
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


def torch_dtype(name: str, key: str = "dtype") -> torch.dtype:
    """The torch dtype called `name`; SettingsError naming `key` when unknown."""
    if name not in DTYPES:
        raise SettingsError(f"{key}: expected one of {', '.join(DTYPES)}, got {name!r}")
    import torch

    dtype: torch.dtype = getattr(torch, name)
    return dtype


# Logging levels a `log_level` setting or `--log-level` flag may name (any case).
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MAX_MESSAGE_MB = 2047  # `max_message_mb` in bytes must fit a C int (gRPC's options)
MAX_C_INT = (1 << 31) - 1  # gRPC's integer options


def check_distinct_ports(settings: object, *names: str) -> None:
    """SettingsError naming the later of two `names` that fix the same port (the server
    would fail to listen on it only once started: under `epd serve`, after Ray's start)."""
    seen: dict[int, str] = {}
    for name in names:
        port = getattr(settings, name)
        if port is not None and port > 0:
            if port in seen:
                raise SettingsError(
                    f"{name}: {port} is also set as {seen[port]}; they cannot share it"
                )
            seen[port] = name


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """What every gRPC server of epd (router and workers) is started with."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(0, "port to listen on (0: pick a free one)")
    max_message_mb: int = setting(256, "largest gRPC message in or out, in MiB")
    grpc_max_connections: int = setting(
        0,
        "gRPC connections the server keeps open at once; one past it is closed as it opens "
        "(0: no cap). Each is a file descriptor and needs no credentials; the process raises "
        "its open-files limit, so set this only where that limit stays low: a source holding "
        "that many connections shuts everyone else out",
    )
    drain_timeout_s: float = setting(
        300.0,
        "on SIGTERM: seconds in-flight work (streams, leases held for peers) may take to "
        "finish before it is cancelled (`python -m <role>`; under `epd serve`, "
        "[pools] drain_timeout_s)",
    )
    metrics_host: str = setting("127.0.0.1", "address the Prometheus /metrics endpoint listens on")
    metrics_port: int | None = setting(
        None, "port of the Prometheus /metrics endpoint (None: no endpoint; 0: a free port)"
    )
    security: SecuritySettings = field(
        default_factory=SecuritySettings, metadata={"help": "cluster token, API keys, TLS"}
    )

    def check(self) -> None:
        """Raise SettingsError naming the first unusable field."""
        if not 0 <= self.port <= 65535:
            raise SettingsError("port: must be between 0 and 65535")
        # "" failed to bind once started (gRPC), or bound every interface (HTTP).
        for name in (f.name for f in fields(self) if f.name.endswith("host")):
            if not getattr(self, name).strip():
                raise SettingsError(f"{name}: is empty: give an address (127.0.0.1, 0.0.0.0, ::)")
        check_positive(self, "max_message_mb", "drain_timeout_s")
        check_not_negative(self, "grpc_max_connections")
        if self.max_message_mb > MAX_MESSAGE_MB:  # gRPC takes the bytes as a C int
            raise SettingsError(f"max_message_mb: must be at most {MAX_MESSAGE_MB}")
        if self.grpc_max_connections >= MAX_C_INT:  # a C int, and gRPC aborts at its top
            raise SettingsError(f"grpc_max_connections: must be at most {MAX_C_INT - 1}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise SettingsError("metrics_port: must be between 0 and 65535")
        check_distinct_ports(self, "port", "metrics_port")


@dataclass(frozen=True, slots=True)
class WorkerSettings(ServerSettings):
    """A server that registers with the router (encoder, prefill, decode)."""

    advertise_address: str | None = setting(
        None, "host:port the router and peers use to reach this worker (None: the bound address)"
    )
    router_address: str | None = setting(None, "router to register with (None: no registration)")
    router_addresses: tuple[str, ...] = setting(
        (),
        "every router to register with, host:port each (comma-separated as a flag); "
        "`router_address`, when set, is one more",
    )
    router_dns: str | None = setting(
        None,
        "host:port whose name resolves to every router (a Kubernetes headless Service): the "
        "worker registers with each address, looked up again every 10 s (None: the lists only)",
    )
    name: str = setting(
        "", "stable worker name for the router (actor or pod name; unique within a role)"
    )

    @property
    def routers(self) -> tuple[str, ...]:
        """Every router this worker registers with: `router_address` (when set) first, then
        `router_addresses`, each once, in order."""
        listed = (self.router_address,) if self.router_address else ()
        return tuple(dict.fromkeys((*listed, *self.router_addresses)))

    def check(self) -> None:
        """Raise SettingsError naming the first unusable field."""
        ServerSettings.check(self)
        named = [("router_dns", self.router_dns)] if self.router_dns else []
        named += [
            ("router_address" if a == self.router_address else "router_addresses", a)
            for a in self.routers
        ]
        for key, address in named:
            try:  # a port past 65535 was taken modulo 65536 by gRPC: another router's
                check_address(address, key)
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        if self.advertise_address is not None:
            try:  # what the routers would refuse it for, each time it registers
                check_address(bracketed(self.advertise_address), "advertise_address")
            except ValueError as exc:
                raise SettingsError(str(exc)) from None

    def reachable_address(self, bound: str) -> str:
        """The address to register and hand to peers, for a server bound to `bound` (a bare
        IPv6 host put in brackets: `common.address.bracketed`)."""
        return bracketed(self.advertise_address) if self.advertise_address else bound


@dataclass(frozen=True, slots=True)
class ModelWorkerSettings(WorkerSettings):
    """A worker that loads (part of) a checkpoint onto a device."""

    model: str | None = setting(
        None, "Hugging Face-format Qwen3-VL checkpoint folder (None: the built-in tiny model)"
    )
    dtype: str = setting(
        "float32", "weights dtype (and the KV cache's): float32, bfloat16 or float16"
    )
    device: str = setting("cpu", "torch device of the model and what it computes (cpu, cuda:0)")
    packed_weights: bool | None = setting(
        None,
        "on CPU in float32 or bfloat16, also keep each linear layer's weight packed for "
        "oneDNN and run it there (float32: at 2+ rows), doubling those weights' memory; "
        "unset: where that is the faster kernel (float32: MKL on a CPU not Intel's, 1.4-1.9x "
        "at decode batches on AMD EPYC, while on Intel Xeon MKL is faster; bfloat16: a CPU "
        "with bfloat16 instructions, 1.6-2.4x); false: one copy and torch's GEMM",
    )

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype` as a torch dtype; SettingsError when unknown."""
        return torch_dtype(self.dtype)

    def check(self) -> None:
        """Raise SettingsError naming the first unusable field."""
        WorkerSettings.check(self)
        _ = self.torch_dtype
        self.security.check()  # every worker needs the cluster token unless insecure


@dataclass(frozen=True, slots=True)
class KvWorkerSettings(ModelWorkerSettings):
    """A worker with a paged KV cache (prefill, decode): both ends of a KV handoff."""

    block_size: int = setting(
        16, "tokens per KV block (prefill and decode workers must use the same)"
    )
    num_blocks: int = setting(1024, "KV blocks in this worker's cache")

    def check(self) -> None:
        """Raise SettingsError naming the first unusable field."""
        check_positive(self, "block_size", "num_blocks")
        ModelWorkerSettings.check(self)
