"""One NIXL agent per process: memory registration, peer metadata, and blocking READs.

KV blocks and large embedding tensors move worker-to-worker by NIXL READ, initiated by the
receiver (DESIGN §4). `TransferAgent` wraps one `nixl_agent` with the UCX backend, which moves
host DRAM between processes on CPU-only machines and device memory where there are GPUs.

Lifecycle: construct (creates the agent and its UCX backend) -> `register` the buffers peers
may read or this process reads into -> send `metadata()` to peers (after registering: the
metadata is a snapshot of the registrations) -> `add_peer` for each holder -> `read` (it
blocks: servers call it on worker threads) -> `close()`. Snapshots may reach a reader in
any order: `add_peer` loads each at most once, `refresh_peer` starts a peer over from one
snapshot, and `read` given `peer_metadata` does that and retries once when NIXL refuses the
remote ranges (the rules, and why NIXL needs them, are in `peers`).

Ownership: `register` keeps a reference to the tensor until `deregister` or `close`, so
registered memory is never freed while NIXL may still touch it. The caller owns the tensor's
contents. A holder must keep a range alive (lease) until the reader confirms its READ.

Thread safety: all public methods may be called from several threads (servers run `read`
on worker threads). Python-side state is guarded by a lock and the nixl agent is created
with NIXL_THREAD_SYNC_STRICT. Neither `close()` nor `deregister(region)` may race with a read
in flight that touches the region; stop those reads first.

Failures: a peer whose READ failed (disconnected) is forgotten, and loaded again from the
`peer_metadata` of its next READ (`peers`); a READ that timed out (or may otherwise still be
writing) is parked until it has ended, its peer kept loaded, and one NIXL would not release
until it does (`parked`). Value types and errors live in `types`, region lookup in `regions`,
transfer polling in `polling`, finding the NIXL package in `nixl`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Final

import numpy as np
import torch

from common.transfer.nixl import PROGRESS_DELAY_US, import_nixl, make_agent
from common.transfer.parked import ParkedHandles
from common.transfer.peers import PeerSnapshots
from common.transfer.polling import run_read
from common.transfer.ranges import (
    Ranges,
    as_range_array,
    check_pair_lists,
    check_pairs,
    merge_for_read,
)
from common.transfer.regions import (
    RegisteredRegion,
    desc_array,
    local_regions_of,
    local_regions_small,
    registered_region,
    tensor_memory,
)
from common.transfer.types import (
    DEVICE_MEMORY,
    HOST_MEMORY,
    TransferError,
    TransferRefusedError,
    TransferStats,
    TransferTimeoutError,
)

logger = logging.getLogger(__name__)

# Registered tensors of closed agents whose parked READs may still write into them.
_KEPT: list[torch.Tensor] = []


# Reads with at most this many ranges (given as sequences) take the plain-Python path.
_SMALL_READ: Final = 64


class TransferAgent:
    """One NIXL agent (UCX backend) for this process; see the module docstring for contracts."""

    def __init__(
        self,
        name_prefix: str = "epd",
        *,
        progress_thread: bool = True,
        progress_delay_us: int = PROGRESS_DELAY_US,
    ) -> None:
        """Create the agent, named `<prefix>-<pid>-<random>` so names never collide. Its
        progress thread waits `progress_delay_us` between idle polls (`nixl.make_agent`).
        Raises ImportError without NIXL, RuntimeError if the UCX backend cannot be created."""
        nixl = import_nixl()
        self.name: str = f"{name_prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        config = nixl.nixl_agent_config(
            enable_prog_thread=progress_thread,
            backends=["UCX"],
            sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        try:
            self._agent = make_agent(nixl, self.name, config, progress_delay_us)
        except Exception as exc:
            raise RuntimeError(f"cannot create NIXL agent {self.name!r}: {exc}") from exc
        if "UCX" not in self._agent.backends:
            raise RuntimeError(
                f"NIXL UCX backend unavailable (plugins found: {self._agent.get_plugin_list()}); "
                "check that the UCX plugin ships with the nixl wheel"
            )
        self._lock = threading.Lock()
        self._regions: list[RegisteredRegion] = []
        self._peers = PeerSnapshots(self._agent, self.name)  # peers, snapshots loaded
        self._parked = ParkedHandles(self.name)  # READs not released yet (`parked`)
        self._closed = False
        logger.info("NIXL agent %s ready (UCX)", self.name)

    # -- registration ------------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> RegisteredRegion:
        """Register a contiguous tensor's memory so peers may READ it or it may receive READs.

        Idempotent: a tensor lying inside an already registered region returns that region.
        A tensor otherwise overlapping a registered region is refused (ValueError). The agent
        holds a reference to the tensor until `deregister` or `close`.
        """
        if not tensor.is_contiguous():
            raise ValueError("only contiguous tensors can be registered")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise ValueError("cannot register an empty tensor")
        memory, device_id = tensor_memory(tensor)
        address = tensor.data_ptr()
        with self._lock:
            self._check_open()
            existing = registered_region(self._regions, memory, device_id, address, nbytes)
            if existing is not None:
                return existing
            reg_descs = self._agent.get_reg_descs([(address, nbytes, device_id, "")], memory)
            try:
                self._agent.register_memory(reg_descs)
            except Exception as exc:
                raise TransferError(
                    f"NIXL could not register {nbytes} bytes of {memory}: {exc}"
                ) from exc
            region = RegisteredRegion(address, nbytes, memory, device_id, tensor, reg_descs)
            self._regions.append(region)
        logger.debug("%s registered %s %#x+%d", self.name, memory, address, nbytes)
        return region

    def deregister(self, region: RegisteredRegion) -> None:
        """Deregister a region returned by `register` and drop the agent's tensor reference.

        Peers holding older metadata may still try to read it; their transfers fail.
        """
        with self._lock:
            self._check_open()
            if region not in self._regions:
                raise ValueError(f"region {region} is not registered with {self.name}")
            self._regions.remove(region)
            self._agent.deregister_memory(region._reg_descs)

    def region_of(self, address: int, nbytes: int) -> RegisteredRegion | None:
        """The registered region holding [address, address + nbytes), if any."""
        with self._lock:
            return next((r for r in self._regions if r.contains(address, nbytes)), None)

    # -- peers -------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's serialized metadata for peers: connection info plus registrations.

        It is a snapshot: send it again after registering more memory.
        """
        with self._lock:
            self._check_open()
            return bytes(self._agent.get_agent_metadata())

    def add_peer(self, agent_metadata: bytes, *, force: bool = False) -> str:
        """Load a peer's metadata snapshot and return its agent name. Bytes loaded before
        are a cheap no-op unless `force` (a known peer never regresses to an earlier
        snapshot); TransferRefusedError for bytes NIXL cannot load."""
        with self._lock:
            self._check_open()
            return self._peers.load(agent_metadata, force=force)

    @property
    def peers(self) -> list[str]:
        """Names of the peers loaded so far."""
        with self._lock:
            return self._peers.names()

    def refresh_peer(self, peer: str, agent_metadata: bytes) -> str:
        """Make NIXL forget `peer` and load `agent_metadata` alone, once no READ of `peer` is
        in flight here (new ones wait); return `peer`. TransferRefusedError for bytes NIXL
        cannot load (`peer` is then unknown), ValueError for another agent's."""
        return self._peers.refresh(self._lock, peer, agent_metadata, lambda: peer)

    def covers(
        self,
        peer: str,
        remote: Ranges,
        *,
        remote_memory: str = HOST_MEMORY,
        device_id: int = 0,
        peer_metadata: bytes | None = None,
    ) -> bool:
        """Whether every remote range lies in memory `peer` registered, as far as the
        snapshots loaded of it tell (nothing moves). UnknownPeerError for a peer never added
        (with `peer_metadata`, one forgotten since is loaded again first)."""
        ranges = desc_array(as_range_array(remote, "remote"), device_id)
        descs = self._agent.get_xfer_descs(ranges, remote_memory)
        with self._lock:
            self._check_open()
            self._reload(peer, peer_metadata)
            return self._peers.covers(peer, descs)

    def _reload(self, peer: str, metadata: bytes | None) -> None:
        """Load `peer` again from `metadata` if it was forgotten since (lock held)."""
        if metadata is None or peer in self._peers:
            return
        if self._peers.load(metadata) != peer:
            raise ValueError(f"metadata for peer {peer!r} is another agent's")

    # -- transfers ---------------------------------------------------------------------

    def read(
        self,
        peer: str,
        remote: Ranges,
        local: Ranges,
        *,
        timeout_s: float,
        remote_memory: str = HOST_MEMORY,
        remote_device_id: int = 0,
        merge: bool = True,
        peer_metadata: bytes | None = None,
    ) -> TransferStats:
        """READ `remote[i]` of `peer` into `local[i]` for every i, and block until done.

        Ranges are (address, nbytes) tuples or Nx2 integer arrays (cheaper for many blocks).
        Pairs contiguous on both sides are merged first (see `merge_ranges`), then the whole
        copy is posted as one NIXL transfer and polled to completion. Local ranges must lie
        in memory registered with this agent; remote ranges in memory the peer registered
        before producing the metadata given to `add_peer` (NIXL refuses others).

        NIXL refuses a descriptor that spans two registrations, even adjacent ones. Merging
        never crosses a local registration boundary, but remote registrations are unknown
        here: holders register one buffer per pool (the KV cache is one buffer), or callers
        pass `merge=False` when remote ranges may sit in adjacent, separate registrations.

        The timeout covers polling only: with UCX on host memory, NIXL often performs the
        whole copy inside the post call, which cannot be interrupted.

        `peer_metadata`, the snapshot that described the remote ranges: if NIXL refuses the
        READ, the peer is refreshed from it (`refresh_peer`) and the READ prepared again.

        Raises ValueError for malformed ranges, UnknownPeerError for a peer never added,
        TransferTimeoutError after `timeout_s`, or when the READ broke off and may still be
        writing (the handle is parked until the READ has ended: the caller keeps the local
        memory until the error's `released` is set; its bytes are undefined),
        TransferRefusedError if NIXL refuses the ranges (after the retry), and TransferError
        if the transfer fails (a disconnected peer, a failed READ).
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if remote_memory not in (HOST_MEMORY, DEVICE_MEMORY):
            raise ValueError(f"remote_memory must be 'DRAM' or 'VRAM', got {remote_memory!r}")
        started = time.perf_counter()
        small = (
            not isinstance(remote, np.ndarray)
            and not isinstance(local, np.ndarray)
            and len(remote) <= _SMALL_READ
        )
        if small:
            r_list, l_list = check_pair_lists(remote, local)  # type: ignore[arg-type]
            requested = len(r_list)
        else:
            r, loc = check_pairs(remote, local)
            requested = len(r)
        self._parked.retry()  # (outside the lock: their futures' callbacks may take it)
        with self._lock:
            self._check_open()
            self._reload(peer, peer_metadata)
            self._peers.check_known(peer)
            if small:
                ids, local_memory, local_device = local_regions_small(
                    self._regions, l_list, self.name
                )
            else:
                region_ids, local_memory, local_device = local_regions_of(
                    self._regions, loc, self.name
                )
        if small:
            merged_r, merged_l = merge_for_read(r_list, l_list, ids if merge else None)
        else:
            merged_r, merged_l = merge_for_read(r, loc, region_ids if merge else None)
        remote_descs = self._agent.get_xfer_descs(
            desc_array(merged_r, remote_device_id), remote_memory
        )
        local_descs = self._agent.get_xfer_descs(desc_array(merged_l, local_device), local_memory)
        nbytes = int(merged_l[:, 1].sum())
        parked: list[Future[None]] = []  # a READ that may still write: `peer` kept till it ends
        self._peers.begin_read(peer)
        try:
            self._check_open()  # again, counted: `close` either sees this READ or refuses it
            handle = self._peers.prepare_read(
                self._lock, local_descs, remote_descs, len(merged_r), peer, peer_metadata
            )
            if self._closed:  # a refresh left it uncounted a while: `close` may not see it
                handle.release()  # prepared, never posted (ownfix review)
                self._check_open()
            run_read(
                self._agent, self._parked, handle, peer, nbytes, timeout_s, started, parked.append
            )
        except BaseException as exc:
            self._peers.end_read(peer, parked=bool(parked))
            if parked:
                parked[0].add_done_callback(lambda _: self._peers.unpark(peer))
            elif isinstance(exc, TransferError) and not isinstance(
                exc, TransferRefusedError | TransferTimeoutError
            ):
                self._peers.forget(self._lock, peer)  # disconnected (a restart is another agent)
            raise
        self._peers.end_read(peer)
        stats = TransferStats(
            nbytes=nbytes,
            descriptors=len(merged_r),
            requested=requested,
            seconds=time.perf_counter() - started,
        )
        logger.debug("%s read from %s: %s", self.name, peer, stats)
        return stats

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Forget peers, deregister every region, and drop tensor references (but where a
        READ that timed out may still write: those stay alive for the process's life, a
        late write landing in freed heap corrupted it; races review). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # first: a READ not yet counted now never starts (`read`)
        left = max(self._parked.close(), self._peers.reading())  # in flight: may park too
        with self._lock:
            if left:
                logger.warning(
                    "%s closed with %d READs that may still write: their memory is kept",
                    self.name,
                    left,
                )
                _KEPT.extend(region.tensor for region in self._regions)
            self._peers.remove_all()
            for region in self._regions:
                try:
                    self._agent.deregister_memory(region._reg_descs)
                except Exception:
                    logger.warning(
                        "%s: could not deregister %#x", self.name, region.address, exc_info=True
                    )
            self._regions.clear()
        logger.info("NIXL agent %s closed", self.name)

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NIXL agent {self.name} is closed")
