"""NIXL transfer layer: range merging (pure) and real READs over UCX between two processes.

One holder process per module (spawned once) owns a block-major KV-like buffer and answers
commands over a Pipe. Only bytes cross the Pipe: msgpack maps and serialized protobuf.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.transfer.agent import TransferAgent
from common.transfer.ranges import check_pairs, merge_ranges
from common.transfer.types import (
    TransferError,
    TransferRefusedError,
    TransferTimeoutError,
    UnknownPeerError,
)
from common.wire.transfer import handle_for, read_tensor
from epd.v1 import tensor_pb2

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


# -- merge_ranges / check_pairs (pure) ---------------------------------------------------


def test_merge_adjacent_both_sides() -> None:
    remote = [(1000, 10), (1010, 10), (1020, 5), (2000, 10)]
    local = [(0, 10), (10, 10), (40, 5), (45, 10)]
    assert merge_ranges(remote, local) == (
        [(1000, 20), (1020, 5), (2000, 10)],
        [(0, 20), (40, 5), (45, 10)],
    )


def test_merge_orders_pairs_by_remote_address() -> None:
    # Blocks 5, 3, 4 into local slots 2, 0, 1: one run once ordered.
    remote = [(500, 100), (300, 100), (400, 100)]
    local = [(200, 100), (0, 100), (100, 100)]
    assert merge_ranges(remote, local) == ([(300, 300)], [(0, 300)])


@pytest.mark.parametrize(
    ("remote", "local", "message"),
    [
        ([(0, 8)], [], "same number"),
        ([], [], "nothing to transfer"),
        ([(0, 8)], [(100, 4)], "differs"),
        ([(0, 0)], [(100, 0)], "positive"),
        ([(0, 8), (8, 8)], [(100, 8), (104, 8)], "overlap"),
    ],
)
def test_check_pairs_rejects(remote: list, local: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_pairs(remote, local)


@st.composite
def copy_plans(draw: st.DrawFn) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Random valid copies: disjoint local ranges, remote ranges often adjacent."""
    n = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    local_gaps = draw(st.lists(st.sampled_from([0, 0, 0, 3]), min_size=n, max_size=n))
    remote_jumps = draw(st.lists(st.sampled_from([0, 0, 0, 2, -9]), min_size=n, max_size=n))
    local, remote = [], []
    l_addr, r_addr = 0, 50
    for length, gap, jump in zip(lengths, local_gaps, remote_jumps, strict=True):
        l_addr += gap
        r_addr = max(0, r_addr + jump)
        local.append((l_addr, length))
        remote.append((r_addr, length))
        l_addr += length
        r_addr += length
    order = draw(st.permutations(range(n)))
    return [remote[i] for i in order], [local[i] for i in order]


def _byte_map(remote: list[tuple[int, int]], local: list[tuple[int, int]]) -> set:
    return {
        (r + k, dst + k)
        for (r, length), (dst, _) in zip(remote, local, strict=True)
        for k in range(length)
    }


@settings(max_examples=200, deadline=None)
@given(copy_plans())
def test_merge_preserves_bytes_and_never_grows(plan: tuple[list, list]) -> None:
    remote, local = plan
    check_pairs(remote, local)
    m_remote, m_local = merge_ranges(remote, local)
    check_pairs(m_remote, m_local)
    assert len(m_remote) <= len(remote)
    assert _byte_map(m_remote, m_local) == _byte_map(remote, local)
    # The numpy implementation (used for large reads) gives the same result.
    assert merge_ranges(np.array(remote), np.array(local)) == (m_remote, m_local)
    # Maximal: no two neighbouring output pairs could be merged further.
    for (ra, la), (rb, lb) in zip(
        zip(m_remote, m_local, strict=True),
        zip(m_remote[1:], m_local[1:], strict=False),
        strict=False,
    ):
        assert not (ra[0] + ra[1] == rb[0] and la[0] + la[1] == lb[0])


