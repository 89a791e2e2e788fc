"""The shared `python -m <role>` entry point: one parser shape, settings loading, logging, and
serving until a signal.

Every role's `__main__` reads its settings the same way — the dataclass defaults, then the
`--config` TOML file, then one flag per field — and serves until SIGTERM/SIGINT, then drains
(no new work, running work finishes within the drain timeout) and stops the server.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

from common.server.rpc import RunningServer, run_until_signal
from common.settings.schema import SettingsError, add_flags, apply_flags, load, to_toml

S = TypeVar("S")


class DrainingSettings(Protocol):
    """Settings that carry their own drain timeout (every worker role's do)."""

    @property
    def drain_timeout_s(self) -> float: ...


D = TypeVar("D", bound=DrainingSettings)


def build_parser(settings_cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    """`--config`, `--log-level`, `--print-config` and one flag per field of `settings_cls`."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", metavar="FILE.toml", help="settings file (TOML)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    parser.add_argument(
        "--print-config", action="store_true", help="print every setting's default as TOML"
    )
    add_flags(parser, settings_cls)
    return parser


def parse_settings(
    parser: argparse.ArgumentParser, settings_cls: type[S], argv: Sequence[str] | None = None
) -> tuple[S, argparse.Namespace]:
    """Settings from defaults, `--config` and flags, plus the parsed namespace.

    Exits (SystemExit) on `--help`, after `--print-config`, and with a message naming the key
    on a bad file or value.
    """
    args = parser.parse_args(argv)
    if args.print_config:
        sys.stdout.write(to_toml(settings_cls))
        parser.exit(0)
    try:
        settings = apply_flags(load(settings_cls, args.config), args)
    except SettingsError as exc:
        parser.error(str(exc))
    return settings, args


def configure_logging(level: str) -> None:
    """Root logging at `level` (a name such as "info"), one line per record."""
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


async def serve_until_signal(
    serve: Callable[[S], Awaitable[RunningServer]], settings: S, drain_timeout_s: float
) -> None:
    """Start `serve(settings)`, run until a signal (or the server stops), drain, then stop."""
    server = await serve(settings)
    if server.lifecycle is None:
        raise RuntimeError("serve() must return a server with a lifecycle attached")
    await run_until_signal(
        server.lifecycle, drain_timeout_s=drain_timeout_s, cleanup=[lambda: server.stop(0)]
    )


def main(
    parser: argparse.ArgumentParser,
    settings_cls: type[D],
    serve: Callable[[D], Awaitable[RunningServer]],
    argv: Sequence[str] | None = None,
) -> int:
    """Parse, configure logging, serve until a signal with the settings' drain timeout."""
    settings, args = parse_settings(parser, settings_cls, argv)
    configure_logging(args.log_level)
    asyncio.run(serve_until_signal(serve, settings, settings.drain_timeout_s))
    return 0
