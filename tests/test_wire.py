"""Wire form of MultimodalParams: round trips, legacy compatibility, validation at decode."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from common.errors import FieldError
from common.multimodal.params import (
    ItemEmbedding,
    ItemPartition,
    Modality,
    MultimodalItemMetadata,
    MultimodalParams,
)
from common.multimodal.validation import MultimodalLayoutError
from common.wire.convert import params_from_proto, params_to_proto, tensor_from_ref, tensor_to_ref
from epd.v1 import multimodal_pb2, tensor_pb2

LEGACY_PROTO = Path(__file__).parent / "data" / "legacy" / "epd_legacy.proto"
HA, HB = b"\xaa" * 32, b"\xbb" * 32


@pytest.fixture(scope="module")
def legacy(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """The frozen legacy-only schema, compiled with protoc into a temporary module."""
    out = tmp_path_factory.mktemp("legacy")
    # protoc runs in a child process: grpc_tools' compiler and nixl's bundled libraries
    # crash when loaded into one process.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{LEGACY_PROTO.parent}",
            f"--python_out={out}",
            LEGACY_PROTO.name,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module("epd_legacy_pb2")
    finally:
        sys.path.remove(str(out))


def video_and_image() -> MultimodalParams:
    video = MultimodalItemMetadata(
        content_hash=HA,
        runs=((3, 4), (10, 4)),
        modality=Modality.VIDEO,
        payload_index=0,
        uuid="clip-1",
        partitions=(
            ItemPartition(0, 16, 4, b"\x01" * 32),
            ItemPartition(16, 32, 4, b"\x02" * 32),
        ),
        encoder_cost=2.5,
        grid_thw=(2, 4, 4),
        frame_timestamps=(0.5, 1.5),
        partition_keys=True,
    )
    image = MultimodalItemMetadata(
        content_hash=HB,
        runs=((16, 2),),
        modality=Modality.IMAGE,
        payload_index=1,
        grid_thw=(1, 2, 4),
    )
    embeddings = {
        0: ItemEmbedding(torch.randn(8, 6), (torch.randn(8, 6), torch.randn(8, 6))),
        1: ItemEmbedding(torch.randn(2, 6).to(torch.bfloat16)),
    }
    return MultimodalParams.from_items([video, image], embeddings, mrope_position_delta=-5)


def test_round_trip_python_proto_python() -> None:
    params = video_and_image()
    msg = params_to_proto(params)
    assert msg.version == 1
    back = params_from_proto(multimodal_pb2.MultimodalParams.FromString(msg.SerializeToString()))
    assert back.items == params.items
    assert back.mrope_position_delta == -5
    for index, emb in params.embeddings.items():
        got = back.embeddings[index]
        assert torch.equal(got.rows, emb.rows) and got.rows.dtype == emb.rows.dtype
        assert len(got.deepstack) == len(emb.deepstack)
        assert all(torch.equal(a, b) for a, b in zip(got.deepstack, emb.deepstack, strict=True))


def test_round_trip_proto_python_proto() -> None:
    msg = params_to_proto(video_and_image())
    again = params_to_proto(params_from_proto(msg))
    assert again.SerializeToString(deterministic=True) == msg.SerializeToString(deterministic=True)
    assert MultimodalParams.from_proto(msg).to_proto() == msg


def test_flat_arrays_on_the_wire() -> None:
    msg = params_to_proto(video_and_image())
    assert list(msg.mm_positions) == [3, 16]
    assert list(msg.mm_lengths) == [8, 2]
    assert list(msg.mm_uuids) == ["clip-1", ""]
    assert list(msg.item_run_cu_offsets) == [0, 2, 3]
    assert list(msg.run_positions) == [3, 10, 16]
    assert list(msg.run_lengths) == [4, 4, 2]


def test_partition_keys_on_the_wire() -> None:
    msg = params_to_proto(video_and_image())
    assert [meta.partition_keys for meta in msg.items] == [True, False]
    assert [item.partition_keys for item in params_from_proto(msg).items] == [True, False]


def test_legacy_message_decodes_to_contiguous_runs(legacy: ModuleType) -> None:
    old = legacy.MultimodalParams(
        mm_hashes=[HA, HB], mm_positions=[2, 9], mm_lengths=[5, 3], mm_uuids=["x", ""]
    )
    msg = multimodal_pb2.MultimodalParams.FromString(old.SerializeToString())
    params = params_from_proto(msg)
    assert [item.runs for item in params.items] == [((2, 5),), ((9, 3),)]
    assert [item.uuid for item in params.items] == ["x", None]
    assert all(item.modality is None for item in params.items)


def test_extension_still_parses_under_legacy_schema(legacy: ModuleType) -> None:
    data = params_to_proto(video_and_image()).SerializeToString()
    old = legacy.MultimodalParams.FromString(data)
    assert list(old.mm_hashes) == [HA, HB]
    assert list(old.mm_positions) == [3, 16]
    assert list(old.mm_lengths) == [8, 2]
    assert list(old.mm_uuids) == ["clip-1", ""]
    # a legacy relay keeps the unknown extension fields and passes them on intact
    relayed = multimodal_pb2.MultimodalParams.FromString(old.SerializeToString())
    assert params_from_proto(relayed).items == video_and_image().items


def _nan(rows: int, width: int) -> torch.Tensor:
    out = torch.randn(rows, width)
    out[rows // 2, width // 2] = float("nan")
    return out


def _move_cut(item: multimodal_pb2.MultimodalItemMetadata, cut: int) -> None:
    """The cut between the item's two partitions moved to input row `cut`."""
    item.partitions[0].input_end = item.partitions[1].input_start = cut


