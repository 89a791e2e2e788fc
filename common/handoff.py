"""The KV handoff between prefill and decode workers, in one place.

`read_handoff` decodes the multimodal half of a Prefill or Decode request once and checks it
against the worker's model (INVALID_ARGUMENT naming the field, before any cache is
touched); the `Handoff` it returns carries the prompt's mRoPE positions, computed by that
check, so neither worker computes them again.

On the prefill worker, `build_handle` describes a computed prompt's blocks for the decode
worker: the block hashes, the holder's NIXL agent, one descriptor per prompt block (full
blocks, then the partial last block) into the registered block-major KV buffer, the layout,
the lease, the prompt's digest, each block's bytes' digest, and the holder's signature.

Bytes bound to keys (DESIGN §4): the holder signs the handle (`handle_signature`, HMAC-SHA256
under the deployment's cluster key) over every other field, so a handle cannot point at
other blocks, another agent or another holder, nor be moved to another prompt
(`prompt_digest` covers every token, the partial last block's included). The reader checks
the bytes it pulled against `block_digests` before anything uses or caches them, and then
confirms with the holder that the lease was live throughout the READ.

On the decode worker: check the handle, plan the blocks (`KvAllocator.plan_import`), pull by
NIXL READ and verify the digests (`common.kv_pull`), confirm the lease, then
`KvAllocator.finish_import` (or `abort_import`).

`check_handle` refuses a handle that does not fit the handoff or this worker, before anything
is allocated: a signature that does not verify is PERMISSION_DENIED, a different `KvLayout`
(`KvLayout.differences`, the one comparison of layouts) or a handle made for another prompt
FAILED_PRECONDITION, a malformed handle INVALID_ARGUMENT naming the `kv.*` field. The caller
then compares the handle's block hashes with the ones it recomputed from the handoff.

The READ itself and its digests are `common.kv_pull.pull`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import msgpack

from common.errors import FieldError
from common.kv.allocator import blocks_for
from common.kv.digest import DIGEST_BYTES
from common.models.prompt_check import check_context
from common.models.qwen3_vl.rope import MropePositions
from common.models.runner import LmRunner
from common.multimodal.params import MultimodalParams
from common.multimodal.validation import MultimodalLayoutError
from common.sampling import SamplingParams
from common.server.rpc import RpcStatusError
from common.transfer.agent import TransferAgent
from common.transfer.types import (
    DEVICE_MEMORY,
    HOST_MEMORY,
)
from common.wire.convert import TensorResolver, embeddings_from_proto, params_from_proto
from common.wire.kv import layout_from_proto, layout_to_proto
from common.wire.transfer import KIND_TO_MEMORY, MEMORY_TO_KIND
from epd.v1 import decode_service_pb2, kv_pb2, multimodal_pb2, prefill_service_pb2

logger = logging.getLogger(__name__)

# In the details of a prefill worker's UNAVAILABLE when an embedding's holder is gone (the
# READ from the encoder failed): the router encodes the items again and retries prefill,
# keeping this (healthy) prefill worker.
EMBEDDINGS_LOST = "embeddings lost with their encoder; encode again"


@dataclass(frozen=True, slots=True)
class Handoff:
    """The multimodal half of a handoff, decoded and checked against this worker's model."""

    params: MultimodalParams  # items (and embeddings, when asked for)
    positions: MropePositions  # the prompt's mRoPE positions (computed by the check)


HANDLE_SIGNATURE_SCHEME = b"epd-kv-handle-v1"


def _invalid(field: str, message: str) -> RpcStatusError:
    return RpcStatusError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}")


def handle_signature(handle: kv_pb2.KvHandle, key: bytes) -> bytes:
    """HMAC-SHA256 under `key` of every field of `handle` but the signature (a canonical
    msgpack of them; the agent metadata by its SHA-256)."""
    layout = handle.layout
    body = [
        HANDLE_SIGNATURE_SCHEME,
        handle.agent_name,
        hashlib.sha256(handle.agent_metadata).digest(),
        [[b.address, b.length, b.device_id] for b in handle.blocks],
        int(handle.memory_kind),
        list(handle.block_hashes),
        list(handle.block_digests),
        handle.lease_id,
        handle.lease_ttl_ms,
        handle.num_tokens,
        [
            layout.model,
            int(layout.dtype),
            layout.block_size,
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
            layout.layout,
            layout.block_bytes,
        ],
        handle.holder_address,
        handle.prompt_digest,
    ]
    return hmac.new(key, msgpack.packb(body, use_bin_type=True), hashlib.sha256).digest()


# ------------------------------------------------------------------------ prefill side


def build_handle(
    runner: LmRunner,
    prompt_blocks: Sequence[int],
    hashes: list[bytes],
    *,
    num_tokens: int,
    prompt_digest: bytes,
    block_digests: Sequence[bytes],
    agent: TransferAgent,
    agent_metadata: bytes,
    lease_id: str,
    lease_ttl_s: float,
    holder_address: str,
    key: bytes | None,
) -> kv_pb2.KvHandle:
    """The `KvHandle` lending the first `blocks_for(num_tokens)` of `prompt_blocks` (held by
    the lease `lease_id`, whose bytes have `block_digests`) out of `runner`'s KV buffer,
    registered with `agent`, whose metadata after that registration is `agent_metadata`;
    signed with `key` (unsigned when None: an insecure deployment)."""
    kv = runner.kv
    device = kv.device
    memory = HOST_MEMORY if device.type == "cpu" else DEVICE_MEMORY
    device_id = 0 if device.type == "cpu" else (device.index or 0)
    blocks = prompt_blocks[: blocks_for(num_tokens, runner.block_size)]
    if len(block_digests) != len(blocks):
        raise ValueError(f"{len(block_digests)} digests for {len(blocks)} prompt blocks")
    handle = kv_pb2.KvHandle(
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
        prompt_digest=prompt_digest,
        block_digests=block_digests,
    )
    if key is not None:
        handle.signature = handle_signature(handle, key)
    return handle


