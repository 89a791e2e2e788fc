"""The one `epd` config file: every role's settings plus the pools and Ray sections.

    model = "/path/to/checkpoint"      # optional: one checkpoint for every role
    [router]   RouterSettings           (router/settings.py)
    [encoder]  EncoderSettings          (encoder_worker/settings.py)
    [prefill]  PrefillSettings          (prefill_worker/settings.py)
    [decode]   DecodeSettings           (decode_worker/settings.py)
    [security] SecuritySettings         the cluster token (common/settings/security.py), for
                                        every role
    [pools]    PoolSettings             replicas per role, resources per worker actor
    [ray]      RaySettings              which Ray cluster, and how to start a local one

`epd serve --config epd.toml` reads it with `common.settings.schema.load` (unknown keys are an error
naming them); every field is also a flag (`--pools-prefill-replicas 2`, `--router-port 0`)
applied over the file. `epd config --print-defaults` prints the commented defaults, and
docs/config.md is generated from the same descriptions.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.roles import WORKER_ROLES
from common.settings.api_keys import load_api_keys
from common.settings.base import LOG_LEVELS, ModelWorkerSettings
from common.settings.schema import SettingsError, check_positive, describe, setting, to_toml
from common.settings.security import SecuritySettings, named_by_table
from decode_worker.settings import DecodeSettings
from encoder_worker.settings import EncoderSettings
from prefill_worker.settings import PrefillSettings
from router.settings import RouterSettings

# Worker role names, as TOML sections and `epd scale --role` choices.
ROLES = tuple(str(role) for role in WORKER_ROLES)
MIN_OBJECT_STORE_MB = 75  # Ray refuses a smaller object store when it starts


# A worker process of the built-in tiny model: Python, torch, gRPC, NIXL (about 370-420 MB
# resident, measured with `ps`); a checkpoint's weights come on top.
BASE_WORKER_MB = 448


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """How many workers each pool runs and what each worker actor asks Ray for."""

    encoder_replicas: int = setting(1, "encoder workers started by `epd serve`")
    prefill_replicas: int = setting(1, "prefill workers started by `epd serve`")
    decode_replicas: int = setting(1, "decode workers started by `epd serve`")
    max_replicas: int = setting(64, "largest pool `epd scale` may ask for")
    num_gpus: float | None = setting(
        None,
        "GPUs per worker actor, asked for only when the Ray cluster has GPUs (None: 1, or an "
        "equal share when there are fewer GPUs than starting workers; 0: CPU only)",
    )
    num_cpus: float | None = setting(
        None,
        "CPUs per worker actor asked of Ray (None: the worker's threads, or 0 for an auto-threads "
        "worker that shares its node's cores with the others; see cluster/placement.py)",
    )
    memory_mb: int | None = setting(
        None,
        "memory per worker actor asked of Ray, in MiB: a worker past what the nodes have free "
        "waits for Ray resources, instead of starting and running the node out of memory "
        f"(None: {BASE_WORKER_MB} MiB, plus the checkpoint's weight files for a CPU worker; "
        "0: none)",
    )
    max_restarts: int = setting(
        -1, "times Ray restarts a crashed worker actor (-1: always, 0: never)"
    )
    drain_timeout_s: float = setting(
        300.0, "longest a retiring worker may take to finish its in-flight work (streams, leases)"
    )
    ready_timeout_s: float = setting(
        600.0, "longest `epd serve` waits for every worker to register"
    )
    routers: int = setting(
        1,
        "routers `epd serve` starts (in its controller actor), each with its own registry; "
        "ports consecutive from router.port, router.http_port and router.metrics_port (0: "
        "each a free one); every worker registers with all of them",
    )

    def gpus_per_worker(self, cluster_gpus: float) -> float:
        """What each worker actor asks Ray for on a cluster with `cluster_gpus` GPUs."""
        if cluster_gpus <= 0:
            return 0.0
        if self.num_gpus is not None:
            return self.num_gpus
        workers = sum(self.initial_replicas().values())
        if workers <= cluster_gpus:
            return 1.0
        # Share: e.g. 3 workers on 1 GPU ask for 0.33 each (Ray packs fractions on one GPU).
        return math.floor(cluster_gpus / workers * 100) / 100

    def memory_per_worker(self, model: str | None, device: str = "cpu") -> int:
        """Bytes of memory each worker actor of a role serving `model` (None: the built-in
        tiny one, whose weights are a few MiB) on `device` asks Ray for (`memory_mb`): the
        weights count on CPU only (on a GPU they are in its memory), all of them (a role
        loads a part: an upper bound)."""
        if self.memory_mb is not None:
            return self.memory_mb << 20
        weights = 0
        if model is not None and device == "cpu":
            weights = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
        return (BASE_WORKER_MB << 20) + weights

    def initial_replicas(self) -> dict[str, int]:
        """Workers per role at start-up."""
        return {
            "encoder": self.encoder_replicas,
            "prefill": self.prefill_replicas,
            "decode": self.decode_replicas,
        }


@dataclass(frozen=True, slots=True)
class RaySettings:
    """Which Ray cluster `epd serve` runs on."""

    address: str | None = setting(
        None, "Ray cluster to join ('auto': the one running on this node; None: start one here)"
    )
    namespace: str = setting("epd", "Ray namespace of the controller and worker actors")
    num_cpus: int | None = setting(None, "CPUs of a Ray started here (None: this machine's)")
    num_gpus: int | None = setting(None, "GPUs of a Ray started here (None: detect)")
    object_store_mb: int = setting(256, "object store of a Ray started here, in MiB")
    worker_host: str | None = setting(
        None,
        "host workers listen on and register (None: 127.0.0.1 on a Ray started here, "
        "else the node's IP)",
    )
    log_to_driver: bool = setting(True, "show the actors' logs in `epd serve`'s output")


@dataclass(frozen=True, slots=True)
class EpdSettings:
    """Everything `epd serve` needs: one table per role, plus pools and Ray."""

    model: str | None = setting(
        None,
        "checkpoint folder for every role (None: each role's own `model`, whose default is "
        "the built-in tiny model, made on first use)",
    )
    log_level: str = setting("warning", "log level of the router and worker actors")
    security: SecuritySettings = field(
        default_factory=SecuritySettings,
        metadata={
            "help": "every role's [security]; a role's own table wins, setting by setting, "
            "where it sets a value other than the default (a role cannot set one back)"
        },
    )
    router: RouterSettings = field(default_factory=RouterSettings, metadata={"help": "the router"})
    encoder: EncoderSettings = field(
        default_factory=EncoderSettings, metadata={"help": "every encoder worker"}
    )
    prefill: PrefillSettings = field(
        default_factory=PrefillSettings, metadata={"help": "every prefill worker"}
    )
    decode: DecodeSettings = field(
        default_factory=DecodeSettings, metadata={"help": "every decode worker"}
    )
    pools: PoolSettings = field(default_factory=PoolSettings, metadata={"help": "the pools"})
    ray: RaySettings = field(default_factory=RaySettings, metadata={"help": "the Ray cluster"})

    def __post_init__(self) -> None:
        # Decode READs prefill's blocks as they are laid out: one block size for both.
        if self.prefill.block_size != self.decode.block_size:
            raise SettingsError(
                f"prefill.block_size ({self.prefill.block_size}) and decode.block_size "
                f"({self.decode.block_size}) must be equal"
            )

    def check(self) -> None:
        """Raise SettingsError with one line naming the first unusable key (`decode.dtype`,
        `prefill.block_size`, `model`, ...): every role's own `check()`, the model folders,
        then the pools. `epd config --check` and `epd serve` (before Ray starts) call it.

        The cluster token and API keys are not required here: `epd serve` makes them when
        they are unset. The TLS file pairing is still checked."""
        if self.model is not None:
            check_model_folder("model", self.model)
            for role in ("router", *ROLES):
                own = getattr(self, role).model
                if own is not None and own != self.model:
                    # with_model gives `model` to every role: the role's own would be lost.
                    raise SettingsError(
                        f"{role}.model: {own} differs from model ({self.model}), which is "
                        f"every role's; set one of them"
                    )
        full = self.with_model()
        roles: dict[str, RouterSettings | EncoderSettings | PrefillSettings | DecodeSettings] = {
            "router": full.router,
            "encoder": full.encoder,
            "prefill": full.prefill,
            "decode": full.decode,
        }
        for role, settings in roles.items():
            # insecure skips only the "secret unset" checks, which `epd serve` fills in.
            relaxed = dataclasses.replace(
                settings, security=dataclasses.replace(settings.security, insecure=True)
            )
            try:
                relaxed.check()
                if role == "router":  # it runs here (the workers may run on other nodes)
                    read_secrets(settings.security)
            except SettingsError as exc:
                raise SettingsError(
                    named_by_table(role, str(exc), getattr(self, role).security, self.security)
                ) from None
            if self.model is None and settings.model is not None:
                check_model_folder(f"{role}.model", settings.model)
        # Embeddings and KV differ by dtype, and the caches key them by the KV's: one dtype.
        dtypes = {role: getattr(self, role).dtype for role in ROLES}
        if len(set(dtypes.values())) > 1:
            said = ", ".join(f"{role}.dtype ({dtype})" for role, dtype in dtypes.items())
            raise SettingsError(f"{said} must be equal")
        pools = self.pools
        for name, n in pools.initial_replicas().items():
            if n < 0:
                raise SettingsError(f"pools.{name}_replicas: must not be negative")
            if n > pools.max_replicas:
                raise SettingsError(
                    f"pools.{name}_replicas: {n} is more than pools.max_replicas "
                    f"({pools.max_replicas})"
                )
            one_worker_ports(name, getattr(full, name), n, f"pools.{name}_replicas")
        for name in ("num_cpus", "num_gpus"):
            if (getattr(pools, name) or 0) < 0 or (getattr(self.ray, name) or 0) < 0:
                where = "pools" if (getattr(pools, name) or 0) < 0 else "ray"
                raise SettingsError(f"{where}.{name}: must not be negative")
        if (pools.memory_mb or 0) < 0:
            raise SettingsError("pools.memory_mb: must not be negative (0: ask for none)")
        if pools.max_restarts < -1:
            raise SettingsError("pools.max_restarts: must be -1 (always), 0 (never) or more")
        if pools.routers < 1:
            raise SettingsError("pools.routers: must be at least 1")
        full.router.check_copies(pools.routers)
        if self.ray.object_store_mb < MIN_OBJECT_STORE_MB:
            raise SettingsError(f"ray.object_store_mb: Ray needs at least {MIN_OBJECT_STORE_MB}")
        namespace = self.ray.namespace  # also a folder: $EPD_HOME/<namespace>
        if namespace in ("", ".", "..") or any(c in namespace for c in "/\\\0"):
            raise SettingsError(
                f"ray.namespace: {namespace!r} must be a plain name (it names the folder "
                "$EPD_HOME/<namespace>: no '/', '\\', '.' or '..')"
            )
        if self.log_level.lower() not in LOG_LEVELS:
            raise SettingsError(f"log_level: expected one of {', '.join(LOG_LEVELS)}")
        try:
            check_positive(pools, "drain_timeout_s", "ready_timeout_s")
        except SettingsError as exc:
            raise SettingsError(f"pools.{exc}") from None

    def with_model(self) -> EpdSettings:
        """A copy where a top-level `model` has been given to every role, and the top-level
        `[security]` fills in each setting a role's own table leaves unset (a role's own
        TLS files or API keys are kept)."""
        if self.model is None and self.security == SecuritySettings():
            return self

        def shared(role: Any) -> Any:
            model = {"model": self.model} if self.model is not None else {}
            return dataclasses.replace(
                role, security=_filled_in(role.security, self.security), **model
            )

        return dataclasses.replace(
            self,
            router=shared(self.router),
            encoder=shared(self.encoder),
            prefill=shared(self.prefill),
            decode=shared(self.decode),
        )

    def role_settings(self) -> dict[str, ModelWorkerSettings]:
        """The settings of each worker role, by role name (the top-level model applied)."""
        full = self.with_model()
        return {"encoder": full.encoder, "prefill": full.prefill, "decode": full.decode}


def _filled_in(own: SecuritySettings, top: SecuritySettings) -> SecuritySettings:
    """`own` with every setting it leaves at its default taken from `top`."""
    unset = SecuritySettings()
    taken = {
        f.name: getattr(top, f.name)
        for f in dataclasses.fields(own)
        if getattr(own, f.name) == getattr(unset, f.name)
    }
    return dataclasses.replace(own, **taken)


# What a checkpoint folder must hold for every role to load it (weights are found by
# the loader, which names what it misses).
MODEL_FILES = ("config.json", "tokenizer.json")


def read_secrets(security: SecuritySettings) -> None:
    """Read the token, TLS and API keys files the router's `security` names, as the router
    will (on this node, in `epd serve`'s controller), SettingsError naming the one that
    fails (`epd serve` refused a missing keys file only after Ray had started, with a
    20-line traceback)."""
    if security.insecure:
        return
    if security.cluster_token_file:
        security.cluster_key()
    security.tls_files()
    if security.api_keys_file:
        load_api_keys(security.api_keys_file)


def one_worker_ports(role: str, worker: ModelWorkerSettings, replicas: int, asked: str) -> None:
    """SettingsError where `replicas` workers of `role` would share a fixed port of theirs
    (`port`, `metrics_port`: Ray may place replicas on one host); `asked` names what asked
    for them (`epd scale` did not check: its new worker failed to start, "port in use":
    operator2 review L7, s44)."""
    for key in ("port", "metrics_port"):
        if replicas > 1 and (getattr(worker, key) or 0) > 0:
            raise SettingsError(
                f"{role}.{key}: a fixed port takes one worker, and {asked} is {replicas} "
                "(0: a free port each)"
            )


def check_model_folder(key: str, model: str) -> None:
    """SettingsError naming `key` when `model` is not a folder holding `MODEL_FILES`."""
    folder = Path(model)
    if not folder.exists():
        raise SettingsError(f"{key}: {model} does not exist")
    if not folder.is_dir():
        raise SettingsError(f"{key}: {model} is not a checkpoint folder")
    for name in MODEL_FILES:
        if not (folder / name).is_file():
            raise SettingsError(f"{key}: {model} has no {name}")


def defaults_toml() -> str:
    """The commented TOML of every setting with its default (`epd config --print-defaults`)."""
    header = (
        "# epd configuration: every setting with its default. Uncomment what you change.\n"
        "# Use with `epd serve --config FILE`; flags (see `epd serve --help`) override it.\n\n"
    )
    return header + to_toml(EpdSettings)


_SECTIONS = {
    "": "Top level",
    "router": "`[router]`: the router (`router/settings.py`)",
    "encoder": "`[encoder]`: every encoder worker (`encoder_worker/settings.py`)",
    "prefill": "`[prefill]`: every prefill worker (`prefill_worker/settings.py`)",
    "decode": "`[decode]`: every decode worker (`decode_worker/settings.py`)",
    "security": "`[security]`: cluster token, API keys, TLS, for every role "
    "(`common/settings/security.py`, docs/security.md)",
    "pools": "`[pools]`: worker pools on Ray (`cluster/settings.py`)",
    "ray": "`[ray]`: the Ray cluster (`cluster/settings.py`)",
}


def reference_markdown() -> str:
    """docs/config.md: every setting with its flag, default and help, one table per section."""
    lines = [
        "# epd configuration reference",
        "",
        "<!-- Generated by `python -m epd config --markdown > docs/config.md`; do not edit. -->",
        "",
        "`epd serve --config epd.toml` reads one TOML file with the sections below; every",
        "setting is also a flag of `epd serve` (shown), applied over the file. Unknown keys are",
        "an error naming them. `epd config --print-defaults` prints the same defaults as a",
        "commented TOML file; `epd config --check FILE` loads a file and reports the first error.",
        "Worker and router sections hold what `python -m <role> --config` reads at its file's top",
        "level; under `epd serve` the pool manager fills in each worker's `router_address`, `name`",
        "and `host` (see `[ray] worker_host`), and `device` = `cuda` where Ray has GPUs.",
    ]
    section = None
    for key, default, help_text in describe(EpdSettings):
        head, _, leaf = key.rpartition(".")
        if head != section:
            section = head
            lines += ["", f"## {_SECTIONS.get(head, head)}", ""]
            lines += ["| key | flag | default | meaning |", "| --- | --- | --- | --- |"]
        flag = "--" + key.replace(".", "-").replace("_", "-")
        shown = "unset" if default is None else f"`{_toml_literal(default)}`"
        meaning = help_text.replace("|", "\\|")
        lines.append(f"| `{leaf}` | `{flag}` | {shown} | {meaning} |")
    return "\n".join(lines) + "\n"


def _toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    return repr(value)
