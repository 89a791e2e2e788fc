"""The HTTP connections the router keeps: at most `[router] http_max_connections`, each
sending a whole request head within `http_header_timeout_s` of opening or of its last
answer.

uvicorn closes a connection that idles after an answer, but only while no byte arrives, and
sets no time for the first request: a client that connects and sends nothing, or a header
byte now and then, holds its socket for ever. Each one is a file descriptor of the router's
process, which its gRPC server, its channels to the workers and its NIXL agent draw on too,
so enough of them (one machine can open thousands) would leave the router unable to accept
a worker's registration. Here a connection past the cap is answered 503 and closed as it
opens, before it costs anything more, and one without a complete request head in time is
closed then. A request whose head has arrived has `request_timeout_s` for its body
(`router.http.body`). A connection whose answers wait for a client that takes (almost)
none of them is cut too: while its buffers are full, or its head is late (or uvicorn closed
it) with answers still unsent, it must take `MIN_READ_BYTES` of them (as TCP acknowledges
them) per `http_header_timeout_s`, on average over the last `READ_PERIODS` of them.
Pipelining requests and reading none of the answers held a connection for good without a
key, the head timer never running again, and a close() waits for good to send what nobody
takes; a late head with answers unsent is no cut by itself, as a slow client may still be
taking the last one. Over several periods, as TCP acknowledges in bursts: a client's kernel
opens a closed window only once its reader freed about half its receive buffer, 64-128 KiB
with seconds between, so a client reading a steady 2 KiB/s went a whole period with nothing
acknowledged, and was cut (own-fix review 5).

Every connection sends without Nagle's delay (TCP_NODELAY). asyncio sets it only on sockets
made with `IPPROTO_TCP` named, and the router's listening socket (bound before uvicorn
starts, to learn a free port) is not: on a kept-alive connection, a streamed answer's first
events then waited for the client's delayed ACK of the response head, about 40 ms, and
reached an OpenAI client in one burst (TTFT 60-77 ms where the first token was ready at
11-18 ms).

h11 takes a body's chunks one by one on the event loop: a 256 KiB read of 1-byte chunks held
it 0.9 s (stalls review). A read of many line ends is handed to h11 `SLICE_BYTES` at a time,
a loop turn each (`data_received`), and a body of more than `FREE_PIECES` chunks plus one a
`MIN_PIECE_BYTES` of it is refused as malformed (400, connection closed; `_counting`),
bounding what one costs: a bound per read refused a JSON encoder's small pieces when they
arrived together, as under load (ownfix review). Nothing more is read while slices wait,
whatever uvicorn's flow control says (`_Flow`), and none is handed on while a pipelined
request waits for the answer before it (ownfix review D: 29 MB were read on into the
slices' buffer; 21k chunks handed on at once at the answer's end).

A draining router asks each client to close its connection with its answer
(`CloseWhileDraining`): a kept-alive connection came back to it with each request, each
answered 503, as long as its longest running answer lasted (up to `drain_timeout_s`),
while a load balancer had other routers ready for a new connection (deploy review).

uvicorn logs a WARNING for each connection whose bytes are not HTTP, and two for each request
asking to upgrade the connection (h2c, WebSocket), from callers who need no key: a line or
two each grew the router's log with every such connection. At most one of them a
`INVALID_EVERY_S` is logged now, saying how many were dropped since.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol

MIN_READ_BYTES = 4096  # of a connection's waiting answers, read per `http_header_timeout_s`
READ_PERIODS = 4  # ... on average over this many of them
# A request body's pieces (chunks): FREE_PIECES, and one more per MIN_PIECE_BYTES of it.
FREE_PIECES = 1 << 16
MIN_PIECE_BYTES = 512
# A read of more line ends than this goes to h11 in slices of SLICE_BYTES (at 6 bytes and
# ~18 µs a 1-byte chunk, ~25 ms of the loop a slice).
SLICE_LINES = 1024
SLICE_BYTES = 8 << 10
SMALL_PIECES = "a request body sent in too many small pieces (send pieces of 512 bytes or more)"
# Linux's `struct tcp_info`: the bytes asked for, and where its u64 tcpi_bytes_acked lies.
TCP_INFO_BYTES = 232
BYTES_ACKED = 120

# What a connection past the cap is told as it is closed: OpenAI's error shape, as every
# other error (its body was empty: openai review F4, s44).
_BUSY_BODY = (
    b'{"error": {"message": "too many connections to this router (http_max_connections); '
    b'retry after 1 s", "type": "service_unavailable", "param": null, '
    b'"code": "too_many_connections"}}'
)
BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


INVALID_EVERY_S = 10.0  # one of uvicorn's `_INVALID` lines at most this often
_INVALID = (  # uvicorn's warnings about a connection, whoever sent it
    "Invalid HTTP request received",
    "Unsupported upgrade request",
    "No supported WebSocket library detected",
)


class _InvalidRequests(logging.Filter):
    """Lets one of uvicorn's `_INVALID` warnings through per `INVALID_EVERY_S`."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        super().__init__()
        self.clock = clock
        self.last = -INVALID_EVERY_S
        self.dropped = 0  # since the last one logged

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(_INVALID):
            return True
        now = self.clock()
        if now - self.last < INVALID_EVERY_S:
            self.dropped += 1
            return False
        if self.dropped:
            record.msg, record.args = f"{record.getMessage()} ({self.dropped} more since)", ()
        self.last, self.dropped = now, 0
        return True


