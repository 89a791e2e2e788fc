"""Conversion between in-process data types and the `epd.v1` protobuf messages.

Everything that crosses a gRPC boundary passes through here, so validation happens once,
at the edge: a malformed message raises `FieldError` (a `ValueError`) naming the wire field,
`MultimodalLayoutError` (its subclass, naming the item too) for the multimodal fields, and
the servers turn that into `INVALID_ARGUMENT`. Sampling's wire form is `common.wire.sampling`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Final

import torch

from common.errors import FieldError
from common.multimodal.params import (
    ItemEmbedding,
    ItemPartition,
    Modality,
    MultimodalItemMetadata,
    MultimodalParams,
)
from common.multimodal.validation import MultimodalLayoutError, validate_flat
from epd.v1 import multimodal_pb2, tensor_pb2

_MAX_INT64: Final = 2**63 - 1
MAX_DIMS: Final = 8  # dimensions of a tensor sent inline (pixel rows and embeddings have 2)

RUN_EXTENSION_VERSION = 1

_DTYPES: dict[torch.dtype, tensor_pb2.ElementType] = {
    torch.float32: tensor_pb2.ELEMENT_TYPE_FLOAT32,
    torch.float16: tensor_pb2.ELEMENT_TYPE_FLOAT16,
    torch.bfloat16: tensor_pb2.ELEMENT_TYPE_BFLOAT16,
    torch.int64: tensor_pb2.ELEMENT_TYPE_INT64,
    torch.int32: tensor_pb2.ELEMENT_TYPE_INT32,
    torch.uint8: tensor_pb2.ELEMENT_TYPE_UINT8,
}
_TORCH_DTYPES: dict[int, torch.dtype] = {int(v): k for k, v in _DTYPES.items()}
_MODALITIES = {
    Modality.IMAGE: multimodal_pb2.MODALITY_IMAGE,
    Modality.VIDEO: multimodal_pb2.MODALITY_VIDEO,
    Modality.AUDIO: multimodal_pb2.MODALITY_AUDIO,
}
_MODALITY_NAMES = {v: k for k, v in _MODALITIES.items()}
# Element types an embedding may have: the models' floating dtypes.
_EMBEDDING_TYPES = frozenset(
    {
        tensor_pb2.ELEMENT_TYPE_FLOAT32,
        tensor_pb2.ELEMENT_TYPE_FLOAT16,
        tensor_pb2.ELEMENT_TYPE_BFLOAT16,
    }
)


def element_type(dtype: torch.dtype) -> tensor_pb2.ElementType:
    """The wire element type of a torch dtype."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no wire element type") from None


def torch_dtype(element: int, field: str = "dtype") -> torch.dtype:
    """The torch dtype of a wire element type; `FieldError` naming `field` if unknown."""
    try:
        return _TORCH_DTYPES[element]
    except KeyError:
        raise FieldError(field, f"unknown element type {element}") from None


def tensor_to_ref(tensor: torch.Tensor) -> tensor_pb2.TensorRef:
    """A tensor as an inline `TensorRef` (C-contiguous little-endian bytes)."""
    return fill_ref(tensor_pb2.TensorRef(), tensor)


def fill_ref(ref: tensor_pb2.TensorRef, tensor: torch.Tensor) -> tensor_pb2.TensorRef:
    """`ref` (e.g. a field of a message being built) set to `tensor` inline; `ref`. Filling
    the field in place spares the copy that assigning a made `TensorRef` to it takes (a
    video's pixels are tens of megabytes)."""
    t = tensor.detach().to("cpu").contiguous()
    raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    ref.dtype = element_type(t.dtype)
    ref.shape[:] = t.shape
    ref.inline_data = raw.numpy().tobytes() if t.numel() else b""
    return ref


def shape_fits(shape: tuple[int, ...] | list[int], itemsize: int) -> bool:
    """Whether a tensor of `shape` (no negative dimension) can be made: its bytes, counting
    a zero dimension as one (its strides still multiply the others), fit in int64. An empty
    tensor whose other dimensions are huge would otherwise fail inside torch."""
    return math.prod(max(d, 1) for d in shape) * itemsize <= _MAX_INT64


