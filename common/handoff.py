"""The KV handoff between prefill and decode workers, in one place.

`read_handoff` decodes the multimodal half of a Prefill or Decode request once and checks it
against the worker's model (INVALID_ARGUMENT naming the field, before any cache is
touched); the `Handoff` it returns carries the prompt's mRoPE positions, computed by that
check, so neither worker computes them again.

On the prefill worker, `build_handle` describes a computed prompt's blocks for the decode
worker: the block hashes, the holder's NIXL agent, one descriptor per prompt block (full
blocks, then the partial last block) into the registered block-major KV buffer, the layout
and the lease.

On the decode worker: check the handle, plan the blocks (`KvAllocator.plan_import`), pull by
NIXL READ, then `KvAllocator.finish_import` (or `abort_import`).

`check_handle` refuses a handle that does not fit the handoff or this worker: a different
`KvLayout` (`KvLayout.differences`, the one comparison of layouts) is FAILED_PRECONDITION
(the two workers cannot exchange blocks), a malformed handle INVALID_ARGUMENT naming the
`kv.*` field. The caller then compares the handle's block hashes with the ones it
recomputed from the handoff.

`pull` READs, in one NIXL transfer (adjacent blocks merged into one descriptor on both
sides), the prompt blocks an `ImportPlan` lacks into the plan's own blocks; small pulls run
on the event loop's thread (see `INLINE_PULL_BYTES`), large ones on a worker thread. The plan's
blocks stay owned by the caller throughout; if the awaiting task is cancelled while the READ
runs, `on_orphan` is called once the READ has finished (NIXL may write the blocks until
then), so the caller can give the blocks back only when it is safe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from common.kv.allocator import ImportPlan, blocks_for
from common.models.qwen3_vl.rope import MropePositions
from common.models.runner import LmRunner
from common.multimodal.params import MultimodalParams
from common.multimodal.validation import MultimodalLayoutError
from common.server.rpc import RpcStatusError
from common.transfer.agent import TransferAgent
from common.transfer.types import DEVICE_MEMORY, HOST_MEMORY, TransferStats
from common.wire.convert import TensorResolver, embeddings_from_proto, params_from_proto
from common.wire.kv import layout_from_proto, layout_to_proto
from common.wire.transfer import KIND_TO_MEMORY, MEMORY_TO_KIND
from epd.v1 import kv_pb2, multimodal_pb2

# Pulls up to this size READ on the event loop's own thread: a hop to a worker thread and
# back costs a scheduler slice (milliseconds) on a busy host, more than the READ of a few
# MiB itself; larger pulls go to a worker thread so the loop keeps serving streams.
INLINE_PULL_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Handoff:
    """The multimodal half of a handoff, decoded and checked against this worker's model."""

    params: MultimodalParams  # items (and embeddings, when asked for)
    positions: MropePositions  # the prompt's mRoPE positions (computed by the check)


def _invalid(field: str, message: str) -> RpcStatusError:
    return RpcStatusError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}")


# ------------------------------------------------------------------------ prefill side


def build_handle(
    runner: LmRunner,
    prompt_blocks: Sequence[int],
    hashes: list[bytes],
    *,
    num_tokens: int,
    agent: TransferAgent,
    agent_metadata: bytes,
    lease_id: str,
    lease_ttl_s: float,
    holder_address: str,
) -> kv_pb2.KvHandle:
    """The `KvHandle` lending the first `blocks_for(num_tokens)` of `prompt_blocks` (held by
    the lease `lease_id`) out of `runner`'s KV buffer, registered with `agent`, whose
    metadata after that registration is `agent_metadata`."""
    kv = runner.kv
    device = kv.device
    memory = HOST_MEMORY if device.type == "cpu" else DEVICE_MEMORY
    device_id = 0 if device.type == "cpu" else (device.index or 0)
    blocks = prompt_blocks[: blocks_for(num_tokens, runner.block_size)]
    return kv_pb2.KvHandle(
        block_hashes=hashes,
        agent_metadata=agent_metadata,
        agent_name=agent.name,
        blocks=[
            kv_pb2.KvBlockDescriptor(address=address, length=length, device_id=device_id)
            for address, length in map(kv.block_address, blocks)
        ],
        lease_id=lease_id,
        memory_kind=MEMORY_TO_KIND[memory],
        num_tokens=num_tokens,
        layout=layout_to_proto(runner.kv_layout),
        lease_ttl_ms=int(lease_ttl_s * 1000),
        holder_address=holder_address,
    )


