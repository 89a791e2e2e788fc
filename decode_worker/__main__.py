"""`python -m decode_worker [--config FILE.toml] [--flag VALUE ...]`: run one decode worker
until SIGTERM/SIGINT, then drain (in-flight streams finish) and stop (see common.server.main)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from common.server import main as worker_main
from decode_worker.server import serve
from decode_worker.settings import DecodeSettings


def build_parser() -> argparse.ArgumentParser:
    """`--config`, `--log-level`, `--print-config` and one flag per `DecodeSettings` field."""
    return worker_main.build_parser(
        DecodeSettings, prog="python -m decode_worker", description="Run an epd decode worker."
    )


def parse(argv: Sequence[str] | None = None) -> DecodeSettings:
    """Settings from `--config` (TOML) overridden by flags."""
    return worker_main.parse_settings(build_parser(), DecodeSettings, argv)[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: serve until a signal, then drain and stop."""
    return worker_main.main(build_parser(), DecodeSettings, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
