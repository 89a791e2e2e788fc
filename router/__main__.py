"""`python -m router [--config FILE.toml] [--flag VALUE ...]`: run the router until a signal.

Settings come from the `RouterSettings` defaults, then the TOML file, then the flags. On
SIGTERM/SIGINT the router drains for up to `--drain-timeout-s` (no new requests, running
ones finish) and stops (see common.server.main).
"""

from __future__ import annotations

import logging
import sys

from common.server.main import RoleMain
from router.server import RunningRouter, serve
from router.settings import RouterSettings

logger = logging.getLogger("router")


async def _serve(settings: RouterSettings) -> RunningRouter:
    running = await serve(settings)
    # Machine-readable line for launchers that start the router on port 0.
    logger.info("EPD_ROUTER_ADDRESS=%s", running.address)
    if running.http_address is not None:
        logger.info("EPD_HTTP_ADDRESS=%s", running.http_address)
    return running


ENTRY = RoleMain(
    RouterSettings, _serve, "python -m router", "epd router: chat in, streamed tokens out."
)
parse_args = ENTRY.parse_args  # (settings, namespace) from --config and flags
parse = ENTRY.parse
main = ENTRY.main

if __name__ == "__main__":
    sys.exit(main())
