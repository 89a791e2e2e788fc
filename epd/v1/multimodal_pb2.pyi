from epd.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    MODALITY_IMAGE: _ClassVar[Modality]
    MODALITY_VIDEO: _ClassVar[Modality]
    MODALITY_AUDIO: _ClassVar[Modality]
MODALITY_UNSPECIFIED: Modality
MODALITY_IMAGE: Modality
MODALITY_VIDEO: Modality
MODALITY_AUDIO: Modality

class ItemPartition(_message.Message):
    __slots__ = ("input_start", "input_end", "output_rows", "content_hash")
    INPUT_START_FIELD_NUMBER: _ClassVar[int]
    INPUT_END_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_ROWS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    input_start: int
    input_end: int
    output_rows: int
    content_hash: bytes
    def __init__(self, input_start: _Optional[int] = ..., input_end: _Optional[int] = ..., output_rows: _Optional[int] = ..., content_hash: _Optional[bytes] = ...) -> None: ...

class MultimodalItemMetadata(_message.Message):
    __slots__ = ("modality", "payload_index", "partitions", "encoder_cost", "grid_thw", "frame_timestamps", "partition_keys")
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_INDEX_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_COST_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    FRAME_TIMESTAMPS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_KEYS_FIELD_NUMBER: _ClassVar[int]
    modality: Modality
    payload_index: int
    partitions: _containers.RepeatedCompositeFieldContainer[ItemPartition]
    encoder_cost: float
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    frame_timestamps: _containers.RepeatedScalarFieldContainer[float]
    partition_keys: bool
    def __init__(self, modality: _Optional[_Union[Modality, str]] = ..., payload_index: _Optional[int] = ..., partitions: _Optional[_Iterable[_Union[ItemPartition, _Mapping]]] = ..., encoder_cost: _Optional[float] = ..., grid_thw: _Optional[_Iterable[int]] = ..., frame_timestamps: _Optional[_Iterable[float]] = ..., partition_keys: _Optional[bool] = ...) -> None: ...

class ItemEmbedding(_message.Message):
    __slots__ = ("item_index", "rows", "deepstack", "partition_start", "partition_end")
    ITEM_INDEX_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DEEPSTACK_FIELD_NUMBER: _ClassVar[int]
    PARTITION_START_FIELD_NUMBER: _ClassVar[int]
    PARTITION_END_FIELD_NUMBER: _ClassVar[int]
    item_index: int
    rows: _tensor_pb2.TensorRef
    deepstack: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorRef]
    partition_start: int
    partition_end: int
    def __init__(self, item_index: _Optional[int] = ..., rows: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., deepstack: _Optional[_Iterable[_Union[_tensor_pb2.TensorRef, _Mapping]]] = ..., partition_start: _Optional[int] = ..., partition_end: _Optional[int] = ...) -> None: ...

class MultimodalParams(_message.Message):
    __slots__ = ("mm_hashes", "mm_positions", "mm_lengths", "mm_uuids", "version", "item_run_cu_offsets", "run_positions", "run_lengths", "items", "embeddings", "mrope_position_delta")
    MM_HASHES_FIELD_NUMBER: _ClassVar[int]
    MM_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    MM_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    MM_UUIDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ITEM_RUN_CU_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    RUN_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    RUN_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    MROPE_POSITION_DELTA_FIELD_NUMBER: _ClassVar[int]
    mm_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    mm_positions: _containers.RepeatedScalarFieldContainer[int]
    mm_lengths: _containers.RepeatedScalarFieldContainer[int]
    mm_uuids: _containers.RepeatedScalarFieldContainer[str]
    version: int
    item_run_cu_offsets: _containers.RepeatedScalarFieldContainer[int]
    run_positions: _containers.RepeatedScalarFieldContainer[int]
    run_lengths: _containers.RepeatedScalarFieldContainer[int]
    items: _containers.RepeatedCompositeFieldContainer[MultimodalItemMetadata]
    embeddings: _containers.RepeatedCompositeFieldContainer[ItemEmbedding]
    mrope_position_delta: int
    def __init__(self, mm_hashes: _Optional[_Iterable[bytes]] = ..., mm_positions: _Optional[_Iterable[int]] = ..., mm_lengths: _Optional[_Iterable[int]] = ..., mm_uuids: _Optional[_Iterable[str]] = ..., version: _Optional[int] = ..., item_run_cu_offsets: _Optional[_Iterable[int]] = ..., run_positions: _Optional[_Iterable[int]] = ..., run_lengths: _Optional[_Iterable[int]] = ..., items: _Optional[_Iterable[_Union[MultimodalItemMetadata, _Mapping]]] = ..., embeddings: _Optional[_Iterable[_Union[ItemEmbedding, _Mapping]]] = ..., mrope_position_delta: _Optional[int] = ...) -> None: ...
