"""The router's channels to workers: the shared peer client (`common.server.peers`), one
channel per worker address with the router's message limits, plus lease releases."""

from __future__ import annotations

from common.server.peers import PeerClient

# The name `router.prefix_index` annotates its channels with.
Channels = PeerClient
