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
import asyncio

import pytest

from common.tasks import cancel_and_wait, outcome
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


def _suppressed_cancels(tree: ast.AST) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "suppress"
        and any(
            isinstance(arg, ast.Attribute) and arg.attr == "CancelledError" for arg in node.args
        )
    ]


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


def test_no_suppressed_cancellation_in_the_code() -> None:
    source = "with contextlib.suppress(asyncio.CancelledError):\n    await task\n"
    assert _suppressed_cancels(ast.parse(source)) == [1]
    found = [
        f"{path.name}:{line}"
        for path in _sources()
        for line in _suppressed_cancels(ast.parse(path.read_text()))
    ]
    assert found == [], "use common.tasks.cancel_and_wait or outcome"


async def test_cancel_and_wait_ends_the_task_and_keeps_the_callers_cancellation() -> None:
    never = asyncio.Event()
    task = asyncio.create_task(never.wait())
    await asyncio.sleep(0)
    await cancel_and_wait(task)  # the task's cancellation: swallowed
    assert task.cancelled()
    await cancel_and_wait(None)

    async def stubborn() -> None:  # takes a while to end once cancelled
        try:
            await never.wait()
        finally:
            await asyncio.sleep(0.05)

    inner = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    stopping = asyncio.create_task(cancel_and_wait(inner))
    await asyncio.sleep(0.01)
    stopping.cancel()  # the caller is cancelled while it waits: that is raised
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert stopping.cancelled()


async def test_a_caller_cleaning_up_after_its_own_cancellation_can_still_wait() -> None:
    # In a `finally` after the caller was cancelled, a stop went on with the old suppress;
    # it must not raise the cancellation already delivered (review of this fix).
    steps: list[str] = []

    async def server() -> None:
        background = asyncio.create_task(asyncio.Event().wait())
        try:
            await asyncio.Event().wait()
        finally:
            await cancel_and_wait(background)
            steps.append("stopped")

    task = asyncio.create_task(server())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == ["stopped"]


async def test_outcome_is_the_result_or_none_when_the_task_was_cancelled() -> None:
    async def value() -> int:
        return 7

    assert await outcome(asyncio.create_task(value())) == 7
    cancelled = asyncio.create_task(asyncio.Event().wait())
    await asyncio.sleep(0)
    cancelled.cancel()
    assert await outcome(cancelled) is None
