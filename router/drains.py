"""What holds a worker out of rotation beyond its record (`Registry.drain`, `retire`), kept
under the worker's name so that it stands when the worker registers again:

- an operator's drain (AdminService.Drain), under the worker's (role, name) with the address
  it was last registered at. It stands when the worker registers again, at that address or
  another: Ray restarts a crashed actor under its name on a new port, and a worker dropped
  for silence registers again; the drain was most likely put on because something was wrong
  with that worker. Only Undrain (of that address, or of that name) clears it.
- a retirement (the deployment's scale-down), under the worker's name (a deployment's actor
  names are unique across roles and never reused). Nothing clears it: the worker leaves.
  Undrain leaves it draining, and a worker retired before it registered (still loading its
  model) registers draining.

A worker registered without a name is held under its address (`WorkerRecord.name`). At most
`MAX_HELD` names of each kind are kept, the least recently held forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TypeVar

from common.roles import Role
from router.workers import WorkerRecord

MAX_HELD = 256  # names remembered, of drained workers and of retiring ones

_K = TypeVar("_K")
_V = TypeVar("_V")


class Holds:
    """The names an operator drained and the names the deployment retires."""

    def __init__(self) -> None:
        # (role, name) -> the address last registered under it, of workers an operator drained
        self._drained: OrderedDict[tuple[Role, str], str] = OrderedDict()
        # Names of retiring workers -> whether for their death
        self._retiring: OrderedDict[str, bool] = OrderedDict()

    def apply(self, record: WorkerRecord) -> None:
        """Hold a newly registered `record` as its name is held."""
        key = (record.role, record.name)
        if key in self._drained:
            self._drained[key] = record.address
            record.drain_requested = True
        record.retiring = record.name in self._retiring
        record.died = self._retiring.get(record.name, False)  # a Register late in flight

    def drain(self, records: Iterable[WorkerRecord]) -> None:
        """An operator drained `records` (those at one address). A retiring worker's drain
        (a scale-down's own) is not held as an operator's: `retire` holds it, and each one
        filed here pushed an operator's drain nearer the `MAX_HELD` bound."""
        for record in records:
            record.drain_requested = True
            if record.name not in self._retiring:
                _hold(self._drained, (record.role, record.name), record.address)

    def undrain(self, records: Iterable[WorkerRecord], address: str = "", name: str = "") -> bool:
        """An operator undrained the worker at `address`, or of `name`: `records` (those
        registered so) and the drains held for that name or for names last registered at
        that address (gone since, perhaps restarting) serve again, unless retiring. True
        when a drain held for no registered worker was lifted."""
        registered = set()
        for record in records:
            record.drain_requested = False
            registered.add((record.role, record.name))
            self._drained.pop((record.role, record.name), None)
        away = [
            key
            for key, last in self._drained.items()
            if (address and last == address) or (name and key[1] == name)
        ]
        for key in away:
            del self._drained[key]
        return bool(set(away) - registered)

    def retire(self, name: str, records: Iterable[WorkerRecord], died: bool = False) -> None:
        """The deployment retires the worker `name` (`died`: for it died for good);
        `records` are every registered one."""
        died |= self._retiring.get(name, False)
        _hold(self._retiring, name, died)
        for record in records:
            if record.name == name:
                record.retiring = True
                record.died = died

    def drained(self, name: str) -> bool:
        """Whether an operator drained a worker of this name (any role) and did not undrain it."""
        return any(held == name for _, held in self._drained)


def _hold(held: OrderedDict[_K, _V], key: _K, value: _V) -> None:
    held[key] = value
    held.move_to_end(key)
    while len(held) > MAX_HELD:
        held.popitem(last=False)
