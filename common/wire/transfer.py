"""Protobuf transfer handles: make one for a local tensor, or pull the tensor behind one.

Used for tensors too large to ship inline in a `TensorRef` (encoder embeddings): the holder
registers the tensor and puts a `TransferHandle` on the wire; the reader loads the holder's
metadata and READs the bytes into a fresh local tensor. Only protobuf crosses the wire.

Bytes are bound to the handle (DESIGN §4, as for KV blocks): the holder puts the digest of
the tensor's bytes (`common.kv.digest`) in it, and the reader checks what it READ against
that digest before returning it. A lease that ran out while the handle waited (a queued
request, a slow pull) frees its range for the holder's next output; without the check, a
READ of it succeeds and returns another request's rows.

A reader trusts nothing a handle claims: sizes are checked, and the range is checked against
what the holder's metadata says it registered, before anything is allocated. Handles reach
readers in any order, each with the holder's snapshot of when it was made; a reader whose
view of the holder is older than the handle's reloads the handle's own snapshot once.
"""

from __future__ import annotations

import hmac
import math
from typing import Final

import torch

from common.kv.digest import block_digests
from common.transfer.agent import TransferAgent
from common.transfer.regions import tensor_memory
from common.transfer.types import (
    DEVICE_MEMORY,
    HOST_MEMORY,
    TransferDigestError,
    TransferRefusedError,
    TransferTimeoutError,
)
from common.wire.convert import shape_fits
from epd.v1 import tensor_pb2

# The one map between the wire MemoryKind and NIXL's memory names (handles, KV handles).
KIND_TO_MEMORY = {
    tensor_pb2.MEMORY_KIND_HOST: HOST_MEMORY,
    tensor_pb2.MEMORY_KIND_DEVICE: DEVICE_MEMORY,
}
MEMORY_TO_KIND = {memory: kind for kind, memory in KIND_TO_MEMORY.items()}

# Sizes and addresses torch and NIXL take (int64): larger claims are refused unread.
_MAX_INT64: Final = (1 << 63) - 1


def handle_for(
    tensor: torch.Tensor,
    agent: TransferAgent,
    lease_id: str,
    *,
    metadata: bytes | None = None,
) -> tensor_pb2.TransferHandle:
    """Describe `tensor` for a remote READ, registering it with `agent` first if needed.

    The holder must keep the tensor alive and registered until the lease `lease_id` is
    released or expires; `agent.deregister(agent.register(tensor))` ends it. The handle carries
    `metadata`, a snapshot of the agent's metadata taken after the tensor's memory was
    registered (ValueError if that memory is not registered), or else `agent.metadata()` now,
    which includes the registration made here. Holders that register once pass one cached
    snapshot, so every handle carries the same bytes and readers load them once.
    """
    nbytes = tensor.numel() * tensor.element_size()
    if metadata is None:
        region = agent.register(tensor)
        metadata = agent.metadata()
    else:
        found = agent.region_of(tensor.data_ptr(), nbytes)
        if found is None:
            raise ValueError("handle_for was given metadata, but the tensor is not registered")
        region = found
    _, device_id = tensor_memory(tensor)
    return tensor_pb2.TransferHandle(
        agent_metadata=metadata,
        agent_name=agent.name,
        address=tensor.data_ptr(),
        length=nbytes,
        device_id=device_id,
        memory_kind=MEMORY_TO_KIND[region.memory],
        lease_id=lease_id,
        digest=tensor_digest(tensor),
    )


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """The digest of a contiguous tensor's bytes (`common.kv.digest`, on its device); empty
    for a tensor without bytes."""
    if not tensor.numel():
        return b""
    return block_digests(tensor.reshape(-1).view(torch.int8).view(1, -1))[0]


class HandleWithoutDigestError(ValueError):
    """A handle that lends bytes without their digest: its holder predates digests."""


