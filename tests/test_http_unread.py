"""A connection whose answers nobody reads is cut (`router.http.connections`): pipelined
requests whose answers wait for a client reading none of them, measured by what left
asyncio's buffer and what TCP acknowledged (`TCP_INFO`); a client that reads, however
slowly or in bursts, is not cut. Against a `bounded_protocol` on a transport the test sets."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from typing import Any

import pytest
import uvicorn
import uvicorn.server

from router.http.connections import (
    BYTES_ACKED,
    MIN_READ_BYTES,
    READ_PERIODS,
    TCP_INFO_BYTES,
    ConnectionStats,
    bounded_protocol,
)


class WaitingTransport:
    """A transport whose unsent bytes the test sets (`buffer`); it records a close and an
    abort (the cut)."""

    def __init__(self) -> None:
        self.buffer = 0
        self.closing = self.aborted = False
        self.acked: int | None = None  # TCP's count of bytes acknowledged (None: no socket)

    def get_write_buffer_size(self) -> int:
        return self.buffer

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = self.aborted = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "socket" and self.acked is not None:
            return self  # as a socket, for TCP_INFO
        return {"sockname": ("127.0.0.1", 1), "peername": ("127.0.0.1", 2)}.get(name, default)

    def getsockopt(self, level: int, option: int, size: int) -> bytes:
        assert (level, option) == (socket.IPPROTO_TCP, socket.TCP_INFO)
        info = bytearray(size)
        info[BYTES_ACKED : BYTES_ACKED + 8] = (self.acked or 0).to_bytes(8, sys.byteorder)
        return bytes(info)

    def write(self, data: bytes) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def waiting_connection(timeout_s: float) -> tuple[Any, WaitingTransport, ConnectionStats]:
    """A `bounded_protocol` connection on a `WaitingTransport`, its head timer stopped (a
    request being answered)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        pass

    config = uvicorn.Config(app=app, log_level="error")
    config.load()
    stats = ConnectionStats()
    protocol: Any = bounded_protocol(timeout_s, 0, stats)(
        config=config, server_state=uvicorn.server.ServerState(), app_state={}
    )
    transport = WaitingTransport()
    protocol.connection_made(transport)
    protocol._stop_waiting()
    return protocol, transport, stats


async def test_answers_that_wait_for_a_client_reading_none_of_them_are_cut() -> None:
    # Pipelined requests whose answers nobody read held a connection for good without a
    # key (httpattack review, s33); a client that reads, slowly, is not cut (own-fix 2).
    protocol, transport, stats = waiting_connection(0.2)  # 4 reads a period: room for load
    transport.buffer = 200_000
    protocol.pause_writing()  # the buffers are full: the answers wait
    for _ in range(12):
        await asyncio.sleep(0.05)
        transport.buffer -= MIN_READ_BYTES  # read: slowly, but read
    assert not transport.aborted
    await asyncio.sleep(0.2 * (READ_PERIODS + 2))  # then nothing
    assert transport.aborted and stats.closed_unread == 1


async def test_reading_acknowledged_in_bursts_is_reading() -> None:
    # A client's kernel opens a closed window once its reader freed about half its
    # receive buffer: a steady 2 KiB/s reader's bytes were acknowledged 64-128 KiB at a
    # time, seconds apart, and one period without any cut it (own-fix review 5).
    protocol, transport, stats = waiting_connection(0.1)
    transport.buffer, transport.acked = 500_000, 1_000
    protocol.pause_writing()
    for _ in range(4):
        transport.acked += 2 * READ_PERIODS * MIN_READ_BYTES  # a burst, then 3 quiet periods
        await asyncio.sleep(0.3)
    assert not transport.aborted and stats.closed_unread == 0
    await asyncio.sleep(0.1 * (READ_PERIODS + 3))  # then nothing at all
    assert transport.aborted and stats.closed_unread == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's TCP_INFO")
async def test_reading_counts_what_tcp_acknowledged_and_what_left_the_buffer() -> None:
    # asyncio's buffer moves only once the kernel's send buffer drained a third: a steady
    # 96 KiB/s reader looked like none and was cut (own-fix review 3); and a stack that
    # leaves TCP's count at 0 must not make every reader look like none (own-fix 4).
    protocol, transport, stats = waiting_connection(0.2)
    transport.buffer, transport.acked = 200_000, 1_000
    protocol.pause_writing()
    for _ in range(12):  # acknowledged, the buffer unmoved
        await asyncio.sleep(0.05)
        transport.acked += MIN_READ_BYTES
    assert not transport.aborted
    transport.acked = 0  # a count left at 0: the buffer's drain still counts
    for _ in range(12):
        await asyncio.sleep(0.05)
        transport.buffer -= MIN_READ_BYTES
    assert not transport.aborted
    await asyncio.sleep(0.2 * (READ_PERIODS + 2))  # then neither moves
    assert transport.aborted and stats.closed_unread == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's TCP_INFO")
def test_tcp_info_holds_the_bytes_acknowledged_where_read() -> None:
    # The offset the router reads (`BYTES_ACKED`) against a real connection: what the peer
    # took is acknowledged there, and never counts more than was sent.
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
        with sender, receiver:
            before = tcp_acked(sender)
            sender.sendall(b"x" * 100_000)
            got = 0
            while got < 100_000:
                got += len(receiver.recv(65536))
            for _ in range(100):  # the last ACK may trail the last byte read
                if tcp_acked(sender) - before >= 100_000:
                    break
                time.sleep(0.01)
            assert tcp_acked(sender) - before == 100_000


def tcp_acked(sock: socket.socket) -> int:
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
    return int.from_bytes(info[BYTES_ACKED : BYTES_ACKED + 8], sys.byteorder)


async def test_a_late_head_with_answers_unsent_waits_for_them_to_be_taken() -> None:
    # Below the high-water mark writing is never paused; a close() then waited for good to
    # send what nobody takes, the connection keeping its place under the cap (own-fix
    # review 2). But an answer still being taken is no reason to cut (the head timer starts
    # when it is handed to the transport: a 10 KiB/s reader lost half of one; own-fix 3).
    protocol, transport, stats = waiting_connection(0.2)
    transport.buffer = 10 * MIN_READ_BYTES
    protocol.on_response_complete()  # answered: the next head is awaited
    while transport.buffer:
        await asyncio.sleep(0.05)
        transport.buffer -= MIN_READ_BYTES  # taken, slowly
    await asyncio.sleep(0.7)  # then no head: closed as late, not cut
    assert transport.closing and not transport.aborted
    assert stats.closed_late == 1 and stats.closed_unread == 0
    for closed_by_uvicorn in (False, True):  # its keep-alive timeout closes it
        protocol, transport, stats = waiting_connection(0.05)
        transport.buffer = 5_000
        protocol.on_response_complete()
        if closed_by_uvicorn:
            transport.close()
        await asyncio.sleep(0.05 * (READ_PERIODS + 4))  # head late, then nothing taken
        assert transport.aborted and stats.closed_unread == 1
