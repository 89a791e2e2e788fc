"""`epd scale` (`cluster.scale.cmd_scale`) against a fake router's AdminService
(`tests.test_cli_router_commands.FakeAdmin`): it asks for the pool size, then waits until
the pool has it, telling the workers that failed to start or died for good on the way, and
stops at once where waiting cannot help."""

from __future__ import annotations

import pytest

from cluster.admin import DRAINED_STAY
from cluster.scale import cmd_scale
from epd.v1 import registry_service_pb2
from tests.test_cli_router_commands import FakeAdmin, FakeRouter, scale_prefill
from tests.test_cli_router_commands import router as router  # fixture


async def test_scale_asks_the_router_and_waits_for_the_pool(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    address, _, admin = router
    args = scale_prefill(address, 3)
    assert await cmd_scale(args) == 0
    assert admin.scaled == [(registry_service_pb2.WORKER_ROLE_PREFILL, 3)]
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "prefill: 1 worker serving -> 3 workers"
    assert out[1].startswith("prefill: 3 workers serving")


async def test_scale_stops_waiting_at_a_worker_that_failed_to_start(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    # It waited the whole timeout and said only "still 1 worker serving"; the reason was
    # in `epd serve`'s console alone (walkthrough review, s39).
    address, _, admin = router
    admin.starts_fail = True
    args = scale_prefill(address, 3)
    assert await cmd_scale(args) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == [
        "prefill: epd-prefill-2 failed to start: boom; epd-prefill-3 failed to start: boom",
        "prefill: 1 worker serving; `epd scale` again starts others",
    ]


async def test_scale_tells_a_dead_worker_it_replaced_and_waits_on(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    # A worker found dead for good by the scale was cleared with the failures before it and
    # never told (raypools2 review 1); it is no start that failed: the wait goes on.
    address, _, admin = router
    admin.found_dead = True
    args = scale_prefill(address, 2)
    assert await cmd_scale(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "prefill: epd-prefill-0 died for good: it crashed"
    assert out[2].startswith("prefill: 2 workers serving (") and len(out) == 3


async def test_scale_tells_a_death_the_status_before_it_found(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    # The Status `epd scale` asks first found the dead worker; the scale cleared it with the
    # failures before replacing it: told nowhere (ownfixD review D2).
    address, _, admin = router
    admin.failed = ["epd-prefill-0 died for good: it crashed"]  # cleared by the Scale
    args = scale_prefill(address, 2)
    assert await cmd_scale(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "prefill: epd-prefill-0 died for good: it crashed"


async def test_scale_without_waiting_tells_the_deaths_it_found_and_only_its_roles(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    # With --no-wait it returned before telling them (ownfixE review E1); a decode worker's
    # line whose cause names a prefill worker was the prefill's (E5).
    address, _, admin = router
    admin.failed = [
        "epd-prefill-0 died for good: it crashed",
        "epd-decode-0 died for good: epd-prefill-0 took its port",
    ]
    args = scale_prefill(address, 2, "--no-wait")
    assert await cmd_scale(args) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "prefill: epd-prefill-0 died for good: it crashed"
    ]


async def test_scale_tells_a_death_whose_cause_says_failed_to_start_as_a_death(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    # Read as a failed start, the death the scale replaced stopped it, 1 (s41 review F6).
    address, _, admin = router
    admin.failed = ["epd-prefill-0 died for good: RuntimeError: UCX failed to start: no device"]
    args = scale_prefill(address, 2)
    assert await cmd_scale(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert (
        out[1]
        == "prefill: epd-prefill-0 died for good: RuntimeError: UCX failed to start: no device"
    )
    assert out[2].startswith("prefill: 2 workers serving (") and len(out) == 3


async def test_scale_stops_at_a_worker_that_died_while_it_waited(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    # Not replaced by this scale: the pool stays short. It waited its whole timeout
    # (ownfixD review D3).
    address, _, admin = router
    admin.failed, admin.dies_at = [], 3  # the first Status, the first poll, then it dies
    admin.grows = False
    args = scale_prefill(address, 3)
    assert await cmd_scale(args) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == [
        "prefill: epd-prefill-1 died for good: it crashed again",
        "prefill: 1 worker serving; `epd scale` again starts others",
    ]


async def test_scale_down_waits_for_its_retiree_not_for_a_dead_worker(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    # The dead worker (held out: draining) counted among those draining before the scale,
    # so its registration dropping passed for the retiree leaving (ownfixE review E3).
    address, _, admin = router
    admin.sizes[2] = 2
    admin.failed = ["epd-prefill-2 died for good: it crashed"]
    admin.draining = [
        ["epd-prefill-2"],  # the Status before the scale
        ["epd-prefill-2", "epd-prefill-1"],  # the retiree drains
        ["epd-prefill-1"],  # the dead one's registration dropped
        ["epd-prefill-1"],
        [],  # the retiree is gone
    ]
    args = scale_prefill(address, 1)
    assert await cmd_scale(args) == 0
    assert admin.polls == 5
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("prefill: 1 worker serving (")


async def test_scale_does_not_wait_for_a_worker_an_operator_drained(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    # Registered again meanwhile (a new id), it was taken for a retiree and waited on for
    # the whole timeout (ownfixA review, s41).
    address, _, admin = router
    admin.draining, admin.drained = [["epd-prefill-7"]], {"epd-prefill-7"}
    admin.grows = False  # the pool of 2 holds it: 1 serving, 1 drained
    args = scale_prefill(address, 2, "--timeout", "5")
    assert await cmd_scale(args) == 1
    assert capsys.readouterr().out.splitlines()[-1] == f"  {DRAINED_STAY}"
    assert admin.polls == 2


async def test_scale_stops_at_a_death_its_first_poll_finds_where_the_router_tells_replaced(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    # Taken for one the scale replaced, it was waited on for the whole timeout (where the
    # scale's question to Ray timed out, nothing replaced it: ownfixE review E2).
    address, _, admin = router
    admin.tells, admin.grows = True, False
    admin.failed, admin.dies_at = [], 2  # the first poll finds it
    args = scale_prefill(address, 3, "--timeout", "5")
    assert await cmd_scale(args) == 1
    assert capsys.readouterr().out.splitlines()[1:] == [
        "prefill: epd-prefill-1 died for good: it crashed again",
        "prefill: 1 worker serving; `epd scale` again starts others",
    ]
    assert admin.polls == 2


async def test_scale_tells_the_dead_the_router_says_it_replaced_and_waits_on(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    address, _, admin = router
    admin.tells, admin.found_dead = True, True
    admin.failed = ["epd-prefill-5 failed to start: boom"]  # before the scale: cleared by it
    args = scale_prefill(address, 2)
    assert await cmd_scale(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (
        "prefill: epd-prefill-0 died for good: it crashed; epd-prefill-5 failed to start: boom"
    )
    assert out[2].startswith("prefill: 2 workers serving (") and len(out) == 3


async def test_scale_up_waits_for_no_dead_worker_to_leave(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    # A worker the scale found dead and replaced stays registered (held out) until its
    # registration times out: the pool is full meanwhile.
    address, _, admin = router
    admin.found_dead = True
    admin.draining = [[], ["epd-prefill-0"]]
    args = scale_prefill(address, 2)
    assert await cmd_scale(args) == 0
    assert admin.polls == 2
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "prefill: epd-prefill-0 died for good: it crashed"


async def test_scale_tells_a_death_at_the_poll_the_pool_reads_full(
    router: tuple[str, FakeRouter, FakeAdmin], capsys: pytest.CaptureFixture[str]
) -> None:
    # It returned 0, the death told nowhere (ownfixE review E4).
    address, _, admin = router
    admin.failed, admin.dies_at = [], 3  # the second poll finds the death
    admin.grows = False
    admin.sizes[2] = 2  # the death leaves 1, the size asked for

    args = scale_prefill(address, 1)
    assert await cmd_scale(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "prefill: epd-prefill-1 died for good: it crashed again"
    assert out[2].startswith("prefill: 1 worker serving (") and len(out) == 3
