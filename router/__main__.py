"""`python -m router [--config FILE.toml] [--flag VALUE ...]`: run the router until a signal.

Settings come from the `RouterSettings` defaults, then the TOML file, then the flags. On
SIGTERM/SIGINT the router drains (no new requests, running ones finish) and stops.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from common.rpc import run_until_signal
from common.settings import SettingsError, add_flags, apply_flags, load, to_toml
from router.server import serve
from router.settings import RouterSettings

logger = logging.getLogger("router")


def parse_args(argv: list[str] | None = None) -> tuple[RouterSettings, argparse.Namespace]:
    """Settings from defaults, `--config` and flags; exits with a message on a bad value."""
    parser = argparse.ArgumentParser(
        prog="python -m router", description="epd router: chat in, streamed tokens out."
    )
    parser.add_argument("--config", metavar="FILE.toml", help="settings file (TOML)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    parser.add_argument(
        "--print-config", action="store_true", help="print every setting's default as TOML"
    )
    parser.add_argument(
        "--drain-timeout-s", type=float, default=30.0, help="longest drain on shutdown"
    )
    add_flags(parser, RouterSettings)
    args = parser.parse_args(argv)
    if args.print_config:
        sys.stdout.write(to_toml(RouterSettings))
        parser.exit(0)
    try:
        settings = apply_flags(load(RouterSettings, args.config), args)
    except SettingsError as exc:
        parser.error(str(exc))
    return settings, args


async def main_async(settings: RouterSettings, drain_timeout_s: float) -> None:
    """Serve until a signal, then drain and stop."""
    running = await serve(settings)
    assert running.lifecycle is not None
    # Machine-readable line for launchers that start the router on port 0.
    logger.info("EPD_ROUTER_ADDRESS=%s", running.address)
    await run_until_signal(
        running.lifecycle,
        drain_timeout_s=drain_timeout_s,
        cleanup=[lambda: running.stop(0)],
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    settings, args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(main_async(settings, args.drain_timeout_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
