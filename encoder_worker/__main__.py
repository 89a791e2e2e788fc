"""`python -m encoder_worker [--config FILE.toml] [--flag VALUE ...]`: run one encoder worker
until SIGTERM/SIGINT, then drain (in-flight Encode calls finish) and stop."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence

from common.rpc import run_until_signal
from common.settings import add_flags, apply_flags, load
from encoder_worker.server import serve
from encoder_worker.settings import EncoderSettings


def parse(argv: Sequence[str] | None = None) -> EncoderSettings:
    """Settings from `--config` (TOML) overridden by flags."""
    parser = argparse.ArgumentParser(
        prog="python -m encoder_worker", description="Run an epd encoder worker."
    )
    parser.add_argument("--config", metavar="FILE.toml", help="settings file (TOML)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    add_flags(parser, EncoderSettings)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return apply_flags(load(EncoderSettings, args.config), args)


async def main(settings: EncoderSettings) -> None:
    """Serve until a signal, then drain and stop everything the server owns."""
    server = await serve(settings)
    assert server.lifecycle is not None
    await run_until_signal(server.lifecycle, drain_timeout_s=settings.drain_timeout_s)
    await server.stop(0)


if __name__ == "__main__":
    asyncio.run(main(parse()))
