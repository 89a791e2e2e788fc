"""The role vocabulary every process shares, and the protocol version they all speak.

One definition: the router's registry, the role servers, the CLI and the Ray pools all name
roles with `Role`; `common.wire.roles` converts them to and from the wire `WorkerRole`.
"""

from __future__ import annotations

import enum

# What a worker says in `WorkerInfo.protocol_version`; the router refuses any other.
PROTOCOL_VERSION = "epd.v1"


class Role(enum.StrEnum):
    """A worker's role (the router is not one: workers register with it)."""

    ENCODER = "encoder"
    PREFILL = "prefill"
    DECODE = "decode"


# Every worker role, in request order (encode, prefill, decode).
WORKER_ROLES: tuple[Role, ...] = tuple(Role)
# The roles that hold paged KV and must agree on its layout.
KV_ROLES = frozenset({Role.PREFILL, Role.DECODE})
