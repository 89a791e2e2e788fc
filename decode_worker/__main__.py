"""`python -m decode_worker [--config FILE.toml] [--flag VALUE ...]`: run one decode worker
until SIGTERM/SIGINT, then drain (in-flight streams finish) and stop."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence

from common.rpc import run_until_signal
from common.settings import add_flags, apply_flags, load
from decode_worker.server import serve
from decode_worker.settings import DecodeSettings


def parse(argv: Sequence[str] | None = None) -> DecodeSettings:
    """Settings from `--config` (TOML) overridden by flags."""
    parser = argparse.ArgumentParser(
        prog="python -m decode_worker", description="Run an epd decode worker."
    )
    parser.add_argument("--config", metavar="FILE.toml", help="settings file (TOML)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    add_flags(parser, DecodeSettings)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return apply_flags(load(DecodeSettings, args.config), args)


async def main(settings: DecodeSettings) -> None:
    """Serve until a signal, then drain."""
    server = await serve(settings)
    await run_until_signal(server.lifecycle, drain_timeout_s=settings.drain_timeout_s)
    await server.stop(0)


if __name__ == "__main__":
    asyncio.run(main(parse()))
