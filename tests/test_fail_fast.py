"""Operator mistakes fail fast with one line naming the key or the address: bad settings
(`epd config --check`, and `epd serve` before Ray starts) and a port already in use."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.settings import EpdSettings
from common.server.role import _role_name
from common.server.rpc import start_server, wait_healthy
from common.settings.schema import SettingsError, load
from common.settings.security import SecuritySettings, named_by_table
from decode_worker.settings import DecodeSettings


def _model_folder(tmp_path: Path, *files: str) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name in files:
        (folder / name).write_text("{}")
    return folder


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """`epd serve` must stop at its checks: the step after them fails the test instead."""

    def past_the_checks(settings: object) -> None:
        raise AssertionError("epd serve got past its checks")

    monkeypatch.setattr("cluster.serve._prepare_checkpoint", past_the_checks)


BAD_FILES = [
    ('[decode]\ndtype = "fp8"\n', r"decode\.dtype: expected one of"),
    ("[prefill]\nblock_size = 16\n[decode]\nblock_size = 32\n", r"prefill\.block_size"),
    ("[prefill]\nblock_size = 0\n[decode]\nblock_size = 0\n", r"prefill\.block_size"),
    ("[decode]\nmax_batch = 0\n", r"decode\.max_batch: must be positive"),
    ('model = "/no/such/checkpoint"\n', r"model: /no/such/checkpoint does not exist"),
    ('[encoder]\nmodel = "/no/such/checkpoint"\n', r"encoder\.model: .* does not exist"),
    ("[pools]\ndecode_replicas = -1\n", r"pools\.decode_replicas"),
    ("[router]\nhttp_port = 70000\n", r"router\.http_port"),
    # These passed the check and failed in `epd serve` only after Ray started (new-user
    # review): a keys file it cannot read, a port given twice.
    # Named by the table they are in: [security], every role's (docsdrift review, s37).
    (
        '[security]\napi_keys_file = "/no/keys.toml"\n',
        r"(^|: )security\.api_keys_file: cannot read /no/keys\.toml",
    ),
    ('[security]\ncluster_token_file = "/no/token"\n', r"(^|: )security\.cluster_token_file"),
    (
        '[router.security]\ncluster_token_file = "/no/token"\n',
        r"router\.security\.cluster_token_file",
    ),
    ("[router]\nport = 20999\nmetrics_port = 20999\n", r"router\.metrics_port: 20999 is also"),
    ("[router]\nhttp_port = 20998\nmetrics_port = 20998\n", r"router\.metrics_port"),
    ("[decode]\nport = 20997\nmetrics_port = 20997\n", r"decode\.metrics_port"),
]


@pytest.mark.parametrize(("text", "named"), BAD_FILES)
def test_config_check_names_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, named: str
) -> None:
    path = tmp_path / "epd.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        main(["config", "--check", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err  # one line
    assert re.search(named, err), err


@pytest.mark.parametrize(("text", "named"), BAD_FILES)
def test_serve_prechecks_before_ray(
    no_ray: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, named: str
) -> None:
    path = tmp_path / "epd.toml"
    path.write_text(text)
    # cmd_serve's first step, called directly: no Ray.
    with pytest.raises(SettingsError, match=named):
        load(EpdSettings, path).check()
    # And through `epd serve`: exit 2 with the line (the check runs before Ray is imported).
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--config", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(named, err), err


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json"])
def test_model_folder_names_the_missing_file(tmp_path: Path, missing: str) -> None:
    present = [f for f in ("config.json", "tokenizer.json") if f != missing]
    folder = _model_folder(tmp_path, *present)
    with pytest.raises(SettingsError, match=rf"^model: .* has no {re.escape(missing)}$"):
        EpdSettings(model=str(folder)).check()


def test_good_settings_pass(tmp_path: Path) -> None:
    EpdSettings().check()  # defaults (built-in tiny model; secrets made by `epd serve`)
    folder = _model_folder(tmp_path, "config.json", "tokenizer.json")
    EpdSettings(model=str(folder)).check()


# ------------------------------------------------------------------------- port in use


async def test_second_server_on_a_taken_port_refuses() -> None:
    first = await start_server([], service_names=["epd.v1.RouterService"])
    try:
        port = int(first.address.rsplit(":", 1)[1])
        with pytest.raises(SettingsError) as exc:
            await start_server([], port=port, name="router")
        assert str(exc.value) == (
            f"router port 127.0.0.1:{port} is in use; set `port` to a free one (0: any free port)"
        )
        await wait_healthy(first.address, timeout_s=5.0)  # the first keeps serving
    finally:
        await first.stop(0)


async def test_bad_host_names_host_and_port() -> None:
    with pytest.raises(SettingsError, match=r"^server port 203\.0\.113\.7:0 cannot be bound"):
        await start_server([], host="203.0.113.7")  # TEST-NET-3: not this machine's


def test_role_name_for_messages() -> None:
    assert _role_name(["epd.v1.RouterService", "epd.v1.AdminService"]) == "router"
    assert _role_name(["epd.v1.DecodeService"]) == "decode"
    assert _role_name([]) == "server"


async def test_second_http_api_on_a_taken_port_refuses() -> None:
    from fastapi import FastAPI

    from router.http.server import HttpServer

    first = HttpServer(FastAPI(), "127.0.0.1", 0, 1 << 20, 5.0)
    await first.start()
    try:
        port = int(first.address.rsplit(":", 1)[1])
        with pytest.raises(SettingsError, match=rf"^http_port: .*127\.0\.0\.1:{port} "):
            HttpServer(FastAPI(), "127.0.0.1", port, 1 << 20, 5.0)
    finally:
        await first.stop()


@pytest.mark.parametrize("key", ["router.port", "router.http_port"])
def test_serve_refuses_a_taken_router_port_before_ray(
    no_ray: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        path = tmp_path / "epd.toml"
        path.write_text(f"[router]\n{key.split('.')[1]} = {port}\n")
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--config", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{key}: 127.0.0.1:{port} is in use" in err


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_a_role_started_on_a_taken_port_exits_with_one_line(tmp_path: Path, flag: str) -> None:
    """`python -m router` on a port another server holds: exit 2, one line, no traceback
    (the HTTP API's was a traceback)."""
    import socket
    import subprocess
    import sys

    from tests.cluster import ROOT, cluster_security

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    security = cluster_security()
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "router",
                f"--port={port if flag == '--port' else 0}",
                f"--http-port={port if flag == '--http-port' else -1}",
                f"--security-cluster-token-file={security.cluster_token_file}",
                f"--security-api-keys-file={security.api_keys_file}",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        holder.close()
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert f"127.0.0.1:{port}" in last and ("in use" in last or "Address already" in last), last


# ------------------------------------------------------------------- fail-fast leftovers


def test_a_role_model_that_differs_from_model_is_one_line(
    no_ray: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    top = _model_folder(tmp_path, "config.json", "tokenizer.json")
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", str(top), "--decode-model", str(other)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"decode.model: {other} differs from model" in err, err
    EpdSettings(model=str(top), decode=DecodeSettings(model=str(top))).check()  # same: fine


NO_HTTP = ["--router-http-port=0"]


def test_serve_address_auto_without_ray_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import ray

    def no_cluster(**kwargs: object) -> None:  # what ray.init raises with no Ray running
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr("cluster.serve._prepare_checkpoint", lambda settings: None)
    monkeypatch.setattr(ray, "init", no_cluster)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--address", "auto", "--insecure", "--router-port=0", *NO_HTTP])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ray.address: no Ray cluster at 'auto'" in err, err
    assert "RAY_AUTH_MODE" not in err  # Ray loads a token itself for `auto`
    # Another address: a cluster that takes Ray's token only answers as if there were none,
    # and Ray does not send one there unless told (raypools review, s33).
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(SystemExit):
        main(["serve", "--address", "10.0.0.1:6379", "--insecure", "--router-port=0", *NO_HTTP])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "set RAY_AUTH_MODE=token" in err, err


@pytest.mark.parametrize("fps", ["0", "-1", "nan"])
def test_generate_fps_not_positive_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fps: str
) -> None:
    assert main(["generate", "hi", "--video", str(tmp_path), "--fps", fps]) == 2
    out = capsys.readouterr()
    assert out.out.strip() == f"epd: --fps: must be positive, got {float(fps):g}"
    assert "Traceback" not in out.err


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--image", "nosuch.png"], "epd: --image nosuch.png: No such file or directory"),
        (["--image", "./nosuch.png"], "epd: --image nosuch.png: No such file or directory"),
        (["--max-tokens", "0"], "epd: --max-tokens: max_tokens must be "),
        (["--temperature", "-1"], "epd: --temperature: temperature "),
        (["--seed", str(1 << 64)], "epd: --seed: seed "),
    ],
)
def test_generate_names_the_flag_it_refuses(
    capsys: pytest.CaptureFixture[str], flags: list[str], said: str
) -> None:
    # A bare "[Errno 2] ..." for a missing --image; the setting's name for a sampling flag
    # (newuser review, s41).
    assert main(["generate", "hi", *flags]) == 2
    out = capsys.readouterr()
    assert out.out.startswith(said) and out.out.count("\n") == 1, out.out
    assert "Traceback" not in out.err


