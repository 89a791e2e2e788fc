"""The holder process the NIXL transfer tests read from, and their module fixtures.

One holder process per test module that uses `holder` (spawned once) owns a block-major
KV-like buffer and answers commands over a Pipe. Only bytes cross the Pipe: msgpack maps and
serialized protobuf. `agent` is the module's reader and `peer` the holder as its peer; the
holder fixture skips (a NIXL skip) where the UCX backend is unavailable.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import pytest
import torch

from common.transfer.agent import TransferAgent
from common.wire.transfer import handle_for, tensor_digest

# Tiny KV geometry: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], fp16.
NUM_BLOCKS = 16
KV_BLOCK_SHAPE = (2, 2, 16, 2, 64)  # layers, k/v, tokens, heads, dim -> 16 KiB per block
BLOCK_BYTES = 2 * 2 * 16 * 2 * 64 * 2
# A second registered holder buffer, filled with 5s.
BIG_BYTES = 1 << 20
TENSOR_SHAPE = (3, 5, 7)


def block_pattern(block_id: int, nbytes: int = BLOCK_BYTES) -> torch.Tensor:
    """The bytes the holder writes into block `block_id`: distinct per block and offset."""
    return ((torch.arange(nbytes, dtype=torch.int64) * 7 + block_id * 131) % 251).to(torch.uint8)


def known_tensor() -> torch.Tensor:
    return torch.arange(3 * 5 * 7, dtype=torch.float32).reshape(TENSOR_SHAPE) * 0.5 - 3.0


def _send(conn: Connection, **msg: Any) -> None:
    conn.send_bytes(msgpack.packb(msg))


def _recv(conn: Connection) -> dict[str, Any]:
    return msgpack.unpackb(conn.recv_bytes())


def holder_main(conn: Connection) -> None:
    """Holder process: register a block-major buffer, then serve commands until 'stop'."""
    torch.set_num_threads(1)
    try:
        agent = TransferAgent("holder")
    except (ImportError, RuntimeError) as exc:
        _send(conn, error=str(exc))
        return
    kv = torch.empty((NUM_BLOCKS, *KV_BLOCK_SHAPE), dtype=torch.float16)
    kv_bytes = kv.view(torch.uint8).view(NUM_BLOCKS, BLOCK_BYTES)
    for b in range(NUM_BLOCKS):
        kv_bytes[b] = block_pattern(b)
    big = torch.full((BIG_BYTES,), 5, dtype=torch.uint8)
    agent.register(kv)
    agent.register(big)
    keep: list[torch.Tensor] = []
    _send(
        conn,
        metadata=agent.metadata(),
        name=agent.name,
        pid=os.getpid(),
        kv_addr=kv.data_ptr(),
        big_addr=big.data_ptr(),
    )
    while True:
        cmd = _recv(conn)["cmd"]
        if cmd == "tensor":
            t = known_tensor()
            keep.append(t)
            conn.send_bytes(handle_for(t, agent, lease_id="lease-1").SerializeToString())
        elif cmd == "reuse":
            # Register a range, snapshot, deregister it, then register a larger range over
            # the same memory (as an allocator reusing freed memory would): the reader has
            # the first snapshot, the handle the second.
            pool = torch.zeros(8192, dtype=torch.uint8)
            keep.append(pool)
            first = agent.register(pool[1024:2048])
            older = agent.metadata()
            agent.deregister(first)
            pool[4096:].copy_(block_pattern(3, 4096))
            handle = handle_for(pool, agent, lease_id="lease-2")
            handle.address, handle.length = pool.data_ptr() + 4096, 4096
            handle.digest = tensor_digest(pool[4096:])
            _send(conn, older=older, handle=handle.SerializeToString())
        elif cmd == "stop":
            agent.close()
            _send(conn, ok=True)
            return


@pytest.fixture(scope="module")
def holder() -> Iterator[tuple[Connection, dict[str, Any]]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=holder_main, args=(child,), daemon=True)
    proc.start()
    if not parent.poll(60):
        proc.kill()
        pytest.fail("holder process did not start within 60 s")
    info = _recv(parent)
    if "error" in info:
        proc.join(5)
        pytest.skip(f"NIXL UCX backend unavailable on this machine: {info['error']}")
    yield parent, info
    _send(parent, cmd="stop")
    parent.poll(10)
    proc.join(10)
    if proc.is_alive():
        proc.kill()


@pytest.fixture(scope="module")
def agent(holder: tuple[Connection, dict[str, Any]]) -> Iterator[TransferAgent]:
    a = TransferAgent("reader")
    yield a
    a.close()


@pytest.fixture(scope="module")
def peer(agent: TransferAgent, holder: tuple[Connection, dict[str, Any]]) -> str:
    return agent.add_peer(holder[1]["metadata"])
