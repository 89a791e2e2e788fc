"""Offline checks of the deploy/ image: the Dockerfile installs every package of the project
and the pinned torch and Ray (Ray within pyproject's range), and the root .dockerignore keeps
local state out of the build context while letting in everything the Dockerfile copies.
"""

from __future__ import annotations

import re
import stat
import tomllib
from pathlib import Path

import pytest

from tests.test_deploy import DEPLOY, ROOT


def test_dockerfile_installs_the_project() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert text.splitlines()[
        next(i for i, x in enumerate(text.splitlines()) if x.startswith("FROM"))
    ] == ("FROM python:3.11-slim")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch=="))
    assert f"ARG TORCH_VERSION={torch_pin.removeprefix('torch==')}" in text
    assert "download.pytorch.org/whl/${TORCH_INDEX}" in text
    for package in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        folder = package.rstrip("*")
        assert re.search(rf"^COPY {folder} \./{folder}$", text, re.M), f"{folder} not copied"


def _dockerignore_excludes(path: str) -> bool:
    """Whether the root .dockerignore keeps `path` (relative, "/"-separated) out of the build
    context: the last matching pattern wins, a "!" pattern re-includes; a folder's exclusion
    covers what is inside it."""
    import fnmatch

    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        if any(
            fnmatch.fnmatch(p, pattern) or fnmatch.fnmatch(p, pattern.removeprefix("**/"))
            for p in prefixes
        ):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_local_state_out_and_what_the_image_copies_in() -> None:
    for path in (".venv", ".venv/bin/python", ".git", ".git/config", "a.log", "x/y.log"):
        assert _dockerignore_excludes(path), f".dockerignore does not exclude {path}"
    assert _dockerignore_excludes("common/__pycache__/x.cpython-311.pyc")
    copied = re.findall(r"^COPY (.+?) \S+$", (DEPLOY / "Dockerfile").read_text(), re.M)
    sources = [s for line in copied for s in line.split()]
    assert "pyproject.toml" in sources
    for source in sources:
        assert not _dockerignore_excludes(source), f".dockerignore excludes {source}"


def test_dockerfile_pins_ray_within_pyproject() -> None:
    from packaging.requirements import Requirement

    text = (DEPLOY / "Dockerfile").read_text()
    version = re.search(r"^ARG RAY_VERSION=(\S+)$", text, re.M)
    assert version, "the Dockerfile must pin Ray (ARG RAY_VERSION=...)"
    assert '"ray[default]==${RAY_VERSION}"' in text
    assert re.search(r"^RUN pip install -c constraints.txt \. ", text, re.M), "the tested pins"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (ray,) = [
        Requirement(d) for d in pyproject["project"]["dependencies"] if Requirement(d).name == "ray"
    ]
    assert ray.specifier.contains(version.group(1)), f"ray=={version.group(1)} is not {ray}"


def test_the_pods_user_owns_the_cache_it_reads_and_writes() -> None:
    # The checkpoint is baked as root; the pods run as 10001 and read it, and build the C
    # kernels under the same cache. Without the chown every process failed at start
    # (PermissionError reading the checkpoint) and the kernels were never built.
    text = (DEPLOY / "Dockerfile").read_text()
    cache = re.search(r"EPD_CACHE_DIR=(\S+)", text)
    assert cache is not None
    assert f"chown -R 10001:10001 {cache.group(1)}" in text
    assert text.index("default_checkpoint()") < text.index("chown -R") < text.index("USER 10001")


def test_a_checkpoint_made_once_is_readable_by_other_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from common.models.tiny import default_checkpoint

    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    made = default_checkpoint("tiny")
    assert stat.S_IMODE(made.stat().st_mode) & 0o055 == 0o055  # group and others: r-x
    assert all(stat.S_IMODE(f.stat().st_mode) & 0o044 == 0o044 for f in made.iterdir())