async def test_a_refused_worker_is_remembered_with_its_reason() -> None:
    import grpc

    from common.roles import Role
    from epd.v1 import registry_service_pb2, registry_service_pb2_grpc
    from router.registry import Registry
    from router.registry_service import RegistryServicer
    from tests.registry_helpers import MODEL, info

    registry = Registry(worker_timeout_s=60.0, heartbeat_interval_s=1.0, expected_model=MODEL)
    servicer = RegistryServicer(registry)
    server = await start_server(
        [lambda s: registry_service_pb2_grpc.add_RegistryServiceServicer_to_server(servicer, s)]
    )
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = registry_service_pb2_grpc.RegistryServiceStub(ch)
            wrong = info(Role.DECODE, 7001, model="another/model")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Register(registry_service_pb2.RegisterRequest(worker=wrong))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "another/model" in registry.refusals["127.0.0.1:7001"]
            right = info(Role.DECODE, 7001)
            await stub.Register(registry_service_pb2.RegisterRequest(worker=right))
            assert registry.refusals == {}  # it came back with the right settings
    finally:
        await server.stop(0)


@pytest.mark.parametrize(
    ("own", "shared", "named"),
    [
        # Both files the role's own: both keys its table's (the second was `security.`'s).
        (
            ("c.pem", "k.pem"),
            ("", ""),
            "router.security.tls_cert_file, router.security.tls_key_file",
        ),
        ((None, None), ("c.pem", "k.pem"), "security.tls_cert_file, security.tls_key_file"),
        # Each key where it is set (both were named the role's).
        ((None, "k.pem"), ("c.pem", None), "security.tls_cert_file, router.security.tls_key_file"),
    ],
)
def test_a_two_key_security_error_names_each_key_by_its_table(
    own: tuple[str | None, str | None], shared: tuple[str | None, str | None], named: str
) -> None:
    # ownfix review C (s37): a bad certificate and key named the second by the first's table.
    message = "security.tls_cert_file, security.tls_key_file: not a PEM certificate chain"
    tables = [SecuritySettings(tls_cert_file=c, tls_key_file=k) for c, k in (own, shared)]
    assert named_by_table("router", message, *tables) == named + message[message.index(":") :]


