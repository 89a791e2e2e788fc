"""`python -m prefill_worker [--config FILE.toml] [--flag VALUE ...]`: run one prefill worker
until SIGTERM/SIGINT, then drain (in-flight prefills finish) and stop (see common.server.main)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from common.server import main as worker_main
from prefill_worker.server import serve
from prefill_worker.settings import PrefillSettings


def build_parser() -> argparse.ArgumentParser:
    """`--config`, `--log-level`, `--print-config` and one flag per `PrefillSettings` field."""
    return worker_main.build_parser(
        PrefillSettings, prog="python -m prefill_worker", description="Run an epd prefill worker."
    )


def parse(argv: Sequence[str] | None = None) -> PrefillSettings:
    """Settings from `--config` (TOML) overridden by flags."""
    return worker_main.parse_settings(build_parser(), PrefillSettings, argv)[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: serve until a signal, then drain and stop."""
    return worker_main.main(build_parser(), PrefillSettings, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