def _move_rows(item: multimodal_pb2.MultimodalItemMetadata, rows: int) -> None:
    """`rows` output rows moved from the item's first partition to its second."""
    item.partitions[0].output_rows -= rows
    item.partitions[1].output_rows += rows


def _image_keyed_by_partition(item: multimodal_pb2.MultimodalItemMetadata) -> None:
    t, h, w = item.grid_thw
    part = item.partitions.add(input_start=0, input_end=t * h * w, content_hash=b"p" * 32)
    part.output_rows = t * h * w // 4
    item.partition_keys = True


def base_message() -> multimodal_pb2.MultimodalParams:
    return params_to_proto(video_and_image())


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda m: m.ClearField("run_lengths"), "run_lengths"),
        (lambda m: m.ClearField("item_run_cu_offsets"), "item_run_cu_offsets"),
        (lambda m: m.run_lengths.__setitem__(0, 3), "run_lengths"),
        (lambda m: setattr(m, "version", 0), "version"),
        (lambda m: setattr(m, "version", 2), "version"),
        (lambda m: m.mm_lengths.append(3), "mm_lengths"),
        (lambda m: m.items.pop(), "items"),
        (lambda m: m.items[0].grid_thw.append(1), "items.grid_thw"),
        (lambda m: m.items[0].partitions[0].__setattr__("output_rows", 5), "items.partitions"),
        (lambda m: m.items[0].partitions[0].__setattr__("content_hash", b"x"), "items.partitions"),
        (lambda m: m.items[0].partitions[1].__setattr__("input_start", 17), "items.partitions"),
        # Inputs past the grid's patch rows (split for prefill, 2**40 rows made a grid
        # protobuf could not hold), or not on a frame of it.
        (lambda m: m.items[0].partitions[1].__setattr__("input_end", 2**40), "items.partitions"),
        (lambda m: _move_cut(m.items[0], 17), "items.partitions"),
        # Rows moved between partitions (the sum kept): each would key the other's rows.
        (lambda m: _move_rows(m.items[0], 1), "items.partitions"),
        (lambda m: m.items[1].__setattr__("partition_keys", True), "items.partition_keys"),
        # Partition keys on an image (one partition of all its rows): the rule is a video's.
        (lambda m: _image_keyed_by_partition(m.items[1]), "items.partition_keys"),
        (lambda m: m.embeddings[0].rows.shape.__setitem__(0, 7), "embeddings.rows"),
        (lambda m: setattr(m.embeddings[1], "item_index", 5), "embeddings.item_index"),
        (lambda m: setattr(m.embeddings[1].rows, "dtype", 99), "embeddings.rows"),
        # Values that are not finite: their KV would enter the prefix cache.
        (lambda m: m.embeddings[0].rows.CopyFrom(tensor_to_ref(_nan(8, 6))), "embeddings.rows"),
        (
            lambda m: m.embeddings[0].deepstack[1].CopyFrom(tensor_to_ref(_nan(8, 6))),
            "embeddings.deepstack",
        ),
        # A shape of a million dimensions is refused by its count, before it is made.
        (lambda m: m.embeddings[0].rows.shape.extend([1] * 1_000_000), "embeddings.rows"),
        (lambda m: m.embeddings[0].deepstack[0].shape.extend([1] * 10), "embeddings.deepstack"),
    ],
)
def test_malformed_wire_names_field(mutate: object, field: str) -> None:
    msg = base_message()
    mutate(msg)  # type: ignore[operator]
    with pytest.raises(MultimodalLayoutError) as info:
        params_from_proto(msg)
    assert info.value.field == field, str(info.value)


