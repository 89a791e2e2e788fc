"""Router settings: the front door's TOML table and `python -m router` flags."""

from __future__ import annotations

from dataclasses import dataclass

from common.settings.base import ServerSettings
from common.settings.schema import setting


@dataclass(frozen=True, slots=True)
class RouterSettings(ServerSettings):
    """Everything `router.server.serve` needs; every field has a documented default.

    host, max_message_mb and drain_timeout_s come from `ServerSettings`; `port` is declared
    there too and only its default differs here.
    """

    port: int = setting(50051, "port to listen on (0: pick a free one)")
    model: str | None = setting(
        None, "checkpoint folder the router processes inputs for (None: the built-in tiny model)"
    )
    heartbeat_interval_s: float = setting(1.0, "how often workers are told to heartbeat")
    worker_timeout_s: float = setting(
        5.0, "a worker whose last heartbeat is older than this is dropped"
    )
    request_timeout_s: float = setting(
        300.0, "longest a request may run when the client sets no earlier deadline"
    )
    release_timeout_s: float = setting(
        5.0, "deadline of the ReleaseKv call that frees a lease decode never took"
    )
    max_inline_embedding_mb: int = setting(
        128,
        "largest total of inline embedding bytes one request may carry through the router; "
        "larger outputs must come as NIXL handles",
    )
    expected_model: str | None = setting(
        None,
        "model identity workers must report (None: derived from the checkpoint when the "
        "runtime can, else the first registered worker's)",
    )
    cache_aware_routing: bool = setting(
        True,
        "send prefill to the worker caching the longest prefix (among the least loaded) and "
        "skip encoding items that prefix covers",
    )
    encoder_affinity_slack: int = setting(
        2,
        "send each image to the encoder its content hash maps to (rendezvous hashing, so "
        "its encoder cache hits) unless that encoder has more than this many requests beyond "
        "the least loaded one; 0: no affinity, each request to the least loaded encoder",
    )
    kv_reprefills: int = setting(
        2,
        "times a request is prefilled again when decode refuses the pulled KV (its lease "
        "ran out or a block failed its digest) before the client gets ABORTED",
    )
    grace_s: float = setting(5.0, "grace period for in-flight requests on shutdown")

    def check(self) -> None:
        """Raise SettingsError naming the first unusable field; the router also needs the
        API keys file unless insecure."""
        ServerSettings.check(self)
        self.security.check(api_keys=True)

    @property
    def address(self) -> str:
        """host:port as configured (port 0 is resolved only once the server is up)."""
        return f"{self.host}:{self.port}"
