"""The registry's records of workers: roles, the KV layout and checkpoint shape they must
agree on, the load they report, and one record per registered worker (see router.registry).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from common.kv.layout import KvLayout
from common.roles import EMBEDDING_DIGESTS, KV_ROLES, PATCH_CODES, SIGNED_KV, Role
from epd.v1 import registry_service_pb2

# A worker suspected again within this many seconds of its mark's clearing is held suspect
# through its heartbeats, twice as long as the time before, up to `SUSPECT_HOLD_MAX_S`.
SUSPECT_MEMORY_S = 60.0
SUSPECT_HOLD_MAX_S = 60.0
MAX_STRIKES = 32  # 2 ** strikes stays a float (past 1023 it overflowed, every mark raised)


class RegistrationRefused(Exception):
    """A worker that does not fit this deployment (FAILED_PRECONDITION on the wire)."""


class NoWorkerError(Exception):
    """No live, non-draining worker of a role (UNAVAILABLE on the wire)."""

    def __init__(self, role: Role, refused: int = 0, workers: Sequence[WorkerRecord] = ()) -> None:
        # Refused ones (a version mismatch, another model) and draining ones (`workers`, the
        # role's registered ones; an operator's drain apart from a stop or a retirement, which
        # undrain cannot undo): clients saw only "no worker", though `epd status` listed them.
        why = f" ({refused} refused at registration: `epd status` says why)" if refused else ""
        if drained := sum(w.operator_drained for w in workers):
            why += f" ({drained} drained: `epd undrain` takes it back)"
        if leaving := sum(w.draining and not w.operator_drained for w in workers):
            why += f" ({leaving} stopping or retired)"
        super().__init__(f"no {role} worker is registered and available{why}")
        self.role = role


@dataclass(frozen=True, slots=True)
class CheckpointShape:
    """The KV fields a checkpoint config fixes, for checking layouts before any worker."""

    num_layers: int  # decoder layers
    num_kv_heads: int  # KV heads per layer
    head_dim: int  # head dimension


def check_layout(
    role: Role,
    address: str,
    layout: KvLayout,
    shape: CheckpointShape | None,
    reference: KvLayout | None,
) -> None:
    """RegistrationRefused unless a KV worker's `layout` fits the checkpoint's `shape` and
    the deployment's `reference` layout (the first KV worker's), where known."""
    if shape is not None:
        wrong = [
            f"{name}={getattr(layout, name)} (checkpoint has {getattr(shape, name)})"
            for name in ("num_layers", "num_kv_heads", "head_dim")
            if getattr(layout, name) != getattr(shape, name)
        ]
        if wrong:
            raise RegistrationRefused(
                f"{role} worker {address} has a KV layout that does not match the "
                f"checkpoint: {', '.join(wrong)}"
            )
    if reference is not None:
        wrong = layout.differences(reference)
        if wrong:
            raise RegistrationRefused(
                f"{role} worker {address} has a KV layout that differs from the "
                f"deployment's: {', '.join(wrong)} (every prefill and decode worker must use "
                "one; a router keeps its first KV worker's until it restarts)"
            )


def rendezvous_weight(key: bytes, name: str) -> int:
    """The weight of worker `name` for `key` in rendezvous hashing (`Registry.pick`): stable
    across processes and routers (no Python `hash`), uniform over 64 bits."""
    digest = hashlib.blake2b(key, digest_size=8, person=b"epd-rendezvous")
    digest.update(name.encode())
    return int.from_bytes(digest.digest(), "big")


def check_capabilities(role: Role, info: registry_service_pb2.WorkerInfo) -> None:
    """RegistrationRefused unless a worker says it binds the bytes it lends to its handles:
    a KV worker signs and checks KV handles (`SIGNED_KV`), an encoder's handles carry their
    bytes' digest (`EMBEDDING_DIGESTS`), and it takes the uint8 patch codes every router
    sends (`PATCH_CODES`, older than digests). Versions from before are refused
    (docs/compatibility.md)."""
    needed = (
        {SIGNED_KV: "it signs and checks KV handles"}
        if role in KV_ROLES
        else {PATCH_CODES: "it takes patch codes", EMBEDDING_DIGESTS: "its handles carry digests"}
    )
    for capability, what in needed.items():
        if capability not in info.capabilities:
            raise RegistrationRefused(
                f"{role} worker {info.address} does not say {what} (no {capability!r} "
                "capability: a version older than this router's floor, docs/compatibility.md); "
                "upgrade workers before routers"
            )


def said_dtype(info: registry_service_pb2.WorkerInfo, layout: KvLayout | None) -> str:
    """The dtype a worker computes in, as it registered ("": an older encoder's, unsaid)."""
    return info.dtype or (layout.dtype_name if layout is not None else "")


def check_dtype(role: Role, address: str, dtype: str, deployment: str | None) -> None:
    """RegistrationRefused unless a worker computes in the deployment's dtype
    (`Registry.dtype_now`; "" and None: not compared). An encoder's embeddings, and the KV
    computed from them, differ by dtype, and the prefix caches key KV by the KV workers'
    dtype only: encoders in float32 and in bfloat16 gave one request two answers, and
    whichever came first was cached for both (configs review, s32)."""
    if dtype and deployment and dtype != deployment:
        raise RegistrationRefused(
            f"{role} worker {address} computes in {dtype}; this deployment's workers compute "
            f"in {deployment} (every encoder, prefill and decode worker must use one dtype; "
            "a router keeps its first KV worker's until it restarts)"
        )


@dataclass(slots=True)
class WorkerLoad:
    """A worker's load as of its last heartbeat."""

    active_requests: int = 0  # requests in flight on the worker (from every router)
    kv_blocks_used: int = 0  # KV blocks in use
    kv_blocks_free: int = 0  # KV blocks free
    cache_hits: int = 0  # prefix or encoder cache hits since start
    cache_lookups: int = 0  # prefix or encoder cache lookups since start
    draining: bool = False  # the worker says it drains

    @classmethod
    def from_proto(cls, msg: registry_service_pb2.WorkerLoad) -> WorkerLoad:
        """Decode the wire form."""
        return cls(**{f.name: getattr(msg, f.name) for f in fields(cls)})

    def to_proto(self) -> registry_service_pb2.WorkerLoad:
        """The wire form (the message has exactly this dataclass's fields)."""
        return registry_service_pb2.WorkerLoad(
            **{f.name: getattr(self, f.name) for f in fields(self)}
        )


@dataclass(slots=True)
class WorkerRecord:
    """One registered worker."""

    worker_id: str  # id handed out at registration, used in heartbeats
    role: Role  # what it does
    address: str  # gRPC host:port
    name: str  # stable process name (actor, pod), for logs and Status
    model: str  # model identity it serves
    layout: KvLayout | None  # KV layout (prefill and decode only)
    info: registry_service_pb2.WorkerInfo  # the registration as sent, echoed by Status
    last_seen: float  # clock time of the last register or heartbeat, plus `excused`
    excused: float = 0.0  # seconds of the router's stalls added to last_seen since (`excuse`)
    load: WorkerLoad = field(default_factory=WorkerLoad)  # last reported load
    in_flight: int = 0  # requests this router has on the worker now
    in_flight_at_heartbeat: int = 0  # `in_flight` when the last heartbeat arrived
    # Requests admission placed here whose reservation stands: started or not (a decode is
    # placed when its request is admitted, and starts after encode and prefill).
    placed: int = 0
    drain_requested: bool = False  # AdminService.Drain asked for it (Undrain undoes it)
    retiring: bool = False  # the deployment retires it (`Registry.retire`): nothing undoes it
    died: bool = False  # ... for it died for good (its registration lasts until it times out)
    last_pick: int = 0  # selection tick of the last pick (least recently picked wins ties)
    # A call on it failed UNAVAILABLE since its last heartbeat (killed, frozen, unreachable):
    # picked only when no other worker of its role is left (`Registry.pick`).
    suspect: bool = False
    suspect_until: float = 0.0  # a heartbeat before then leaves it suspect
    suspect_strikes: int = 0  # marks in a row, each soon after the last was cleared
    suspect_cleared: float = -math.inf  # clock time the last mark was cleared
    # Its connection was lost under a call (could not be made, or was cut) since its last
    # heartbeat: not wedged but gone, so requests wait for its restart at once
    # (`router.returns`), not once its heartbeats are missed.
    unreachable: bool = False

    @property
    def shown(self) -> str:
        """Its name and address, as logs give it (operators look for a pod by its name, and
        a pod's address is reused: operator2 review L6, s44)."""
        return self.address if self.name == self.address else f"{self.name} ({self.address})"

    def mark_suspect(self, now: float, heartbeat_interval_s: float) -> None:
        """A call on it failed UNAVAILABLE. A first failure lasts until the next heartbeat;
        one within `SUSPECT_MEMORY_S` of the last mark's clearing (heartbeats arrive, calls
        fail: a one-way partition, a wedged server beside a live registrar) lasts through
        heartbeats for 2, 4, 8, ... heartbeat intervals, up to `SUSPECT_HOLD_MAX_S`."""
        if self.suspect:
            return
        again = now - self.suspect_cleared < SUSPECT_MEMORY_S
        self.suspect_strikes = min(self.suspect_strikes + 1, MAX_STRIKES) if again else 0
        hold = heartbeat_interval_s * 2**self.suspect_strikes if self.suspect_strikes else 0.0
        self.suspect_until = now + min(hold, SUSPECT_HOLD_MAX_S)
        self.suspect = True

    def heard(self, now: float) -> None:
        """A heartbeat arrived: clear the suspect mark if it has been held long enough."""
        self.last_seen = now
        self.excused = 0.0
        self.unreachable = False
        if self.suspect and now >= self.suspect_until:
            self.suspect = False  # alive after all: its failed call was its own
            self.suspect_cleared = now

    @property
    def draining(self) -> bool:
        """No new work: the worker reported draining, an operator asked for it, or the
        deployment retires it."""
        return self.drain_requested or self.retiring or self.load.draining

    @property
    def operator_drained(self) -> bool:
        """Draining only as an operator asked (AdminService.Drain), which Undrain takes back:
        not a worker the deployment retires (its scale-down asks for a drain too) nor one
        draining itself (stopping)."""
        return self.drain_requested and not (self.retiring or self.load.draining)

    @property
    def load_estimate(self) -> int:
        """Requests the worker has: this router's (in flight, or placed by admission and yet
        to start: a burst admitted at once must not all see the same idle worker) plus what
        the last heartbeat reported beyond this router's requests at that time (other
        routers' work, or queued work), so a request is not counted twice."""
        others = max(0, self.load.active_requests - self.in_flight_at_heartbeat)
        return max(self.in_flight, self.placed) + others
