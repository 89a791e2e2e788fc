"""Rules read from the source (no import), for mistakes a test of behaviour catches only by
luck of timing.

`asyncio.wait_for` is not used: on Python 3.11 (our floor) it runs the awaited thing as a
task of its own, and a cancellation that arrives as that task completes is dropped (or turned
into a TimeoutError): a caller who went away was admitted, pulled its KV and ran on to its
deadline holding its blocks (`tests.test_admission_queue` shows the race). `asyncio.timeout`
awaits in the caller's task and keeps the cancellation.
"""

from __future__ import annotations

import ast

from tests.test_layers import _sources


def _wait_fors(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "asyncio":
            lines += [node.lineno for alias in node.names if alias.name == "wait_for"]
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "wait_for"
            and isinstance(node.value, ast.Name)
            and node.value.id == "asyncio"
        ):
            lines.append(node.lineno)
    return lines


def test_the_rule_sees_both_spellings() -> None:
    source = "import asyncio\nfrom asyncio import wait_for\nawait asyncio.wait_for(x, 1)\n"
    assert _wait_fors(ast.parse(source)) == [2, 3]


def test_no_asyncio_wait_for_in_the_code() -> None:
    found = [
        f"{path.name}:{line}"
        for path in _sources()
        for line in _wait_fors(ast.parse(path.read_text()))
    ]
    assert found == [], "use `async with asyncio.timeout(...)` (see this module's docstring)"
