"""The `epd` command line without Ray: parsing, the config file, turning media into messages,
and the errors and help of the subcommands' flags. The client commands against a fake router
are in test_cli_router_commands.py."""

from __future__ import annotations

import itertools
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cluster.cli import build_messages, build_parser, frame_files, load_settings, main
from cluster.settings import EpdSettings, defaults_toml, reference_markdown
from common.settings.schema import from_mapping

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------- config, parsing


def test_print_defaults_uncommented_is_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--print-defaults"]) == 0
    text = capsys.readouterr().out
    assert text == defaults_toml()
    # Every value line is "# key = value" right after its "# help" line; uncommenting the
    # value lines (unset ones stay out) must give back exactly the defaults.
    lines = text.splitlines()
    uncommented = []
    for previous, line in itertools.pairwise(lines):
        if line.startswith("[") or (
            previous.startswith("# ") and re.match(r"^# \w+ = ", line) and "(unset)" not in line
        ):
            uncommented.append(line.removeprefix("# "))
    data = tomllib.loads("\n".join(uncommented))
    assert from_mapping(EpdSettings, data) == EpdSettings()
    assert {"router", "encoder", "prefill", "decode", "pools", "ray"} <= set(data)


def test_docs_config_md_is_up_to_date() -> None:
    docs = (ROOT / "docs" / "config.md").read_text()
    assert docs == reference_markdown(), (
        "docs/config.md is stale: run `python -m epd config --markdown > docs/config.md`"
    )


def test_every_setting_is_documented() -> None:
    from common.settings.schema import describe

    for key, _default, help_text in describe(EpdSettings):
        assert help_text.strip(), f"{key} has no help text"


def test_config_file_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "epd.toml"
    path.write_text(
        'model = "/models/qwen3-vl"\n'
        "[router]\nport = 6000\n"
        "[pools]\nprefill_replicas = 2\ndecode_replicas = 3\n"
        '[ray]\naddress = "10.0.0.1:6379"\n'
    )
    args = build_parser().parse_args(
        ["serve", "--config", str(path), "--pools-prefill-replicas", "4", "--address", "auto"]
    )
    settings = load_settings(args)
    assert settings.router.port == 6000
    assert settings.pools.initial_replicas() == {"encoder": 1, "prefill": 4, "decode": 3}
    assert settings.ray.address == "auto"  # --address wins over the file
    roles = settings.role_settings()
    assert {s.model for s in roles.values()} == {"/models/qwen3-vl"}
    assert settings.with_model().router.model == "/models/qwen3-vl"


def test_serve_flags_cover_every_section() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--router-port=0",
            "--encoder-cache-bytes=1024",
            "--prefill-num-blocks=64",
            "--decode-max-batch=4",
            "--ray-num-cpus=2",
            "--log-level=info",
        ]
    )
    settings = load_settings(args)
    assert settings.router.port == 0
    assert settings.encoder.cache_bytes == 1024
    assert settings.prefill.num_blocks == 64
    assert settings.decode.max_batch == 4
    assert settings.ray.num_cpus == 2
    assert settings.log_level == "info"
    assert settings.ray.address is None


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (
            "[pools]\nprefil_replicas = 2\n",
            r"pools\.prefil_replicas .*did you mean pools\.prefill_replicas",
        ),
        ("[router]\nport = 'x'\n", r"router\.port"),
        # A fixed worker port with 2 replicas: `epd serve` failed after 50 s of starting.
        ("[pools]\nprefill_replicas = 2\n[prefill]\nport = 6123\n", r"prefill\.port: a fixed"),
        ("[pools]\ndecode_replicas = 2\n[decode]\nmetrics_port = 9500\n", r"decode\.metrics_port"),
        ("[gpu]\nx = 1\n", r"unknown setting gpu"),
    ],
)
def test_config_errors_name_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, named: str
) -> None:
    path = tmp_path / "epd.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        main(["config", "--check", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert re.search(named, err) and err.count(str(path)) == 1, err  # it was named twice
    with pytest.raises(SystemExit):
        main(["serve", "--config", str(path)])  # serve refuses it before starting anything


