"""The HTTP API's server: uvicorn on a port bound at `start`, in the router's own event
loop, serving `router.http.app`'s endpoints behind `router.http.body` and
`router.http.connections`."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from common.settings.schema import SettingsError
from router.held import HeldBytes
from router.http.body import limit_body
from router.http.connections import CloseWhileDraining, ConnectionStats


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the router's process owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """uvicorn serving an app on a port bound at `start`, in the running event loop."""

    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        max_body_bytes: int,
        body_timeout_s: float,
        held: HeldBytes | None = None,
        protocol: type[H11Protocol] = H11Protocol,
        connections: ConnectionStats | None = None,
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        """`app` on `host:port`, behind `router.http.body` (`max_body_bytes`,
        `body_timeout_s`, `held`) and `protocol`, counting in `connections`; every answer
        says `Connection: close` while `draining()`, `limit_body`'s refusals too."""
        limited = limit_body(
            app,
            max_body_bytes,
            held or HeldBytes(0),
            body_timeout_s,
            connections or ConnectionStats(),
        )
        config = uvicorn.Config(
            CloseWhileDraining(limited, draining),
            http=protocol,  # HTTP/1.1 as uvicorn speaks it (`connections.bounded_protocol`)
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        self._server = _Server(config)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._sock = socket.create_server((host.strip("[]"), port), family=family)
        except OSError as exc:
            raise SettingsError(
                f"http_port: the HTTP API cannot listen on {host}:{port} ({exc.strerror}); "
                "0: any free port, -1: no HTTP API"
            ) from None
        self._sock.setblocking(False)
        bound_host, bound_port = self._sock.getsockname()[:2]
        bound_host = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
        self.address = f"{bound_host}:{bound_port}"  # host:port actually bound
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Serve until `stop`; returns once uvicorn listens."""
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # raises what stopped it

    async def close_after_answers(self) -> None:
        """The drain began: every connection whose answer is under way closes once it has
        ended. A streamed answer's head went out before the drain, without `Connection:
        close` (`CloseWhileDraining`): kept alive, its client's next request on it got 503
        where a new connection would reach another router (ownfix review)."""
        for connection in self._server.server_state.connections:
            cycle = getattr(connection, "cycle", None)
            if cycle is not None and not cycle.response_complete:
                cycle.keep_alive = False  # uvicorn closes it once the answer is sent

    async def stop(self) -> None:
        """Stop serving (open streams get a second), then close the socket."""
        self._server.should_exit = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self._sock.close()