def test_counts_past_what_the_prompt_holds_are_refused_before_they_are_walked() -> None:
    # A million partitions of a one-row item, or 300,000 items, were each walked in Python
    # before anything compared them with the prompt (seconds of a decode worker's loop).
    msg = base_message()
    rows = sum(msg.run_lengths)
    msg.items[1].partitions.add()
    for _ in range(rows):
        msg.items[1].partitions.append(msg.items[1].partitions[0])
    with pytest.raises(MultimodalLayoutError) as info:
        params_from_proto(msg)
    assert info.value.field == "items.partitions" and "for an item of" in str(info.value)
    msg = base_message()
    t = msg.items[0].grid_thw[0]
    msg.items[0].frame_timestamps.extend([0.0] * (t + 1))
    with pytest.raises(MultimodalLayoutError) as info:
        params_from_proto(msg)
    assert info.value.field == "items.frame_timestamps"
    msg = base_message()
    with pytest.raises(MultimodalLayoutError) as info:
        params_from_proto(msg, num_tokens=len(msg.mm_hashes) - 1)
    assert info.value.field == "mm_hashes"


def test_a_tensor_of_too_many_dimensions_is_refused_by_their_count() -> None:
    ref = tensor_to_ref(torch.zeros(1))
    ref.shape[:] = [1] * 5_000_000
    with pytest.raises(MultimodalLayoutError, match="5000000 dimensions, at most 8"):
        tensor_from_ref(ref, "pixel_values")


def test_tensor_ref_round_trip_dtypes() -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32):
        t = (torch.arange(24) - 7).reshape(2, 3, 4).to(dtype)
        back = tensor_from_ref(
            tensor_pb2.TensorRef.FromString(tensor_to_ref(t).SerializeToString())
        )
        assert back.dtype == dtype and torch.equal(back, t)
    empty = tensor_from_ref(tensor_to_ref(torch.empty(0, 4)))
    assert empty.shape == (0, 4)


@pytest.mark.parametrize("grid", [[-4, -2, 2], [4, -2, -2], [2, 0, 4]])
def test_a_grid_with_an_entry_below_one_is_refused_naming_the_field(grid) -> None:
    # (-4, -2, 2) "holds" 4 tokens at merge 2, and positioning its frames never ended (the
    # worker's memory filled); (2, 0, 4) divided by zero splitting partitions.
    msg = params_to_proto(video_and_image())
    msg.items[0].grid_thw[:] = grid
    with pytest.raises(MultimodalLayoutError, match=r"items\.grid_thw \(item 0\)"):
        params_from_proto(msg)


@pytest.mark.parametrize("shape", [[0, 2**62, 2**62], [2**62, 0, 4], [0, 2**63 - 1, 2]])
def test_an_empty_tensor_too_large_to_lay_out_is_refused_naming_the_field(shape) -> None:
    # Zero bytes of data agree with the shape; torch could not make its strides.
    ref = tensor_pb2.TensorRef(dtype=tensor_pb2.ELEMENT_TYPE_UINT8, shape=shape, inline_data=b"")
    with pytest.raises(MultimodalLayoutError, match=r"pixel_values: shape .* is too large"):
        tensor_from_ref(ref, "pixel_values")


