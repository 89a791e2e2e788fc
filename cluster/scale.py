"""`epd scale`: ask a router's scaler for a pool size, then wait until the pool has it
(counted as `cluster.admin.role_counts` counts), telling the workers that failed to start or
died for good on the way.

A scale is done when the pool's serving count is what was asked and no worker drains that
did not before it (the retired ones are gone; dead ones, held out, leave on their own). The
workers dead for good or failed to start that the scale took out of the pool's count (the
router answers them: `ScaleResponse.replaced`) are told, and waited on; it stops at once,
1, at any other start that failed or death while the pool is short: waiting cannot help
(one found as the pool reads full is told, and the scale is done).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Collection
from typing import Any

from cluster.actor_states import FAILED_TO_START
from cluster.admin import DRAINED_STAY, admin_stub, counted, n_workers, role_counts, workers_by_role
from cluster.console import say as _say


async def cmd_scale(args: argparse.Namespace) -> int:
    """Ask the router's scaler for `--replicas` workers, then wait until the pool has them."""
    from common.wire.roles import role_to_proto
    from epd.v1 import admin_service_pb2

    ch, stub = await admin_stub(args)
    async with ch:
        first = await stub.Status(admin_service_pb2.StatusRequest(), timeout=10)
        before = role_counts(first)[args.role]
        reply = await stub.Scale(
            admin_service_pb2.ScaleRequest(role=role_to_proto(args.role), replicas=args.replicas),
            timeout=60,
        )
        _say(f"{args.role}: {counted(before)} -> {n_workers(reply.replicas)}")
        # Workers dead for good since they started, found by that Status or by the scale
        # (which replaced them): told once, and waited on. One found later is not replaced.
        # A router from before `tells_replaced`: those the first Status and poll tell (a
        # death found meanwhile is taken for replaced: ownfixE review E2).
        told = reply.tells_replaced
        replaced = set(
            reply.replaced if told else (w for w in first.failed_starts if _died(w, args.role))
        )
        # Leaving before the scale, by name, but the dead (held out; their registrations
        # dropping had passed for this scale's retirees leaving: ownfixE review E3).
        retiring = _leaving(first, args.role, _names(replaced))
        if args.no_wait:
            if replaced:  # the scale cleared them: told here or nowhere
                _say(f"{args.role}: " + "; ".join(sorted(replaced)))
            return 0
        t0 = time.monotonic()
        said: list[str] = []
        polls = 0
        while True:
            status = await stub.Status(admin_service_pb2.StatusRequest(), timeout=10)
            now = role_counts(status)[args.role]
            died = [w for w in status.failed_starts if _died(w, args.role)]
            if not polls:
                replaced.update(() if told else died)
                if replaced:
                    _say(f"{args.role}: " + "; ".join(sorted(replaced)))
            polls += 1
            died = [w for w in died if w not in replaced]
            leaving = _leaving(status, args.role, _names(replaced) | _names(died)) - retiring
            # Workers drained with `epd drain` stay in the pool, serving nothing: said at once.
            if now.serving == reply.replicas - now.drained and not leaving:
                if died:  # told before the pool reads full, or never (ownfixE review E4)
                    _say(f"{args.role}: " + "; ".join(died))
                took = time.monotonic() - t0
                _say(f"{args.role}: {counted(now)} ({took:.1f}s)")
                if not now.drained:
                    return 0
                _say(f"  {DRAINED_STAY}")
                return 1
            waiting = [w for w in status.waiting if w.startswith(f"epd-{args.role}-")]
            if waiting and waiting != said:  # e.g. Ray has no CPU or GPU left for a worker
                _say(f"{args.role}: " + "; ".join(waiting))
                said = waiting
            starts = [w for w in status.failed_starts if _died(w, args.role, start=True)]
            failed = [w for w in starts if w not in replaced] + died
            if failed:  # out of the pool: waiting cannot help (scaling again starts others)
                _say(f"{args.role}: " + "; ".join(failed))
                _say(f"{args.role}: {counted(now)}; `epd scale` again starts others")
                return 1
            if time.monotonic() - t0 > args.timeout:
                _say(f"{args.role}: still {counted(now)} after {args.timeout:.0f}s")
                # A router from before `drained` tells none: hedged, where the pool is short
                # (in a scale-down, the draining ones are retiring).
                if now.drained or (now.draining and now.serving < reply.replicas):
                    _say(f"  {DRAINED_STAY}" + ("" if now.drained else " (if one is)"))
                return 1
            await asyncio.sleep(0.2)


def _died(line: str, role: str, *, start: bool = False) -> bool:
    """Whether a `failed_starts` line tells of a worker of `role` that failed to start
    (`start`), or else of one dead for good after it started."""
    name, _, end = line.partition(" ")  # the end's cause may say anything (s41 review F6)
    return name.startswith(f"epd-{role}-") and end.startswith(f"{FAILED_TO_START}: ") == start


def _names(lines: Collection[str]) -> set[str]:
    """The workers `failed_starts` lines tell of (a line starts with the worker's name)."""
    return {line.split(" ", 1)[0] for line in lines}


def _leaving(reply: Any, role: str, dead: set[str]) -> set[str]:
    """`role`'s workers draining to leave in a Status reply, by name (by address where a
    worker has none): not those an operator drained (they stay, counted apart: a
    registration again gets a new id, and one waited the whole timeout: ownfixA review,
    s41), nor the `dead` (named), which leave on their own when their registration times
    out."""
    return {
        w.info.name or w.info.address
        for r, w in workers_by_role(reply)
        if r == role and w.draining and not w.drained and w.info.name not in dead
    }
