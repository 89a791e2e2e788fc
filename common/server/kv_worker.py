"""What the KV workers (prefill and decode) share around their servicers: loading the
runner, the registration they send the router, and their heartbeat load.

Their running server is a `common.server.role.RoleServer`; their calls to peers go through
`common.server.peers.PeerClient`.
"""

from __future__ import annotations

from typing import Any

from common.models.runner import LmRunner
from common.roles import PROTOCOL_VERSION
from common.server.lifecycle import ServerLifecycle
from common.server.role import checkpoint_path
from common.settings.base import KvWorkerSettings
from common.wire.kv import layout_to_proto
from epd.v1 import registry_service_pb2


def load_runner(settings: KvWorkerSettings, **extra: Any) -> LmRunner:
    """The checkpoint's language model and a KV cache as `settings` say (blocking).

    `extra` goes to `LmRunner.from_pretrained` (e.g. prefill's `prefill_chunk`)."""
    return LmRunner.from_pretrained(
        checkpoint_path(settings.model),
        dtype=settings.torch_dtype,
        device=settings.device,
        block_size=settings.block_size,
        num_blocks=settings.num_blocks,
        **extra,
    )


def kv_worker_info(
    role: registry_service_pb2.WorkerRole, address: str, runner: LmRunner, name: str
) -> registry_service_pb2.WorkerInfo:
    """What a KV worker registers: its address, model identity and KV layout."""
    return registry_service_pb2.WorkerInfo(
        role=role,
        address=address,
        model=runner.identity,
        kv_layout=layout_to_proto(runner.kv_layout),
        protocol_version=PROTOCOL_VERSION,
        capabilities=["nixl"],
        name=name,
    )


def kv_load(
    runner: LmRunner, active: int, lifecycle: ServerLifecycle
) -> registry_service_pb2.WorkerLoad:
    """Heartbeat load of a KV worker: `active` RPCs, KV blocks, prefix-cache hits/lookups."""
    pool = runner.allocator.pool
    return registry_service_pb2.WorkerLoad(
        active_requests=active,
        kv_blocks_used=pool.num_used_blocks,
        kv_blocks_free=pool.num_free_blocks,
        cache_hits=pool.hits,
        cache_lookups=pool.lookups,
        draining=lifecycle.draining,
    )
