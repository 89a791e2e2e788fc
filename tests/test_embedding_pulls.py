"""Prefill-side pulls of encoder outputs held by NIXL, from encoder processes exporting
through the real `OutputLeases`: encoder 0's arena is too small for every output, so some
fall back to buffers of their own; encoder 1 has no arena, so every output registers its
own buffer, its metadata changes while readers pull, and released buffers' addresses come
back in later registrations (which NIXL readers cannot follow without a refresh).

Each encoder process serves commands over a Pipe (msgpack maps, serialized protobuf).
Readers pull with `read_tensor` from many threads at once, as prefill workers do, and the
prefill worker's `EmbeddingPulls._resolve` turns what goes wrong into the right gRPC status.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any, cast

import grpc
import msgpack
import pytest
import torch

from common.handoff import EMBEDDINGS_LOST
from common.multimodal.validation import MultimodalLayoutError
from common.server.rpc import RpcStatusError
from common.transfer.agent import TransferAgent
from common.transfer.types import TransferDigestError, TransferError, TransferRefusedError
from common.wire.convert import element_type
from common.wire.transfer import read_tensor
from epd.v1 import tensor_pb2
from prefill_worker.embeddings import EmbeddingPulls

HIDDEN = 64  # row width of the fake outputs
LAYERS = 3  # tensors per output: rows and two deepstack layers
POOL_BYTES = 1 << 20  # encoder 0's arena: fills up, and the largest outputs never fit


def output_rows(k: int) -> int:
    """Rows of output `k`: mostly small, every seventh 3 MiB in all (larger than the arena)."""
    return 4096 if k % 7 == 3 else 16 + 37 * (k % 5)


def output_tensor(encoder: int, k: int, layer: int) -> torch.Tensor:
    """The exact values of tensor `layer` of output `k` of encoder `encoder`."""
    rows = output_rows(k)
    base = torch.arange(rows * HIDDEN, dtype=torch.float32).reshape(rows, HIDDEN)
    return base + float(100_000 * encoder + 100 * k + layer)


def _send(conn: Connection, **msg: Any) -> None:
    conn.send_bytes(msgpack.packb(msg))


def _recv(conn: Connection) -> dict[str, Any]:
    return msgpack.unpackb(conn.recv_bytes())


def encoder_main(conn: Connection, encoder: int) -> None:
    """An encoder process: export outputs through `OutputLeases` until told to stop."""
    torch.set_num_threads(1)
    asyncio.run(_serve(conn, encoder))


async def _serve(conn: Connection, encoder: int) -> None:
    from encoder_worker.leases import OutputLeases

    leases = OutputLeases(
        60.0,
        pool_bytes=0 if encoder == 1 else POOL_BYTES,
        agent_factory=lambda: TransferAgent(f"enc{encoder}"),
    )
    leases.start()
    agent = await leases.agent()
    if agent is None:
        _send(conn, error="NIXL unavailable")
        return
    _send(conn, name=agent.name, pid=os.getpid())
    while True:
        msg = await asyncio.to_thread(_recv, conn)
        if msg["cmd"] == "export":
            handles = []
            for k in msg["outputs"]:
                tensors = [output_tensor(encoder, k, layer) for layer in range(LAYERS)]
                handles.append([h.SerializeToString() for h in leases.export(agent, tensors)])
            _send(conn, handles=handles)
        elif msg["cmd"] == "release":
            _send(conn, released=leases.release(msg["lease_ids"]))
        elif msg["cmd"] == "counters":
            _send(conn, exported=leases.exported, unpooled=leases.unpooled, live=len(leases))
        elif msg["cmd"] == "stop":
            await leases.close()
            _send(conn, ok=True)
            return


class Encoder:
    """The test's side of one encoder process."""

    def __init__(self, index: int, conn: Connection, proc: Any) -> None:
        self.index = index
        self.conn = conn
        self.proc = proc
        self.info: dict[str, Any] = {}

    def ask(self, **msg: Any) -> dict[str, Any]:
        _send(self.conn, **msg)
        if not self.conn.poll(30):
            pytest.fail(f"encoder {self.index} did not answer {msg['cmd']!r} within 30 s")
        return _recv(self.conn)

    def export(self, outputs: list[int]) -> list[list[tensor_pb2.TransferHandle]]:
        reply = self.ask(cmd="export", outputs=outputs)
        return [[tensor_pb2.TransferHandle.FromString(h) for h in out] for out in reply["handles"]]


