"""What Ray says of a deployment's worker actors, each asked by its actor id: its name is no
key (Ray's actor table has no namespace, so another deployment on the cluster may have its
own "epd-prefill-0").

- `actor_states`: from the GCS actor table (no dashboard needed), the actors not placed on a
  node yet, those starting again after a crash (how often), and those dead for good.
- `start_outcome`: wait until an actor has started, or is dead for good (Ray's call waits
  through the restarts it has left); `death` tells the cause of such an end.
- `error_summary`: a Ray error's root cause in one line; `WorkerStartError` carries one.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ActorStates:
    """Actors not serving, by actor id (hex), as Ray's GCS actor table has them."""

    unplaced: frozenset[str] = frozenset()  # not placed on a node yet
    restarted: dict[str, int] = field(default_factory=dict)  # starting again: restarts so far
    dead: frozenset[str] = frozenset()  # dead for good: Ray restarts it no more


def actor_id(handle: Any) -> str:
    """The actor id of a Ray actor handle, in hex, as the GCS actor table keys it."""
    return str(handle._actor_id.hex())


def actor_states(ids: Sequence[str]) -> ActorStates:
    """The state of each actor of `ids` (one GCS query each: well under a millisecond);
    none when this Ray does not answer. Blocks: call it off the event loop."""
    try:
        from ray._private.state import actors

        table = [actors(actor_id=one) for one in ids]  # {} for an id Ray does not know
    except Exception:
        logger.debug("Ray's actor table did not answer", exc_info=True)
        return ActorStates()
    unplaced, restarted, dead = set(), {}, set()
    for one, info in zip(ids, table, strict=True):
        state = info.get("State")
        if state == "DEAD":
            dead.add(one)
        elif state in ("PENDING_CREATION", "RESTARTING"):
            # PENDING_CREATION also covers a placed actor whose __init__ runs (loading its
            # model): one still waiting for resources has no process and no node yet.
            if state == "PENDING_CREATION" and not (
                info.get("Pid") or info.get("Address", {}).get("IPAddress")
            ):
                unplaced.add(one)
            if restarts := int(info.get("NumRestarts") or 0):
                restarted[one] = restarts
    return ActorStates(frozenset(unplaced), restarted, frozenset(dead))


async def start_outcome(
    handle: Any, gone: Callable[[], bool], retry_s: float
) -> BaseException | None:
    """None once the actor of `handle` has started (or `gone()`: nobody waits for it any
    more); the error of its end when it is dead for good first: its start raised (Ray
    restarts no actor whose creation task failed), or it died past its `max_restarts`.
    An actor unreachable for now, or a call that failed, is asked again after `retry_s`."""
    import ray

    while True:
        try:
            await handle.__ray_ready__.remote()
            return None
        except ray.exceptions.ActorUnavailableError:  # unreachable for now: ask again
            pass
        except ray.exceptions.RayActorError as exc:
            return exc
        except Exception:  # an error of the call itself: asked again below
            logger.debug("waiting for an actor's start failed", exc_info=True)
        if gone():
            return None
        await asyncio.sleep(retry_s)


FAILED_TO_START = "failed to start"  # what a new worker's end says (`epd scale` stops at it)


def death(exc: BaseException, started: bool) -> str:
    """How an actor dead for good ended, from Ray's error: its start (or, once it had
    started, a restart after a crash) raised, or it died past its restarts (or was killed)
    while starting or since."""
    # Ray's guesses after its cause ("Some common causes include: (1) ...") are no cause.
    cause = error_summary(exc).split(" Some common causes include")[0]
    if getattr(exc, "actor_init_failed", False):
        return f"{'failed to restart' if started else FAILED_TO_START}: {cause}"[:300]
    if started:  # past its restarts, or killed from outside
        return f"died for good: {cause}"[:300]
    return f"{FAILED_TO_START}: it died while starting, past its restarts: {cause}"[:300]


class WorkerStartError(RuntimeError):
    """A worker actor (or the controller) raised while starting; the message has the cause."""


class WorkerRefusedError(WorkerStartError):
    """The router refused a worker's registration for its settings (another model, protocol
    or KV layout): a settings error, found only once the worker runs."""


def error_summary(exc: BaseException | None) -> str:
    """The last line of a (Ray) error: the exception that started it all, named without
    its module ("SettingsError: ..."; ours, WorkerStartError, not at all)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    last = _MODULE.sub("", lines[-1]) if lines else repr(exc)
    for cls in (WorkerRefusedError, WorkerStartError):
        last = last.removeprefix(f"{cls.__name__}: ")
    return last


# A dotted module path before an exception's class name, as a traceback's last line has it.
_MODULE = re.compile(r"^(?:[a-z_][a-z0-9_]*\.)+(?=[A-Z]\w*: )")
