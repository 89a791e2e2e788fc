"""The single executor thread every call into a worker's `LmRunner` runs on.

The runner is not thread-safe (its pool and KV buffer are shared by all requests), so the
workers serialize every call through one `ModelThread`; awaiting `call` keeps their event
loops responsive while the model runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from common.cpu import torch_thread

T = TypeVar("T")

logger = logging.getLogger(__name__)


class ModelThread:
    """The one thread that runs every call into a runner, in submission order.

    Servers await `call` so the event loop stays responsive while the model runs. A call
    whose awaiting task is cancelled still runs to completion on the thread (torch cannot be
    interrupted); `on_orphan(result)` then receives what it returned, so blocks it took can
    be given back (schedule that with `submit`, it runs on this thread too).
    """

    def __init__(self, name: str = "epd-model") -> None:
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name, initializer=torch_thread
        )

    async def call(
        self,
        fn: Callable[..., T],
        *args: Any,
        on_orphan: Callable[[T], object] | None = None,
        **kwargs: Any,
    ) -> T:
        """Run `fn(*args, **kwargs)` on the model thread and return its result."""
        work = self._executor.submit(functools.partial(fn, *args, **kwargs))
        future = asyncio.wrap_future(work)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if on_orphan is not None:
                orphan = on_orphan

                def done(f: asyncio.Future[T]) -> None:
                    if not f.cancelled() and f.exception() is None:
                        orphan(f.result())

                future.add_done_callback(done)
            raise

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue `fn(*args)` without waiting (cleanup from callbacks); what it raises is
        logged (nobody may wait for it: pulled KV left uncached said nothing; races review)."""
        work = self._executor.submit(fn, *args)
        work.add_done_callback(functools.partial(_log_failure, fn))
        return work

    def close(self) -> None:
        """Finish queued calls and stop the thread."""
        self._executor.shutdown(wait=True)


def _log_failure(fn: Callable[..., object], work: concurrent.futures.Future[Any]) -> None:
    if not work.cancelled() and (error := work.exception()) is not None:
        name = getattr(fn, "__qualname__", repr(fn))
        logger.error("model thread call %s failed", name, exc_info=error)
