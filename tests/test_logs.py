"""`epd serve`'s quiet logs (`cluster.logs`): Ray's colour and dedup knobs when the output is
not a terminal, NIXL below warning, Ray's start-up notices, all back at --log-level debug."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from cluster import logs

KNOBS = ("RAY_COLOR_PREFIX", "RAY_DEDUP_LOGS", "NIXL_LOG_LEVEL", "NO_COLOR")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from ray.exceptions import colorama

    for name in KNOBS:
        monkeypatch.delenv(name, raising=False)
    for colour in ("CYAN", "RESET"):  # `plain_ray_errors` sets them for the process
        monkeypatch.setattr(colorama.Fore, colour, getattr(colorama.Fore, colour))
    nixl = logging.getLogger("nixl")
    level = nixl.level
    yield
    nixl.setLevel(level)


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_piped_output_gets_no_colour_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdout", io.StringIO())  # a pipe or a file
    logs.driver_env("warning")
    assert (logs.os.environ["RAY_COLOR_PREFIX"], logs.os.environ["RAY_DEDUP_LOGS"]) == ("0", "0")
    assert logs.os.environ["NIXL_LOG_LEVEL"] == "WARN"
    assert logging.getLogger("nixl").level == logging.WARNING


def test_a_workers_ray_errors_get_no_colour_codes_where_its_prefixes_have_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A worker's failed start reached a piped `epd serve` log with Ray's cyan `ray::...`
    # line (newuser review, s41).
    from ray.exceptions import RayTaskError

    def said() -> str:
        trace = 'Traceback (most recent call last):\n  File "w.py", line 1\nValueError: x'
        error = RayTaskError("f", trace, ValueError("x"), "ray::A.__init__", 1, "10.0.0.1")
        return str(error)

    from ray.exceptions import colorama

    # As Ray has them (a test before may have run `epd serve` piped, in this process).
    monkeypatch.setattr(colorama.Fore, "CYAN", "\x1b[36m")
    monkeypatch.setattr(colorama.Fore, "RESET", "\x1b[39m")
    logs.worker_env("warning")  # a terminal: Ray's colours stay
    assert "\x1b[" in said()
    monkeypatch.setenv("RAY_COLOR_PREFIX", "0")  # as `driver_env` sets it for a pipe
    logs.worker_env("warning")
    assert "\x1b" not in said() and said().startswith("ray::A.__init__() (pid=1")


def test_a_terminal_keeps_colour_unless_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdout", Tty())
    monkeypatch.setattr("sys.stderr", Tty())
    assert logs.colour_ok()
    logs.driver_env("warning")
    assert "RAY_COLOR_PREFIX" not in logs.os.environ
    monkeypatch.setenv("NO_COLOR", "1")
    assert not logs.colour_ok()


def test_debug_shows_everything_and_user_choices_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    logs.worker_env("debug")
    assert logs.os.environ["NIXL_LOG_LEVEL"] == "DEBUG"
    assert logging.getLogger("nixl").level == logging.DEBUG
    monkeypatch.setenv("NIXL_LOG_LEVEL", "INFO")  # the user's
    logging.getLogger("nixl").setLevel(logging.NOTSET)
    logs.worker_env("warning")
    assert logs.os.environ["NIXL_LOG_LEVEL"] == "INFO"
    assert logging.getLogger("nixl").level == logging.NOTSET


def test_rays_start_up_notices_are_quiet_below_debug() -> None:
    notice = logging.getLogger(logs._DRIVER_NOTICES[0])
    level = notice.level
    try:
        logs.quiet_driver("warning")
        assert notice.level == logging.ERROR
        from ray.util.debug import log_once

        assert not log_once("log_dedup_warning")  # Ray's advice was already "shown"
    finally:
        notice.setLevel(level)
