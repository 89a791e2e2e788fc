"""What `epd serve` and its actors log, and what they keep quiet.

Below `--log-level debug`, third-party start-up chatter stays out of the console: Ray's
token-auth notice and its INFO lines in the driver, Ray's one-time "deduplicates logs"
advice, and NIXL's INFO lines in the workers (`NIXL_LOG_LEVEL`, which NIXL reads when its
logging starts, plus its logger's level when that already happened). When stdout or stderr
is not a terminal, or `NO_COLOR` is set, the actors' log lines reach the driver without ANSI
colour codes: Ray's prefix colour is off (`RAY_COLOR_PREFIX=0`) and so is its log
deduplication, whose "[repeated Nx]" marker is always coloured (`RAY_DEDUP_LOGS=0`, read
when Ray is imported, so `driver_env` runs before `import ray`), and so are the colours of
Ray's task errors in the workers. A variable the user set is left as it is.
"""

from __future__ import annotations

import logging
import os
import sys

# Loggers of the driver that only print start-up notices, quiet below debug.
_DRIVER_NOTICES = ("ray._private.authentication.authentication_token_setup",)


def debug(level: str) -> bool:
    """Whether `level` (a log level name) asks for everything."""
    return level.strip().lower() == "debug"


def colour_ok() -> bool:
    """ANSI colours only for a terminal on both streams, and not under NO_COLOR."""
    if os.environ.get("NO_COLOR"):
        return False
    return all(stream.isatty() for stream in (sys.stdout, sys.stderr))


def driver_env(level: str) -> None:
    """Before `import ray` in `epd serve`: Ray's colour and dedup knobs (module docstring)."""
    if not colour_ok():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    worker_env(level)  # a Ray started here passes the driver's environment to its workers


def quiet_driver(level: str) -> None:
    """After `import ray`: the driver's notices below warning unless `level` is debug."""
    if debug(level):
        return
    for name in _DRIVER_NOTICES:
        logging.getLogger(name).setLevel(logging.ERROR)
    from ray.util.debug import log_once

    log_once("log_dedup_warning")  # Ray shows this advice only the first time it is asked


def worker_env(level: str) -> None:
    """In a worker (before NIXL starts, and again after): NIXL at warning unless debug;
    Ray's errors without colour where its prefixes have none."""
    wanted = "DEBUG" if debug(level) else "WARN"
    if os.environ.setdefault("NIXL_LOG_LEVEL", wanted) == wanted:  # else: the user's choice
        logging.getLogger("nixl").setLevel(logging.DEBUG if debug(level) else logging.WARNING)
    if os.environ.get("RAY_COLOR_PREFIX") == "0":
        plain_ray_errors()


def plain_ray_errors() -> None:
    """Ray colours the `ray::Actor.method()` line of a task's error whatever the stream
    (colorama's codes, in the process that raised): a worker's failed start reached a piped
    `epd serve` log with ANSI codes (newuser review, s41)."""
    from ray import exceptions  # its colorama: Ray's own copy

    exceptions.colorama.Fore.CYAN = exceptions.colorama.Fore.RESET = ""
