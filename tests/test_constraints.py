"""constraints.txt, the exact releases `make test`, `make serve` and the image install: it pins
every dependency pyproject.toml names (torch aside, pinned there) to one release that
pyproject allows, and the Makefile and the Dockerfile install with it."""

from __future__ import annotations

import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.test_deploy import DEPLOY, ROOT


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        requirement = Requirement(line)
        (spec,) = requirement.specifier
        assert spec.operator == "==", f"constraints.txt: {line} is not an exact release"
        name = canonicalize_name(requirement.name)
        assert name not in pins, f"constraints.txt: {name} twice"
        pins[name] = spec.version
    return pins


def test_every_dependency_is_pinned_within_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins()
    named = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    for text in named:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name == "torch":
            assert name not in pins, "torch is pinned in pyproject.toml, not in constraints.txt"
            continue
        assert name in pins, f"constraints.txt does not pin {name}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt: {name}=={pins[name]} is outside pyproject's {text!r}"
        )
    assert "epd" not in pins


def test_the_makefile_and_the_image_install_with_it() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^\$\(STAMP\): pyproject\.toml constraints\.txt$", makefile, re.M)
    assert '-m pip install --quiet -c constraints.txt -e ".[dev]"' in makefile
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    ray = re.search(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.M)
    assert ray and ray.group(1) == _pins()["ray"], "the image's Ray is not the one tested"
