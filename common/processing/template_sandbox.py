"""The Jinja2 sandbox chat templates render in, with bounds on what one render may spend.

`ImmutableSandboxedEnvironment` already refuses attribute escapes and caps one `range` at
100 000 items, but not the product of nested loops, nor `'x' * 3000000000` (a
`MemoryError` after the whole RAM). `BoundedSandbox` adds, per render (`RenderBudget`,
entered with `budget`):

- `*` and `**` refuse a result past `MAX_SEQUENCE` items (a string, list or tuple repeated)
  or `MAX_INT_BITS` bits (an integer);
- every `range` counts against `MAX_RANGE_TOTAL` items for the whole render (two nested
  `range(100000)` loops are refused after ten rows, not run for hours);
- every call, attribute or item lookup and intercepted operator checks the render's time
  (CPU time of the rendering thread, `RENDER_SECONDS`), so a template spending longer is
  stopped at its next such step.

Each refusal is a `SecurityError` (a `TemplateError`), which the renderer turns into the
same `ValueError` as any other template failure. A loop whose body does none of these
steps (an empty loop nested over a long string) is not stopped by the deadline; the check
at load (`common.processing.template`) runs in a thread it stops waiting for.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError, safe_range

MAX_SEQUENCE = 1 << 24  # items of a repeated string, list or tuple
MAX_INT_BITS = 1 << 16  # bits of an integer made by * or **
MAX_RANGE_TOTAL = 1_000_000  # items of every range of one render together
RENDER_SECONDS = 5.0  # one render's time (a real template renders in milliseconds)


@dataclass(slots=True)
class RenderBudget:
    """What one render may still spend; `stop` makes its next step raise."""

    seconds: float  # CPU time of the rendering thread it may spend
    started: float | None = None  # that thread's time.thread_time() at its first step
    range_left: int = MAX_RANGE_TOTAL  # range items it may still make
    stop: bool = False  # set by a caller that gave up waiting

    def step(self) -> None:
        """Raise `SecurityError` when the render is out of time or was stopped. CPU time of
        the rendering thread (the one that steps), as a router renders on many threads
        under one GIL: on wall-clock time 16 legitimate 0.7 s renders at once were refused."""
        now = time.thread_time()
        if self.started is None:
            self.started = now
        if self.stop or now - self.started > self.seconds:
            raise SecurityError("the chat template ran out of time")


_current: ContextVar[RenderBudget | None] = ContextVar("template_budget", default=None)


def new_budget(seconds: float = RENDER_SECONDS) -> RenderBudget:
    """A `RenderBudget` of `seconds` of the rendering thread's CPU time."""
    return RenderBudget(seconds)


@contextlib.contextmanager
def budget(current: RenderBudget | None = None) -> Iterator[RenderBudget]:
    """`current` (default: a fresh `new_budget()`) for the renders made inside the block,
    in this thread's context."""
    current = current or new_budget()
    token = _current.set(current)
    try:
        yield current
    finally:
        _current.reset(token)


def _step() -> RenderBudget | None:
    current = _current.get()
    if current is not None:
        current.step()
    return current


def _counted_range(*args: int) -> range:
    rng = safe_range(*args)
    current = _step()
    if current is not None:
        current.range_left -= len(rng)
        if current.range_left < 0:
            raise SecurityError(f"the chat template's loops exceed {MAX_RANGE_TOTAL} steps")
    return rng


def _check_repeat(left: Any, right: Any) -> None:
    """Refuse `left * right` past the bounds, before it is computed."""
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, str | list | tuple) and isinstance(count, int):
            if len(seq) * max(count, 0) > MAX_SEQUENCE:
                raise SecurityError(f"the chat template repeats past {MAX_SEQUENCE} items")
            return
    bits = abs(left).bit_length() + abs(right).bit_length() if _ints(left, right) else 0
    if bits > MAX_INT_BITS:
        raise SecurityError(f"the chat template makes an integer past {MAX_INT_BITS} bits")


def _check_power(base: Any, exponent: Any) -> None:
    """Refuse `base ** exponent` on integers past `MAX_INT_BITS`, before it is computed."""
    bits = exponent * abs(base).bit_length() if _ints(base, exponent) and exponent > 0 else 0
    if bits > MAX_INT_BITS:
        raise SecurityError(f"the chat template makes an integer past {MAX_INT_BITS} bits")


def _ints(*values: Any) -> bool:
    return all(isinstance(v, int) for v in values)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with the bounds of the module docstring."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.globals["range"] = _counted_range

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        _step()
        if operator == "*":
            _check_repeat(left, right)
        elif operator == "**":
            _check_power(left, right)
        return super().call_binop(context, operator, left, right)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _step()
        return super().getitem(obj, argument)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _step()
        return super().call(__context, __obj, *args, **kwargs)