def test_config_check_accepts_a_good_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "epd.toml"
    path.write_text("[pools]\nprefill_replicas = 2\n")
    assert main(["config", "--check", str(path)]) == 0
    assert "ok" in capsys.readouterr().out


def test_bad_flag_value_names_the_setting(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--router-port", "fifty"])
    assert exc.value.code == 2
    assert "router.port" in capsys.readouterr().err


def test_scale_needs_a_known_role() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["scale", "--role", "router", "--replicas", "2"])


def test_admin_commands_fail_in_one_line_not_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Each was a traceback: an unreadable CA file, a negative count (past the wire's
    # uint32), a key from a file with its newline (no valid header value).
    with pytest.raises(SystemExit) as exc:
        main(["status", "--tls-ca-file", str(tmp_path / "none.pem"), "--address", "127.0.0.1:1"])
    err = capsys.readouterr().err  # an argument the client refuses, naming it: a usage error
    assert exc.value.code == 2 and "tls-ca-file: cannot read" in err and "none.pem" in err
    with pytest.raises(SystemExit) as exc:
        main(["scale", "--role", "prefill", "--replicas", "-1"])
    assert exc.value.code == 2 and "-1 is negative" in capsys.readouterr().err
    from common.settings.api_keys import default_api_key

    monkeypatch.setenv("EPD_API_KEY", "epd-key\n")
    assert default_api_key() == "epd-key"
    assert build_parser().parse_args(["status", "--api-key", " k\n"]).api_key == "k"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        # An empty $EPD_ROUTER or a stray comma: IndexError tracebacks, and drain/undrain
        # told no router and exited 0 with no output.
        (["status", "--address", ""], "--address: no router address given"),
        (["drain", "decode", "--address", " , "], "--address: no router address given"),
        (["undrain", "decode", "--address", ","], "--address: no router address given"),
        (["generate", "hi", "--address", ""], "router address: none given"),
        # gRPC dialed 99999 as 34463 (another server's port) and an empty port as 443.
        (["status", "--address", "127.0.0.1:99999"], "the port must be 1-65535"),
        (["drain", "decode", "--address", "a:1,127.0.0.1:"], "the port must be 1-65535"),
        (["generate", "hi", "--address", "127.0.0.1:99999"], "the port must be 1-65535"),
        # A key no header can carry: a gRPC traceback, or INTERNAL naming nothing.
        (["status", "--address", "127.0.0.1:1", "--api-key", "k\u00e9y"], "--api-key"),
        (["generate", "hi", "--address", "127.0.0.1:1", "--api-key", "k\ty"], "api_key"),
        (["scale", "--role", "decode", "--replicas", "1", "--timeout", "nan"], "--timeout"),
    ],
)
def test_cli_arguments_no_router_could_use_are_one_line_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and says in err and "Traceback" not in err, err


