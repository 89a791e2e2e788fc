from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ElementType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ELEMENT_TYPE_UNSPECIFIED: _ClassVar[ElementType]
    ELEMENT_TYPE_FLOAT32: _ClassVar[ElementType]
    ELEMENT_TYPE_FLOAT16: _ClassVar[ElementType]
    ELEMENT_TYPE_BFLOAT16: _ClassVar[ElementType]
    ELEMENT_TYPE_INT64: _ClassVar[ElementType]
    ELEMENT_TYPE_INT32: _ClassVar[ElementType]
    ELEMENT_TYPE_UINT8: _ClassVar[ElementType]

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_HOST: _ClassVar[MemoryKind]
    MEMORY_KIND_DEVICE: _ClassVar[MemoryKind]
ELEMENT_TYPE_UNSPECIFIED: ElementType
ELEMENT_TYPE_FLOAT32: ElementType
ELEMENT_TYPE_FLOAT16: ElementType
ELEMENT_TYPE_BFLOAT16: ElementType
ELEMENT_TYPE_INT64: ElementType
ELEMENT_TYPE_INT32: ElementType
ELEMENT_TYPE_UINT8: ElementType
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_HOST: MemoryKind
MEMORY_KIND_DEVICE: MemoryKind

class TransferHandle(_message.Message):
    __slots__ = ("agent_metadata", "agent_name", "address", "length", "device_id", "memory_kind", "lease_id", "digest")
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    agent_metadata: bytes
    agent_name: str
    address: int
    length: int
    device_id: int
    memory_kind: MemoryKind
    lease_id: str
    digest: bytes
    def __init__(self, agent_metadata: _Optional[bytes] = ..., agent_name: _Optional[str] = ..., address: _Optional[int] = ..., length: _Optional[int] = ..., device_id: _Optional[int] = ..., memory_kind: _Optional[_Union[MemoryKind, str]] = ..., lease_id: _Optional[str] = ..., digest: _Optional[bytes] = ...) -> None: ...

class TensorRef(_message.Message):
    __slots__ = ("dtype", "shape", "inline_data", "handle")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    INLINE_DATA_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    dtype: ElementType
    shape: _containers.RepeatedScalarFieldContainer[int]
    inline_data: bytes
    handle: TransferHandle
    def __init__(self, dtype: _Optional[_Union[ElementType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., inline_data: _Optional[bytes] = ..., handle: _Optional[_Union[TransferHandle, _Mapping]] = ...) -> None: ...