def test_a_missing_partner_is_named_by_the_table_that_sets_the_other() -> None:
    message = "security.tls_key_file: tls_cert_file and tls_key_file go together"
    own = SecuritySettings(tls_cert_file="c.pem")
    assert named_by_table("decode", message, own, SecuritySettings()).startswith("decode.security")
    assert named_by_table("decode", message, SecuritySettings(), own).startswith("security.")


def test_a_path_holding_another_keys_name_does_not_name_the_table() -> None:
    # `cannot read /no/api_keys_file` took the router's own api_keys_file as the error's
    # (s37diff review).
    message = "security.cluster_token_file: cannot read /no/api_keys_file"
    shared = SecuritySettings(cluster_token_file="/no/api_keys_file")
    own = SecuritySettings(api_keys_file="keys.toml")
    assert named_by_table("router", message, own, shared) == message


def test_only_the_keys_leading_an_error_are_renamed() -> None:
    # A path holding "security.token" was shown as "router.security.token", and a value
    # ("file") inside a key's name hid that key (ownfixD review).
    message = "security.cluster_token_file: cannot read /etc/epd/security.token"
    own = SecuritySettings(cluster_token_file="/etc/epd/security.token")
    named = named_by_table("router", message, own, SecuritySettings())
    assert named == "router." + message
    message = "security.tls_cert_file, security.tls_key_file: not a PEM certificate chain"
    own = SecuritySettings(tls_cert_file="c.pem", tls_key_file="file")
    named = named_by_table("router", message, own, SecuritySettings())
    assert named.startswith("router.security.tls_cert_file, router.security.tls_key_file:")


def test_a_value_spelled_as_its_key_does_not_hide_the_key() -> None:
    # A token file named "cluster_token_file" hid the key it was the value of (ownfixE).
    message = "security.cluster_token_file: cannot read cluster_token_file"
    own = SecuritySettings(cluster_token_file="cluster_token_file")
    named = named_by_table("router", message, own, SecuritySettings())
    assert named == "router." + message
