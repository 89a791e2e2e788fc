from epd.v1 import registry_service_pb2 as _registry_service_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "info", "load", "router_in_flight", "seconds_since_heartbeat", "draining", "router_reserved_kv_blocks", "suspect", "drained")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    ROUTER_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ROUTER_RESERVED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    info: _registry_service_pb2.WorkerInfo
    load: _registry_service_pb2.WorkerLoad
    router_in_flight: int
    seconds_since_heartbeat: float
    draining: bool
    router_reserved_kv_blocks: int
    suspect: bool
    drained: bool
    def __init__(self, worker_id: _Optional[str] = ..., info: _Optional[_Union[_registry_service_pb2.WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[_registry_service_pb2.WorkerLoad, _Mapping]] = ..., router_in_flight: _Optional[int] = ..., seconds_since_heartbeat: _Optional[float] = ..., draining: _Optional[bool] = ..., router_reserved_kv_blocks: _Optional[int] = ..., suspect: _Optional[bool] = ..., drained: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: _registry_service_pb2.WorkerRole
    def __init__(self, role: _Optional[_Union[_registry_service_pb2.WorkerRole, str]] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("workers", "model", "active_requests", "queued_requests", "queued_peak", "admitted_requests", "refused_requests", "requeued_requests", "queue_wait_p50_s", "queue_wait_max_s", "waiting", "refused_registrations", "failed_starts", "dropped_workers")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PEAK_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REQUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_P50_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_MAX_S_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    REFUSED_REGISTRATIONS_FIELD_NUMBER: _ClassVar[int]
    FAILED_STARTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    model: str
    active_requests: int
    queued_requests: int
    queued_peak: int
    admitted_requests: int
    refused_requests: int
    requeued_requests: int
    queue_wait_p50_s: float
    queue_wait_max_s: float
    waiting: _containers.RepeatedScalarFieldContainer[str]
    refused_registrations: _containers.RepeatedScalarFieldContainer[str]
    failed_starts: _containers.RepeatedScalarFieldContainer[str]
    dropped_workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., model: _Optional[str] = ..., active_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., queued_peak: _Optional[int] = ..., admitted_requests: _Optional[int] = ..., refused_requests: _Optional[int] = ..., requeued_requests: _Optional[int] = ..., queue_wait_p50_s: _Optional[float] = ..., queue_wait_max_s: _Optional[float] = ..., waiting: _Optional[_Iterable[str]] = ..., refused_registrations: _Optional[_Iterable[str]] = ..., failed_starts: _Optional[_Iterable[str]] = ..., dropped_workers: _Optional[_Iterable[str]] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("role", "replicas")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    role: _registry_service_pb2.WorkerRole
    replicas: int
    def __init__(self, role: _Optional[_Union[_registry_service_pb2.WorkerRole, str]] = ..., replicas: _Optional[int] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("replicas", "replaced", "tells_replaced")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    TELLS_REPLACED_FIELD_NUMBER: _ClassVar[int]
    replicas: int
    replaced: _containers.RepeatedScalarFieldContainer[str]
    tells_replaced: bool
    def __init__(self, replicas: _Optional[int] = ..., replaced: _Optional[_Iterable[str]] = ..., tells_replaced: _Optional[bool] = ...) -> None: ...

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

class UndrainRequest(_message.Message):
    __slots__ = ("address", "name")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    address: str
    name: str
    def __init__(self, address: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class UndrainResponse(_message.Message):
    __slots__ = ("found", "serving", "lifted_away")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    LIFTED_AWAY_FIELD_NUMBER: _ClassVar[int]
    found: bool
    serving: bool
    lifted_away: bool
    def __init__(self, found: _Optional[bool] = ..., serving: _Optional[bool] = ..., lifted_away: _Optional[bool] = ...) -> None: ...