@pytest.fixture(scope="module")
def encoders() -> Iterator[list[Encoder]]:
    """Three encoder processes, started together: two to pull from, one to kill."""
    ctx = mp.get_context("spawn")
    started = []
    for index in range(3):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=encoder_main, args=(child, index), daemon=True)
        proc.start()
        started.append(Encoder(index, parent, proc))
    try:
        for enc in started:
            if not enc.conn.poll(60):
                pytest.fail(f"encoder {enc.index} did not start within 60 s")
            enc.info = _recv(enc.conn)
            if "error" in enc.info:
                pytest.skip(f"NIXL UCX backend unavailable: {enc.info['error']}")
        yield started
    finally:
        for enc in started:
            if enc.proc.is_alive():
                _send(enc.conn, cmd="stop")
                enc.conn.poll(10)
            enc.proc.join(10)
            if enc.proc.is_alive():
                enc.proc.kill()


@pytest.fixture(scope="module")
def reader(encoders: list[Encoder]) -> Iterator[TransferAgent]:
    agent = TransferAgent("prefill")
    yield agent
    agent.close()


def _pull(handle: tensor_pb2.TransferHandle, rows: int, agent: TransferAgent) -> torch.Tensor:
    return read_tensor(handle, torch.float32, (rows, HIDDEN), agent, timeout_s=10)


def test_concurrent_pulls_from_two_encoders_all_succeed(
    encoders: list[Encoder], reader: TransferAgent
) -> None:
    rng = random.Random(3)
    rounds, per_round = 3, 8
    pulled = 0
    with ThreadPoolExecutor(max_workers=16) as pool:
        # Exports go on while the previous round's pulls are in flight, and each round's
        # leases are released once pulled, so the next round reuses their memory.
        previous: list[tuple[int, int, int, Any]] = []
        leases: dict[int, list[str]] = {0: [], 1: []}
        for round_ in range(rounds + 1):
            jobs = []
            fresh: dict[int, list[str]] = {0: [], 1: []}
            if round_ < rounds:
                for enc in encoders[:2]:
                    outputs = [rng.randrange(50) for _ in range(per_round)]
                    for k, handles in zip(outputs, enc.export(outputs), strict=True):
                        fresh[enc.index].append(handles[0].lease_id)
                        jobs += [(enc.index, k, layer, h) for layer, h in enumerate(handles)]
            rng.shuffle(jobs)
            current = [
                (e, k, layer, pool.submit(_pull, h, output_rows(k), reader))
                for e, k, layer, h in jobs
            ]
            for enc_index, k, layer, future in previous:
                assert torch.equal(future.result(timeout=30), output_tensor(enc_index, k, layer))
                pulled += 1
            for enc in encoders[:2]:
                released = enc.ask(cmd="release", lease_ids=leases[enc.index])["released"]
                assert released == len(leases[enc.index])
            previous, leases = current, fresh
    assert pulled == 2 * rounds * per_round * LAYERS
    unpooled = [enc.ask(cmd="counters")["unpooled"] for enc in encoders[:2]]
    assert 0 < unpooled[0] < rounds * per_round  # both paths ran: arena ranges, own buffers
    assert unpooled[1] == rounds * per_round
    assert all(enc.ask(cmd="counters")["live"] == 0 for enc in encoders[:2])


