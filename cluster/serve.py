"""`epd serve`: start (or join) Ray, run a deployment until SIGINT/SIGTERM, then stop it,
saying what happens on the console. A signal during the stop (which waits up to the drain
timeout) forces it: the drain is cut, and the exit status is 130."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import os
import shlex
import signal
import time
from collections.abc import Awaitable, Iterator
from typing import TYPE_CHECKING, TypeVar

from cluster.console import say as _say

if TYPE_CHECKING:
    from cluster.deployment import Deployment
    from cluster.settings import EpdSettings
    from common.settings.base import ServerSettings

T = TypeVar("T")
LOCK_FILE = "serve.lock"  # in $EPD_HOME/<namespace>, held by the running `epd serve`


def cmd_serve(settings: EpdSettings) -> int:
    """Check the settings (SettingsError naming the key, before anything starts), start
    (or join) Ray, run the deployment until SIGINT/SIGTERM, then stop it cleanly."""
    settings.check()  # the same check as `epd config --check`; `epd` exits 2 with its line
    check_ports(settings)
    token_file_for_all(settings)  # roles' tokens that differ: refused before Ray starts
    with holding_namespace(settings.ray.namespace):
        return _start_and_serve(settings)


@contextlib.contextmanager
def holding_namespace(namespace: str) -> Iterator[None]:
    """Hold `$EPD_HOME/<namespace>/serve.lock` while the block runs (released at exit, a
    kill included). A second `epd serve` of the namespace on this machine started its own
    Ray cluster, where `refuse_if_running` saw nothing, and wrote its token and keys over
    the first one's: that one's clients and admins were locked out, and its restarted
    workers read the new token and were refused by their own router. SettingsError naming
    `ray.namespace` when another process holds it."""
    from common.settings.api_keys import state_dir
    from common.settings.schema import SettingsError

    folder = state_dir(namespace)
    lock = folder / LOCK_FILE
    unheld = "; a second epd serve of this namespace on this machine would not be refused"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:  # a read-only home: a deployment that writes nothing there runs
        _say(f"warning: cannot hold {lock} ({exc.strerror}){unheld} (set $EPD_HOME)")
        fd = None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                raise SettingsError(
                    f"ray.namespace: an epd serve of namespace {namespace!r} runs on this "
                    f"machine (pid {holder}; it keeps its token and keys in {folder}); stop it, "
                    "or set another --ray-namespace (or $EPD_HOME)"
                ) from None
            except OSError as exc:  # a filesystem without locks (some FUSE and 9p mounts)
                _say(f"warning: cannot lock {lock} ({exc.strerror}){unheld}")
            else:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # the lock goes with it


def _start_and_serve(settings: EpdSettings) -> int:
    import logging

    from cluster.ray_start import init_ray, refuse_if_running

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _prepare_checkpoint(settings)
    started = time.monotonic()
    if settings.ray.address:
        _say(f"joining the Ray cluster at {settings.ray.address}")
    else:
        _say("starting a local Ray cluster")
    try:
        started_ray = init_ray(settings.ray, settings.log_level)
        # Only now the secrets: a serve refused here (no Ray cluster at that address, a
        # deployment already running in the namespace) must not replace that deployment's
        # token and keys, which its clients and restarting workers read.
        refuse_if_running(settings.ray.namespace)
    except BaseException:  # SIGTERM during Ray's start-up exits from inside ray.init too
        _stop_ray()
        raise
    settings = with_api_keys(with_cluster_token(settings))
    return asyncio.run(_serve(settings, started_ray, started))


def _stop_ray() -> None:
    """Stop what this process started of Ray (nothing when it started nothing, or was
    stopped while it imported Ray: a second import of a half-imported module fails)."""
    with contextlib.suppress(Exception):
        import ray

        ray.shutdown()


def check_ports(settings: EpdSettings) -> None:
    """SettingsError naming `router.port` or `router.http_port` when that fixed port is
    taken on this node (where the router's actor runs), before Ray starts: a second
    `epd serve` on the same ports fails at once with one line."""
    from common.server.bind import bind_problem
    from common.settings.schema import SettingsError

    router = settings.router
    for key, host, port in (
        ("router.port", router.host, router.port),
        ("router.http_port", router.http_host, router.http_port),
    ):
        if port > 0 and bind_problem(host, port) == "in use":
            raise SettingsError(
                f"{key}: {host}:{port} is in use (another epd serve or router?); "
                "set a free port, or 0 for any"
            )


def try_line(addresses: list[str], settings: EpdSettings) -> str:
    """The command `epd serve` suggests once ready: to every router; in another namespace
    than the default, with the `EPD_NAMESPACE` its key is found under (without it:
    UNAUTHENTICATED); with `--api-key` when the keys file is the operator's (serve wrote no
    key file) and `--tls-ca-file` when the router serves TLS (without them it failed as
    printed, "Socket closed")."""
    from common.settings.api_keys import DEFAULT_NAMESPACE, NAMESPACE_VAR

    namespace = settings.ray.namespace
    env = f"{NAMESPACE_VAR}={shlex.quote(namespace)} " if namespace != DEFAULT_NAMESPACE else ""
    security = settings.with_model().router.security
    flags = ""
    if security.tls_cert_file:
        flags += f" --tls-ca-file {shlex.quote(security.tls_ca_file or 'CA.pem')}"
    if not security.insecure and security.api_keys_file and not _wrote_keys(settings):
        flags += " --api-key KEY"
    command = f'epd generate "Describe the image." --image IMG --address {",".join(addresses)}'
    return f"try: {env}{command}{flags}"


def _wrote_keys(settings: EpdSettings) -> bool:
    """Whether `with_api_keys` wrote the router's keys file (the client key beside it)."""
    from common.settings.api_keys import API_KEYS_FILE, state_dir

    path = settings.with_model().router.security.api_keys_file
    return path == str(state_dir(settings.ray.namespace) / API_KEYS_FILE)


