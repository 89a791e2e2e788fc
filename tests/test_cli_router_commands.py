"""The `epd` client commands against a fake router (a real gRPC server on 127.0.0.1 with
canned answers): `generate` streams text then timings and block counts, `status` lists every
worker, `drain` reports unknown workers, and an unreachable router is a one-line error
(`scale`: tests.test_cli_scale, over the `FakeAdmin` here)."""

from __future__ import annotations

import argparse
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from cluster.admin import cmd_drain, cmd_status
from cluster.cli import build_parser, cmd_generate, main
from common.server.rpc import start_server
from epd.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    decode_service_pb2,
    registry_service_pb2,
    router_service_pb2,
    router_service_pb2_grpc,
)
from tests.test_cli import frames

__all__ = ["frames"]  # fixture shared with test_cli


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
        self.failed = ["epd-encoder-3 failed to start: SettingsError: port 9 is in use"]
        self.starts_fail = False  # a Scale's new workers fail to start
        self.found_dead = False  # a Scale finds a worker dead for good, and replaces it
        self.grows = True  # a Scale's workers come up
        self.polls = 0  # Status calls answered
        self.dies_at = 0  # from this Status on (0: never), a worker died for good is told
        # The names of the draining prefill workers at each Status (the last list from then on)
        self.draining: list[list[str]] = [[]]
        self.drained: set[str] = set()  # of those, drained by an operator (`epd drain`)
        self.tells = False  # a Scale says the dead it replaced (`tells_replaced`)
        self.drains: set[str] = set()  # the addresses Drain found

    async def Status(self, request: Any, context: Any) -> admin_service_pb2.StatusResponse:
        self.polls += 1
        if self.dies_at and self.polls >= self.dies_at:
            self.failed = ["epd-prefill-1 died for good: it crashed again"]
            self.sizes[2] = 1
        response = admin_service_pb2.StatusResponse(
            model="tiny",
            active_requests=1,
            waiting=["epd-decode-1 waits for Ray resources: asks CPU 4"],
            refused_registrations=["127.0.0.1:9: encoder worker serves model 'other'"],
            failed_starts=self.failed,
            dropped_workers=["decode w-3-1 127.0.0.1:7031: no heartbeat for 5 s, dropped 9 s ago"],
        )
        for role, n in self.sizes.items():
            for i in range(n):
                worker = response.workers.add(
                    worker_id=f"w{role}{i}",
                    info=registry_service_pb2.WorkerInfo(
                        role=role, address=f"127.0.0.1:{7000 + 10 * role + i}", name=f"w-{role}-{i}"
                    ),
                    router_in_flight=1,
                    seconds_since_heartbeat=0.5,
                    suspect=role == 3,
                    draining=f"127.0.0.1:{7000 + 10 * role + i}" in self.drains,
                )
                worker.load.active_requests = 1
                if role != 3:  # the decode worker has not heartbeated yet
                    worker.load.kv_blocks_used = 3
                    worker.load.kv_blocks_free = 61
                worker.load.cache_hits = 2
                worker.load.cache_lookups = 5
        for name in self.draining[min(self.polls, len(self.draining)) - 1]:
            response.workers.add(
                worker_id=f"id-{name}-{self.polls}",  # a registration again: a new id
                info=registry_service_pb2.WorkerInfo(
                    role=registry_service_pb2.WORKER_ROLE_PREFILL, address="127.0.0.1:9", name=name
                ),
                draining=True,
                drained=name in self.drained,
            )
        return response

    async def Scale(self, request: Any, context: Any) -> admin_service_pb2.ScaleResponse:
        self.scaled.append((request.role, request.replicas))
        role = ("encoder", "prefill", "decode")[request.role - 1]
        cleared = [w for w in self.failed if f"-{role}-" in w]
        self.failed = [w for w in self.failed if f"-{role}-" not in w]  # as the pools clear
        if self.starts_fail:
            self.failed = [f"epd-prefill-{n} failed to start: boom" for n in range(2, 4)]
        elif self.grows:
            if self.found_dead:
                self.failed = ["epd-prefill-0 died for good: it crashed"]
            self.sizes[request.role] = request.replicas
        response = admin_service_pb2.ScaleResponse(replicas=request.replicas)
        if self.tells:
            response.replaced.extend(cleared + self.failed)
            response.tells_replaced = True
        return response

    async def Drain(self, request: Any, context: Any) -> admin_service_pb2.DrainResponse:
        found = request.address in ("127.0.0.1:7030", "127.0.0.1:7020", "127.0.0.1:7021")
        if found:
            self.drains.add(request.address)
        return admin_service_pb2.DrainResponse(found=found)


