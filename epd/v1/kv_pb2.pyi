from epd.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_KIND_UNSPECIFIED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_STORED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_REMOVED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_CLEARED: _ClassVar[KvEventKind]
KV_EVENT_KIND_UNSPECIFIED: KvEventKind
KV_EVENT_KIND_STORED: KvEventKind
KV_EVENT_KIND_REMOVED: KvEventKind
KV_EVENT_KIND_CLEARED: KvEventKind

class KvLayout(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "layout", "block_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: _tensor_pb2.ElementType
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str
    block_bytes: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[_Union[_tensor_pb2.ElementType, str]] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., layout: _Optional[str] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class KvBlockDescriptor(_message.Message):
    __slots__ = ("address", "length", "device_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    address: int
    length: int
    device_id: int
    def __init__(self, address: _Optional[int] = ..., length: _Optional[int] = ..., device_id: _Optional[int] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("block_hashes", "agent_metadata", "agent_name", "blocks", "lease_id", "memory_kind", "num_tokens", "layout", "lease_ttl_ms", "holder_address", "prompt_digest", "block_digests", "signature")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    HOLDER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    BLOCK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    agent_metadata: bytes
    agent_name: str
    blocks: _containers.RepeatedCompositeFieldContainer[KvBlockDescriptor]
    lease_id: str
    memory_kind: _tensor_pb2.MemoryKind
    num_tokens: int
    layout: KvLayout
    lease_ttl_ms: int
    holder_address: str
    prompt_digest: bytes
    block_digests: _containers.RepeatedScalarFieldContainer[bytes]
    signature: bytes
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., agent_metadata: _Optional[bytes] = ..., agent_name: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[KvBlockDescriptor, _Mapping]]] = ..., lease_id: _Optional[str] = ..., memory_kind: _Optional[_Union[_tensor_pb2.MemoryKind, str]] = ..., num_tokens: _Optional[int] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., lease_ttl_ms: _Optional[int] = ..., holder_address: _Optional[str] = ..., prompt_digest: _Optional[bytes] = ..., block_digests: _Optional[_Iterable[bytes]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("kind", "block_hashes", "sequence")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    kind: KvEventKind
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    sequence: int
    def __init__(self, kind: _Optional[_Union[KvEventKind, str]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., sequence: _Optional[int] = ...) -> None: ...
