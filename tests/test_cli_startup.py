"""The `epd` admin and client commands start without torch, ray or transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "ray", "transformers")


def _imported(code: str) -> set[str]:
    """The top-level modules a fresh interpreter imports running `code` (-X importtime)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = set()
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["status", "--help"], ["scale", "--help"], ["drain", "--help"]],
)
def test_cli_help_does_not_import_heavy_modules(argv: list[str]) -> None:
    code = f"from cluster.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass"
    imported = _imported(code)
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_admin_commands_do_not_import_heavy_modules() -> None:
    # What cmd_status / cmd_scale / cmd_drain import when they run.
    code = (
        "import cluster.cli, cluster.admin, common.server.credentials, common.server.rpc, "
        "common.settings.api_keys, common.wire.roles, epd.v1.admin_service_pb2_grpc"
    )
    imported = _imported(code)
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_generate_path_does_not_import_heavy_modules() -> None:
    code = "import cluster.cli, epd.client, common.sampling, common.wire.sampling"
    imported = _imported(code)
    assert not imported & {*HEAVY, "numpy", "PIL"}, sorted(imported & {*HEAVY, "numpy", "PIL"})
