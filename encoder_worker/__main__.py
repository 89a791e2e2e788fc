"""`python -m encoder_worker [--config FILE.toml] [--flag VALUE ...]`: run one encoder worker
until SIGTERM/SIGINT, then drain (in-flight Encode calls finish) and stop (common.server.main)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from common.server import main as worker_main
from encoder_worker.server import serve
from encoder_worker.settings import EncoderSettings


def build_parser() -> argparse.ArgumentParser:
    """`--config`, `--log-level`, `--print-config` and one flag per `EncoderSettings` field."""
    return worker_main.build_parser(
        EncoderSettings, prog="python -m encoder_worker", description="Run an epd encoder worker."
    )


def parse(argv: Sequence[str] | None = None) -> EncoderSettings:
    """Settings from `--config` (TOML) overridden by flags."""
    return worker_main.parse_settings(build_parser(), EncoderSettings, argv)[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: serve until a signal, then drain and stop."""
    return worker_main.main(build_parser(), EncoderSettings, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
