"""Typed settings: TOML in, flags over it, unknown keys and bad types rejected by name."""

from __future__ import annotations

import argparse
import inspect
import logging
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from common.settings.schema import (
    SettingsError,
    add_flags,
    apply_flags,
    describe,
    from_mapping,
    load,
    setting,
    to_toml,
)


@dataclass(frozen=True)
class Pool:
    replicas: int = setting(1, "workers in the pool")
    address: str | None = setting(None, "address to join")


@dataclass(frozen=True)
class Top:
    host: str = setting("127.0.0.1", "listen host")
    port: int = setting(50051, "listen port")
    ratio: float = setting(0.5, "a ratio")
    verbose: bool = setting(False, "more logs")
    tags: tuple[str, ...] = setting((), "labels")
    prefill: Pool = field(default_factory=Pool, metadata={"help": "prefill pool"})


def test_defaults_and_nested_tables(tmp_path: Path) -> None:
    path = tmp_path / "epd.toml"
    path.write_text('port = 6000\ntags = ["a", "b"]\n[prefill]\nreplicas = 3\n')
    cfg = load(Top, path)
    assert cfg == Top(port=6000, tags=("a", "b"), prefill=Pool(replicas=3))
    assert load(Top, None) == Top()


def test_unknown_key_named_with_hint() -> None:
    with pytest.raises(SettingsError, match=r"prefill\.replica .*did you mean prefill\.replicas"):
        from_mapping(Top, {"prefill": {"replica": 2}})
    with pytest.raises(SettingsError, match="unknown setting colour"):
        from_mapping(Top, {"colour": "red"})


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"port": "x"}, "port"),
        ({"verbose": 3}, "verbose"),
        ({"prefill": 1}, "prefill"),
        ({"tags": 5}, "tags"),
        ({"host": 1}, "host"),
        ({"port": True}, "port"),
        ({"port": 50062.9}, "port"),  # refused, not truncated
        ({"port": float("inf")}, "port"),
        ({"ratio": float("nan")}, "ratio"),  # nan passes every `> 0` check after
        ({"ratio": "inf"}, "ratio"),
    ],
)
def test_bad_types_named(data: dict[str, object], key: str) -> None:
    with pytest.raises(SettingsError, match=key):
        from_mapping(Top, data)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="does not exist"):
        load(Top, tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("port = = 1")
    with pytest.raises(SettingsError, match="not valid TOML"):
        load(Top, bad)
    # A folder (a Kubernetes ConfigMap mounted whole) and bytes that are not UTF-8 were
    # tracebacks of `python -m <role>`.
    with pytest.raises(SettingsError, match=f"settings file {tmp_path} cannot be read"):
        load(Top, tmp_path)
    bad.write_bytes(b"\xff\xfe port = 1")
    with pytest.raises(SettingsError, match="not UTF-8"):
        load(Top, bad)


def test_flags_override_file_values() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, Top)
    args = parser.parse_args(["--port", "7000", "--prefill-replicas", "2", "--verbose", "true"])
    cfg = apply_flags(Top(host="0.0.0.0", port=1), args)
    assert cfg == Top(host="0.0.0.0", port=7000, verbose=True, prefill=Pool(replicas=2))
    with pytest.raises(SettingsError, match="port"):
        apply_flags(Top(), parser.parse_args(["--port", "many"]))


def test_every_field_documented() -> None:
    keys = [key for key, _default, help_text in describe(Top) if help_text]
    assert keys == [
        "host",
        "port",
        "ratio",
        "verbose",
        "tags",
        "prefill.replicas",
        "prefill.address",
    ]
    text = to_toml(Top)
    assert "# port = 50051" in text and "[prefill]" in text


_SETTING_LINE = re.compile(r"^# ([A-Za-z_][A-Za-z0-9_]*) = ")


def _uncommented(text: str) -> str:
    """`text` with every `# key = value` line uncommented (what an operator would do)."""
    return "\n".join(
        line.removeprefix("# ") if _SETTING_LINE.match(line) else line for line in text.splitlines()
    )


def test_to_toml_uncommented_is_valid_toml_with_the_defaults() -> None:
    """Uncommenting the `# key = value` lines gives a file that loads as the defaults; an
    unset field is written `# key: unset (a string)`, which is not a value line."""
    from cluster.settings import EpdSettings, defaults_toml

    for cls, text in ((Top, to_toml(Top)), (EpdSettings, defaults_toml())):
        assert "# (unset)" not in text
        data = tomllib.loads(_uncommented(text))
        assert from_mapping(cls, data) == cls()
    text = defaults_toml()
    assert "# model: unset (a string)" in text.splitlines()
    assert "# metrics_port: unset (an integer)" in text.splitlines()
    assert not any(re.match(r"^# \w+ = $", line) for line in text.splitlines())