INVALID_REQUESTS = _InvalidRequests()
logging.getLogger("uvicorn.error").addFilter(INVALID_REQUESTS)


@dataclass(slots=True)
class ConnectionStats:
    """What the HTTP API's connections did (`epd:http_connections*`)."""

    open: int = 0  # connections open now
    closed_at_cap: int = 0  # closed as they opened, past `http_max_connections`
    closed_late: int = 0  # closed without a whole request head in time
    closed_body_late: int = 0  # closed without a whole body in time (`router.http.body`)
    closed_unread: int = 0  # cut with answers the client read (almost) none of in time


class CloseWhileDraining:
    """ASGI middleware: every answer that starts while `draining()` says `Connection:
    close`, those of requests that came before the drain included (decided as the request
    came, a keep-alive client whose answer was under way at SIGTERM sent its next request
    on the same connection, and got 503 where it would have reached another router)."""

    def __init__(self, app: Any, draining: Callable[[], bool]) -> None:
        self.app = app
        self.draining = draining

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def closing(message: Any) -> None:
            if message["type"] == "http.response.start" and self.draining():
                kept = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"connection"]
                message = {**message, "headers": [*kept, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, closing)


def _counting(next_event: Callable[[], Any], body: list[int]) -> Callable[[], Any]:
    """h11's `next_event`, refusing a request body (`body`: its pieces so far and bytes)
    past `FREE_PIECES` plus one a `MIN_PIECE_BYTES`, as malformed: uvicorn answers 400 and
    closes the connection."""

    def counted() -> Any:
        event = next_event()
        if isinstance(event, h11.Data):
            body[0], body[1] = body[0] + 1, body[1] + len(event.data)
            if body[0] > FREE_PIECES + body[1] // MIN_PIECE_BYTES:
                raise h11.RemoteProtocolError(SMALL_PIECES)
        elif isinstance(event, h11.Request):
            body[0] = body[1] = 0
        return event

    return counted


class _Flow(FlowControl):
    """uvicorn's flow control, where reading resumes only once a read's slices are handed to
    h11 (`Bounded.data_received`)."""

    def __init__(self, transport: Any, protocol: Any) -> None:
        super().__init__(transport)
        self._protocol = protocol

    def resume_reading(self) -> None:
        if self.read_paused and self._protocol._pending:
            self.read_paused = False
            self._protocol._slice_soon()
        else:
            super().resume_reading()


def bounded_protocol(
    header_timeout_s: float, max_connections: int, stats: ConnectionStats
) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol, closing connections past `max_connections` (0: no cap)
    and those whose request head is `header_timeout_s` late, counted in `stats`."""

    class Bounded(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _read_timer: asyncio.TimerHandle | None = None  # while answers wait (`_expect_reads`)
        _unsent = 0  # bytes waiting to be sent when `_read_timer` was set
        _acked_then: int | None = None  # TCP's count of bytes acknowledged then
        _taken_before: tuple[int, ...] = ()  # bytes taken in the periods before (at most 3)
        _body: list[int]  # the pieces and bytes of the request body so far (`_counting`)
        _pending: bytearray  # what was read and not yet handed to h11 (`data_received`)
        _slicing = False  # a `_slice` is scheduled

        def connection_made(self, transport: Any) -> None:
            self._body, self._pending = [0, 0], bytearray()
            super().connection_made(transport)
            self.flow = _Flow(transport, self)
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stats.open = len(self.connections)
            if max_connections and len(self.connections) > max_connections:
                stats.closed_at_cap += 1
                transport.write(BUSY)  # best effort: the client may not be reading yet
                transport.close()  # connection_lost follows and forgets it
                return
            self.conn.next_event = _counting(self.conn.next_event, self._body)  # type: ignore[method-assign]
            self._expect_head()

        def data_received(self, data: bytes) -> None:
            if self._pending:  # read while slices wait (uvicorn resumed reading): they go first
                self.transport.pause_reading()
                self._pending += data
                return
            if data.count(b"\r\n") <= SLICE_LINES:
                super().data_received(data)
                return
            self.transport.pause_reading()  # slices to come: nothing more is read meanwhile
            self._pending = bytearray(data)
            self._slice_soon()

        def _slice_soon(self) -> None:
            if not self._slicing:
                self._slicing = True
                self.loop.call_soon(self._slice)

        def _slice(self) -> None:
            self._slicing = False
            if self.transport.is_closing():
                self._pending.clear()
                return
            if self.conn.their_state is h11.MUST_CLOSE:  # what follows is not read (uvicorn
                self._pending.clear()  # reads none of it either; h11 refused it with a 400)
                return
            if self.flow.read_paused or self.conn.their_state is h11.DONE:
                return  # uvicorn's pause (a body unread: `_Flow` goes on), or a request
                # read whose answer is not complete (pipelined: `on_response_complete`)
            piece = bytes(self._pending[:SLICE_BYTES])
            del self._pending[:SLICE_BYTES]  # from the front: no copy of the rest
            super().data_received(piece)
            if self._pending:
                self._slice_soon()
            elif not self.flow.read_paused and not self.transport.is_closing():
                self.transport.resume_reading()

        def send_400_response(self, msg: str) -> None:
            small = self._body[0] > FREE_PIECES + self._body[1] // MIN_PIECE_BYTES
            super().send_400_response(SMALL_PIECES if small else msg)  # uvicorn's says nothing

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._pending and not self.transport.is_closing():
                self._slice_soon()  # a pipelined request's bytes, waiting for this answer
            self._expect_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_waiting()
            if self._read_timer is not None:
                self._read_timer.cancel()
            super().connection_lost(exc)
            stats.open = len(self.connections)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._read_timer is None:
                self._expect_reads()

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None
                self._taken_before = ()
                if self._head_timer is None:  # it ran while the answers waited
                    self._expect_head()

        def _acked(self) -> int | None:
            """TCP's count of the bytes the client acknowledged (`tcpi_bytes_acked`, Linux
            4.1 on), None where there is none."""
            if not sys.platform.startswith("linux"):  # another `struct tcp_info`
                return None
            sock = self.transport.get_extra_info("socket")
            try:
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
            except (AttributeError, OSError, ValueError):
                return None
            if len(info) < BYTES_ACKED + 8:  # an older kernel's, shorter
                return None
            return int.from_bytes(info[BYTES_ACKED : BYTES_ACKED + 8], sys.byteorder)

        def _expect_reads(self) -> None:
            self._acked_then = self._acked()
            self._unsent = self.transport.get_write_buffer_size()
            self._read_timer = self.loop.call_later(header_timeout_s, self._unread)

        def _taken(self) -> int:
            """Bytes the client took since `_expect_reads`: by TCP's count where there is
            one (asyncio's buffer moves only once the kernel's send buffer drained a third:
            a steady 96 KiB/s reader looked like none; own-fix review 3), never less than
            what left asyncio's buffer (a stack that leaves the count at 0; own-fix 4)."""
            drained = self._unsent - self.transport.get_write_buffer_size()
            acked, then = self._acked(), self._acked_then
            return drained if acked is None or then is None else max(drained, acked - then)

        def _unread(self) -> None:
            self._read_timer = None
            taken = (*self._taken_before, self._taken())
            if len(taken) < READ_PERIODS or sum(taken) >= READ_PERIODS * MIN_READ_BYTES:
                if self.flow.write_paused or self.transport.get_write_buffer_size():
                    self._taken_before = taken[1 - READ_PERIODS :]
                    self._expect_reads()  # it reads, slowly (or not yet): answers still wait
                else:
                    self._taken_before = ()
                    if self._head_timer is None:
                        self._expect_head()
                return
            self._cut()

        def _cut(self) -> None:
            stats.closed_unread += 1
            self.transport.abort()  # close() would wait to send what nobody reads

        def _expect_head(self) -> None:
            self._stop_waiting()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_late)

        def _stop_waiting(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self.transport.get_write_buffer_size():  # its answers wait: is it reading?
                if self._read_timer is None:
                    self._expect_reads()
                return
            # IDLE: no whole request head since the connection opened or its last answer.
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                stats.closed_late += 1
                self.transport.close()

    return Bounded
