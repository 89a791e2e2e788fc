"""`python -m router [--config FILE.toml] [--flag VALUE ...]`: run the router until a signal.

Settings come from the `RouterSettings` defaults, then the TOML file, then the flags. On
SIGTERM/SIGINT the router drains (no new requests, running ones finish) and stops (see
common.server.main).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from common.server import main as worker_main
from router.server import RunningRouter, serve
from router.settings import RouterSettings

logger = logging.getLogger("router")


def build_parser() -> argparse.ArgumentParser:
    """The shared worker flags, `--drain-timeout-s`, and one flag per `RouterSettings` field."""
    parser = worker_main.build_parser(
        RouterSettings,
        prog="python -m router",
        description="epd router: chat in, streamed tokens out.",
    )
    parser.add_argument(
        "--drain-timeout-s", type=float, default=30.0, help="longest drain on shutdown"
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[RouterSettings, argparse.Namespace]:
    """Settings from defaults, `--config` and flags; exits with a message on a bad value."""
    return worker_main.parse_settings(build_parser(), RouterSettings, argv)


async def _serve(settings: RouterSettings) -> RunningRouter:
    running = await serve(settings)
    # Machine-readable line for launchers that start the router on port 0.
    logger.info("EPD_ROUTER_ADDRESS=%s", running.address)
    return running


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    settings, args = parse_args(argv)
    worker_main.configure_logging(args.log_level)
    asyncio.run(worker_main.serve_until_signal(_serve, settings, args.drain_timeout_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
