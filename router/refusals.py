"""Why the registry refused the workers it refused, for `epd status` (`Registry.refusals`).

A refused worker asks again every second or so (its registrar's back-off is capped at 1 s),
so a refusal not repeated for `REFUSAL_SHOWN_S` is of a worker that gave up or went away: it
is no longer shown. The log warns of a refusal once, and again when its reason changes or
after `REFUSAL_SHOWN_S` without it (`note`'s answer): it warned every second, for as long
as the worker asked (operator2 review L3, s44). At most `MAX_REFUSALS` addresses are kept,
each reason cut to `MAX_REFUSAL_CHARS`; a worker that registers is forgotten here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

MAX_REFUSALS = 256  # refused worker addresses remembered (and their reasons, cut to:)
MAX_REFUSAL_CHARS = 1024
REFUSAL_SHOWN_S = 60.0


class Refusals(OrderedDict[str, str]):
    """Worker address -> why Register refused it, the least recently refused first."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__()
        self._clock = clock
        self._when: dict[str, float] = {}  # address -> when last refused
        self._role: dict[str, str] = {}  # address -> the role it asked to serve

    def note(self, address: str, why: str, role: str = "") -> bool:
        """Register refused the worker at `address`, of `role`, for `why`; whether that is
        news (not the same refusal within `REFUSAL_SHOWN_S`)."""
        key, why, now = address[:MAX_REFUSAL_CHARS], why[:MAX_REFUSAL_CHARS], self._clock()
        news = self.get(key) != why or now - self._when[key] > REFUSAL_SHOWN_S
        self[key] = why
        self.move_to_end(key)
        self._when[key] = now
        self._role[key] = role
        while len(self) > MAX_REFUSALS:
            self._drop(self.popitem(last=False)[0])
        return news

    def forget(self, address: str) -> None:
        """The worker at `address` registered."""
        self.pop(address, None)
        self._drop(address)

    def of(self, role: str) -> int:
        """How many workers of `role` were refused lately (`recent`)."""
        return sum(self._role.get(address) == role for address, _ in self.recent())

    def _drop(self, address: str) -> None:
        self._when.pop(address, None)
        self._role.pop(address, None)

    def recent(self) -> list[tuple[str, str]]:
        """(address, why) of the refusals repeated in the last `REFUSAL_SHOWN_S`, oldest
        first; older ones are forgotten."""
        cutoff = self._clock() - REFUSAL_SHOWN_S
        while self and self._when[next(iter(self))] < cutoff:
            self._drop(self.popitem(last=False)[0])
        return list(self.items())
