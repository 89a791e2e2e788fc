"""The epd.v1 protocol: buf lint (STANDARD), buf breaking against the committed v1 image
(kept current: it holds every element of the protos), and committed generated code that
matches the .proto sources."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
IMAGE = PROTOS / "images" / "epd-v1.binpb"


def buf() -> str:
    path = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    if not Path(path).exists():
        pytest.fail("buf is not installed: `pip install -e .[dev]` installs it (buf-bin)")
    return path


def run_buf(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([buf(), *args], cwd=PROTOS, capture_output=True, text=True, timeout=120)


def test_buf_lint_standard() -> None:
    result = run_buf("lint")
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_breaking_against_v1_image() -> None:
    assert IMAGE.exists(), "the committed v1 image is missing"
    result = run_buf("breaking", "--against", str(IMAGE))
    assert result.returncode == 0, result.stdout + result.stderr


def elements(image: Path) -> set[str]:
    """Every file, message, field (number, name, label, type), enum value and method of a
    buf image (wire-compatible with a FileDescriptorSet), one string each."""
    from google.protobuf import descriptor_pb2

    files = descriptor_pb2.FileDescriptorSet.FromString(image.read_bytes()).file
    found: set[str] = set()

    def message(prefix: str, m: descriptor_pb2.DescriptorProto) -> None:
        name = f"{prefix}.{m.name}"
        found.add(f"message {name}")
        for f in m.field:
            oneof = m.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else ""
            found.add(f"field {name} {f.number} {f.name} {f.label} {f.type} {f.type_name} {oneof}")
        for nested in m.nested_type:
            message(name, nested)
        for e in m.enum_type:
            enum(name, e)

    def enum(prefix: str, e: descriptor_pb2.EnumDescriptorProto) -> None:
        found.update(f"enum {prefix}.{e.name} {v.number} {v.name}" for v in e.value)

    for file in files:
        if not file.name.startswith("epd/"):
            continue  # imports (google/protobuf/...)
        found.add(f"file {file.name}")
        for m in file.message_type:
            message(file.package, m)
        for e in file.enum_type:
            enum(file.package, e)
        for service in file.service:
            for method in service.method:
                found.add(
                    f"rpc {file.package}.{service.name}.{method.name} {method.input_type} "
                    f"{method.output_type} {method.client_streaming} {method.server_streaming}"
                )
    return found


def test_the_v1_image_is_current(tmp_path: Path) -> None:
    # The image was committed once, early, and never refreshed: `buf breaking` compares
    # only what a baseline holds, so a removed or renumbered field added since (KvHandle's
    # digests and signature, partition_keys, all of AdminService) passed unnoticed.
    current = tmp_path / "current.binpb"
    run = run_buf("build", "--exclude-source-info", "-o", str(current))
    assert run.returncode == 0, run.stdout + run.stderr
    now, committed = elements(current), elements(IMAGE)
    assert len(now) > 300  # the parse found the protocol
    missing = sorted(now - committed)
    assert not missing, f"the image lacks {missing[:10]}...: run scripts/gen_protos.py"
    gone = sorted(committed - now)
    assert not gone, f"the image holds {gone[:10]}, gone from the protos: run gen_protos.py"


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    # protoc runs in a child process: grpc_tools' compiler and nixl's bundled libraries
    # crash when loaded into one process.
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    fresh = {p.name: p.read_text() for p in (tmp_path / "epd" / "v1").glob("*_pb2*.py*")}
    committed = {p.name: p.read_text() for p in (ROOT / "epd" / "v1").glob("*_pb2*.py*")}
    assert set(fresh) == set(committed), "generated file set differs; run scripts/gen_protos.py"
    stale = sorted(name for name in fresh if fresh[name] != committed[name])
    assert not stale, f"stale generated code: {stale}; run scripts/gen_protos.py"


def test_every_rpc_has_its_own_messages() -> None:
    from epd.v1 import (
        admin_service_pb2,
        decode_service_pb2,
        encoder_service_pb2,
        prefill_service_pb2,
        registry_service_pb2,
        router_service_pb2,
    )

    seen: set[str] = set()
    for module in (
        admin_service_pb2,
        encoder_service_pb2,
        prefill_service_pb2,
        decode_service_pb2,
        router_service_pb2,
        registry_service_pb2,
    ):
        for service in module.DESCRIPTOR.services_by_name.values():
            assert service.full_name.startswith("epd.v1.")
            for method in service.methods:
                assert method.input_type.name == f"{method.name}Request"
                assert method.output_type.name == f"{method.name}Response"
                for name in (method.input_type.full_name, method.output_type.full_name):
                    assert name not in seen
                    seen.add(name)
    assert {"epd.v1.DecodeResponse", "epd.v1.GenerateResponse"} <= seen


# Fields deleted from the protocol: (message, number, name). Both stay reserved forever, so
# neither is reused with another meaning (`buf breaking` only lets a deletion through then).
DELETED_FIELDS = [("epd.v1.DecodeResponse", 2, "text")]


@pytest.mark.parametrize(("message", "number", "name"), DELETED_FIELDS)
def test_deleted_fields_keep_number_and_name_reserved(message: str, number: int, name: str) -> None:
    from google.protobuf import descriptor_pb2, descriptor_pool

    import epd.v1.decode_service_pb2  # noqa: F401  (registers the descriptors)

    descriptor = descriptor_pool.Default().FindMessageTypeByName(message)
    assert number not in descriptor.fields_by_number and name not in descriptor.fields_by_name
    proto = descriptor_pb2.DescriptorProto()
    descriptor.CopyToProto(proto)
    assert any(r.start <= number < r.end for r in proto.reserved_range), f"{number} not reserved"
    assert name in proto.reserved_name, f"{name!r} not reserved"