# -- TransferAgent, one process -----------------------------------------------------------


def test_register_is_idempotent_and_refuses_partial_overlap(agent: TransferAgent) -> None:
    buf = torch.zeros(4096, dtype=torch.uint8)
    region = agent.register(buf[1000:2000])
    assert agent.register(buf[1100:1200]) is region
    assert agent.region_of(buf.data_ptr() + 1010, 100) is region
    for overlapping in (buf[500:1500], buf):
        with pytest.raises(ValueError, match="overlaps"):
            agent.register(overlapping)
    with pytest.raises(ValueError, match="contiguous"):
        agent.register(torch.zeros(8, 8)[:, 0])
    agent.deregister(region)
    assert agent.region_of(buf.data_ptr() + 1000, 1) is None


def test_closed_agent_refuses_work() -> None:
    a = TransferAgent("closing")
    a.register(torch.zeros(64, dtype=torch.uint8))
    a.close()
    a.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.metadata()


# -- real READs from the holder process ----------------------------------------------------


@pytest.mark.parametrize(
    ("blocks", "slots", "descriptors"),
    [
        ([3], [0], 1),
        ([2, 3, 4, 5], [0, 1, 2, 3], 1),  # one adjacent run -> one descriptor
        ([0, 5, 9, 15], [3, 1, 0, 2], 4),  # scattered
        ([7, 8, 1, 2, 3, 12], [4, 5, 0, 1, 2, 9], 3),  # two runs and a single
        ([10, 11, 12], [6, 8, 10], 3),  # remote adjacent, local not
        ([6, 4, 5], [2, 0, 1], 1),  # out of order but one run once sorted
    ],
)
@pytest.mark.parametrize("as_array", [False, True], ids=["lists", "arrays"])
def test_read_blocks_into_other_slots(
    agent: TransferAgent,
    holder: tuple[Connection, dict[str, Any]],
    peer: str,
    blocks: list[int],
    slots: list[int],
    descriptors: int,
    as_array: bool,
) -> None:
    base = holder[1]["kv_addr"]
    local = torch.zeros((NUM_BLOCKS, *KV_BLOCK_SHAPE), dtype=torch.float16)
    remote = [(base + b * BLOCK_BYTES, BLOCK_BYTES) for b in blocks]
    dst = [(local.data_ptr() + s * BLOCK_BYTES, BLOCK_BYTES) for s in slots]
    region = agent.register(local)
    try:
        if as_array:
            stats = agent.read(peer, np.array(remote), np.array(dst), timeout_s=10)
        else:
            stats = agent.read(peer, remote, dst, timeout_s=10)
    finally:
        agent.deregister(region)
    assert stats.nbytes == len(blocks) * BLOCK_BYTES
    assert (stats.requested, stats.descriptors) == (len(blocks), descriptors)
    got = local.view(torch.uint8).view(NUM_BLOCKS, BLOCK_BYTES)
    for b, s in zip(blocks, slots, strict=True):
        assert torch.equal(got[s], block_pattern(b)), f"block {b} -> slot {s}"
    untouched = set(range(NUM_BLOCKS)) - set(slots)
    assert all(int(got[s].count_nonzero()) == 0 for s in untouched)


def test_merge_stops_at_local_registration_boundary(
    agent: TransferAgent, holder: tuple[Connection, dict[str, Any]], peer: str
) -> None:
    # Two registrations adjacent in memory: NIXL needs each descriptor inside one of them.
    local = torch.zeros(4 * BLOCK_BYTES, dtype=torch.uint8)
    first = agent.register(local[: 2 * BLOCK_BYTES])
    second = agent.register(local[2 * BLOCK_BYTES :])
    base = holder[1]["kv_addr"]
    remote = [(base + b * BLOCK_BYTES, BLOCK_BYTES) for b in range(4)]
    dst = [(local.data_ptr() + s * BLOCK_BYTES, BLOCK_BYTES) for s in range(4)]
    try:
        unmerged = agent.read(peer, remote, dst, timeout_s=10, merge=False)
        stats = agent.read(peer, remote, dst, timeout_s=10)
        as_arrays = agent.read(peer, np.array(remote), np.array(dst), timeout_s=10)
    finally:
        agent.deregister(first)
        agent.deregister(second)
    assert (unmerged.descriptors, stats.descriptors, as_arrays.descriptors) == (4, 2, 2)
    for b in range(4):
        assert torch.equal(local.view(4, BLOCK_BYTES)[b], block_pattern(b))


