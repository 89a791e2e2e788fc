"""`common.roles.Role` <-> the wire `WorkerRole` enum."""

from __future__ import annotations

from common.roles import WORKER_ROLES, Role
from epd.v1 import registry_service_pb2

_TO_PROTO = {
    Role.ENCODER: registry_service_pb2.WORKER_ROLE_ENCODER,
    Role.PREFILL: registry_service_pb2.WORKER_ROLE_PREFILL,
    Role.DECODE: registry_service_pb2.WORKER_ROLE_DECODE,
}
_FROM_PROTO = {int(v): k for k, v in _TO_PROTO.items()}


def role_to_proto(role: Role | str) -> registry_service_pb2.WorkerRole:
    """The wire value of a role (or role name); ValueError naming the known ones."""
    try:
        return _TO_PROTO[Role(role)]
    except ValueError:
        known = ", ".join(WORKER_ROLES)
        raise ValueError(f"unknown role {role!r}; expected one of {known}") from None


def role_from_proto(value: int) -> Role:
    """The role of a wire `WorkerRole`; ValueError for unspecified or unknown values."""
    try:
        return _FROM_PROTO[int(value)]
    except KeyError:
        raise ValueError(f"worker role {value} is not encoder, prefill or decode") from None