def _resolve(
    reader: TransferAgent, ref: tensor_pb2.TensorRef, field: str, pulls: Any = None
) -> torch.Tensor:
    """`EmbeddingPulls._resolve` as a prefill worker calls it (its agent, a CPU device)."""
    if pulls is None:
        pulls = _pulls(reader)
    return EmbeddingPulls._resolve(pulls, ref, field, pulled=[], deadline=time.monotonic() + 5)


def _pulls(reader: TransferAgent) -> Any:
    """The parts of `EmbeddingPulls` `_resolve` uses."""
    return cast(
        Any,
        SimpleNamespace(
            agent=reader,
            runner=SimpleNamespace(device="cpu"),
            digest_failures=0,
            _lock=threading.Lock(),
        ),
    )


def _ref(handle: tensor_pb2.TransferHandle, shape: list[int]) -> tensor_pb2.TensorRef:
    ref = tensor_pb2.TensorRef(dtype=element_type(torch.float32), shape=shape)
    ref.handle.CopyFrom(handle)
    return ref


@pytest.mark.parametrize("case", ["garbage_metadata", "past_the_registration", "oversize"])
def test_a_bad_handle_is_invalid_argument_naming_the_field(
    encoders: list[Encoder], reader: TransferAgent, case: str
) -> None:
    (handles,) = encoders[0].export([100])
    handle = handles[1]
    rows = output_rows(100)
    good = _resolve(reader, _ref(handle, [rows, HIDDEN]), "embeddings.deepstack")
    assert torch.equal(good, output_tensor(0, 100, 1))
    bad = tensor_pb2.TransferHandle()
    bad.CopyFrom(handle)
    shape = [rows, HIDDEN]
    if case == "garbage_metadata":
        bad.agent_metadata = b"\x00garbage"
    elif case == "past_the_registration":
        bad.address += POOL_BYTES  # the arena is 1 MiB: past its end
    else:
        shape = [4, 1 << 36]
        bad.length = 4 << 38
    with pytest.raises(MultimodalLayoutError) as info:
        _resolve(reader, _ref(bad, shape), "embeddings.deepstack")
    assert info.value.field == "embeddings.deepstack"
    if case != "oversize":
        assert isinstance(info.value.__context__, TransferRefusedError)
    encoders[0].ask(cmd="release", lease_ids=[handle.lease_id])


def test_a_handle_without_a_digest_names_the_encoder_not_the_caller(
    encoders: list[Encoder], reader: TransferAgent
) -> None:
    # An encoder from before digests, behind a router that still takes it: INVALID_ARGUMENT
    # blamed a field the client never sent, and the client took it as its own fault
    # (ownfix review, s36). Nothing is READ.
    (handles,) = encoders[0].export([100])
    bare = tensor_pb2.TransferHandle()
    bare.CopyFrom(handles[1])
    bare.ClearField("digest")
    with pytest.raises(RpcStatusError) as info:
        _resolve(reader, _ref(bare, [output_rows(100), HIDDEN]), "embeddings[0].deepstack")
    assert info.value.code == grpc.StatusCode.INTERNAL  # a 500: not the client's to fix
    assert "embeddings[0].deepstack" in str(info.value) and "upgrade encoders" in str(info.value)
    encoders[0].ask(cmd="release", lease_ids=[handles[1].lease_id])


def test_a_range_reused_after_its_lease_ended_is_not_read_as_the_old_output(
    encoders: list[Encoder], reader: TransferAgent
) -> None:
    # A's lease ends (released here; expiry frees it alike) while its handle still waits
    # for a prefill worker; B's output lands in the range A held.
    enc = encoders[0]
    ((a, *_),) = enc.export([40])
    assert enc.ask(cmd="release", lease_ids=[a.lease_id])["released"] == 1
    ((b, *_),) = enc.export([50])
    assert b.address == a.address and output_rows(40) == output_rows(50)
    ref = _ref(a, [output_rows(40), HIDDEN])
    with pytest.raises(TransferDigestError):  # the bytes are B's, not those A lent
        read_tensor(ref.handle, torch.float32, tuple(ref.shape), reader, timeout_s=10)
    pulls = _pulls(reader)
    with pytest.raises(RpcStatusError) as info:
        _resolve(reader, ref, "embeddings.rows", pulls)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert EMBEDDINGS_LOST in str(info.value)  # the router encodes the item again
    assert pulls.digest_failures == 1  # epd:embedding_digest_failures
    assert torch.equal(_pull(b, output_rows(50), reader), output_tensor(0, 50, 0))
    enc.ask(cmd="release", lease_ids=[b.lease_id])


