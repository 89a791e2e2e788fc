"""`AdminService`: the operator's view of the registry, scaling and draining.

Scaling is not the router's job: it delegates to a pluggable async `Scaler` given to
`router.server.serve` (the Ray deployment plugs one in). Without one, Scale answers
UNIMPLEMENTED. A scaler may also have async `waiting()` and `failed()` methods: lines about
workers it started that are not up yet (what they wait for) and whose start failed (why),
which Status reports; and `replaced(role)`: the lines of those dead for good that its last
scale of `role` took out of the pool's count, which Scale answers (`epd scale` waits on
those and stops at any other).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import NoReturn

import grpc

from common.roles import Role
from common.wire.roles import role_from_proto
from epd.v1 import admin_service_pb2, admin_service_pb2_grpc, registry_service_pb2
from router.admission import Admission
from router.registry import Registry
from router.workers import WorkerRecord

logger = logging.getLogger(__name__)

# scaler(role, replicas) -> the pool's worker count after the call (or the target it moves
# to). It may raise ValueError for a request it refuses (answered INVALID_ARGUMENT).
Scaler = Callable[[Role, int], Awaitable[int]]

NO_SCALER = "scaling needs `epd serve` on Ray"
MAX_DROPPED = 16  # workers `Dropped` keeps
DROPPED_FOR_S = 3600.0  # seconds it keeps each


class Dropped:
    """The workers `registry` dropped lately for their silence (not those that drained and
    left, nor one a namesake replaced), until one of that role and name registers again:
    Status lists them, as the table of registered workers cannot (which worker went quiet
    was in the router's log alone: walkthrough review, s39)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        # (role, name) -> (address, seconds silent, when dropped), the oldest first
        self._dropped: OrderedDict[tuple[str, str], tuple[str, float, float]] = OrderedDict()
        registry.on_expire.append(self._note)
        registry.on_register.append(self._back)

    def _note(self, record: WorkerRecord) -> None:
        if record.draining:  # it left as asked (a scale-down, a stop, `epd drain`)
            return
        key = (str(record.role), record.name)
        now = self.registry.clock()
        self._dropped[key] = (record.address, self.registry.seconds_since(record), now)
        self._dropped.move_to_end(key)
        while len(self._dropped) > MAX_DROPPED:
            self._dropped.popitem(last=False)

    def _back(self, record: WorkerRecord) -> None:
        self._dropped.pop((str(record.role), record.name), None)

    def lines(self) -> list[str]:
        now = self.registry.clock()
        return [
            f"{role} {name} {address}: no heartbeat for {silent:.1f} s, dropped "
            f"{now - when:.0f} s ago"
            for (role, name), (address, silent, when) in self._dropped.items()
            if now - when <= DROPPED_FOR_S
        ]


class AdminServicer(admin_service_pb2_grpc.AdminServiceServicer):
    """Status / Scale / Drain / Undrain over a `Registry`, an optional `Scaler` and the router's
    `Admission` (queue figures in Status; zeros without one)."""

    def __init__(
        self,
        registry: Registry,
        scaler: Scaler | None = None,
        admission: Admission | None = None,
        requests: Callable[[], int] | None = None,
    ) -> None:
        self.registry = registry
        self.dropped = Dropped(registry)
        self.scaler = scaler
        self.admission = admission
        # Requests in the router, arrival to end (None: its calls on workers are counted,
        # a request on two encoders at once twice).
        self.requests = requests

    async def Status(
        self, request: admin_service_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> admin_service_pb2.StatusResponse:
        """Every live worker (of the role asked for) with its last load, and the admission
        queue's figures."""
        role = None
        if request.role != registry_service_pb2.WORKER_ROLE_UNSPECIFIED:
            try:
                role = role_from_proto(request.role)
            except ValueError as exc:
                await _invalid(context, "role", str(exc))
        response = admin_service_pb2.StatusResponse(
            model=self.registry.expected_model or "",
            active_requests=self.registry.active_requests,
        )
        if self.admission is not None:
            queue = self.admission.stats()
            if self.requests is not None:  # as `vllm:num_requests_running`: not the queued
                response.active_requests = max(0, self.requests() - queue.queued)
            response.queued_requests = queue.queued
            response.queued_peak = queue.peak
            response.admitted_requests = queue.admitted
            response.refused_requests = queue.refused
            response.requeued_requests = queue.requeued
            response.queue_wait_p50_s = queue.wait_p50_s
            response.queue_wait_max_s = queue.wait_max_s
        for field, lines in (("waiting", "waiting"), ("failed_starts", "failed")):
            told = getattr(self.scaler, lines, None)
            if told is not None:
                getattr(response, field).extend(await told())
        response.refused_registrations.extend(
            f"{address}: {why}" for address, why in self.registry.refusals.recent()
        )
        response.dropped_workers.extend(self.dropped.lines())
        for w in self.registry.workers(role):
            response.workers.add(
                worker_id=w.worker_id,
                info=w.info,
                load=w.load.to_proto(),
                router_in_flight=w.in_flight,
                seconds_since_heartbeat=self.registry.seconds_since(w),
                draining=w.draining,
                drained=w.operator_drained,
                suspect=w.suspect,
                router_reserved_kv_blocks=(
                    self.admission.reserved(w.address) if self.admission is not None else 0
                ),
            )
        return response

    async def Scale(
        self, request: admin_service_pb2.ScaleRequest, context: grpc.aio.ServicerContext
    ) -> admin_service_pb2.ScaleResponse:
        """Delegate to the scaler; UNIMPLEMENTED without one."""
        try:
            role = role_from_proto(request.role)
        except ValueError as exc:
            await _invalid(context, "role", str(exc))
        if self.scaler is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, NO_SCALER)
            raise AssertionError("unreachable")  # abort raises; this keeps mypy honest
        logger.info("scaling %s to %d replicas", role, request.replicas)
        try:
            replicas = await self.scaler(role, request.replicas)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        response = admin_service_pb2.ScaleResponse(replicas=replicas)
        # The dead it took out of the count: read with nothing awaited since the scale left
        # its pool's lock (no other Scale of the role runs between; s41diff F6, s42).
        replaced = getattr(self.scaler, "replaced", None)
        if replaced is not None:
            response.replaced.extend(await replaced(role))
            response.tells_replaced = True
        return response

    async def Drain(
        self, request: admin_service_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> admin_service_pb2.DrainResponse:
        """Route no new work to the worker at `address`."""
        if not request.address:
            await _invalid(context, "address", "is empty")
        return admin_service_pb2.DrainResponse(found=self.registry.drain(request.address))

    async def Undrain(
        self, request: admin_service_pb2.UndrainRequest, context: grpc.aio.ServicerContext
    ) -> admin_service_pb2.UndrainResponse:
        """Route new work to the worker at `address`, or of `name`, again (undoes Drain)."""
        if not request.address and not request.name.strip():
            await _invalid(context, "address", "is empty (and so is name)")
        name = request.name.strip()
        found, serving, lifted_away = self.registry.undrain(request.address, name)
        return admin_service_pb2.UndrainResponse(
            found=found, serving=serving, lifted_away=lifted_away
        )


async def _invalid(context: grpc.aio.ServicerContext, field: str, message: str) -> NoReturn:
    """Abort with INVALID_ARGUMENT "field: message", the field in `epd-field` too."""
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{field}: {message}",
        trailing_metadata=(("epd-field", field),),
    )
    raise AssertionError("unreachable")  # abort raises; this keeps mypy honest
