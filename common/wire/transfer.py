"""Protobuf transfer handles: make one for a local tensor, or pull the tensor behind one.

Used for tensors too large to ship inline in a `TensorRef` (encoder embeddings): the holder
registers the tensor and puts a `TransferHandle` on the wire; the reader loads the holder's
metadata and READs the bytes into a fresh local tensor. Only protobuf crosses the wire.
"""

from __future__ import annotations

import math

import torch

from common.transfer.agent import TransferAgent
from common.transfer.regions import tensor_memory
from common.transfer.types import DEVICE_MEMORY, HOST_MEMORY, TransferTimeoutError
from epd.v1 import tensor_pb2

# The one map between the wire MemoryKind and NIXL's memory names (handles, KV handles).
KIND_TO_MEMORY = {
    tensor_pb2.MEMORY_KIND_HOST: HOST_MEMORY,
    tensor_pb2.MEMORY_KIND_DEVICE: DEVICE_MEMORY,
}
MEMORY_TO_KIND = {memory: kind for kind, memory in KIND_TO_MEMORY.items()}


def handle_for(
    tensor: torch.Tensor, agent: TransferAgent, lease_id: str
) -> tensor_pb2.TransferHandle:
    """Register `tensor` with `agent` (if needed) and describe it for a remote READ.

    The holder must keep the tensor alive and registered until the lease `lease_id` is
    released or expires; `agent.deregister(agent.register(tensor))` ends it. The handle carries
    the agent's current metadata, which includes this registration.
    """
    region = agent.register(tensor)
    _, device_id = tensor_memory(tensor)
    return tensor_pb2.TransferHandle(
        agent_metadata=agent.metadata(),
        agent_name=agent.name,
        address=tensor.data_ptr(),
        length=tensor.numel() * tensor.element_size(),
        device_id=device_id,
        memory_kind=MEMORY_TO_KIND[region.memory],
        lease_id=lease_id,
    )


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

    The fresh buffer is registered for the READ and deregistered afterwards, so the caller
    owns an ordinary tensor. Raises ValueError if dtype and shape disagree with the handle's
    length or the handle is malformed, and the errors of `TransferAgent.read` otherwise.
    """
    if handle.memory_kind not in KIND_TO_MEMORY:
        raise ValueError(f"transfer handle has no valid memory kind ({handle.memory_kind})")
    if not handle.agent_metadata:
        raise ValueError("transfer handle carries no agent metadata")
    if any(dim < 0 for dim in shape):
        raise ValueError(f"negative dimension in shape {list(shape)}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes != handle.length:
        raise ValueError(
            f"shape {list(shape)} of {dtype} is {nbytes} bytes but the handle holds {handle.length}"
        )
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    if nbytes == 0:
        return out
    peer = agent.add_peer(handle.agent_metadata)
    if peer != handle.agent_name:
        raise ValueError(
            f"handle names agent {handle.agent_name!r} but its metadata is for {peer!r}"
        )
    region = agent.register(out)
    try:
        agent.read(
            peer,
            [(handle.address, handle.length)],
            [(out.data_ptr(), nbytes)],
            timeout_s=timeout_s,
            remote_memory=KIND_TO_MEMORY[handle.memory_kind],
            remote_device_id=handle.device_id,
        )
    except TransferTimeoutError as exc:
        if exc.cancelled:
            agent.deregister(region)
        # Otherwise NIXL may still write `out`: the agent keeps it registered and alive.
        raise
    except BaseException:
        agent.deregister(region)
        raise
    agent.deregister(region)
    return out
