"""The KV handoff between prefill and decode workers, in one place.

`read_handoff` decodes the multimodal half of a Prefill or Decode request and checks it
against the worker's model (INVALID_ARGUMENT naming the field, before any cache is
touched).

Bringing a prefill worker's KV into this decode worker: check the handle, pull by NIXL READ.

`check_handle` refuses a handle that does not fit the handoff or this worker: a different
`KvLayout` is FAILED_PRECONDITION (the two workers cannot exchange blocks), a malformed
handle INVALID_ARGUMENT naming the `kv.*` field. The caller then compares the handle's block
hashes with the ones it recomputed from the handoff.

`pull` READs, in one NIXL transfer (adjacent blocks merged into one descriptor on both
sides), the prompt blocks an `ImportPlan` lacks into the plan's own blocks; small pulls run
on the event loop's thread (see `INLINE_PULL_BYTES`), large ones on a worker thread. The plan's
blocks stay owned by the caller throughout; if the awaiting task is cancelled while the READ
runs, `on_orphan` is called once the READ has finished (NIXL may write the blocks until
then), so the caller can give the blocks back only when it is safe.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence

import grpc

from common.kv.allocator import ImportPlan, blocks_for
from common.models.runner import LmRunner
from common.multimodal.params import MultimodalParams
from common.multimodal.validation import MultimodalLayoutError
from common.server.rpc import RpcStatusError
from common.transfer.agent import TransferAgent
from common.transfer.types import DEVICE_MEMORY, HOST_MEMORY, TransferStats
from common.wire.convert import TensorResolver, params_from_proto
from epd.v1 import kv_pb2, multimodal_pb2, tensor_pb2

# Pulls up to this size READ on the event loop's own thread: a hop to a worker thread and
# back costs a scheduler slice (milliseconds) on a busy host, more than the READ of a few
# MiB itself; larger pulls go to a worker thread so the loop keeps serving streams.
INLINE_PULL_BYTES = 8 * 1024 * 1024

_MEMORY = {tensor_pb2.MEMORY_KIND_HOST: HOST_MEMORY, tensor_pb2.MEMORY_KIND_DEVICE: DEVICE_MEMORY}
_LAYOUT_FIELDS = (
    "model",
    "dtype",
    "block_size",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "layout",
    "block_bytes",
)


def _invalid(field: str, message: str) -> RpcStatusError:
    return RpcStatusError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}")


def check_handle(handle: kv_pb2.KvHandle, runner: LmRunner, num_tokens: int) -> None:
    """Raise `RpcStatusError` unless `handle` can be pulled into `runner` for a prompt of
    `num_tokens` tokens (see the module docstring for the statuses)."""
    mine = runner.kv_layout
    differ = [
        f"{name} {getattr(handle.layout, name)!r} (here {getattr(mine, name)!r})"
        for name in _LAYOUT_FIELDS
        if getattr(handle.layout, name) != getattr(mine, name)
    ]
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
    if handle.memory_kind not in _MEMORY:
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
        remote_memory=_MEMORY[handle.memory_kind],
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


def read_handoff(
    runner: LmRunner,
    prompt_token_ids: Sequence[int],
    multimodal: multimodal_pb2.MultimodalParams,
    *,
    with_embeddings: bool,
    resolve: TensorResolver | None = None,
) -> MultimodalParams:
    """Decode and validate the multimodal half of a handoff against `runner`'s model.

    The layout and the prompt (vocabulary, placeholders exactly at the runs, positions) are
    checked before `resolve` pulls any embedding held by a transfer handle; embedding widths
    after. Raises `MultimodalLayoutError` naming the field. Blocking (NIXL
    pulls): call it from a worker thread in a server.
    """
    if not prompt_token_ids:
        raise MultimodalLayoutError("prompt_token_ids", "empty prompt")
    layout = params_from_proto(multimodal, with_embeddings=False)
    runner.check_prompt(prompt_token_ids, layout)
    if not with_embeddings:
        return layout
    params = params_from_proto(multimodal, resolve=resolve)
    runner.check_embeddings(params)
    return params
