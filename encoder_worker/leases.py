"""Large encoder outputs over NIXL: registered output buffers held under leases.

An item whose output exceeds the inline limit is copied into one fresh buffer, registered
with this worker's `TransferAgent`, and described by `TransferHandle`s (one per tensor, all
sharing the buffer's lease id). The reader pulls with `common.transfer.read_tensor`, then
calls `EncoderService.ReleaseEmbeddings` with the lease id.

Lifecycle of a lease (held in the shared `common.server.leases.LeaseTable`, whose reaper
frees expired ones): `export` (buffer registered, lease live) → `release` (by the reader)
or expiry (the reaper, `ttl_s` after export: a reader that died never releases) → the
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from common.server.leases import Lease, LeaseTable
from common.transfer.agent import TransferAgent
from common.transfer.regions import RegisteredRegion
from common.wire.transfer import handle_for
from epd.v1 import tensor_pb2

logger = logging.getLogger(__name__)

_ALIGN = 64  # byte alignment of each tensor inside a lease buffer


@dataclass(frozen=True, slots=True)
class OutputBuffer:
    """What one output lease holds."""

    region: RegisteredRegion  # the registration of `buffer`
    buffer: torch.Tensor  # flat uint8 buffer holding the lease's tensors


class OutputLeases:
    """Live output leases of one encoder worker; see the module docstring.

    Counters: `exported`, and the table's `released`, `expired` (leases since start).
    """

    def __init__(
        self,
        ttl_s: float,
        *,
        agent_factory: Callable[[], TransferAgent] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.table: LeaseTable[OutputBuffer] = LeaseTable(ttl_s, clock)  # live leases
        self._factory = agent_factory or (lambda: TransferAgent("encoder"))
        self._agent_task: asyncio.Task[TransferAgent | None] | None = None
        self._agent: TransferAgent | None = None
        self.exported = 0  # leases made since start

    def __len__(self) -> int:
        return len(self.table)

    @property
    def ttl_s(self) -> float:
        """Lifetime of a new lease."""
        return self.table.ttl_s

    @property
    def released(self) -> int:
        """Leases their reader released, since start."""
        return self.table.released

    @property
    def expired(self) -> int:
        """Leases the reaper freed, since start."""
        return self.table.expired

    def start(self) -> None:
        """Begin creating the agent in the background and start the table's reaper."""
        if self._agent_task is None:
            self._agent_task = asyncio.create_task(self._make_agent(), name="epd-nixl-agent")
        self.table.start_reaper(self._on_expire)

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
        lease = self.table.add(OutputBuffer(region, buffer))
        self.exported += 1
        return [handle_for(view, agent, lease.lease_id) for view in views]

    def release(self, lease_ids: Sequence[str]) -> int:
        """Free the given leases now; unknown or already freed ids are ignored."""
        freed = 0
        for lease_id in lease_ids:
            lease = self.table.pop(lease_id)
            if lease is not None:
                self._free(lease)
                freed += 1
        return freed

    def expire(self) -> int:
        """Free every lease whose time ran out now, without waiting for the reaper."""
        due = self.table.pop_expired()
        for lease in due:
            self._free(lease)
        return len(due)

    async def _on_expire(self, lease: Lease[OutputBuffer]) -> None:
        self._free(lease)

    def _free(self, lease: Lease[OutputBuffer]) -> None:
        if self._agent is not None:
            self._agent.deregister(lease.held.region)

    async def close(self, wait_s: float = 0.0) -> None:
        """Wait up to `wait_s` for readers to release, free the rest, close the agent."""
        clock = self.table.clock
        deadline = clock() + wait_s
        while len(self.table) and clock() < deadline:
            await asyncio.sleep(0.02)
        await self.table.stop_reaper()
        agent = None
        if self._agent_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                agent = await self._agent_task
        rest = self.table.pop_all()
        if rest:
            logger.warning("closing with %d unreleased output lease(s)", len(rest))
        for lease in rest:
            self._free(lease)
        if agent is not None:
            await asyncio.to_thread(agent.close)
        self._agent = None
