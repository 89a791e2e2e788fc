"""The router's `RegistryService`: workers register and heartbeat into its `Registry`."""

from __future__ import annotations

import logging

import grpc

from common.wire.roles import role_from_proto
from epd.v1 import registry_service_pb2, registry_service_pb2_grpc
from router.registry import Registry
from router.workers import RegistrationRefused, WorkerLoad

logger = logging.getLogger(__name__)


class RegistryServicer(registry_service_pb2_grpc.RegistryServiceServicer):
    """`RegistryService` over a `Registry`: refusals become FAILED_PRECONDITION, incomplete
    registrations INVALID_ARGUMENT."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def Register(
        self, request: registry_service_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> registry_service_pb2.RegisterResponse:
        """Record the worker or refuse it."""
        try:
            record = self.registry.register(request.worker)
        except RegistrationRefused as exc:
            role = str(role_from_proto(request.worker.role))  # parsed before any refusal
            _log(self.registry.refuse(request.worker.address, str(exc), role), exc)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:  # an incomplete registration: refused as the others are
            _log(self.registry.refuse(request.worker.address or context.peer(), str(exc)), exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return registry_service_pb2.RegisterResponse(
            worker_id=record.worker_id,
            heartbeat_interval_ms=max(1, round(self.registry.heartbeat_interval_s * 1000)),
        )

    async def Heartbeat(
        self, request: registry_service_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> registry_service_pb2.HeartbeatResponse:
        """Refresh liveness and load; known=False asks the worker to register again."""
        known = self.registry.heartbeat(request.worker_id, WorkerLoad.from_proto(request.load))
        return registry_service_pb2.HeartbeatResponse(known=known)


def _log(news: bool, exc: Exception) -> None:
    """A refusal: a warning when it is news (`Refusals.note`), else a debug line."""
    logger.log(logging.WARNING if news else logging.DEBUG, "refused worker: %s", exc)
