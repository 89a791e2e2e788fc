"""Large encoder outputs over NIXL: registered output buffers held under leases.

An item whose output exceeds the inline limit is copied into one fresh buffer, registered
with this worker's `TransferAgent`, and described by `TransferHandle`s (one per tensor, all
sharing the buffer's lease id). The reader pulls with `common.transfer.read_tensor`, then
calls `EncoderService.ReleaseEmbeddings` with the lease id.

Lifecycle of a lease: `export` (buffer registered, lease live) → `release` (by the reader)
or `expire` (the reaper, `ttl_s` after export: a reader that died never releases) → the
buffer is deregistered and dropped. Each lease is freed exactly once.

The agent is created on a background thread at `start()` (making a NIXL agent takes
seconds); `agent()` waits for it. If NIXL is unavailable, `agent()` returns None and the
server falls back to inline outputs. `export`, `release` and `expire` run on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from common.transfer.agent import TransferAgent
from common.transfer.regions import RegisteredRegion
from common.wire.transfer import handle_for
from epd.v1 import tensor_pb2

logger = logging.getLogger(__name__)

_ALIGN = 64  # byte alignment of each tensor inside a lease buffer


@dataclass(slots=True)
class _Lease:
    region: RegisteredRegion  # the registration of `buffer`
    buffer: torch.Tensor  # flat uint8 buffer holding the lease's tensors
    expires_at: float  # clock() time after which the reaper frees it


class OutputLeases:
    """Live output leases of one encoder worker; see the module docstring.

    Counters: `exported`, `released`, `expired` (leases since start).
    """

    def __init__(
        self,
        ttl_s: float,
        *,
        agent_factory: Callable[[], TransferAgent] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s  # lifetime of a new lease
        self.clock = clock
        self._factory = agent_factory or (lambda: TransferAgent("encoder"))
        self._agent_task: asyncio.Task[TransferAgent | None] | None = None
        self._agent: TransferAgent | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._leases: dict[str, _Lease] = {}
        self.exported = 0
        self.released = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    def start(self) -> None:
        """Begin creating the agent in the background and start the reaper."""
        if self._agent_task is None:
            self._agent_task = asyncio.create_task(self._make_agent(), name="epd-nixl-agent")
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap(), name="epd-lease-reaper")

    async def _make_agent(self) -> TransferAgent | None:
        try:
            agent = await asyncio.to_thread(self._factory)
        except Exception as exc:
            logger.warning("NIXL unavailable, large outputs go inline: %s", exc)
            return None
        self._agent = agent
        return agent

    async def agent(self) -> TransferAgent | None:
        """The transfer agent once created; None when NIXL is unavailable or not started."""
        if self._agent_task is None:
            return None
        return await asyncio.shield(self._agent_task)

    def export(
        self, agent: TransferAgent, tensors: Sequence[torch.Tensor]
    ) -> list[tensor_pb2.TransferHandle]:
        """Copy `tensors` into one registered buffer under a new lease; a handle per tensor."""
        offsets = []
        total = 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        device = tensors[0].device
        buffer = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
        views = []
        for t, offset in zip(tensors, offsets, strict=True):
            nbytes = t.numel() * t.element_size()
            view = buffer[offset : offset + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            views.append(view)
        region = agent.register(buffer)
        lease_id = uuid.uuid4().hex
        self._leases[lease_id] = _Lease(region, buffer, self.clock() + self.ttl_s)
        self.exported += 1
        return [handle_for(view, agent, lease_id) for view in views]

    def release(self, lease_ids: Sequence[str]) -> int:
        """Free the given leases now; unknown or already freed ids are ignored."""
        freed = sum(self._free(lease_id) for lease_id in lease_ids)
        self.released += freed
        return freed

    def expire(self) -> int:
        """Free every lease whose time ran out; returns how many."""
        now = self.clock()
        due = [lease_id for lease_id, lease in self._leases.items() if lease.expires_at <= now]
        freed = sum(self._free(lease_id) for lease_id in due)
        if freed:
            logger.info("%d output lease(s) expired unreleased", freed)
        self.expired += freed
        return freed

    def _free(self, lease_id: str) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        if self._agent is not None:
            self._agent.deregister(lease.region)
        return True

    async def _reap(self) -> None:
        interval = min(max(self.ttl_s / 4, 0.01), 1.0)
        while True:
            await asyncio.sleep(interval)
            try:
                self.expire()
            except Exception:
                logger.exception("lease reaper failed")

    async def close(self, wait_s: float = 0.0) -> None:
        """Wait up to `wait_s` for readers to release, free the rest, close the agent."""
        deadline = self.clock() + wait_s
        while self._leases and self.clock() < deadline:
            await asyncio.sleep(0.02)
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        agent = None
        if self._agent_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                agent = await self._agent_task
        if self._leases:
            logger.warning("closing with %d unreleased output lease(s)", len(self._leases))
        for lease_id in list(self._leases):
            self._free(lease_id)
        if agent is not None:
            await asyncio.to_thread(agent.close)
        self._agent = None