def test_a_dead_holder_is_unavailable(encoders: list[Encoder], reader: TransferAgent) -> None:
    doomed = encoders[2]
    (handles,) = doomed.export([1])
    ref = _ref(handles[0], [output_rows(1), HIDDEN])
    assert torch.equal(_resolve(reader, ref, "embeddings.rows"), output_tensor(2, 1, 0))
    os.kill(doomed.proc.pid, signal.SIGKILL)
    doomed.proc.join(10)
    with pytest.raises(TransferError) as raw:
        read_tensor(ref.handle, torch.float32, tuple(ref.shape), reader, timeout_s=2)
    assert not isinstance(raw.value, TransferRefusedError)
    with pytest.raises(RpcStatusError) as info:
        _resolve(reader, ref, "embeddings.rows")
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "embeddings.rows" in str(info.value)
    assert EMBEDDINGS_LOST in str(info.value)  # the router encodes the item again
    # The dead agent is forgotten, not kept loaded for good (a restart is another agent).
    assert ref.handle.agent_name not in reader.peers


async def test_stalled_pulls_leave_the_loops_default_threads_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The pulls ran on the event loop's default executor: six threads on a two-core
    # machine, which six stalled encoders held up to the pull timeout, and with them every
    # `asyncio.to_thread` of the worker (races review). They have threads of their own.
    import prefill_worker.embeddings as embeddings

    release = threading.Event()
    monkeypatch.setattr(embeddings, "read_handoff", lambda *a, **k: release.wait(10))
    peers = SimpleNamespace(release_embeddings=lambda known: None)
    pulls = EmbeddingPulls(cast(Any, None), cast(Any, None), cast(Any, peers), 30.0)
    stalled = [
        asyncio.ensure_future(pulls.read_handoff([], cast(Any, None), {}, None))
        for _ in range(min(32, (os.cpu_count() or 1) + 4) + 2)  # more than the default's
    ]
    await asyncio.sleep(0.1)  # each pull on its thread
    try:
        async with asyncio.timeout(5):
            assert await asyncio.to_thread(lambda: 7) == 7
    finally:
        release.set()
        await asyncio.gather(*stalled)


async def test_a_pull_whose_request_went_away_while_it_waited_never_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Queued behind stalled pulls, a handoff whose request had gone still ran later, each
    # with a full timeout of its own (ownfix review): one not started is cancelled, and a
    # pull's time counts from the request, not from when a thread took it.
    import prefill_worker.embeddings as embeddings

    release, started = threading.Event(), []

    def stalled(*args: Any, **kwargs: Any) -> None:
        started.append(kwargs["resolve"].keywords["deadline"] - time.monotonic())
        release.wait(10)

    monkeypatch.setattr(embeddings, "read_handoff", stalled)
    monkeypatch.setattr(embeddings, "_pulls", ThreadPoolExecutor(2))
    peers = SimpleNamespace(release_embeddings=lambda known: None)
    pulls = EmbeddingPulls(cast(Any, None), cast(Any, None), cast(Any, peers), 30.0)
    calls = [
        asyncio.ensure_future(pulls.read_handoff([], cast(Any, None), {}, None)) for _ in range(4)
    ]
    await asyncio.sleep(0.2)
    for call in calls:
        call.cancel()
    await asyncio.sleep(0.1)
    release.set()
    await asyncio.sleep(0.2)
    assert len(started) == 2  # the two queued ones never started
    embeddings._pulls.shutdown(wait=True)
