"""Regenerate the Python bindings of the epd.v1 protocol.

Reads protos/epd/v1/*.proto and writes epd/v1/*_pb2.py, *_pb2.pyi and *_pb2_grpc.py.
The output is committed; `test_generated_code_is_up_to_date` in tests/test_protocol.py
regenerates it into a temporary folder and fails on any difference, so edit the .proto
files and rerun this script.

It also refreshes the committed buf image (protos/images/epd-v1.binpb), the baseline that
`buf breaking` checks the protocol against, once the protos pass that check against it: a
change that breaks wire compatibility is refused here and never becomes the new baseline.
`test_the_v1_image_is_current` fails while the image lacks an element of the protos.

    python scripts/gen_protos.py [--out DIR]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
IMAGE = PROTO_ROOT / "images" / "epd-v1.binpb"


def proto_files() -> list[Path]:
    """The protocol's .proto files, relative to the proto root, in a stable order."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / "epd" / "v1").glob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Run protoc for every .proto file into `out`; return the files written."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    out.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed; see the messages above")
    package = out / "epd" / "v1"
    for init in (out / "epd" / "__init__.py", package / "__init__.py"):
        if not init.exists():
            init.write_text("")
    return sorted(package.glob("*_pb2*.py*"))


def buf() -> str:
    """The buf binary (the dev dependency buf-bin puts it beside the interpreter)."""
    path = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    if not Path(path).exists():
        raise RuntimeError("buf is not installed: `pip install -e .[dev]` installs it (buf-bin)")
    return path


def build_image(out: Path) -> None:
    """`buf build` of the protos into `out`: their messages, fields, enums and services."""
    subprocess.run(
        [buf(), "build", "--exclude-source-info", "-o", str(out)],
        cwd=PROTO_ROOT,
        check=True,
        timeout=120,
    )


def refresh_image() -> None:
    """Make the protos the new `buf breaking` baseline, once they pass it against the old."""
    check = subprocess.run(
        [buf(), "breaking", "--against", str(IMAGE)],
        cwd=PROTO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check.returncode != 0:
        raise RuntimeError(
            "the protos break wire compatibility with the committed image; not refreshing "
            f"it:\n{check.stdout}{check.stderr}"
        )
    build_image(IMAGE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: repo root)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))
    if args.out == ROOT:
        refresh_image()
        print(IMAGE.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
