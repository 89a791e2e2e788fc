"""`common.handoff.check_handle`'s checks of a handle's shape: one descriptor of one block
each, one digest per block, one device. Without them every other test passed (invariants
review, mutations); in an insecure deployment (no signature) they alone stand between a
caller's handle and a READ of any length, or an IndexError in `kv_pull.pull` (INTERNAL,
not INVALID_ARGUMENT naming the field)."""

from __future__ import annotations

import types
from typing import Any, cast

import grpc
import pytest

from common.handoff import check_handle
from common.kv.layout import KvLayout
from common.server.rpc import RpcStatusError
from common.wire.kv import layout_to_proto
from epd.v1 import kv_pb2, tensor_pb2

BS, BLOCK_BYTES = 4, 1024
LAYOUT = KvLayout("m", tensor_pb2.ELEMENT_TYPE_FLOAT32, BS, 2, 1, 8, "block-major", BLOCK_BYTES)
RUNNER = types.SimpleNamespace(
    kv_layout=LAYOUT,
    block_size=BS,
    kv=types.SimpleNamespace(spec=types.SimpleNamespace(block_bytes=BLOCK_BYTES)),
)
DIGEST = b"\x00" * 16


def good(num_tokens: int = 10) -> kv_pb2.KvHandle:
    n = -(-num_tokens // BS)
    return kv_pb2.KvHandle(
        agent_name="a",
        agent_metadata=b"m",
        blocks=[kv_pb2.KvBlockDescriptor(address=4096 * i, length=BLOCK_BYTES) for i in range(n)],
        memory_kind=tensor_pb2.MEMORY_KIND_HOST,
        num_tokens=num_tokens,
        layout=layout_to_proto(LAYOUT),
        lease_id="l",
        holder_address="h:1",
        prompt_digest=b"d" * 32,
        block_digests=[DIGEST] * n,
    )


def refused(h: kv_pb2.KvHandle) -> str:
    with pytest.raises(RpcStatusError) as info:
        check_handle(h, cast(Any, RUNNER), 10, prompt_digest=b"d" * 32, key=None)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return str(info.value)


def test_a_good_handle_passes() -> None:
    check_handle(good(), cast(Any, RUNNER), 10, prompt_digest=b"d" * 32, key=None)


def test_a_descriptor_of_other_than_one_block_is_refused() -> None:
    h = good()
    h.blocks[1].length = BLOCK_BYTES * 4
    assert "kv.blocks" in refused(h)


def test_too_few_digests_are_refused() -> None:
    h = good()
    del h.block_digests[-1]
    assert "kv.block_digests" in refused(h)


def test_descriptors_on_two_devices_are_refused() -> None:
    h = good()
    h.blocks[0].device_id = 1
    assert "kv.blocks" in refused(h)


def test_too_many_digests_are_refused() -> None:
    # Without this check (and the two below) every test passed (mutation review, s36).
    h = good()
    h.block_digests.append(DIGEST)
    assert "kv.block_digests" in refused(h)


def test_an_unknown_memory_kind_is_refused() -> None:
    h = good()
    h.memory_kind = cast(Any, 99)
    assert "kv.memory_kind" in refused(h)


async def test_an_agent_name_not_its_metadatas_is_refused_before_any_read() -> None:
    # The name is whom the lease is confirmed with: a handle naming one agent and carrying
    # another's metadata must not be READ from the other.
    from common.kv.allocator import ImportPlan
    from common.kv_pull import pull

    agent = types.SimpleNamespace(peers={"a"}, add_peer=lambda metadata: "someone-else")
    plan = ImportPlan(blocks=[0, 1, 2], pull=[0, 1, 2], reused=[])
    with pytest.raises(RpcStatusError) as info:
        await pull(
            cast(Any, agent),
            cast(Any, None),
            good(),
            plan,
            timeout_s=1.0,
            on_orphan=lambda: None,
            on_quarantine=lambda e: None,
        )
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "kv.agent_name" in str(info.value)