def tensor_from_ref(ref: tensor_pb2.TensorRef, field: str = "tensor") -> torch.Tensor:
    """The tensor of an inline `TensorRef`; a transfer handle needs a transfer agent.

    Raises `MultimodalLayoutError` naming `field`: the tensors sent inline are multimodal
    (embeddings, pixel values), and their callers add the item to that kind.
    """
    try:
        dtype = torch_dtype(ref.dtype, field)
    except FieldError as exc:
        raise MultimodalLayoutError(field, exc.reason) from None
    kind = ref.WhichOneof("data")
    if kind != "inline_data":
        says = "holds no data" if kind is None else "holds a transfer handle, not inline data"
        raise MultimodalLayoutError(field, says)
    if len(ref.shape) > MAX_DIMS:  # before a tuple, a reshape and a message of millions
        raise MultimodalLayoutError(field, f"{len(ref.shape)} dimensions, at most {MAX_DIMS}")
    shape = tuple(int(d) for d in ref.shape)
    if any(d < 0 for d in shape):
        raise MultimodalLayoutError(field, f"negative dimension in shape {shape}")
    if not shape_fits(shape, dtype.itemsize):
        raise MultimodalLayoutError(field, f"shape {shape} is too large")
    itemsize = dtype.itemsize
    numel = math.prod(shape)
    data = ref.inline_data  # a copy on every read (upb): read once
    if len(data) != numel * itemsize:
        raise MultimodalLayoutError(field, f"{len(data)} bytes for shape {shape} of {dtype}")
    if not numel:
        return torch.empty(shape, dtype=dtype)
    # One more copy, into memory the tensor owns and may write (bytes are immutable).
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def inline_bytes(refs: Iterable[tensor_pb2.TensorRef]) -> int:
    """Serialized bytes of those of `refs` that hold their data inline (handles count 0):
    the data plus a few bytes of dtype and shape, so at least the data's length. Read
    without copying the data, as reading `inline_data` would (megabytes a request for a
    video's embeddings)."""
    return sum(ref.ByteSize() for ref in refs if ref.WhichOneof("data") == "inline_data")


def params_to_proto(params: MultimodalParams) -> multimodal_pb2.MultimodalParams:
    """The wire form: legacy flat arrays, run extension, item metadata, embeddings."""
    msg = multimodal_pb2.MultimodalParams(
        mm_hashes=params.hashes,
        mm_positions=params.positions,
        mm_lengths=params.lengths,
        mm_uuids=[u or "" for u in params.uuids] if any(params.uuids) else [],
        version=RUN_EXTENSION_VERSION,
        item_run_cu_offsets=params.item_run_cu_offsets.tolist(),
        run_positions=params.run_positions.tolist(),
        run_lengths=params.run_lengths.tolist(),
    )
    for item in params.items:
        meta = msg.items.add(
            modality=_MODALITIES.get(item.modality, multimodal_pb2.MODALITY_UNSPECIFIED)
            if item.modality is not None
            else multimodal_pb2.MODALITY_UNSPECIFIED,
            payload_index=item.payload_index,
            grid_thw=list(item.grid_thw or ()),
            frame_timestamps=list(item.frame_timestamps),
            partition_keys=item.partition_keys,
        )
        if item.encoder_cost is not None:
            meta.encoder_cost = item.encoder_cost
        for part in item.partitions:
            meta.partitions.add(
                input_start=part.input_start,
                input_end=part.input_end,
                output_rows=part.output_rows,
                content_hash=part.content_hash,
            )
    for index in sorted(params.embeddings):
        emb = params.embeddings[index]
        out = msg.embeddings.add(item_index=index)
        fill_ref(out.rows, emb.rows)
        for layer in emb.deepstack:
            fill_ref(out.deepstack.add(), layer)
    if params.mrope_position_delta is not None:
        msg.mrope_position_delta = params.mrope_position_delta
    return msg


# `resolve(ref, field)`: the tensor a transfer handle holds (a worker's NIXL pull), of the
# ref's declared element type and shape (already checked when it is called).
TensorResolver = Callable[[tensor_pb2.TensorRef, str], torch.Tensor]


