"""The tree is layered: nothing below imports anything above (read from the source, no import).

`common/` is a stack of folders, bottom first (see README "Layout"); the role packages sit on
`common` and never import each other; `cluster` (the `epd` command, Ray pools) is on top and
nothing imports it. Only the wire layer, the server plumbing and the KV handoff (and the
roles, the client and the CLI above them) import the generated `epd.v1` bindings; the model
runtime and the KV cache hold no protobuf types.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Bottom first. A module may import modules of its own layer or of a lower one.
COMMON_LAYERS: list[tuple[str, ...]] = [
    (
        "common.errors",
        "common.address",
        "common.roles",
        "common.settings",
        "common.sampling",
        "common.byte_lru",
        "common.cpu",
        "common.host_memory",
        "common.tasks",
    ),
    ("common.multimodal",),
    ("common.transfer",),
    ("common.kv",),
    ("common.models",),
    ("common.processing",),
    ("common.engine",),
    ("common.wire",),
    ("common.server",),
    ("common.handoff", "common.kv_pull"),
]
ROLES = ("encoder_worker", "prefill_worker", "decode_worker", "router")
BINDINGS_ALLOWED = (
    "common.wire",
    "common.server",
    "common.handoff",
    "common.kv_pull",
    *ROLES,
    "epd",
    "cluster",
)

# Kept on purpose: `MultimodalParams.to_proto` / `from_proto` are public (issue 2); they
# convert through the wire layer at call time and name the message type for mypy only.
ALLOWED_UPWARD = {("common.multimodal.params", "common.wire.convert")}
ALLOWED_BINDINGS = {("common.multimodal.params", "epd.v1")}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> list[Path]:
    out = []
    for top in ("common", *ROLES, "epd", "cluster"):
        for path in (ROOT / top).rglob("*.py"):
            if "v1" in path.relative_to(ROOT).parts or path.name == "__main__.py":
                continue
            out.append(path)
    return sorted(out)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _common_rank(module: str) -> int | None:
    for rank, layer in enumerate(COMMON_LAYERS):
        if any(_under(module, p) for p in layer):
            return rank
    return None


def _owner(module: str) -> str:
    """`common`, a role package, `epd.client`, `epd.v1` or `cluster`."""
    if _under(module, "epd.v1"):
        return "epd.v1"
    return module.split(".")[0] if not _under(module, "epd") else "epd"


EDGES = [(path, _module(path), imported) for path in _sources() for imported in _imports(path)]
OURS = ("common", *ROLES, "epd", "cluster")


def test_every_common_module_has_a_layer() -> None:
    missing = [m for _, m, _ in EDGES if _under(m, "common") and m != "common"]
    assert [m for m in set(missing) if _common_rank(m) is None] == []


@pytest.mark.parametrize("prefix", [layer[0] for layer in COMMON_LAYERS])
def test_common_imports_only_downward(prefix: str) -> None:
    bad = []
    for _path, module, imported in EDGES:
        rank = _common_rank(module)
        if rank is None or not any(_under(module, p) for p in COMMON_LAYERS[rank]):
            continue
        if prefix not in COMMON_LAYERS[rank]:
            continue
        if (module, imported) in ALLOWED_UPWARD:
            continue
        if imported.split(".")[0] in OURS and not _under(imported, "epd.v1"):
            target = _common_rank(imported)
            if target is None or target > rank:
                bad.append(f"{module} imports {imported}")
    assert bad == []


def test_roles_import_only_common_and_the_bindings() -> None:
    bad = []
    for _path, module, imported in EDGES:
        owner = _owner(module)
        if owner not in ROLES:
            continue
        top = imported.split(".")[0]
        if top in OURS and top not in ("common", owner) and not _under(imported, "epd.v1"):
            bad.append(f"{module} imports {imported}")
    assert bad == []


def test_nothing_imports_the_cli_package() -> None:
    bad = [
        f"{m} imports {i}" for _, m, i in EDGES if _under(i, "cluster") and _owner(m) != "cluster"
    ]
    assert bad == []


def test_only_the_edge_layers_import_the_bindings() -> None:
    bad = [
        f"{m} imports {i}"
        for _, m, i in EDGES
        if _under(i, "epd.v1")
        and not any(_under(m, p) for p in BINDINGS_ALLOWED)
        and (m, i) not in ALLOWED_BINDINGS
    ]
    assert bad == []


def test_the_bindings_import_nothing_of_ours() -> None:
    bad = []
    for path in sorted((ROOT / "epd" / "v1").glob("*.py")):
        for imported in _imports(path):
            if imported.split(".")[0] in OURS and not _under(imported, "epd.v1"):
                bad.append(f"{path.name} imports {imported}")
    assert bad == []
    assert _imports(ROOT / "epd" / "__init__.py") == set()
