from epd.v1 import kv_pb2 as _kv_pb2
from epd.v1 import multimodal_pb2 as _multimodal_pb2
from epd.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "multimodal", "sampling", "cache_salt", "lora_id", "embedding_holders", "lease_id")
    class EmbeddingHoldersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MULTIMODAL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    multimodal: _multimodal_pb2.MultimodalParams
    sampling: _sampling_pb2.SamplingParams
    cache_salt: str
    lora_id: str
    embedding_holders: _containers.ScalarMap[str, str]
    lease_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., multimodal: _Optional[_Union[_multimodal_pb2.MultimodalParams, _Mapping]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., lora_id: _Optional[str] = ..., embedding_holders: _Optional[_Mapping[str, str]] = ..., lease_id: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "kv", "cached_tokens", "computed_tokens")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    kv: _kv_pb2.KvHandle
    cached_tokens: int
    computed_tokens: int
    def __init__(self, first_token_id: _Optional[int] = ..., kv: _Optional[_Union[_kv_pb2.KvHandle, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("lease_id", "mismatched_blocks")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MISMATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    mismatched_blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., mismatched_blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class RenewKvRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class RenewKvResponse(_message.Message):
    __slots__ = ("renewed", "lease_ttl_ms")
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    renewed: bool
    lease_ttl_ms: int
    def __init__(self, renewed: _Optional[bool] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class StreamKvEventsRequest(_message.Message):
    __slots__ = ("subscriber",)
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    subscriber: str
    def __init__(self, subscriber: _Optional[str] = ...) -> None: ...

class StreamKvEventsResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[_kv_pb2.KvEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[_kv_pb2.KvEvent, _Mapping]]] = ...) -> None: ...