def test_a_bad_router_address_from_the_environment_is_named_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # It read "--address: router address 'bogus': no port" (s42 operator review L4).
    monkeypatch.setenv("EPD_ROUTER", "bogus")
    with pytest.raises(SystemExit) as exc:
        main(["status"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "$EPD_ROUTER: router address 'bogus': no port" in err, err


def test_a_ca_file_that_is_no_ca_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # gRPC said only "Failed to create security handshaker", after C-core log lines.
    ca = tmp_path / "hostname"
    ca.write_text("not a certificate\n")
    with pytest.raises(SystemExit) as exc:
        main(["status", "--tls-ca-file", str(ca), "--address", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{ca} holds no PEM certificate" in err, err


# ------------------------------------------------------------------------------ messages


@pytest.fixture
def frames(tmp_path: Path) -> Path:
    folder = tmp_path / "frames"
    folder.mkdir()
    for i in (2, 0, 1):
        Image.fromarray(np.full((32, 32, 3), i * 50, np.uint8)).save(folder / f"f{i:02d}.png")
    (folder / "notes.txt").write_text("not a frame")
    return folder


def test_video_frames_are_the_images_of_the_folder_in_name_order(frames: Path) -> None:
    assert [p.name for p in frame_files(frames)] == ["f00.png", "f01.png", "f02.png"]
    with pytest.raises(ValueError, match="nor a folder"):
        frame_files(frames / "f00.png")
    empty = frames.parent / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no image files"):
        frame_files(empty)


def test_build_messages_puts_media_before_the_text(frames: Path) -> None:
    image = frames / "f00.png"
    messages = build_messages("what happens?", [image], [frames], fps=4.0, system="be brief")
    assert [m["role"] for m in messages] == ["system", "user"]
    parts = messages[1]["content"]
    assert [p["type"] for p in parts] == ["image", "video", "text"]
    assert parts[0]["image"] == image.read_bytes()
    assert len(parts[1]["video"]) == 3 and parts[1]["fps"] == 4.0
    assert parts[2]["text"] == "what happens?"


# ------------------------------------------------------------------- flag errors and help


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["generate", "hi", "--imag", "x.png"], "usage: epd generate"),
        (["status", "--bogus"], "usage: epd status"),
        (["scale", "--role", "prefill", "--replica", "2"], "usage: epd scale"),
        (["drain", "h:1", "--addr", "h:2"], "usage: epd drain"),
    ],
)
def test_a_wrong_or_abbreviated_flag_is_the_subcommands_error(
    argv: list[str], usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage)
    assert f"{usage[7:]}: error:" in err


def test_role_parser_does_not_take_abbreviations() -> None:
    from common.server.main import build_parser as role_parser

    src = Path(__file__).parents[1] / "common" / "server" / "main.py"
    assert "allow_abbrev=False" in src.read_text()
    assert callable(role_parser)


def test_status_help_explains_every_column(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["status", "--help"])
    out = capsys.readouterr().out
    for column in ("ROLE", "NAME", "ADDRESS", "LOAD", "ROUTED", "KV USED/FREE", "CACHE HITS"):
        assert f"  {column}  " in out
    assert "SEEN" in out and "STATE" in out


def test_an_unauthenticated_command_says_where_it_looked_for_its_key(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # `epd serve --ray-namespace X` wrote the keys under X; `epd status` read the default
    # namespace's and said only UNAUTHENTICATED.
    import grpc

    import cluster.cli

    async def refused(args: object) -> int:
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            details="needs valid credentials",
        )

    monkeypatch.setattr(cluster.cli, "cmd_status", refused)
    monkeypatch.setenv("EPD_HOME", str(tmp_path))
    monkeypatch.delenv("EPD_API_KEY", raising=False)
    monkeypatch.delenv("EPD_NAMESPACE", raising=False)
    with pytest.raises(SystemExit):
        main(["status"])
    err = capsys.readouterr().err
    assert str(tmp_path / "epd" / "admin_key") in err and "EPD_NAMESPACE" in err
    # No such file (serve given a keys file writes none): it says so, and --api-key first.
    assert f"no key file at {tmp_path / 'epd' / 'admin_key'}: give --api-key" in err
    (tmp_path / "epd").mkdir()
    (tmp_path / "epd" / "admin_key").write_text("k" * 32)
    with pytest.raises(SystemExit):
        main(["status"])
    assert f"read {tmp_path / 'epd' / 'admin_key'}: set $EPD_NAMESPACE" in capsys.readouterr().err

    async def refused_generate(args: object) -> int:  # epd.client's error, said without
        from epd.client import GenerateError

        raise GenerateError(grpc.StatusCode.UNAUTHENTICATED, "needs valid credentials")

    monkeypatch.setattr(cluster.cli, "cmd_generate", refused_generate)
    with pytest.raises(SystemExit):
        main(["generate", "hi"])
    err = capsys.readouterr().err
    assert str(tmp_path / "epd" / "client_key") in err and "EPD_NAMESPACE" in err


def test_every_pem_certificate_form_gRPC_takes_is_a_ca_file(tmp_path: Path) -> None:
    # The check took only "BEGIN CERTIFICATE": RHEL's bundles hold TRUSTED CERTIFICATEs.
    from common.server.credentials import read_ca

    for kind in ("CERTIFICATE", "TRUSTED CERTIFICATE", "X509 CERTIFICATE"):
        ca = tmp_path / "ca.pem"
        ca.write_text(f"# a bundle\n-----BEGIN {kind}-----\nMII=\n-----END {kind}-----\n")
        assert read_ca(ca) == ca.read_bytes()