def test_to_toml_escapes_strings() -> None:
    @dataclass(frozen=True)
    class Quoted:
        path: str = setting('C:\\dir "x"', "a path with a backslash and quotes")
        names: tuple[str, ...] = setting(('a"b', "c\\d"), "names")

    data = tomllib.loads(_uncommented(to_toml(Quoted)))
    assert from_mapping(Quoted, data) == Quoted()


# ------------------------------------------------------------------- role settings


def test_block_size_is_declared_once_for_prefill_and_decode() -> None:
    from common.settings.base import KvWorkerSettings
    from decode_worker.settings import DecodeSettings
    from prefill_worker.settings import PrefillSettings

    for cls in (PrefillSettings, DecodeSettings):
        assert issubclass(cls, KvWorkerSettings)
        assert "block_size" not in inspect.get_annotations(cls)


def test_epd_settings_refuse_different_block_sizes(tmp_path: Path) -> None:
    from cluster.settings import EpdSettings

    path = tmp_path / "epd.toml"
    path.write_text("[prefill]\nblock_size = 16\n[decode]\nblock_size = 32\n")
    with pytest.raises(SettingsError, match=r"prefill\.block_size.*decode\.block_size"):
        load(EpdSettings, path)
    path.write_text("[prefill]\nblock_size = 32\n[decode]\nblock_size = 32\n")
    settings = load(EpdSettings, path)
    assert settings.prefill.block_size == settings.decode.block_size == 32


def test_epd_settings_refuse_different_dtypes(tmp_path: Path) -> None:
    # An encoder in another dtype than prefill and decode: its embeddings, and the KV made
    # from them, differ, and the prefix caches key KV by the KV workers' dtype only.
    from cluster.settings import EpdSettings

    path = tmp_path / "epd.toml"
    path.write_text('[prefill]\ndtype = "bfloat16"\n[decode]\ndtype = "bfloat16"\n')
    with pytest.raises(SettingsError, match=r"encoder\.dtype \(float32\).*must be equal"):
        load(EpdSettings, path).check()
    path.write_text('[encoder]\ndtype = "bfloat16"\n' + path.read_text())
    load(EpdSettings, path).check()


@pytest.mark.parametrize("role", ["encoder", "prefill", "decode"])
def test_unknown_dtype_is_one_settings_error(role: str) -> None:
    from cluster.settings import EpdSettings

    settings = getattr(EpdSettings(), role)
    bad = type(settings)(dtype="int4")
    with pytest.raises(SettingsError, match="dtype: expected one of float32"):
        _ = bad.torch_dtype
    with pytest.raises(SettingsError, match="dtype"):
        bad.check()


def test_router_drain_timeout_is_a_setting() -> None:
    from router.__main__ import parse
    from router.settings import RouterSettings

    assert RouterSettings().drain_timeout_s == 300.0
    assert parse(["--drain-timeout-s", "45", "--port", "0", "--insecure"]).drain_timeout_s == 45.0


def test_prefill_lease_times_are_checked() -> None:
    from common.settings.security import SecuritySettings
    from prefill_worker.settings import PrefillSettings

    insecure = SecuritySettings(insecure=True)
    for bad, key in (
        ({"lease_ttl_s": 0.0}, "lease_ttl_s"),
        # 1 ms: every lease ended before decode read it, every request ABORTED naming no
        # setting (clocks review, s36).
        ({"lease_ttl_s": 0.001}, "lease_ttl_s: must be at least 0.1 s"),
        ({"lease_ttl_per_lease_s": -1.0}, "lease_ttl_per_lease_s"),
    ):
        with pytest.raises(SettingsError, match=key):
            PrefillSettings(security=insecure, **bad).check()  # type: ignore[arg-type]
    assert from_mapping(Top, {"port": 50062.0}).port == 50062  # a whole number is fine