async def test_read_async_random_subset(
    agent: TransferAgent, holder: tuple[Connection, dict[str, Any]], peer: str
) -> None:
    rng = random.Random(7)
    blocks = rng.sample(range(NUM_BLOCKS), 9)
    slots = rng.sample(range(NUM_BLOCKS), 9)
    base = holder[1]["kv_addr"]
    local = torch.zeros(NUM_BLOCKS * BLOCK_BYTES, dtype=torch.uint8)
    region = agent.register(local)
    try:
        stats = await agent.read_async(
            peer,
            [(base + b * BLOCK_BYTES, BLOCK_BYTES) for b in blocks],
            [(local.data_ptr() + s * BLOCK_BYTES, BLOCK_BYTES) for s in slots],
            timeout_s=10,
        )
    finally:
        agent.deregister(region)
    assert stats.nbytes == 9 * BLOCK_BYTES
    got = local.view(NUM_BLOCKS, BLOCK_BYTES)
    for b, s in zip(blocks, slots, strict=True):
        assert torch.equal(got[s], block_pattern(b))


def test_tensor_handle_round_trip(
    agent: TransferAgent, holder: tuple[Connection, dict[str, Any]]
) -> None:
    conn = holder[0]
    _send(conn, cmd="tensor")
    handle = tensor_pb2.TransferHandle.FromString(conn.recv_bytes())
    assert handle.memory_kind == tensor_pb2.MEMORY_KIND_HOST
    assert handle.lease_id == "lease-1"
    assert handle.agent_name == holder[1]["name"]
    assert handle.length == known_tensor().numel() * 4
    out = read_tensor(handle, torch.float32, TENSOR_SHAPE, agent)
    assert torch.equal(out, known_tensor())
    # The fresh buffer was deregistered again.
    assert agent.region_of(out.data_ptr(), 4) is None
    with pytest.raises(ValueError, match="bytes but the handle holds"):
        read_tensor(handle, torch.float16, TENSOR_SHAPE, agent)


def test_unknown_peer(agent: TransferAgent) -> None:
    local = torch.zeros(64, dtype=torch.uint8)
    agent.register(local)
    with pytest.raises(UnknownPeerError, match="add_peer"):
        agent.read("nobody", [(4096, 64)], [(local.data_ptr(), 64)], timeout_s=1)


def test_add_peer_is_cached(
    agent: TransferAgent, holder: tuple[Connection, dict[str, Any]], peer: str
) -> None:
    assert agent.add_peer(holder[1]["metadata"]) == peer == holder[1]["name"]
    assert peer in agent.peers


def _tensor_handle(holder: tuple[Connection, dict[str, Any]]) -> tensor_pb2.TransferHandle:
    """A handle for a tensor the holder registers now, with the snapshot taken after."""
    _send(holder[0], cmd="tensor")
    return tensor_pb2.TransferHandle.FromString(holder[0].recv_bytes())


def _regress(reader: TransferAgent, name: str, older: bytes) -> None:
    """Leave NIXL knowing only the `older` snapshot of peer `name`: the state a reader is in
    when an older snapshot won a race with the newer one (NIXL 1.5 merges the sections of
    every snapshot loaded, so only forgetting the peer gets there)."""
    reader._agent.remove_remote_agent(name)
    reader._agent.add_remote_agent(older)


