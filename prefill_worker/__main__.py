"""`python -m prefill_worker [--config FILE.toml] [--flag VALUE ...]`: run one prefill worker
until SIGTERM/SIGINT, then drain (in-flight prefills finish) and stop (common.server.main)."""

from __future__ import annotations

import sys

from common.server.main import RoleMain
from prefill_worker.server import serve
from prefill_worker.settings import PrefillSettings

ENTRY = RoleMain(PrefillSettings, serve, "python -m prefill_worker", "Run an epd prefill worker.")
parse = ENTRY.parse  # settings from --config and flags (tests, deploy checks)
main = ENTRY.main

if __name__ == "__main__":
    sys.exit(main())