def test_router_heartbeat_times_are_checked() -> None:
    from common.settings.security import SecuritySettings
    from router.settings import RouterSettings

    insecure = SecuritySettings(insecure=True)
    for bad, key in (
        ({"heartbeat_interval_s": 0.0}, "heartbeat_interval_s"),
        # Every worker asked for a heartbeat every ms; past 2^32 ms, the answer to Register
        # overflowed and workers looped registering (clocks review, s36).
        ({"heartbeat_interval_s": 0.001}, "heartbeat_interval_s: must be from 0.05 to 3600"),
        ({"heartbeat_interval_s": 5e6, "worker_timeout_s": 1e7}, "heartbeat_interval_s"),
        # A worker would be dropped between two heartbeats it sends on time.
        ({"heartbeat_interval_s": 2.0, "worker_timeout_s": 0.5}, "worker_timeout_s"),
        ({"video_file_fps": 1e-9}, "video_file_fps"),
        # Capped at 64 Mi silently: a 99 M-pixel image was "not a decodable image".
        ({"max_image_pixels": 100_000_000}, "max_image_pixels: at most 67108864"),
        ({"overlap_prefill": True, "cache_aware_routing": False}, "overlap_prefill: needs"),
    ):
        with pytest.raises(SettingsError, match=key):
            RouterSettings(security=insecure, **bad).check()


def test_a_router_says_grace_s_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    # Kept so that files setting it still load, but it no longer does anything: an operator
    # who sets it is told (style review, s33).
    from common.settings.security import SecuritySettings
    from router.settings import RouterSettings

    insecure = SecuritySettings(insecure=True)
    with caplog.at_level(logging.WARNING, logger="router.settings"):
        RouterSettings(security=insecure).check()
        assert not caplog.records
        RouterSettings(security=insecure, grace_s=1.0).check()
    assert "grace_s is ignored" in caplog.text


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"router": {"port": 70000}}, "router.port"),  # the router listened on 70000 - 65536
        ({"router": {"port": 65535}, "pools": {"routers": 2}}, "router.port"),
        ({"router": {"http_port": 65535}, "pools": {"routers": 2}}, "router.http_port"),
        # Router 1's gRPC port was router 0's HTTP port: caught after Ray started (docswalk).
        (
            {"router": {"port": 20140, "http_port": 20141}, "pools": {"routers": 2}},
            "router.http_port: 20141..20142 overlaps router.port 20140..20141",
        ),
        (
            {"router": {"port": 20140, "metrics_port": 20130}, "pools": {"routers": 11}},
            "router.metrics_port: 20130..20140 overlaps router.port",
        ),
        ({"encoder": {"port": 65536}}, "encoder.port"),
        ({"log_level": "bogus"}, "log_level"),
        ({"pools": {"max_restarts": -5}}, "pools.max_restarts"),
        ({"pools": {"num_gpus": -1}}, "pools.num_gpus"),
        ({"ray": {"object_store_mb": 1}}, "ray.object_store_mb"),
        # Bound nothing once started ("router port :20297 cannot be bound": docsdrift, s37).
        ({"router": {"host": ""}}, "router.host: is empty"),
        ({"decode": {"metrics_host": " "}}, "decode.metrics_host: is empty"),
        ({"router": {"http_host": ""}}, "router.http_host: is empty"),  # bound 0.0.0.0
        # One [security] table: it was named `router.security.` (docsdrift).
        ({"security": {"tls_key_file": "k.pem"}}, "security.tls_key_file:"),
        ({"decode": {"security": {"tls_key_file": "k.pem"}}}, "decode.security.tls_key_file:"),
        # A key missing beside its partner in the role's table: the role's (ownfix B).
        ({"decode": {"security": {"tls_cert_file": "c.pem"}}}, "decode.security.tls_key_file:"),
    ],
)
def test_values_epd_serve_would_fail_on_are_refused_by_the_check(
    table: dict[str, object], key: str
) -> None:
    # Each passed `epd config --check`, then failed in `epd serve` with a traceback (or, a
    # port past 65535, listened elsewhere).
    from cluster.settings import EpdSettings

    with pytest.raises(SettingsError, match="^" + re.escape(key)):
        from_mapping(EpdSettings, table).check()


def test_several_routers_on_ports_apart_are_fine() -> None:
    from cluster.settings import EpdSettings

    table = {"router": {"port": 20140, "http_port": 20142, "metrics_port": 0}}
    from_mapping(EpdSettings, {**table, "pools": {"routers": 2}}).check()
    from_mapping(
        EpdSettings, {"router": {"port": 0, "http_port": 1}, "pools": {"routers": 9}}
    ).check()


def test_a_role_process_refuses_an_unknown_log_level() -> None:
    from router.__main__ import parse

    with pytest.raises(SystemExit):
        parse(["--log-level", "bogus", "--port", "0", "--insecure"])


# Numeric settings where -1 means something (every other one refuses -1 and NaN).
