"""Waiting for a task without losing the caller's own cancellation.

`with contextlib.suppress(asyncio.CancelledError): await task` swallows two cancellations
alike: the task's (meant) and the caller's, if it is cancelled meanwhile (a stop cancelled
while it waits for its loop to end then went on as if nothing had happened). These tell them
apart by the caller's `Task.cancelling()`.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

T = TypeVar("T")


async def outcome(task: asyncio.Future[T]) -> T | None:
    """`task`'s result, or None if it was cancelled; a cancellation of the caller while it
    waits is raised (one delivered before, to a caller cleaning up after it, is not)."""
    current = asyncio.current_task()
    before = current.cancelling() if current is not None else 0
    try:
        return await task
    except asyncio.CancelledError:
        if current is not None and current.cancelling() > before:
            raise
        return None


async def cancel_and_wait(task: asyncio.Future[Any] | None) -> None:
    """Cancel `task` (None: nothing) and wait until it has ended; its own error, if it
    raised one other than the cancellation, is raised."""
    if task is not None:
        task.cancel()
        await outcome(task)