@pytest.fixture
def fresh() -> Iterator[TransferAgent]:
    """A reader of its own, for tests that put its view of the holder out of date."""
    a = TransferAgent("fresh")
    yield a
    a.close()


def test_add_peer_never_regresses_to_an_earlier_snapshot(
    fresh: TransferAgent, holder: tuple[Connection, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    older = holder[1]["metadata"]
    newer = _tensor_handle(holder).agent_metadata
    assert newer != older
    loads: list[bytes] = []
    real = fresh._agent.add_remote_agent

    def counted(metadata: bytes) -> Any:
        loads.append(metadata)
        return real(metadata)

    monkeypatch.setattr(fresh._agent, "add_remote_agent", counted)
    name = holder[1]["name"]
    assert fresh.add_peer(older) == fresh.add_peer(newer) == name
    # Both seen: neither is loaded again, whatever order they come back in.
    assert fresh.add_peer(older) == fresh.add_peer(newer) == name
    assert loads == [older, newer]
    assert fresh.add_peer(older, force=True) == name
    assert loads == [older, newer, older]
    assert fresh.peers == [name]


def test_refused_read_reloads_the_handles_snapshot_once(
    fresh: TransferAgent, holder: tuple[Connection, dict[str, Any]]
) -> None:
    handle = _tensor_handle(holder)
    peer = fresh.add_peer(handle.agent_metadata)
    _regress(fresh, peer, holder[1]["metadata"])  # lacks the tensor just registered
    local = torch.zeros(handle.length, dtype=torch.uint8)
    fresh.register(local)
    remote = [(handle.address, handle.length)]
    into = [(local.data_ptr(), handle.length)]
    with pytest.raises(TransferRefusedError, match="NOT_FOUND"):
        fresh.read(peer, remote, into, timeout_s=5)
    assert not fresh.covers(peer, remote)
    stats = fresh.read(peer, remote, into, timeout_s=5, peer_metadata=handle.agent_metadata)
    assert stats.nbytes == handle.length
    assert torch.equal(local.view(torch.float32).view(TENSOR_SHAPE), known_tensor())
    assert fresh.covers(peer, remote)


def test_read_tensor_refreshes_a_stale_view_of_the_holder(
    fresh: TransferAgent, holder: tuple[Connection, dict[str, Any]]
) -> None:
    # The fallback path of an encoder: a buffer registered after a first snapshot was loaded.
    fresh.add_peer(holder[1]["metadata"])
    handle = _tensor_handle(holder)
    peer = fresh.add_peer(handle.agent_metadata)
    _regress(fresh, peer, holder[1]["metadata"])
    # add_peer has seen the handle's bytes and skips them; read_tensor still gets there.
    out = read_tensor(handle, torch.float32, TENSOR_SHAPE, fresh)
    assert torch.equal(out, known_tensor())


def test_read_tensor_follows_a_holder_that_reregistered_reused_memory(
    fresh: TransferAgent, holder: tuple[Connection, dict[str, Any]]
) -> None:
    _send(holder[0], cmd="reuse")
    reply = _recv(holder[0])
    handle = tensor_pb2.TransferHandle.FromString(reply["handle"])
    fresh.add_peer(reply["older"])
    peer = fresh.add_peer(handle.agent_metadata)
    # NIXL keeps the deregistered range, which shadows the new registration around it.
    assert not fresh.covers(peer, [(handle.address, handle.length)])
    out = read_tensor(handle, torch.uint8, (4096,), fresh)
    assert torch.equal(out, block_pattern(3, 4096))


_BAD_HANDLES = {
    "garbage_metadata": (TransferRefusedError, "cannot load peer metadata"),
    "other_name": (ValueError, "names agent"),
    "past_the_registration": (TransferRefusedError, "outside the memory"),
    "oversize_shape": (TransferRefusedError, "outside the memory"),
    "overflowing_shape": (ValueError, "too large"),
    "overflowing_address": (ValueError, "invalid"),
}


@pytest.mark.parametrize("case", sorted(_BAD_HANDLES))
def test_bad_handle_is_refused_before_anything_is_allocated(
    agent: TransferAgent,
    holder: tuple[Connection, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    case: str,
) -> None:
    handle = _tensor_handle(holder)
    shape: list[int] = list(TENSOR_SHAPE)
    if case == "garbage_metadata":
        handle.agent_metadata = b"not nixl metadata"
    elif case == "other_name":
        handle.agent_name = "someone-else"
    elif case == "past_the_registration":
        handle.address = holder[1]["big_addr"] + BIG_BYTES - handle.length // 2
    elif case == "oversize_shape":
        shape = [4, 1 << 36]  # 1 TiB of float32, "held" from the start of a 1 MiB buffer
        handle.address, handle.length = holder[1]["big_addr"], 4 << 38
    elif case == "overflowing_shape":
        shape = [1 << 40, 1 << 40]
        handle.length = 1 << 62
    else:
        handle.address = (1 << 64) - 64
    error, message = _BAD_HANDLES[case]

    def no_allocation(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("read_tensor allocated before the handle checked out")

    monkeypatch.setattr(torch, "empty", no_allocation)
    with pytest.raises(error, match=message):
        read_tensor(handle, torch.float32, shape, agent)


def test_local_range_must_be_registered(
    agent: TransferAgent, holder: tuple[Connection, dict[str, Any]], peer: str
) -> None:
    unregistered = torch.zeros(BLOCK_BYTES, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not inside memory registered"):
        agent.read(
            peer,
            [(holder[1]["kv_addr"], BLOCK_BYTES)],
            [(unregistered.data_ptr(), BLOCK_BYTES)],
            timeout_s=1,
        )


def test_remote_range_outside_registration(
    agent: TransferAgent, holder: tuple[Connection, dict[str, Any]], peer: str
) -> None:
    local = torch.zeros(2 * BLOCK_BYTES, dtype=torch.uint8)
    region = agent.register(local)
    end = holder[1]["kv_addr"] + NUM_BLOCKS * BLOCK_BYTES
    with pytest.raises(TransferError, match="refused"):
        agent.read(
            peer,
            [(end - BLOCK_BYTES, 2 * BLOCK_BYTES)],
            [(local.data_ptr(), 2 * BLOCK_BYTES)],
            timeout_s=1,
        )
    agent.deregister(region)


@pytest.mark.parametrize(
    ("state", "error"), [("PROC", TransferTimeoutError), ("ERR", TransferError)]
)
def test_stalled_or_failed_transfer(
    agent: TransferAgent,
    holder: tuple[Connection, dict[str, Any]],
    peer: str,
    monkeypatch: pytest.MonkeyPatch,
    state: str,
    error: type[Exception],
) -> None:
    # UCX completes host-memory READs between local processes inside the post call (even
    # with the holder SIGSTOPped), so a stall is injected at the nixl agent's status calls;
    # the transfer request itself is real and must be released.
    local = torch.zeros(4096, dtype=torch.uint8)
    region = agent.register(local)
    monkeypatch.setattr(agent._agent, "transfer", lambda handle, notif_msg=b"": state)
    monkeypatch.setattr(agent._agent, "check_xfer_state", lambda handle: state)
    with pytest.raises(error, match="timed out" if state == "PROC" else "failed") as info:
        agent.read(
            peer, [(holder[1]["big_addr"], 4096)], [(local.data_ptr(), 4096)], timeout_s=0.05
        )
    if state == "PROC":
        assert isinstance(info.value, TransferTimeoutError)
        assert info.value.cancelled  # never posted, so NIXL could release it
    monkeypatch.undo()
    # The agent still works afterwards.
    stats = agent.read(
        peer, [(holder[1]["big_addr"], 4096)], [(local.data_ptr(), 4096)], timeout_s=10
    )
    agent.deregister(region)
    assert stats.nbytes == 4096
    assert int(local.sum()) == 5 * 4096