def test_sampling_round_trip_and_defaults() -> None:
    from common.sampling import SamplingParams
    from common.wire.sampling import sampling_from_proto, sampling_to_proto
    from epd.v1 import sampling_pb2

    # float32 on the wire: these values are exact in binary
    params = SamplingParams(
        temperature=0.5, top_p=0.75, top_k=5, seed=3, max_tokens=9, stop_token_ids=(4,)
    )
    assert sampling_from_proto(sampling_to_proto(params)) == params
    assert sampling_from_proto(sampling_pb2.SamplingParams()) == SamplingParams()
    # Each names the field at fault, not the whole message (a client could not tell which).
    for bad, field in [
        (sampling_pb2.SamplingParams(temperature=-1.0), "sampling.temperature"),
        (sampling_pb2.SamplingParams(top_p=2.0), "sampling.top_p"),
        (sampling_pb2.SamplingParams(seed=2**63), "sampling.seed"),
        (sampling_pb2.SamplingParams(stop_token_ids=[1] * 1025), "sampling.stop_token_ids"),
    ]:
        with pytest.raises(FieldError) as info:
            sampling_from_proto(bad)
        assert info.value.field == field


def test_filters_turned_off_are_sent_off_not_left_to_the_checkpoint() -> None:
    # A client's SamplingParams is what it asked for: top_p 1.0 and top_k 0 (off) were left
    # unset on the wire, so the router put the checkpoint's generation_config values in
    # (a Qwen3-VL Instruct's top_k 20, top_p 0.8) and a client could not turn them off.
    from common.models.generation import GenerationDefaults
    from common.sampling import SamplingParams
    from common.wire.sampling import sampling_from_proto, sampling_to_proto
    from epd.v1 import sampling_pb2

    checkpoint = GenerationDefaults(top_p=0.8, top_k=20)
    off = SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
    assert sampling_from_proto(sampling_to_proto(off), checkpoint) == off
    # Only a wire message that leaves them unset takes the checkpoint's.
    unset = sampling_from_proto(sampling_pb2.SamplingParams(temperature=1.0), checkpoint)
    assert (unset.top_p, unset.top_k) == (pytest.approx(0.8, rel=1e-7), 20)  # as float32


def test_non_multimodal_fields_raise_the_general_field_error() -> None:
    from common.wire.convert import torch_dtype
    from common.wire.sampling import sampling_from_proto
    from epd.v1 import sampling_pb2

    with pytest.raises(FieldError) as info:
        sampling_from_proto(sampling_pb2.SamplingParams(temperature=-1.0))
    assert info.value.field == "sampling.temperature"
    assert not isinstance(info.value, MultimodalLayoutError)
    with pytest.raises(FieldError, match=r"kv_layout\.dtype: unknown element type 99") as info:
        torch_dtype(99, "kv_layout.dtype")
    assert info.value.field == "kv_layout.dtype"
    assert not isinstance(info.value, MultimodalLayoutError)
    # an inline multimodal tensor keeps the multimodal kind, so its caller can add the item
    with pytest.raises(MultimodalLayoutError, match="pixel_values: unknown element type 99"):
        ref = tensor_pb2.TensorRef(inline_data=b"")
        ref.dtype = 99  # type: ignore[assignment]  # an element type this build lacks
        tensor_from_ref(ref, "pixel_values")


async def test_servers_name_the_field_of_any_field_error() -> None:
    import grpc

    from common.server.rpc import _abort, status_for

    class Context:
        trailing: tuple[tuple[str, str], ...] = ()

        def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
            self.trailing = metadata

        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            self.status = (code, details)

    error = FieldError("sampling", "temperature must be >= 0")
    assert status_for(error) == (grpc.StatusCode.INVALID_ARGUMENT, str(error))
    context = Context()
    await _abort(context, error, "test")
    assert context.status == (grpc.StatusCode.INVALID_ARGUMENT, str(error))
    assert context.trailing == (("epd-field", "sampling"),)
