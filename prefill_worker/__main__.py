"""`python -m prefill_worker [--config FILE.toml] [--flag VALUE ...]`: run one prefill worker
until SIGTERM/SIGINT, then drain (in-flight prefills finish) and stop."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence

from common.rpc import run_until_signal
from common.settings import add_flags, apply_flags, load
from prefill_worker.server import serve
from prefill_worker.settings import PrefillSettings


def parse(argv: Sequence[str] | None = None) -> PrefillSettings:
    """Settings from `--config` (TOML) overridden by flags."""
    parser = argparse.ArgumentParser(
        prog="python -m prefill_worker", description="Run an epd prefill worker."
    )
    parser.add_argument("--config", metavar="FILE.toml", help="settings file (TOML)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    add_flags(parser, PrefillSettings)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return apply_flags(load(PrefillSettings, args.config), args)


async def main(settings: PrefillSettings) -> None:
    """Serve until a signal, then drain."""
    server = await serve(settings)
    await run_until_signal(server.lifecycle, drain_timeout_s=settings.drain_timeout_s)
    await server.stop(0)


if __name__ == "__main__":
    asyncio.run(main(parse()))