# ------------------------------------------------------------------------- decode side


def check_handle(handle: kv_pb2.KvHandle, runner: LmRunner, num_tokens: int) -> None:
    """Raise `RpcStatusError` unless `handle` can be pulled into `runner` for a prompt of
    `num_tokens` tokens (see the module docstring for the statuses)."""
    differ = layout_from_proto(handle.layout).differences(runner.kv_layout)
    if differ:
        raise RpcStatusError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "kv.layout: the prefill worker's KV layout differs from this decode worker's: "
            + ", ".join(differ),
        )
    if handle.num_tokens != num_tokens:
        raise _invalid("kv.num_tokens", f"{handle.num_tokens}, but the prompt has {num_tokens}")
    want = blocks_for(num_tokens, runner.block_size)
    if len(handle.blocks) != want:
        raise _invalid("kv.blocks", f"{len(handle.blocks)} descriptors, the prompt needs {want}")
    block_bytes = runner.kv.spec.block_bytes
    if any(b.length != block_bytes for b in handle.blocks):
        raise _invalid("kv.blocks", f"every descriptor must be one block of {block_bytes} bytes")
    if len({b.device_id for b in handle.blocks}) > 1:
        raise _invalid("kv.blocks", "descriptors name several devices")
    if handle.memory_kind not in KIND_TO_MEMORY:
        raise _invalid("kv.memory_kind", f"unknown memory kind {handle.memory_kind}")
    if not handle.agent_metadata or not handle.agent_name:
        raise _invalid("kv.agent_metadata", "the holder's NIXL agent is missing")


async def pull(
    agent: TransferAgent,
    runner: LmRunner,
    handle: kv_pb2.KvHandle,
    plan: ImportPlan,
    *,
    timeout_s: float,
    on_orphan: Callable[[], object],
) -> TransferStats | None:
    """READ the plan's missing prompt blocks from the holder; None when nothing is missing.

    Raises `RpcStatusError` (INVALID_ARGUMENT) when the metadata names another agent, and
    the errors of `TransferAgent.read` (TransferError, TransferTimeoutError) otherwise.
    """
    if not plan.pull:
        return None
    if handle.agent_name in agent.peers:
        peer = agent.add_peer(handle.agent_metadata)  # known: a cheap comparison
    else:
        peer = await asyncio.to_thread(agent.add_peer, handle.agent_metadata)
    if peer != handle.agent_name:
        raise _invalid("kv.agent_name", f"{handle.agent_name!r}, but its metadata is {peer!r}")
    remote = [(handle.blocks[i].address, handle.blocks[i].length) for i in plan.pull]
    local = [runner.kv.block_address(plan.blocks[i]) for i in plan.pull]
    read = functools.partial(
        agent.read,
        peer,
        remote,
        local,
        timeout_s=timeout_s,
        remote_memory=KIND_TO_MEMORY[handle.memory_kind],
        remote_device_id=handle.blocks[0].device_id,
    )
    if len(plan.pull) * runner.kv.spec.block_bytes <= INLINE_PULL_BYTES:
        return read()
    future = asyncio.get_running_loop().run_in_executor(None, read)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(lambda _: on_orphan())
        raise


# -------------------------------------------------------------------------- both sides


def read_handoff(
    runner: LmRunner,
    prompt_token_ids: Sequence[int],
    multimodal: multimodal_pb2.MultimodalParams,
    *,
    with_embeddings: bool,
    resolve: TensorResolver | None = None,
) -> Handoff:
    """Decode and validate the multimodal half of a handoff against `runner`'s model.

    The message is parsed once. The layout and the prompt (vocabulary, placeholders exactly
    at the runs, positions) are checked before `resolve` pulls any embedding held by a
    transfer handle; embedding widths after. Raises `MultimodalLayoutError` naming the field.
    Blocking (NIXL pulls): call it from a worker thread in a server.
    """
    if not prompt_token_ids:
        raise MultimodalLayoutError("prompt_token_ids", "empty prompt")
    layout = params_from_proto(multimodal, with_embeddings=False)
    positions = runner.check_prompt(prompt_token_ids, layout)
    if not with_embeddings:
        return Handoff(layout, positions)
    embeddings = embeddings_from_proto(multimodal, list(layout.items), resolve)
    params = dataclasses.replace(layout, embeddings=embeddings)
    runner.check_embeddings(params)
    return Handoff(params, positions)
