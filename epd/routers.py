"""Which routers a client tries, in what order, and when one counts as unreachable
(`epd.client`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc

Routers = str | Sequence[str]  # one address, "a,b" comma-separated, or a list of them

# What a router that is not connected yet gets to connect in, while others are left to try:
# one that accepts the connection and never answers (a frozen process, a black-holed
# backend) took each request starting on it for its whole timeout (DEADLINE_EXCEEDED).
CONNECT_S = 2.0
DOWN_S = 30.0  # a router that did not connect is tried last for this long


class Turns:
    """The order a client tries its `count` routers in, request by request."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._next = 0  # the router the next request starts on
        self._down_until: dict[int, float] = {}  # router index -> put last until then

    def order(self) -> list[int]:
        """Router indices for the next request: the next router in turn, then the rest; a
        router that did not connect within the last `DOWN_S` goes last (a black-holed one
        cost every other request its `CONNECT_S`; client review)."""
        start, n = self._next, self.count
        self._next = (start + 1) % n
        now = time.monotonic()
        turn = [(start + k) % n for k in range(n)]
        return sorted(turn, key=lambda i: self._down_until.get(i, 0.0) > now)

    def down(self, index: int) -> None:
        """Router `index` did not connect: tried last for `DOWN_S`."""
        self._down_until[index] = time.monotonic() + DOWN_S


def router_list(routers: Routers) -> list[str]:
    """The router addresses in `routers`, each once, in order; ValueError when none."""
    items = routers.split(",") if isinstance(routers, str) else list(routers)
    addresses = list(dict.fromkeys(a.strip() for a in items if a.strip()))
    if not addresses:
        raise ValueError(f"router address: none given in {routers!r}")
    for address in addresses:
        check_port(address)
    return addresses


def check_port(address: str) -> None:
    """ValueError unless the port of `address` (host:port, or a gRPC target whose last part
    is one) is 1-65535: gRPC dials an empty port as 443 and takes one past 65535 modulo
    65536, another server's."""
    _, sep, port = address.rpartition(":")
    if not sep or address.endswith("]"):
        raise ValueError(f"router address {address!r}: no port (host:port)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"router address {address!r}: the port must be 1-65535")


async def connects(channel: grpc.aio.Channel, left: float | None) -> bool:
    """Whether `channel` is connected, or becomes so or fails to (a refused connection: the
    call then fails at once, UNAVAILABLE) within `CONNECT_S` (at most `left`)."""
    done = (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE)
    state = channel.get_state(try_to_connect=True)
    end = time.monotonic() + (CONNECT_S if left is None else min(CONNECT_S, left))
    while state not in done:
        try:
            async with asyncio.timeout(end - time.monotonic()):
                await channel.wait_for_state_change(state)
        except TimeoutError:
            return False
        state = channel.get_state(try_to_connect=True)
    return True
