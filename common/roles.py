"""The role vocabulary every process shares, the protocol version they all speak, and the
capabilities a worker can announce.

One definition: the router's registry, the role servers, the CLI and the Ray pools all name
roles with `Role`; `common.wire.roles` converts them to and from the wire `WorkerRole`.
"""

from __future__ import annotations

import enum

# What a worker says in `WorkerInfo.protocol_version`; the router refuses any other.
PROTOCOL_VERSION = "epd.v1"
# What an encoder lists in `WorkerInfo.capabilities` when it takes uint8 patch codes as
# `EncodeItem.pixel_values` (every router sends them; it refuses an encoder without it).
PATCH_CODES = "patch-codes"
# What a prefill and a decode worker list: their KV handles carry, and they check, block
# digests and the cluster's signature (trusted KV, DESIGN §4). A router refuses a KV worker
# without it: handles of a prefill worker from before were refused by every decode worker
# (every request failed, INTERNAL), and a decode worker from before took unsigned ones.
SIGNED_KV = "signed-kv"
# What an encoder lists: the handles it lends its outputs under carry their bytes' digest, so
# a reader that comes after the lease ran out (its range since reused) is refused, not fed
# another request's rows. A router refuses an encoder without it (one from before 955e247
# lent digest-less handles; readers now refuse those too).
EMBEDDING_DIGESTS = "embedding-digests"


class Role(enum.StrEnum):
    """A worker's role (the router is not one: workers register with it)."""

    ENCODER = "encoder"
    PREFILL = "prefill"
    DECODE = "decode"


# Every worker role, in request order (encode, prefill, decode).
WORKER_ROLES: tuple[Role, ...] = tuple(Role)
# The roles that hold paged KV and must agree on its layout, in request order.
KV_ROLES: tuple[Role, ...] = (Role.PREFILL, Role.DECODE)
