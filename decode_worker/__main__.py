"""`python -m decode_worker [--config FILE.toml] [--flag VALUE ...]`: run one decode worker
until SIGTERM/SIGINT, then drain (in-flight streams finish) and stop (common.server.main)."""

from __future__ import annotations

import sys

from common.server.main import RoleMain
from decode_worker.server import serve
from decode_worker.settings import DecodeSettings

ENTRY = RoleMain(DecodeSettings, serve, "python -m decode_worker", "Run an epd decode worker.")
parse = ENTRY.parse  # settings from --config and flags (tests, deploy checks)
main = ENTRY.main

if __name__ == "__main__":
    sys.exit(main())
