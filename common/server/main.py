"""The shared `python -m <role>` entry point: one parser shape, settings loading, logging, and
serving until a signal.

Every role's `__main__` is a `RoleMain`: it reads its settings the same way — the dataclass
defaults, then the `--config` TOML file, then one flag per field (`--drain-timeout-s` among
them, from `ServerSettings`) — and serves until SIGTERM/SIGINT, then drains (no new work,
running work finishes within `drain_timeout_s`) and stops the server in its stated order
(`common.server.role`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from common.errors import CheckpointError
from common.server import threads
from common.server.lifecycle import run_until_signal
from common.server.role import RoleServer, freeze_startup_heap
from common.settings.base import LOG_LEVELS, ServerSettings
from common.settings.schema import SettingsError, add_flags, apply_flags, load, to_toml

S = TypeVar("S", bound=ServerSettings)


def build_parser(settings_cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    """`--config`, `--log-level`, `--print-config` and one flag per field of `settings_cls`."""
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    parser.add_argument("--config", metavar="FILE.toml", help="settings file (TOML)")
    parser.add_argument(
        "--log-level",
        default="info",
        type=str.lower,
        choices=LOG_LEVELS,
        help="logging level (default: info)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print every setting's default as TOML"
    )
    parser.add_argument(
        "--insecure",
        dest="security__insecure",
        action="store_const",
        const="true",
        default=argparse.SUPPRESS,
        help="run without authentication: no cluster token, no API keys (said in the log); "
        "same as --security-insecure true",
    )
    add_flags(parser, settings_cls)
    return parser


def configure_logging(level: str) -> None:
    """Root logging at `level` (a name such as "info"), one line per record."""
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


@dataclass(frozen=True, slots=True)
class RoleMain(Generic[S]):
    """`python -m <role>` for one role: its settings class, its `serve`, its help."""

    settings_cls: type[S]  # the role's settings dataclass
    serve: Callable[[S], Awaitable[RoleServer[Any]]]  # starts the role's server
    prog: str  # e.g. "python -m encoder_worker"
    description: str  # first line of --help

    def parser(self) -> argparse.ArgumentParser:
        """The shared flags plus one flag per settings field."""
        return build_parser(self.settings_cls, self.prog, self.description)

    def parse_args(self, argv: Sequence[str] | None = None) -> tuple[S, argparse.Namespace]:
        """Settings from defaults, `--config` and flags, plus the parsed namespace.

        Exits (SystemExit) on `--help`, after `--print-config`, and with a message naming
        the key on a bad file or value.
        """
        parser = self.parser()
        args = parser.parse_args(argv)
        if args.print_config:
            sys.stdout.write(to_toml(self.settings_cls))
            parser.exit(0)
        try:
            settings = apply_flags(load(self.settings_cls, args.config), args)
            settings.check()
        except SettingsError as exc:
            parser.error(str(exc))
        return settings, args

    def parse(self, argv: Sequence[str] | None = None) -> S:
        """Only the settings of `parse_args`."""
        return self.parse_args(argv)[0]

    def main(self, argv: Sequence[str] | None = None) -> int:
        """Parse, configure logging, serve until a signal, drain, stop. A setting found
        unusable only when serving starts (a port in use, an unreadable token file) or a
        checkpoint that cannot be served (`CheckpointError`: a file unreadable, a value out
        of range, weights that do not match) exits 2 with one line naming it."""
        settings, args = self.parse_args(argv)
        configure_logging(args.log_level)
        try:
            if hasattr(settings, "threads"):  # workers: torch threads before the model loads
                threads.apply(threads.resolve(settings.threads), self.prog)
            asyncio.run(self._serve_until_signal(settings))
        except (SettingsError, CheckpointError) as exc:
            self.parser().exit(2, f"{self.prog}: error: {exc}\n")
        return 0

    async def _serve_until_signal(self, settings: S) -> None:
        server = await self.serve(settings)
        freeze_startup_heap()
        await run_until_signal(
            server.lifecycle,
            drain_timeout_s=settings.drain_timeout_s,
            cleanup=[lambda: server.stop(0)],
        )