# ------------------------------------------------------------------------- decode side


def check_handle(
    handle: kv_pb2.KvHandle,
    runner: LmRunner,
    num_tokens: int,
    *,
    prompt_digest: bytes,
    key: bytes | None,
) -> None:
    """Raise `RpcStatusError` unless `handle` can be pulled into `runner` for a prompt of
    `num_tokens` tokens whose digest is `prompt_digest` (see the module docstring for the
    statuses). With `key` None (insecure) the signature is not checked."""
    if key is not None:
        if not handle.signature:
            raise RpcStatusError(
                grpc.StatusCode.PERMISSION_DENIED,
                "kv.signature: missing; this worker accepts only handles signed with the "
                "deployment's cluster key",
            )
        if not hmac.compare_digest(handle.signature, handle_signature(handle, key)):
            raise RpcStatusError(
                grpc.StatusCode.PERMISSION_DENIED,
                "kv.signature: does not verify; the handle was not made, as it is, by a "
                "worker of this deployment",
            )
    differ = layout_from_proto(handle.layout).differences(runner.kv_layout)
    if differ:
        raise RpcStatusError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "kv.layout: the prefill worker's KV layout differs from this decode worker's: "
            + ", ".join(differ),
        )
    if handle.num_tokens != num_tokens:
        raise _invalid("kv.num_tokens", f"{handle.num_tokens}, but the prompt has {num_tokens}")
    if not hmac.compare_digest(handle.prompt_digest, prompt_digest):
        raise RpcStatusError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "kv.prompt_digest: the handle was made for another prompt (tokens, layout, salt "
            "or LoRA differ from this request's); refusing the KV",
        )
    want = blocks_for(num_tokens, runner.block_size)
    if len(handle.blocks) != want:
        raise _invalid("kv.blocks", f"{len(handle.blocks)} descriptors, the prompt needs {want}")
    if len(handle.block_digests) != want or any(
        len(d) != DIGEST_BYTES for d in handle.block_digests
    ):
        raise _invalid(
            "kv.block_digests", f"expected {want} digests of {DIGEST_BYTES} bytes, one per block"
        )
    block_bytes = runner.kv.spec.block_bytes
    if any(b.length != block_bytes for b in handle.blocks):
        raise _invalid("kv.blocks", f"every descriptor must be one block of {block_bytes} bytes")
    if len({b.device_id for b in handle.blocks}) > 1:
        raise _invalid("kv.blocks", "descriptors name several devices")
    if handle.memory_kind not in KIND_TO_MEMORY:
        raise _invalid("kv.memory_kind", f"unknown memory kind {handle.memory_kind}")
    if not handle.agent_metadata or not handle.agent_name:
        raise _invalid("kv.agent_metadata", "the holder's NIXL agent is missing")
    if not handle.lease_id or not handle.holder_address:
        raise _invalid("kv.lease_id", "a handle names its lease and holder address")


# -------------------------------------------------------------------------- both sides


def check_request(
    runner: LmRunner,
    prompt_token_ids: Sequence[int],
    sampling: SamplingParams,
    request: prefill_service_pb2.PrefillRequest | decode_service_pb2.DecodeRequest,
) -> None:
    """What a Prefill or Decode request asks for, checked before any other work (no
    embedding pulled, no block taken or hashed): no LoRA adapters are loaded, so a
    `lora_id` is refused; prompt tokens + `sampling.max_tokens` must fit the model's
    context. Raises FieldError naming the field (INVALID_ARGUMENT)."""
    if request.HasField("lora_id") and request.lora_id:
        raise FieldError("lora_id", f"unknown lora_id {request.lora_id!r} (no adapters loaded)")
    check_context(
        len(prompt_token_ids),
        sampling.max_tokens,
        runner.config.text.max_position_embeddings,
    )


def read_handoff(
    runner: LmRunner,
    prompt_token_ids: Sequence[int],
    multimodal: multimodal_pb2.MultimodalParams,
    *,
    with_embeddings: bool,
    resolve: TensorResolver | None = None,
) -> Handoff:
    """Decode and validate the multimodal half of a handoff against `runner`'s model.

    The message is parsed once. The layout, the prompt (vocabulary, placeholders exactly
    at the runs, positions) and every embedding's declared shapes (the model's width and
    deepstack depth) are checked before `resolve` pulls any embedding held by a transfer
    handle: a pull allocates what the peer declared (DESIGN §7, limits before work). Raises
    `MultimodalLayoutError` naming the field. Blocking (NIXL pulls): call it from a worker
    thread in a server.
    """
    if not prompt_token_ids:
        raise MultimodalLayoutError("prompt_token_ids", "empty prompt")
    layout = params_from_proto(multimodal, with_embeddings=False, num_tokens=len(prompt_token_ids))
    positions = runner.check_prompt(prompt_token_ids, layout)
    if not with_embeddings:
        return Handoff(layout, positions)
    config = runner.config
    embeddings = embeddings_from_proto(
        multimodal,
        list(layout.items),
        resolve,
        width=config.text.hidden_size,
        depth=len(config.vision.deepstack_visual_indexes),
    )
    return Handoff(dataclasses.replace(layout, embeddings=embeddings), positions)
