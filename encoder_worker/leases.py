"""Large encoder outputs over NIXL: ranges of one registered output arena, held under leases.

An item whose output exceeds the inline limit is copied into one range of the output arena
(`encoder_worker.arena`, `output_pool_mb` of the encoder's device, registered with this
worker's `TransferAgent` once, when the agent is made) and described by `TransferHandle`s
(one per tensor, all sharing the lease id). Every such handle carries the same metadata
snapshot, taken once after the arena was registered, so a reader loads this encoder's
metadata once. The reader pulls with `common.wire.transfer.read_tensor`, then calls
`EncoderService.ReleaseEmbeddings` with the lease id.

An output that does not fit (larger than the free ranges, or the arena is off) is refused
nothing: it gets a buffer of its own, registered for it, and its handles a fresh snapshot
(logged once, counted in `unpooled`). Readers load that snapshot too (`read_tensor`
refreshes from a handle's own snapshot when needed).

Lifecycle of a lease (held in the shared `common.server.leases.LeaseTable`, whose reaper
frees expired ones): `export` (range taken or buffer registered, lease live) → `release`
(by the reader) or expiry (the reaper, `ttl_s` after export: a reader that died never
releases) → the range goes back to the arena (the next export may overwrite it), or the own
buffer is deregistered and dropped. Each lease is freed exactly once. A reader must finish
its READ within `ttl_s`: after expiry its range may hold another output, which the digest
every handle carries (`common.wire.transfer.handle_for`) makes the reader's READ refuse.
A lease's id is random, or the caller's (`EncodeRequest.lease_key` and the item's index,
so the router can release the leases of an answer it never got); `release` of an id not
live bars it, and `export` refuses a barred id (`common.server.leases`), so such an output
is never leased.

The agent and arena are made on a thread at `start()`; `agent()` waits for them, which the
server does before it serves (making an agent, UCX moves the program break: not beside
requests, `encoder_worker.server.serve`). If NIXL is unavailable, `agent()` returns None and
the server falls back to inline outputs. `export`, `release` and `expire` run on the event loop
(so does every use of the arena's allocator).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from common.server.leases import Lease, LeaseTable
from common.tasks import outcome
from common.transfer.agent import TransferAgent
from common.transfer.regions import RegisteredRegion
from common.wire.transfer import handle_for
from encoder_worker.arena import ALIGN, OutputArena
from epd.v1 import tensor_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OutputBuffer:
    """What one output lease holds: a range of the arena, or a buffer of its own."""

    buffer: torch.Tensor  # flat uint8 bytes holding the lease's tensors
    offset: int | None  # where `buffer` starts in the arena; None: a buffer of its own
    region: RegisteredRegion | None  # the registration of a buffer of its own, else None


class OutputLeases:
    """Live output leases of one encoder worker; see the module docstring.

    Counters: `exported`, `unpooled`, and the table's `released`, `expired` (since start).
    """

    def __init__(
        self,
        ttl_s: float,
        *,
        pool_bytes: int = 0,
        device: torch.device | str = "cpu",
        agent_factory: Callable[[], TransferAgent] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`pool_bytes` of `device` make the arena (0: none, every output its own buffer)."""
        self.table: LeaseTable[OutputBuffer] = LeaseTable(ttl_s, clock)  # live leases
        self._factory = agent_factory or (lambda: TransferAgent("encoder"))
        self._pool_bytes = pool_bytes
        self._device = device
        self._agent_task: asyncio.Task[TransferAgent | None] | None = None
        self._agent: TransferAgent | None = None
        self.arena: OutputArena | None = None  # set with the agent; None: off or failed
        self._metadata = b""  # the agent's snapshot taken once the arena was registered
        self.exported = 0  # leases made since start
        self.unpooled = 0  # of those, leases that did not fit the arena (own buffer)

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
        """Begin making the agent and arena on a thread (`agent()` waits for them); start the
        table's reaper."""
        if self._agent_task is None:
            self._agent_task = asyncio.create_task(self._make_agent(), name="epd-nixl-agent")
        self.table.start_reaper(self._on_expire)

    async def _make_agent(self) -> TransferAgent | None:
        try:
            agent = await asyncio.to_thread(self._factory)
        except Exception as exc:
            logger.warning("NIXL unavailable, large outputs go inline: %s", exc)
            return None
        try:
            self.arena, self._metadata = await asyncio.to_thread(self._make_arena, agent)
        except Exception as exc:  # its snapshot: the agent is closed, not left made (s38diff)
            logger.warning("NIXL agent unusable, large outputs go inline: %s", exc)
            await asyncio.to_thread(agent.close)
            self.arena = None
            return None
        self._agent = agent
        return agent

    def _make_arena(self, agent: TransferAgent) -> tuple[OutputArena | None, bytes]:
        """The arena, registered (None if off or it cannot be had), and the snapshot after."""
        arena = None
        if self._pool_bytes > 0:
            try:
                arena = OutputArena(self._pool_bytes, self._device)
                agent.register(arena.buffer)
                logger.info(
                    "output arena of %d MiB on %s registered with %s",
                    self._pool_bytes >> 20,
                    self._device,
                    agent.name,
                )
            except Exception as exc:
                arena = None
                logger.warning("no output arena (each output registers its own): %s", exc)
        return arena, agent.metadata()

    async def agent(self) -> TransferAgent | None:
        """The transfer agent once created; None when NIXL is unavailable or not started."""
        if self._agent_task is None:
            return None
        return await asyncio.shield(self._agent_task)

    def export(
        self,
        agent: TransferAgent,
        tensors: Sequence[torch.Tensor],
        lease_id: str | None = None,
        request_id: str = "",
    ) -> list[tensor_pb2.TransferHandle]:
        """Copy `tensors` under a new lease into a range of the arena, or into a registered
        buffer of their own when none fits; a handle per tensor. `lease_id`: the id the
        caller chose (None: a random one); `LeaseIdError`, nothing taken, when the table
        refuses it (malformed, live, or released already: `LeaseTable.check`).
        `request_id`: the request the lease is for (its expiry's log line names it)."""
        if lease_id is not None:
            self.table.check(lease_id)
        offsets = []
        total = 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        total = max(total, 1)
        held = self._take_range(total) or self._own_buffer(agent, total, tensors[0].device)
        views = []
        for t, offset in zip(tensors, offsets, strict=True):
            nbytes = t.numel() * t.element_size()
            view = held.buffer[offset : offset + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            views.append(view)
        # Own buffers change the metadata: one fresh snapshot for this lease's handles.
        metadata = self._metadata if held.offset is not None else agent.metadata()
        lease = self.table.add(held, request_id, lease_id=lease_id)
        self.exported += 1
        return [handle_for(v, agent, lease.lease_id, metadata=metadata) for v in views]

    def _take_range(self, nbytes: int) -> OutputBuffer | None:
        if self.arena is None:
            return None
        offset = self.arena.allocate(nbytes)
        if offset is None:
            return None
        return OutputBuffer(self.arena.view(offset, nbytes), offset, None)

    def _own_buffer(self, agent: TransferAgent, nbytes: int, device: torch.device) -> OutputBuffer:
        if self.arena is not None:
            level = logging.WARNING if self.unpooled == 0 else logging.DEBUG
            allocator = self.arena.allocator
            logger.log(
                level,
                "an output of %d bytes does not fit the output arena (%d of %d bytes free, "
                "largest range %d): registering a buffer of its own; raise output_pool_mb "
                "if this recurs (warned once, counted in leases_unpooled)",
                nbytes,
                allocator.free_bytes,
                allocator.capacity,
                allocator.largest_free,
            )
        self.unpooled += 1
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return OutputBuffer(buffer, None, agent.register(buffer))

    def release(self, lease_ids: Sequence[str]) -> int:
        """Free the given leases now; an unknown or already freed id is barred instead (an
        Encode still answering under it makes no lease: `LeaseTable.pop_or_bar`)."""
        freed = 0
        for lease_id in lease_ids:
            lease = self.table.pop_or_bar(lease_id)
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
        held = lease.held
        if held.offset is not None:
            if self.arena is not None:
                self.arena.free(held.offset)
        elif self._agent is not None and held.region is not None:
            self._agent.deregister(held.region)

    async def close(self, wait_s: float = 0.0) -> None:
        """Wait up to `wait_s` for readers to release, free the rest, close the agent."""
        clock = self.table.clock
        deadline = clock() + wait_s
        while len(self.table) and clock() < deadline:
            await asyncio.sleep(0.02)
        await self.table.stop_reaper()
        agent = None
        if self._agent_task is not None:
            agent = await outcome(self._agent_task)
        rest = self.table.pop_all()
        if rest:
            logger.warning("closing with %d unreleased output lease(s)", len(rest))
        for lease in rest:
            self._free(lease)
        if agent is not None:
            await asyncio.to_thread(agent.close)  # deregisters the arena too
        self._agent = None
        self.arena = None