def with_cluster_token(settings: EpdSettings) -> EpdSettings:
    """`settings` with a fresh cluster token file for this deployment, unless one is given
    (top level or in every role) or `[security] insecure` is set; says where it went. A
    token file given to some roles only becomes every role's (`token_file_for_all`)."""
    from common.settings.api_keys import state_dir
    from common.settings.security import write_token_file

    security = settings.security
    if security.insecure or security.cluster_token_file:
        token_file_for_all(settings)  # roles of their own files: the tokens must agree
        return settings
    path = token_file_for_all(settings)
    if path is None:
        if all(r.security.cluster_token_file or r.security.insecure for r in _roles(settings)):
            return settings  # every role names its own
        path = str(write_token_file(state_dir(settings.ray.namespace) / "cluster_token"))
        _say(f"cluster token for this deployment written to {path} (readable by you only)")
    return dataclasses.replace(
        settings, security=dataclasses.replace(security, cluster_token_file=path)
    )


def _roles(settings: EpdSettings) -> tuple[ServerSettings, ...]:
    return (settings.router, settings.encoder, settings.prefill, settings.decode)


def token_file_for_all(settings: EpdSettings) -> str | None:
    """The token file the roles that name none take: the top level's, or the one file some
    roles name (None: none is named). SettingsError when the secure roles would hold
    different tokens: files whose tokens differ, or several files for roles that name none
    (unless they all hold one token). Reads the files as the roles will (`cluster_key`); one
    it cannot read is its role's check to name. `epd serve` calls it before Ray starts."""
    from common.settings.schema import SettingsError

    if settings.security.insecure:
        return None
    secure = [r for r in _roles(settings.with_model()) if not r.security.insecure]
    keys = set()
    for role in secure:
        with contextlib.suppress(SettingsError):
            keys.add(role.security.cluster_key())
    if len(keys) > 1:
        raise SettingsError(
            "security.cluster_token_file: the roles' files hold different tokens; every role "
            "needs the same one: set it once in [security]"
        )
    if settings.security.cluster_token_file:
        return str(settings.security.cluster_token_file)
    own = [r.security.cluster_token_file for r in _roles(settings) if not r.security.insecure]
    named = sorted({f for f in own if f is not None})
    if len(named) > 1 and None in own and len(keys) != 1:
        raise SettingsError(
            f"security.cluster_token_file: roles name different files ({', '.join(named)}) "
            "and others none; every role needs the same token: set it once in [security]"
        )
    return named[0] if named and None in own else None


def with_api_keys(settings: EpdSettings) -> EpdSettings:
    """`settings` with a fresh API keys file for this deployment (one client key, tenant
    "default"; one admin key, tenant "admin"), unless one is given (top level or the
    router's) or `[security] insecure` is set. The keys also go, one per file, to
    client_key and admin_key beside it, where `epd generate`/`status`/`scale`/`drain` and
    `epd.client` look by default; says where on the console."""
    from common.settings import api_keys
    from common.settings.security import SecuritySettings

    top, router = settings.security, settings.router.security
    if top.insecure or router.insecure or top.api_keys_file or router.api_keys_file:
        return settings
    namespace = settings.ray.namespace
    folder = api_keys.state_dir(namespace)
    client, admin = api_keys.new_api_key(), api_keys.new_api_key()
    path = api_keys.write_api_keys_file(
        folder / api_keys.API_KEYS_FILE, [(client, "default", False), (admin, "admin", True)]
    )
    # Where the clients read them (`api_keys.key_file`), in this namespace.
    api_keys.write_key_file(api_keys.key_file(api_keys.CLIENT_KEY_FILE, namespace), client)
    api_keys.write_key_file(api_keys.key_file(api_keys.ADMIN_KEY_FILE, namespace), admin)
    _say(
        f"API keys for this deployment written to {folder}: {api_keys.CLIENT_KEY_FILE} "
        f"(epd generate, epd.client), {api_keys.ADMIN_KEY_FILE} (epd status, scale, drain, undrain)"
    )
    if top != SecuritySettings():  # the top-level table reaches every role, the router too
        return dataclasses.replace(
            settings, security=dataclasses.replace(top, api_keys_file=str(path))
        )
    own = dataclasses.replace(router, api_keys_file=str(path))
    return dataclasses.replace(settings, router=dataclasses.replace(settings.router, security=own))


