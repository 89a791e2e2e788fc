"""What a `TransferAgent` knows of its peers: the metadata snapshots it loaded into NIXL.

A peer's metadata is a snapshot of its registrations at the time it was taken. Snapshots
reach a reader in any order: each transfer handle carries the one taken when it was made,
and worker threads pull concurrently, so an older snapshot may arrive after a newer one.

NIXL (1.5) only ever adds what a snapshot loads: descriptors a peer has deregistered since
stay, and once the peer registers memory at a reused address, the stale descriptor shadows
the new one (READs are refused NIXL_ERR_NOT_FOUND) or collides with it (the load is refused
NIXL_ERR_NOT_ALLOWED). Holders that register once (the encoder's arena, the KV pool) never
meet this; holders that register per output do.

The rules. `load`: each distinct snapshot is loaded at most once; bytes seen before (the
peer's current snapshot, or one it superseded) are skipped, so a known peer never regresses
to a snapshot it loaded earlier than the current one. `refresh`: when NIXL refuses what the
snapshots loaded say, NIXL forgets the peer and loads the one snapshot the caller trusts
(the handle's own), while no READ of that peer is prepared or in flight in this agent (a
gate: READs wait during a refresh, a refresh waits for READs to finish). A READ refused is
retried once that way (`prepare_read`). `load` of a new peer also forgets the peers not
loaded nor read for `IDLE_S` (workers scaled away or restarted: another process is another
agent, so a decode worker met every prefill worker it ever pulled from); one forgotten that
is still there is loaded again from its next handle's snapshot, as after a failed READ. A
peer with a READ that timed out and is parked (`end_read(parked=True)` until `unpark`) is
never forgotten nor refreshed (a refresh is refused): NIXL would then call the READ over,
but over TCP a frozen holder's bytes still land once it gets going (ownfix review).

Thread safety: `load`, `covers`, `names` and `check_known` run under the agent's lock.
`begin_read` / `end_read` / `refresh` / `prepare_read` take the gate themselves and the
agent's lock where they need it; no thread waits on the gate while holding the agent's lock.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final, TypeVar

from common.transfer.types import (
    TransferError,
    TransferRefusedError,
    UnknownPeerError,
    nixl_refused,
)

logger = logging.getLogger(__name__)

# Snapshots remembered per peer (16-byte digests); the oldest are forgotten first. A holder
# takes a new snapshot only when it registers more memory, so this is years of fallbacks.
_REMEMBERED: Final = 4096

# A peer neither loaded nor read for this long is forgotten when a new one is loaded.
IDLE_S: Final = 600.0


T = TypeVar("T")


def _digest(metadata: bytes) -> bytes:
    return hashlib.blake2b(metadata, digest_size=16).digest()


class PeerSnapshots:
    """The peers one nixl agent loaded and, per peer, the digests of the snapshots loaded."""

    def __init__(
        self, agent: Any, own_name: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._used: dict[str, float] = {}  # peer name -> when it was last loaded or read
        self._agent = agent  # the nixl agent (binding object) they are loaded into
        self._own_name = own_name  # that agent's name: its own metadata is refused
        self._owner: dict[bytes, str] = {}  # snapshot digest -> peer name
        self._loaded: dict[str, deque[bytes]] = {}  # peer name -> its digests, oldest first
        self._gate = threading.Condition()  # guards the two below
        self._reading: dict[str, int] = {}  # peer -> READs prepared or in flight
        self._parked: dict[str, int] = {}  # peer -> READs timed out, parked until they end
        self._refreshing: set[str] = set()  # peers being refreshed now

    def __contains__(self, name: object) -> bool:
        return name in self._loaded

    def names(self) -> list[str]:
        """Names of the peers loaded so far, in load order."""
        return list(self._loaded)

    def check_known(self, peer: str) -> None:
        """Raise UnknownPeerError unless `peer` was loaded."""
        if peer not in self._loaded:
            raise UnknownPeerError(
                f"unknown NIXL peer {peer!r}: call add_peer with its metadata first"
            )

    def load(self, metadata: bytes, *, force: bool = False) -> str:
        """Load `metadata` into NIXL unless seen before (or `force`); return the peer's name.

        Raises TransferRefusedError if NIXL cannot load the bytes, TransferError if it fails
        otherwise, and ValueError for the agent's own metadata.
        """
        digest = _digest(metadata)
        name = self._owner.get(digest)
        if name is not None and not force:
            self._used[name] = self._clock()
            return name
        try:
            raw_name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            error = TransferRefusedError if nixl_refused(exc) else TransferError
            raise error(f"cannot load peer metadata: {exc}") from exc
        # The binding returns the name as bytes although it is annotated as str.
        name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        if name == self._own_name:
            raise ValueError("add_peer was given this agent's own metadata")
        self._used[name] = self._clock()
        if name not in self._loaded:
            self._forget_idle()
        if digest not in self._owner:
            seen = self._loaded.setdefault(name, deque())
            seen.append(digest)
            self._owner[digest] = name
            if len(seen) > _REMEMBERED:
                del self._owner[seen.popleft()]
        logger.debug("%s loaded %s snapshot of %s", self._own_name, "a" if force else "a new", name)
        return name

    def _forget_idle(self) -> None:
        """Forget the peers idle for `IDLE_S`, none with a READ in flight (lock held)."""
        cutoff = self._clock() - IDLE_S
        with self._gate:
            idle = [
                peer
                for peer in self._loaded
                if self._used.get(peer, cutoff) <= cutoff
                and not self._reading.get(peer)
                and not self._parked.get(peer)
                and peer not in self._refreshing
            ]
            self._refreshing.update(idle)  # READs of them wait the moment this takes
        try:
            for peer in idle:
                self._unload(peer)
                logger.info("%s: forgot peer %s (idle %.0f s)", self._own_name, peer, IDLE_S)
        finally:
            with self._gate:
                self._refreshing.difference_update(idle)
                self._gate.notify_all()

    def covers(self, peer: str, remote_descs: Any) -> bool:
        """Whether NIXL knows `peer` registered every remote descriptor (nothing moves)."""
        self.check_known(peer)
        return bool(self._agent.check_remote_metadata(peer, remote_descs))

    def begin_read(self, peer: str) -> None:
        """Count a READ of `peer` about to be prepared; waits out a refresh of `peer`."""
        with self._gate:
            while peer in self._refreshing:
                self._gate.wait()
            self._reading[peer] = self._reading.get(peer, 0) + 1
            self._used[peer] = self._clock()

    def end_read(self, peer: str, parked: bool = False) -> None:
        """The READ counted by `begin_read` is done: released, or `parked` (timed out, it
        may still write: counted against `peer` until `unpark`)."""
        with self._gate:
            left = self._reading.pop(peer) - 1
            if left:
                self._reading[peer] = left
            if parked:
                self._parked[peer] = self._parked.get(peer, 0) + 1
            self._gate.notify_all()

    def reading(self) -> int:
        """READs of any peer prepared, in flight or parked here now."""
        with self._gate:
            return sum(self._reading.values()) + sum(self._parked.values())

    def unpark(self, peer: str) -> None:
        """A READ `end_read` parked has ended and been let go."""
        with self._gate:
            left = self._parked.pop(peer, 1) - 1
            if left:
                self._parked[peer] = left
            self._gate.notify_all()

    @contextmanager
    def _alone(self, peer: str, *, then_reading: bool) -> Iterator[None]:
        """No READ of `peer` prepared or in flight here inside; with `then_reading`, leave
        counted as one (the caller's READ, prepared inside)."""
        with self._gate:
            while peer in self._refreshing or self._reading.get(peer, 0):
                self._gate.wait()
            if self._parked.get(peer):  # they may never end: not waited for, not pulled from
                if then_reading:  # the caller's READ, which `prepare_read` stopped counting
                    self._reading[peer] = self._reading.get(peer, 0) + 1  # it ends it itself
                raise TransferError(  # not the caller's fault: lost, as a holder gone
                    f"peer {peer!r} has READs that timed out and may still write: it is not "
                    "loaded again until they end"
                )
            self._refreshing.add(peer)
        try:
            yield
        finally:
            with self._gate:
                if then_reading:
                    self._reading[peer] = self._reading.get(peer, 0) + 1
                self._refreshing.discard(peer)
                self._gate.notify_all()

    def refresh(
        self,
        lock: threading.Lock,
        peer: str,
        metadata: bytes,
        then: Callable[[], T],
        *,
        then_reading: bool = False,
    ) -> T:
        """Make NIXL know only `metadata` of `peer`, alone (see the module docstring), then
        return `then()`; both under `lock`. A load NIXL refuses leaves `peer` unknown."""
        with self._alone(peer, then_reading=then_reading), lock:
            self._unload(peer)
            name = self.load(metadata)
            if name != peer:
                raise ValueError(f"metadata for peer {peer!r} is {name!r}'s")
            logger.info("%s: reloaded peer %s from one snapshot", self._own_name, peer)
            return then()

    def prepare_read(
        self,
        lock: threading.Lock,
        local_descs: Any,
        remote_descs: Any,
        descriptors: int,
        peer: str,
        metadata: bytes | None,
    ) -> Any:
        """Prepare a READ (`initialize_xfer`) counted by `begin_read`; the transfer handle.

        If NIXL refuses and `metadata` (the snapshot that described the remote ranges) is
        given, `refresh` the peer from it and prepare once more while no other READ of it
        can start. Raises TransferRefusedError when NIXL refuses the ranges, TransferError
        when it fails otherwise.
        """
        try:
            return self._agent.initialize_xfer("READ", local_descs, remote_descs, peer)
        except Exception as exc:
            if metadata is None:
                raise _refused_read(exc, descriptors, peer) from exc

        def prepare() -> Any:
            try:
                return self._agent.initialize_xfer("READ", local_descs, remote_descs, peer)
            except Exception as exc:
                raise _refused_read(exc, descriptors, peer) from exc

        self.end_read(peer)  # a refresh waits for the others' READs only
        return self.refresh(lock, peer, metadata, prepare, then_reading=True)

    def forget(self, lock: threading.Lock, peer: str) -> None:
        """Make NIXL forget `peer` (its READ failed: it disconnected), under `lock`: a peer
        that died would otherwise stay loaded for good (a process restarted is another
        agent); one that did not is loaded again from its next handle. Left to the last of
        the READs of `peer` in flight here (each that fails forgets it), so that it never
        waits for another READ, nor pulls a peer from under one."""
        with self._gate:
            if peer in self._refreshing or self._reading.get(peer, 0) or self._parked.get(peer):
                return
            self._refreshing.add(peer)  # READs of it wait the moment this takes
        try:
            with lock:
                if self._unload(peer):
                    logger.info("%s: forgot peer %s (its READ failed)", self._own_name, peer)
        finally:
            with self._gate:
                self._refreshing.discard(peer)
                self._gate.notify_all()

    def _unload(self, peer: str) -> bool:
        """Make NIXL forget `peer`, and forget its snapshots here; whether it was loaded.
        Caller holds the agent's lock, with no READ of `peer` in flight (`_alone`)."""
        if peer not in self._loaded:
            return False
        try:
            self._agent.remove_remote_agent(peer)
        except Exception:
            logger.warning("could not forget peer %s", peer, exc_info=True)
        for digest in self._loaded.pop(peer):
            del self._owner[digest]
        self._used.pop(peer, None)
        return True

    def remove_all(self) -> None:
        """Tell NIXL to forget every peer (disconnecting them) and forget them here."""
        for name in self._loaded:
            try:
                self._agent.remove_remote_agent(name)
            except Exception:
                logger.warning("could not remove peer %s", name, exc_info=True)
        self._loaded.clear()
        self._owner.clear()
        self._used.clear()


def _refused_read(exc: Exception, descriptors: int, peer: str) -> TransferError:
    """The error for NIXL's refusal (`exc`) to prepare a READ."""
    error = TransferRefusedError if nixl_refused(exc) else TransferError
    return error(
        f"NIXL refused a READ of {descriptors} descriptors from {peer!r} ({exc}); are the "
        "remote ranges inside memory the peer registered before sending its metadata?"
    )
