from epd.v1 import multimodal_pb2 as _multimodal_pb2
from epd.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeItem(_message.Message):
    __slots__ = ("content_hash", "modality", "pixel_values", "grid_thw", "partitions", "partition_indices")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    PIXEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_INDICES_FIELD_NUMBER: _ClassVar[int]
    content_hash: bytes
    modality: _multimodal_pb2.Modality
    pixel_values: _tensor_pb2.TensorRef
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    partitions: _containers.RepeatedCompositeFieldContainer[_multimodal_pb2.ItemPartition]
    partition_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, content_hash: _Optional[bytes] = ..., modality: _Optional[_Union[_multimodal_pb2.Modality, str]] = ..., pixel_values: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., grid_thw: _Optional[_Iterable[int]] = ..., partitions: _Optional[_Iterable[_Union[_multimodal_pb2.ItemPartition, _Mapping]]] = ..., partition_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "items", "cache_salt", "lease_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LEASE_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    items: _containers.RepeatedCompositeFieldContainer[EncodeItem]
    cache_salt: str
    lease_key: str
    def __init__(self, request_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[EncodeItem, _Mapping]]] = ..., cache_salt: _Optional[str] = ..., lease_key: _Optional[str] = ...) -> None: ...

class EncodedItem(_message.Message):
    __slots__ = ("content_hash", "rows", "deepstack", "partition_indices", "cache_hit")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DEEPSTACK_FIELD_NUMBER: _ClassVar[int]
    PARTITION_INDICES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    content_hash: bytes
    rows: _tensor_pb2.TensorRef
    deepstack: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorRef]
    partition_indices: _containers.RepeatedScalarFieldContainer[int]
    cache_hit: bool
    def __init__(self, content_hash: _Optional[bytes] = ..., rows: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., deepstack: _Optional[_Iterable[_Union[_tensor_pb2.TensorRef, _Mapping]]] = ..., partition_indices: _Optional[_Iterable[int]] = ..., cache_hit: _Optional[bool] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[EncodedItem]
    def __init__(self, items: _Optional[_Iterable[_Union[EncodedItem, _Mapping]]] = ...) -> None: ...

class ReleaseEmbeddingsRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseEmbeddingsResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...