def _prepare_checkpoint(settings: EpdSettings) -> None:
    """Make the built-in tiny checkpoint now (with a progress line) when a role will need it."""
    from common.models.tiny import default_checkpoint

    wanted = [settings.model] + [
        getattr(s, "model", None)
        for s in (settings.router, settings.encoder, settings.prefill, settings.decode)
    ]
    if settings.model is not None or all(m is not None for m in wanted[1:]):
        return
    _say("preparing the built-in tiny checkpoint (random weights; made on first use) ...")
    t0 = time.monotonic()
    path = default_checkpoint("tiny")
    _say(f"checkpoint {path} ready in {time.monotonic() - t0:.1f}s")


class StopSignals:
    """SIGINT/SIGTERM to `epd serve`: the first asks for a stop (`stop`); one while it stops
    (`stop` set) forces it (`force`): an operator at a terminal waiting on a long drain has a
    way out other than kill -9, which leaves Ray's agents running."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.force = asyncio.Event()

    def __call__(self) -> None:
        (self.force if self.stop.is_set() else self.stop).set()


async def _serve(settings: EpdSettings, started_ray: bool, started: float) -> int:
    loop = asyncio.get_running_loop()
    signals = StopSignals()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals)
    started_deployment: list[Deployment] = []
    try:
        code = await _run(settings, started_ray, started, signals.stop, started_deployment)
    finally:
        forced = await _stop(started_deployment, started_ray, signals)
    return 130 if forced else code


async def _run(
    settings: EpdSettings,
    started_ray: bool,
    started: float,
    stop: asyncio.Event,
    started_deployment: list[Deployment],
) -> int:
    """Start the deployment (appended to `started_deployment`) and serve until `stop`; the
    exit code."""
    from cluster.actor_states import WorkerRefusedError, WorkerStartError, error_summary
    from cluster.deployment import Deployment

    code = 0
    try:
        deployment = await _until(stop, Deployment.start(settings, started_ray=started_ray))
        if deployment is None:
            return 130
        started_deployment.append(deployment)
        _say(f"router listening on {deployment.address}")
        for more in deployment.addresses[1:]:  # `--routers N`: every worker joins each
            _say(f"router listening on {more}")
        for http in deployment.http_addresses:  # one per router
            _say(f"OpenAI-compatible HTTP API on http://{http}/v1")
        pools = settings.pools.initial_replicas()
        _say("waiting for " + ", ".join(f"{n} {role}" for role, n in pools.items()) + " ...")
        ready = await _until(stop, deployment.wait_ready(settings.pools.ready_timeout_s, _say))
        if ready is None:
            return 130
        counts = ", ".join(f"{n} {role}" for role, n in ready.items())
        _say(f"ready in {time.monotonic() - started:.1f}s: {counts} registered")
        _say(try_line(deployment.addresses, settings))
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await stop.wait()
            if not stop.is_set() and not await deployment.alive():
                _say("the controller actor died; stopping")
                code = 1
                break
        return code
    except WorkerRefusedError as exc:
        _say(f"epd: error: {error_summary(exc)}")
        return 2
    except (TimeoutError, WorkerStartError) as exc:
        _say(f"not ready: {error_summary(exc)}")
        return 1


async def _stop(
    started_deployment: list[Deployment], started_ray: bool, signals: StopSignals
) -> bool:
    """Stop what `_run` started; True when a signal during the stop forced it."""
    signals.stop.set()  # a signal from now on forces the stop
    _say("stopping ...")
    forced = False
    if started_deployment:
        deployment = started_deployment[0]

        async def stopped() -> bool:
            await deployment.stop(on_step=_say)
            return True

        if await _until(signals.force, stopped()) is None:
            _say("stopping now: the drain is cut (in-flight requests fail)")
            deployment.kill()
            forced = True
    elif started_ray:
        import ray

        ray.shutdown()
    _say("stopped")
    return forced


async def _until(stop: asyncio.Event, work: Awaitable[T]) -> T | None:
    """Await `work` unless `stop` is set first (then cancel it and return None)."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    return None
