from epd.v1 import registry_service_pb2 as _registry_service_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "info", "load", "router_in_flight", "seconds_since_heartbeat", "draining")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    ROUTER_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    info: _registry_service_pb2.WorkerInfo
    load: _registry_service_pb2.WorkerLoad
    router_in_flight: int
    seconds_since_heartbeat: float
    draining: bool
    def __init__(self, worker_id: _Optional[str] = ..., info: _Optional[_Union[_registry_service_pb2.WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[_registry_service_pb2.WorkerLoad, _Mapping]] = ..., router_in_flight: _Optional[int] = ..., seconds_since_heartbeat: _Optional[float] = ..., draining: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: _registry_service_pb2.WorkerRole
    def __init__(self, role: _Optional[_Union[_registry_service_pb2.WorkerRole, str]] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("workers", "model", "active_requests")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    model: str
    active_requests: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., model: _Optional[str] = ..., active_requests: _Optional[int] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("role", "replicas")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    role: _registry_service_pb2.WorkerRole
    replicas: int
    def __init__(self, role: _Optional[_Union[_registry_service_pb2.WorkerRole, str]] = ..., replicas: _Optional[int] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: int
    def __init__(self, replicas: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
