"""`python -m encoder_worker [--config FILE.toml] [--flag VALUE ...]`: run one encoder worker
until SIGTERM/SIGINT, then drain (in-flight Encode calls finish) and stop (common.server.main)."""

from __future__ import annotations

import sys

from common.server.main import RoleMain
from encoder_worker.server import serve
from encoder_worker.settings import EncoderSettings

ENTRY = RoleMain(EncoderSettings, serve, "python -m encoder_worker", "Run an epd encoder worker.")
parse = ENTRY.parse  # settings from --config and flags (tests, deploy checks)
main = ENTRY.main

if __name__ == "__main__":
    sys.exit(main())