def scale_prefill(address: str, replicas: int, *flags: str) -> argparse.Namespace:
    """`epd scale --role prefill --replicas N [flags]` against `address`, parsed."""
    command = ["scale", "--role", "prefill", "--replicas", str(replicas), *flags]
    return build_parser().parse_args([*command, "--address", address])


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
    # After the counts line: what the table cannot show (a worker waiting to be placed, one
    # whose start failed, one gone silent, one the router refused and so never listed).
    assert out[-4:] == [
        "waiting: epd-decode-1 waits for Ray resources: asks CPU 4",
        "failed: epd-encoder-3 failed to start: SettingsError: port 9 is in use",
        "dropped: decode w-3-1 127.0.0.1:7031: no heartbeat for 5 s, dropped 9 s ago",
        "refused: 127.0.0.1:9: encoder worker serves model 'other'",
    ]
    rows = [line.split() for line in out[2:-5]]
    assert [r[0] for r in rows] == ["encoder", "prefill", "decode"]
    assert rows[0][5] == "-"  # encoders have no KV blocks
    assert rows[1][:6] == ["prefill", "w-2-0", "127.0.0.1:7020", "1", "1", "3/61"]
    assert rows[1][6] == "2/5"
    assert rows[2][5] == "?"  # no heartbeat yet: not a full pool of 0 blocks
    assert [r[-1] for r in rows] == ["serving", "serving", "suspect"]  # a call on it failed


async def test_drain_reports_unknown_workers(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    address, _, _ = router
    parser = build_parser()
    assert (
        await cmd_drain(parser.parse_args(["drain", "127.0.0.1:7030", "--address", address])) == 0
    )
    assert await cmd_drain(parser.parse_args(["drain", "127.0.0.1:1", "--address", address])) == 1
    out, err = capsys.readouterr()
    assert "127.0.0.1:7030: draining" in out and "no registered worker at 127.0.0.1:1" in err
    # The only decode worker: said (a drain took every router out of a Service's endpoints
    # without a word, their readiness failing: operator2 review M1, s44).
    assert "127.0.0.1:7030: it was the last serving decode worker" in err


async def test_drain_of_one_of_two_workers_of_a_role_says_nothing_more(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    address, _, admin = router
    admin.sizes[2] = 2  # prefill: 127.0.0.1:7020 and :7021
    drain = build_parser().parse_args(["drain", "127.0.0.1:7020", "--address", address])
    assert await cmd_drain(drain) == 0
    assert "last serving" not in capsys.readouterr().err
    drain = build_parser().parse_args(["drain", "127.0.0.1:7021", "--address", address])
    assert await cmd_drain(drain) == 0
    assert "it was the last serving prefill worker" in capsys.readouterr().err


async def test_drain_beside_only_suspect_workers_says_they_are(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    # The other decode worker is suspect (a call on it failed: dead, maybe, not yet
    # dropped): nothing was said (s44diff review, s45). The router still picks it and stays
    # ready, so not that it was the last (ownfixA F2, s45).
    address, _, admin = router
    admin.sizes[3] = 2  # decode: 127.0.0.1:7030 and :7031, both suspect here
    drain = build_parser().parse_args(["drain", "127.0.0.1:7030", "--address", address])
    assert await cmd_drain(drain) == 0
    err = capsys.readouterr().err
    assert "every other decode worker is suspect" in err and "last serving" not in err


def test_commands_report_an_unreachable_router(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["status", "--address", "127.0.0.1:1"])
    assert exc.value.code == 1
    assert "status failed: UNAVAILABLE" in capsys.readouterr().err


def test_drain_of_an_empty_worker_is_refused_naming_the_argument(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for command in ("drain", "undrain"):
        with pytest.raises(SystemExit) as exc:
            main([command, " ", "--address", "127.0.0.1:1"])  # refused before any call
        assert exc.value.code == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("epd: error: WORKER: ")