def params_from_proto(
    msg: multimodal_pb2.MultimodalParams,
    *,
    with_embeddings: bool = True,
    resolve: TensorResolver | None = None,
    num_tokens: int | None = None,
) -> MultimodalParams:
    """Validate and decode the wire form. A message without the run extension (version 0)
    decodes to the legacy contiguous layout. Raises `MultimodalLayoutError`. `num_tokens`
    (the prompt's length, when the caller has it) bounds the items before any is read.

    Embeddings held inline are decoded here; ones held by a transfer handle are passed to
    `resolve(ref, field)` (a worker's NIXL pull), and are an error without it. The layout is
    validated before any tensor is pulled.
    """
    if num_tokens is not None and len(msg.mm_hashes) > num_tokens:
        raise MultimodalLayoutError(
            "mm_hashes", f"{len(msg.mm_hashes)} items for a prompt of {num_tokens} tokens"
        )
    has_runs = bool(msg.item_run_cu_offsets or msg.run_positions or msg.run_lengths)
    if msg.version > RUN_EXTENSION_VERSION:
        raise MultimodalLayoutError(
            "version",
            f"run extension version {msg.version} is newer than this reader's "
            f"{RUN_EXTENSION_VERSION}",
        )
    if msg.version == 0 and has_runs:
        raise MultimodalLayoutError("version", "run fields are set but version is 0")
    n = len(msg.mm_hashes)
    uuids = [u or None for u in msg.mm_uuids] if msg.mm_uuids else None
    hashes, positions, lengths = list(msg.mm_hashes), list(msg.mm_positions), list(msg.mm_lengths)
    if msg.version >= 1:
        run_fields = {
            "item_run_cu_offsets": list(msg.item_run_cu_offsets),
            "run_positions": list(msg.run_positions),
            "run_lengths": list(msg.run_lengths),
        }
        for name, values in run_fields.items():
            if n and not values:
                raise MultimodalLayoutError(name, "missing; run extension version 1 needs it")
        runs = validate_flat(
            hashes,
            positions,
            lengths,
            uuids,
            run_fields["item_run_cu_offsets"] or [0],
            run_fields["run_positions"],
            run_fields["run_lengths"],
        )
    else:
        runs = validate_flat(hashes, positions, lengths, uuids, None, None, None)
    if msg.items and len(msg.items) != n:
        raise MultimodalLayoutError("items", f"has {len(msg.items)} entries, mm_hashes has {n}")
    items = []
    for i in range(n):
        meta = msg.items[i] if msg.items else multimodal_pb2.MultimodalItemMetadata()
        items.append(_item_from_proto(i, meta, bytes(msg.mm_hashes[i]), runs[i], uuids))
    embeddings = embeddings_from_proto(msg, items, resolve) if with_embeddings else {}
    delta = msg.mrope_position_delta if msg.HasField("mrope_position_delta") else None
    return MultimodalParams(tuple(items), embeddings, delta)


def _item_from_proto(
    index: int,
    meta: multimodal_pb2.MultimodalItemMetadata,
    content_hash: bytes,
    runs: tuple[tuple[int, int], ...],
    uuids: list[str | None] | None,
) -> MultimodalItemMetadata:
    known = meta.modality in _MODALITY_NAMES or meta.modality == multimodal_pb2.MODALITY_UNSPECIFIED
    if not known:
        raise MultimodalLayoutError("items.modality", f"unknown modality {meta.modality}", index)
    if meta.grid_thw and len(meta.grid_thw) != 3:
        raise MultimodalLayoutError("items.grid_thw", "must have 3 entries or none", index)
    if any(g < 1 for g in meta.grid_thw):
        # (-4, -2, 2) "holds" 4 tokens, and positioning its frames never ended.
        raise MultimodalLayoutError(
            "items.grid_thw", f"{list(meta.grid_thw)}: every entry must be at least 1", index
        )
    # Counts bounded before anything is built of them: a peer's message of a million
    # partitions for an item of one row walked them all (seconds of a worker's event loop).
    rows = sum(length for _, length in runs)
    if len(meta.partitions) > rows:
        raise MultimodalLayoutError(
            "items.partitions", f"{len(meta.partitions)} for an item of {rows} rows", index
        )
    if meta.grid_thw and len(meta.frame_timestamps) > meta.grid_thw[0]:
        raise MultimodalLayoutError(
            "items.frame_timestamps",
            f"{len(meta.frame_timestamps)} for {meta.grid_thw[0]} temporal patches",
            index,
        )
    partitions = []
    for part in meta.partitions:
        if not (0 <= part.input_start <= part.input_end) or part.output_rows < 0:
            raise MultimodalLayoutError("items.partitions", "bad input slice or rows", index)
        partitions.append(
            ItemPartition(part.input_start, part.input_end, part.output_rows, part.content_hash)
        )
    grid = tuple(int(g) for g in meta.grid_thw)
    item = MultimodalItemMetadata(
        content_hash=content_hash,
        runs=runs,
        modality=_MODALITY_NAMES.get(meta.modality),
        payload_index=meta.payload_index,
        uuid=uuids[index] if uuids else None,
        partitions=tuple(partitions),
        encoder_cost=meta.encoder_cost if meta.HasField("encoder_cost") else None,
        grid_thw=(grid[0], grid[1], grid[2]) if grid else None,
        frame_timestamps=tuple(meta.frame_timestamps),
        partition_keys=meta.partition_keys,
    )
    item.check_partitions(index)
    return item


