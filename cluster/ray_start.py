"""Starting or joining the Ray cluster `epd serve` runs on (`init_ray`), and refusing a
second deployment in a namespace (`refuse_if_running`).

A cluster started here takes only callers holding its token (`RAY_AUTH_MODE=token`, a random
`RAY_AUTH_TOKEN` its processes inherit), unless the environment chose a mode: Ray's servers
listen on every interface.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import sys
import threading
from collections.abc import Iterator

from cluster import logs
from cluster.pools import CONTROLLER_NAME
from cluster.settings import RaySettings


def _token_auth() -> None:
    """Ray's token authentication for a cluster started here, unless the environment sets
    its own mode. Ray's servers listen on every interface: without a token, anyone who
    reaches this host could join the cluster and run code as this user (read the cluster
    token, scale the pools). Its processes inherit the token; nothing else learns it."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    raylet = sys.modules.get("ray._raylet")
    if raylet is not None:  # imported before: its configuration read the environment then
        raylet.Config.initialize("")
        raylet.AuthenticationTokenLoader.instance().reset_cache()


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM while the block runs are held until it ends, then raised as
    KeyboardInterrupt (the caller then stops what it started). Ray's own SIGTERM handler,
    which `ray.init` installs and which exits at once, is kept out meanwhile: a Ray stopped
    half-way through its start left its dashboard and runtime-env agents running for good.
    A start that fails after a signal is a stop too; a second signal ends the block at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum: int, _frame: object) -> None:
        if held:  # a second signal: the start hangs, perhaps; let it go now
            for number, handler in before.items():
                signal.signal(number, handler)
            raise KeyboardInterrupt(f"signal {signum} again while Ray started")
        held.append(signum)

    before = {s: signal.signal(s, hold) for s in _HELD}
    utils = sys.modules.get("ray._private.utils")
    ray_handler = getattr(utils, "set_sigterm_handler", None)
    if ray_handler is not None:
        utils.set_sigterm_handler = lambda handler: None  # type: ignore[union-attr]
    try:
        yield
    except BaseException as exc:  # a start that failed after the signal is still a stop
        if held and not isinstance(exc, KeyboardInterrupt):
            raise KeyboardInterrupt(f"signal {held[0]} while Ray started") from exc
        raise
    finally:
        if ray_handler is not None:
            utils.set_sigterm_handler = ray_handler  # type: ignore[union-attr]
        for number, handler in before.items():
            signal.signal(number, handler)
    if held:
        raise KeyboardInterrupt(f"signal {held[0]} while Ray started")


_HELD = (signal.SIGINT, signal.SIGTERM)


def init_ray(settings: RaySettings, log_level: str = "warning") -> bool:
    """Join the Ray cluster at `settings.address`, or start a local one; True if started here.
    Ray's start-up notices stay quiet below `log_level` debug (`cluster.logs`)."""
    logs.driver_env(log_level)
    import ray

    logs.quiet_driver(log_level)
    quiet = {"logging_level": logging.DEBUG if logs.debug(log_level) else logging.WARNING}
    if settings.address:
        try:
            ray.init(
                address=settings.address,
                namespace=settings.namespace,
                log_to_driver=settings.log_to_driver,
                **quiet,
            )
        except ConnectionError as exc:
            from common.settings.schema import SettingsError

            token = ""  # Ray turns its token authentication on by itself for `auto` only
            if settings.address != "auto" and not os.environ.get("RAY_AUTH_MODE"):
                token = (  # (raypools review)
                    ", or it takes Ray's token only: set RAY_AUTH_MODE=token (and RAY_AUTH_TOKEN "
                    "or RAY_AUTH_TOKEN_PATH unless it is in ~/.ray/auth_token)"
                )
            raise SettingsError(
                f"ray.address: no Ray cluster at {settings.address!r} answered ({exc}){token}; "
                "start one (`ray start --head`), or leave --address unset to start one here"
            ) from None
        return False
    _token_auth()
    with signals_held():  # stopped half-way, Ray leaves agents running for good
        ray.init(
            address="local",  # always a new cluster, even when `ray start` left one running
            num_cpus=settings.num_cpus,
            num_gpus=settings.num_gpus,
            namespace=settings.namespace,
            include_dashboard=False,
            object_store_memory=settings.object_store_mb * 1024 * 1024,
            log_to_driver=settings.log_to_driver,
            **quiet,
        )
    return True


def refuse_if_running(namespace: str) -> None:
    """SettingsError naming `ray.namespace` when a deployment already runs in `namespace` of
    the Ray cluster this process joined (`Deployment.start` refuses the same, later)."""
    import ray

    try:
        ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError:  # no such actor
        return
    from common.settings.schema import SettingsError

    raise SettingsError(RUNNING.format(namespace=namespace))


# A second deployment in a namespace is refused: one controller (its name) per namespace.
RUNNING = (
    "ray.namespace: an epd deployment already runs in namespace {namespace!r} of this Ray "
    "cluster; stop it, or set another --ray-namespace"
)