def read_tensor(
    handle: tensor_pb2.TransferHandle,
    dtype: torch.dtype,
    shape: tuple[int, ...] | list[int],
    agent: TransferAgent,
    *,
    device: torch.device | str = "cpu",
    timeout_s: float = 10.0,
) -> torch.Tensor:
    """Pull the tensor behind `handle` into a fresh tensor on `device` and return it.

    Nothing is allocated before the handle checks out: its sizes, then its holder's
    metadata, then its range against the memory that metadata says the holder registered
    (refreshing the holder from the handle's snapshot once if the agent's view lacks it). The
    fresh buffer is registered for the READ and deregistered afterwards, so the caller owns
    an ordinary tensor. Thread-safe (servers call it from worker threads).

    Raises ValueError if the handle is malformed, names another agent than its metadata, or
    disagrees with dtype and shape (sizes that overflow included); TransferRefusedError if
    the holder's metadata cannot be loaded or the range lies outside memory it registered;
    the errors of `TransferAgent.read` otherwise (TransferError, TransferTimeoutError:
    the holder is unreachable, gone, or failed the READ); and TransferDigestError when the
    bytes READ do not match the handle's digest (a handle without one is refused before any
    READ: `HandleWithoutDigestError`, a ValueError).
    """
    nbytes = _checked_nbytes(handle, dtype, shape)
    if nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    if not handle.digest:  # nothing would tell a reused range's bytes from those lent
        raise HandleWithoutDigestError("transfer handle carries no digest of the bytes it lends")
    metadata = handle.agent_metadata
    try:
        peer = agent.add_peer(metadata)
    except TransferRefusedError:
        if handle.agent_name not in agent.peers:
            raise
        # NIXL refuses a snapshot that collides with stale ones it holds: start over.
        peer = agent.refresh_peer(handle.agent_name, metadata)
    if peer != handle.agent_name:
        raise ValueError(
            f"handle names agent {handle.agent_name!r} but its metadata is for {peer!r}"
        )
    remote = [(handle.address, handle.length)]
    memory = KIND_TO_MEMORY[handle.memory_kind]

    def covered() -> bool:
        return agent.covers(
            peer, remote, remote_memory=memory, device_id=handle.device_id, peer_metadata=metadata
        )

    if not covered():  # stale descriptors may shadow the range: start over from this one
        agent.refresh_peer(peer, metadata)
        if not covered():
            raise TransferRefusedError(
                f"{handle.length} bytes at {handle.address:#x} of {memory} lie outside the "
                f"memory {peer!r} registered"
            )
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    region = agent.register(out)
    try:
        agent.read(
            peer,
            remote,
            [(out.data_ptr(), nbytes)],
            timeout_s=timeout_s,
            remote_memory=memory,
            remote_device_id=handle.device_id,
            peer_metadata=metadata,
        )
    except TransferTimeoutError as exc:
        # The READ may still write `out`: it stays registered (and alive) until the READ
        # has ended and been let go (`common.transfer.parked`).
        exc.when_released(lambda: agent.deregister(region))
        raise
    except BaseException:
        agent.deregister(region)
        raise
    agent.deregister(region)
    if not hmac.compare_digest(tensor_digest(out), handle.digest):
        raise TransferDigestError(
            f"the {nbytes} bytes READ at {handle.address:#x} from {peer!r} are not those it "
            f"lent under lease {handle.lease_id!r} (it ran out, and the range was reused?)"
        )
    return out


def _checked_nbytes(
    handle: tensor_pb2.TransferHandle, dtype: torch.dtype, shape: tuple[int, ...] | list[int]
) -> int:
    """The bytes `shape` of `dtype` takes, once they agree with the handle (else ValueError)."""
    if handle.memory_kind not in KIND_TO_MEMORY:
        raise ValueError(f"transfer handle has no valid memory kind ({handle.memory_kind})")
    if not handle.agent_metadata:
        raise ValueError("transfer handle carries no agent metadata")
    if any(dim < 0 for dim in shape):
        raise ValueError(f"negative dimension in shape {list(shape)}")
    if not shape_fits(shape, dtype.itemsize):
        raise ValueError(f"shape {list(shape)} of {dtype} is too large")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes != handle.length:
        raise ValueError(
            f"shape {list(shape)} of {dtype} is {nbytes} bytes but the handle holds {handle.length}"
        )
    if handle.address + handle.length > _MAX_INT64:
        raise ValueError(f"transfer handle range {handle.address:#x}+{handle.length} is invalid")
    return nbytes