def embeddings_by_item(
    embeddings: Iterable[multimodal_pb2.ItemEmbedding], count: int
) -> dict[int, multimodal_pb2.ItemEmbedding]:
    """`embeddings` (each of a whole item) by item index, for a message of `count` items.
    Raises `MultimodalLayoutError` for an index with no item or one given twice: a dropped
    duplicate's transfer handle would never be pulled nor its lease released."""
    out: dict[int, multimodal_pb2.ItemEmbedding] = {}
    for emb in embeddings:
        index = emb.item_index
        if index >= count or index in out:
            raise MultimodalLayoutError("embeddings.item_index", "no such item or repeated", index)
        out[index] = emb
    return out


def embeddings_from_proto(
    msg: multimodal_pb2.MultimodalParams,
    items: list[MultimodalItemMetadata],
    resolve: TensorResolver | None,
    *,
    width: int | None = None,
    depth: int | None = None,
) -> dict[int, ItemEmbedding]:
    """The embeddings a message carries, by item index, checked against `items` (inline
    tensors decoded here, NIXL-held ones through `resolve`). Raises MultimodalLayoutError
    naming the field.

    Every embedding's declared shapes and element types are checked from the wire fields
    before any tensor is decoded or pulled (a pull allocates the declared shape), and every
    value is finite once it is (a caller's NaN would compute KV that enters the prefix
    cache; finite junk is the sender's to answer for, DESIGN §7): rows
    `[item length, width]`, `depth` deepstack tensors each of the rows' shape, floating
    element types. `width` and `depth` are the model's (`None`: any width, any depth).
    """
    given = embeddings_by_item(msg.embeddings, len(items))
    for index, emb in given.items():
        _check_declared(emb, items[index].length, width, depth)

    def tensor(ref: tensor_pb2.TensorRef, field: str, index: int) -> torch.Tensor:
        if ref.WhichOneof("data") == "handle" and resolve is not None:
            out = resolve(ref, field)
        else:
            out = tensor_from_ref(ref, field)
        if not bool(torch.isfinite(out).all()):  # their KV would enter the prefix cache
            raise MultimodalLayoutError(field, "holds NaN or infinite values", index)
        return out

    return {
        index: ItemEmbedding(
            tensor(emb.rows, "embeddings.rows", index),
            tuple(tensor(d, "embeddings.deepstack", index) for d in emb.deepstack),
        )
        for index, emb in given.items()
    }


def _check_declared(
    emb: multimodal_pb2.ItemEmbedding, length: int, width: int | None, depth: int | None
) -> None:
    """Raise `MultimodalLayoutError` unless `emb`'s wire shapes and element types fit an
    item of `length` rows and a model of `width` and `depth` (see `embeddings_from_proto`)."""
    index = emb.item_index
    if len(emb.rows.shape) != 2:
        raise MultimodalLayoutError(
            "embeddings.rows", f"{len(emb.rows.shape)} dimensions, the item needs 2", index
        )
    rows = tuple(emb.rows.shape)
    if rows[0] != length or rows[1] < 0 or (width is not None and rows[1] != width):
        want = f"[{length}, {'width' if width is None else width}]"
        raise MultimodalLayoutError(
            "embeddings.rows", f"shape {list(rows)}, the item needs {want}", index
        )
    if depth is not None and len(emb.deepstack) != depth:
        raise MultimodalLayoutError(
            "embeddings.deepstack", f"{len(emb.deepstack)} layers, the model has {depth}", index
        )
    for layer, ref in enumerate(emb.deepstack):
        if len(ref.shape) != 2 or tuple(ref.shape) != rows:
            shape = list(ref.shape) if len(ref.shape) <= MAX_DIMS else f"{len(ref.shape)}-D"
            raise MultimodalLayoutError(
                "embeddings.deepstack",
                f"layer {layer} has shape {shape}, the rows {list(rows)}",
                index,
            )
    refs = [("embeddings.rows", emb.rows)] + [("embeddings.deepstack", d) for d in emb.deepstack]
    for field, ref in refs:
        if ref.dtype not in _EMBEDDING_TYPES:
            name = (
                tensor_pb2.ElementType.Name(ref.dtype) if ref.dtype in _TORCH_DTYPES else ref.dtype
            )
            raise MultimodalLayoutError(
                field, f"element type {name} is not a floating type a model takes", index
            )
