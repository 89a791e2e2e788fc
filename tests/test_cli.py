"""The `epd` command line without Ray: parsing, the config file, and the client commands
against a fake router (a real gRPC server on 127.0.0.1 with canned answers)."""

from __future__ import annotations

import itertools
import re
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from cluster.admin import cmd_drain, cmd_scale, cmd_status
from cluster.cli import build_messages, build_parser, cmd_generate, frame_files, load_settings, main
from cluster.settings import EpdSettings, defaults_toml, reference_markdown
from common.server.rpc import start_server
from common.settings.schema import from_mapping
from epd.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    decode_service_pb2,
    registry_service_pb2,
    router_service_pb2,
    router_service_pb2_grpc,
)

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
    assert re.search(named, capsys.readouterr().err)
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


# --------------------------------------------------------------------- against a router


class FakeRouter(router_service_pb2_grpc.RouterServiceServicer):
    """Streams a canned three-chunk answer and records the request."""

    def __init__(self) -> None:
        self.requests: list[router_service_pb2.GenerateRequest] = []

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.requests.append(request)
        yield router_service_pb2.GenerateResponse(
            token_ids=[5], text="Hel", prompt_tokens=40, cached_tokens=32
        )
        yield router_service_pb2.GenerateResponse(
            token_ids=[6], text="lo", blocks_reused=2, blocks_pulled=1
        )
        yield router_service_pb2.GenerateResponse(
            token_ids=[7], text="!", finish_reason=decode_service_pb2.FINISH_REASON_LENGTH
        )


class FakeAdmin(admin_service_pb2_grpc.AdminServiceServicer):
    """A registry whose pools take the size the last Scale asked for."""

    def __init__(self) -> None:
        self.sizes: dict[Any, int] = {1: 1, 2: 1, 3: 1}  # wire role -> pool size
        self.scaled: list[tuple[int, int]] = []

    async def Status(self, request: Any, context: Any) -> admin_service_pb2.StatusResponse:
        response = admin_service_pb2.StatusResponse(model="tiny", active_requests=1)
        for role, n in self.sizes.items():
            for i in range(n):
                worker = response.workers.add(
                    worker_id=f"w{role}{i}",
                    info=registry_service_pb2.WorkerInfo(
                        role=role, address=f"127.0.0.1:{7000 + 10 * role + i}", name=f"w-{role}-{i}"
                    ),
                    router_in_flight=1,
                    seconds_since_heartbeat=0.5,
                )
                worker.load.active_requests = 1
                worker.load.kv_blocks_used = 3
                worker.load.kv_blocks_free = 61
                worker.load.cache_hits = 2
                worker.load.cache_lookups = 5
        return response

    async def Scale(self, request: Any, context: Any) -> admin_service_pb2.ScaleResponse:
        self.scaled.append((request.role, request.replicas))
        self.sizes[request.role] = request.replicas
        return admin_service_pb2.ScaleResponse(replicas=request.replicas)

    async def Drain(self, request: Any, context: Any) -> admin_service_pb2.DrainResponse:
        return admin_service_pb2.DrainResponse(found=request.address == "127.0.0.1:7030")


@pytest.fixture
async def router() -> AsyncIterator[tuple[str, FakeRouter, FakeAdmin]]:
    fake_router, fake_admin = FakeRouter(), FakeAdmin()
    server = await start_server(
        [
            lambda s: router_service_pb2_grpc.add_RouterServiceServicer_to_server(fake_router, s),
            lambda s: admin_service_pb2_grpc.add_AdminServiceServicer_to_server(fake_admin, s),
        ],
        host="127.0.0.1",
    )
    try:
        yield server.address, fake_router, fake_admin
    finally:
        await server.stop(0)


async def test_generate_streams_text_then_timings_and_block_counts(
    router: tuple[str, FakeRouter, FakeAdmin], frames: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address, fake, _ = router
    args = build_parser().parse_args(
        [
            "generate",
            "hi",
            "--video",
            str(frames),
            "--fps",
            "3",
            "--max-tokens",
            "3",
            "--seed",
            "1",
            "--address",
            address,
        ]
    )
    assert await cmd_generate(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Hello!"
    assert re.match(r"--- 3 tokens \(length\); TTFT \d+ ms, [\d.]+ tokens/s", out[1])
    assert out[2] == (
        "--- prompt 40 tokens, 32 from prefix cache; KV blocks at decode: 2 reused, 1 pulled"
    )
    (request,) = fake.requests
    assert request.sampling.max_tokens == 3 and request.sampling.seed == 1
    video = request.messages[0].content[0].video
    assert len(video.frames) == 3 and video.fps == 3.0


async def test_generate_sends_a_video_file_with_its_sample_rate(
    router: tuple[str, FakeRouter, FakeAdmin], tmp_path: Path
) -> None:
    address, fake, _ = router
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"\x00\x00\x00\x18ftypmp42 the router decodes this")
    argv = ["generate", "hi", "--video", str(clip), "--fps", "2", "--address", address]
    assert await cmd_generate(build_parser().parse_args(argv)) == 0
    video = fake.requests[0].messages[0].content[0].video
    assert video.file == clip.read_bytes() and not video.frames and video.fps == 2.0


async def test_status_lists_every_worker(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    address, _, _ = router
    assert await cmd_status(build_parser().parse_args(["status", "--address", address])) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"router {address}  model tiny")
    assert out[1].split() == [
        "ROLE",
        "NAME",
        "ADDRESS",
        "LOAD",
        "ROUTED",
        "KV",
        "USED/FREE",
        "CACHE",
        "HITS",
        "SEEN",
        "STATE",
    ]
    rows = [line.split() for line in out[2:-1]]
    assert [r[0] for r in rows] == ["encoder", "prefill", "decode"]
    assert rows[0][5] == "-"  # encoders have no KV blocks
    assert rows[1][:6] == ["prefill", "w-2-0", "127.0.0.1:7020", "1", "1", "3/61"]
    assert rows[1][6] == "2/5"


async def test_scale_asks_the_router_and_waits_for_the_pool(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    address, _, admin = router
    args = build_parser().parse_args(
        ["scale", "--role", "prefill", "--replicas", "3", "--address", address]
    )
    assert await cmd_scale(args) == 0
    assert admin.scaled == [(registry_service_pb2.WORKER_ROLE_PREFILL, 3)]
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "prefill: 1 worker serving -> 3 workers"
    assert out[1].startswith("prefill: 3 workers serving")


async def test_drain_reports_unknown_workers(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    address, _, _ = router
    parser = build_parser()
    assert (
        await cmd_drain(parser.parse_args(["drain", "127.0.0.1:7030", "--address", address])) == 0
    )
    assert await cmd_drain(parser.parse_args(["drain", "127.0.0.1:1", "--address", address])) == 1
    out = capsys.readouterr().out
    assert "127.0.0.1:7030: draining" in out and "no registered worker at 127.0.0.1:1" in out


def test_commands_report_an_unreachable_router(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["status", "--address", "127.0.0.1:1"])
    assert exc.value.code == 1
    assert "status failed: UNAVAILABLE" in capsys.readouterr().err


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
