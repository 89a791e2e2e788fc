"""A NIXL agent closing or interrupted beside a READ, over UCX from a holder process
(tests/nixl_holder_helpers.py): a READ that may still write keeps its memory and its peer,
whichever way it stopped (s35 review of the parked READs)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from common.transfer import agent as agent_module
from common.transfer import polling
from common.transfer.agent import TransferAgent
from common.transfer.parked import ParkedHandles
from tests.nixl_holder_helpers import BIG_BYTES, holder

__all__ = ["holder"]


@pytest.fixture
def reader(holder: tuple[Connection, dict[str, Any]]) -> Iterator[tuple[TransferAgent, str]]:
    a = TransferAgent("closing")
    yield a, a.add_peer(holder[1]["metadata"])
    a.close()


def _ranges(holder: tuple[Connection, dict[str, Any]], into: torch.Tensor) -> Any:
    return [(holder[1]["big_addr"], 4096)], [(into.data_ptr(), 4096)]


def test_a_read_interrupted_keeps_its_peer_until_it_ends(
    reader: tuple[TransferAgent, str],
    holder: tuple[Connection, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Interrupted (a KeyboardInterrupt on the main thread), a READ is parked, since it may
    # still write; its peer was counted free, and could be unloaded under it.
    agent, peer = reader
    into = torch.zeros(4096, dtype=torch.uint8)
    agent.register(into)
    remote, local = _ranges(holder, into)
    assert BIG_BYTES >= 4096 and agent.read(peer, remote, local, timeout_s=10).nbytes == 4096

    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(polling, "post_and_wait", interrupted)
    ended = threading.Event()
    monkeypatch.setattr(ParkedHandles, "park", _parked_until(ended))
    with pytest.raises(KeyboardInterrupt):
        agent.read(peer, remote, local, timeout_s=10)
    assert agent._peers.reading() == 1  # parked against `peer`
    agent._peers.forget(agent._lock, peer)  # as a failed READ of it would
    assert peer in agent._peers  # kept loaded: the parked READ may still write
    ended.set()
    deadline = time.monotonic() + 10
    while agent._peers.reading() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert agent._peers.reading() == 0


def _parked_until(ended: threading.Event) -> Any:
    """`ParkedHandles.park` whose future is set once `ended` is (the handle released)."""
    from concurrent.futures import Future

    def park(self: ParkedHandles, handle: Any, check: Any = None) -> Future[None]:
        released: Future[None] = Future()

        def end() -> None:
            ended.wait(30)
            released.set_result(None)

        threading.Thread(target=end).start()
        return released

    return park


def test_a_read_starting_as_the_agent_closes_is_counted_or_refused(
    reader: tuple[TransferAgent, str],
    holder: tuple[Connection, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `close` counted the READs in flight before it marked itself closed: one that passed
    # the open check just then started after the count, and its memory was let go while it
    # could still write. Now it is refused before it is posted.
    agent, peer = reader
    into = torch.zeros(4096, dtype=torch.uint8)
    agent.register(into)
    remote, local = _ranges(holder, into)
    begin = agent._peers.begin_read

    def closing_first(name: str) -> None:
        closed = threading.Thread(target=agent.close)
        closed.start()
        closed.join(10)
        begin(name)

    monkeypatch.setattr(agent._peers, "begin_read", closing_first)
    posted: list[Any] = []
    monkeypatch.setattr(polling, "post_and_wait", lambda *args: posted.append(args))
    kept = len(agent_module._KEPT)
    with pytest.raises(RuntimeError, match="is closed"):
        agent.read(peer, remote, local, timeout_s=10)
    assert posted == [] and agent._peers.reading() == 0
    assert len(agent_module._KEPT) == kept  # nothing in flight: nothing kept


def test_a_retry_due_as_the_handles_close_asks_nothing_after() -> None:
    # A retry tick already fired ran on after `close`, asking NIXL of a closed agent.
    parked = ParkedHandles("test", retry_s=60)
    asked: list[int] = []

    def ended() -> bool:
        asked.append(1)
        return False

    parked.park(object(), ended)
    assert parked.close() == 1 and asked == [1]
    parked.retry()
    assert asked == [1]


class _RefuseOnce:
    """NIXL refusing the first READ prepared (a stale snapshot of the holder)."""

    def __init__(self, inner: Any) -> None:
        self._inner, self.refused = inner, False

    def initialize_xfer(self, *args: Any) -> Any:
        if not self.refused:
            self.refused = True
            raise RuntimeError("NIXL_ERR_NOT_FOUND (stale snapshot)")
        return self._inner.initialize_xfer(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_read_refreshed_as_the_agent_closes_is_counted_or_refused(
    reader: tuple[TransferAgent, str],
    holder: tuple[Connection, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A READ refused once is not counted while its peer is refreshed: a close then counted
    # none and let its memory go, and the READ was posted after (ownfix review).
    agent, peer = reader
    into = torch.zeros(4096, dtype=torch.uint8)
    agent.register(into)
    remote, local = _ranges(holder, into)
    monkeypatch.setattr(agent._peers, "_agent", _RefuseOnce(agent._peers._agent))
    counted, go_on, seen = threading.Event(), threading.Event(), list[int]()
    reading, refresh = agent._peers.reading, agent._peers.refresh

    def reading_then_wait() -> int:  # the close, paused once it has counted
        seen.append(reading())
        counted.set()
        go_on.wait(10)
        return seen[-1]

    def closing_during_refresh(*args: Any, **kwargs: Any) -> Any:
        threading.Thread(target=agent.close, daemon=True).start()
        assert counted.wait(10)
        return refresh(*args, **kwargs)

    monkeypatch.setattr(agent._peers, "reading", reading_then_wait)
    monkeypatch.setattr(agent._peers, "refresh", closing_during_refresh)
    posted: list[Any] = []
    monkeypatch.setattr(polling, "post_and_wait", lambda *args: posted.append(args))
    with pytest.raises(RuntimeError, match="is closed"):
        agent.read(peer, remote, local, timeout_s=10, peer_metadata=holder[1]["metadata"])
    go_on.set()
    assert seen == [0] and posted == []
