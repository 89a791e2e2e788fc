"""Shared by the registry tests: a fake clock, builders of a KV layout and a WorkerInfo,
and the `clock` and `registry` fixtures (a registry on that clock, no network)."""

from __future__ import annotations

from typing import Any

import pytest

from common.roles import EMBEDDING_DIGESTS, PATCH_CODES, SIGNED_KV, Role
from common.wire.roles import role_to_proto
from epd.v1 import kv_pb2, registry_service_pb2, tensor_pb2
from router.registry import Registry
from router.workers import CheckpointShape

MODEL = "qwen3-vl/test"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def layout(**overrides: object) -> kv_pb2.KvLayout:
    fields: dict[str, Any] = dict(
        model=MODEL,
        dtype=tensor_pb2.ELEMENT_TYPE_FLOAT32,
        block_size=16,
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        layout="block-major/layer,kv,token,head,dim",
        block_bytes=8192,
    )
    fields.update(overrides)
    return kv_pb2.KvLayout(**fields)


def info(role: Role, port: int, **overrides) -> registry_service_pb2.WorkerInfo:
    msg = registry_service_pb2.WorkerInfo(
        role=role_to_proto(role),
        address=f"127.0.0.1:{port}",
        model=overrides.pop("model", MODEL),
        protocol_version=overrides.pop("protocol_version", "epd.v1"),
        name=f"{role}-{port}",
    )
    needed = [PATCH_CODES, EMBEDDING_DIGESTS] if role == Role.ENCODER else [SIGNED_KV]
    msg.capabilities.extend(overrides.pop("capabilities", needed))
    if role != Role.ENCODER:
        msg.kv_layout.CopyFrom(overrides.pop("kv_layout", layout()))
    msg.dtype = overrides.pop("dtype", "")
    return msg


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def registry(clock: Clock) -> Registry:
    return Registry(
        worker_timeout_s=3.0,
        heartbeat_interval_s=1.0,
        expected_model=MODEL,
        checkpoint_shape=CheckpointShape(num_layers=2, num_kv_heads=2, head_dim=16),
        clock=clock,
    )
