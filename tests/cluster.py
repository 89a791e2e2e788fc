"""A real local deployment for end-to-end tests and benchmarks: router + 1 encoder +
1 prefill + 1 decode, each a `python -m ...` subprocess on 127.0.0.1 with a free port.

    cluster = start_cluster(checkpoint, log_dir)      # returns once every worker registered
    try:
        ... Client(cluster.address, api_key=cluster.client_key) ...
    finally:
        cluster.stop()

Every process gets the deployment's cluster token, the router an API keys file with two
tenants' client keys and an admin key (`Cluster.client_key`, `other_key`, `admin_key`).
The router gets a port that was just free (its log line `EPD_ROUTER_ADDRESS=` confirms it)
so the workers start at the same time; workers bind port 0 and register with the router.
Each process logs to `<log_dir>/<name>.log`; a start-up failure raises with the tail of the
logs. `stop` sends SIGTERM (workers first, so they drain), then kills what is left.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import grpc

from common.server.auth import service_credentials
from common.server.credentials import ChannelCredentials
from common.settings.api_keys import write_api_keys_file
from common.settings.security import SecuritySettings, write_token_file
from epd.v1 import admin_service_pb2, admin_service_pb2_grpc, registry_service_pb2

ROOT = Path(__file__).resolve().parent.parent
ROLES = {
    "encoder": registry_service_pb2.WORKER_ROLE_ENCODER,
    "prefill": registry_service_pb2.WORKER_ROLE_PREFILL,
    "decode": registry_service_pb2.WORKER_ROLE_DECODE,
}
_ADDRESS = re.compile(r"EPD_ROUTER_ADDRESS=(\S+)")
_HTTP_ADDRESS = re.compile(r"EPD_HTTP_ADDRESS=(\S+)")


# The API keys of every test deployment: two tenants' client keys and an admin key.
CLIENT_KEY = "epd-test-client-key-tenant-a"
OTHER_KEY = "epd-test-client-key-tenant-b"
ADMIN_KEY = "epd-test-admin-key-operators"
TEST_KEYS = [
    (CLIENT_KEY, "tenant-a", False),
    (OTHER_KEY, "tenant-b", False),
    (ADMIN_KEY, "ops", True),
]

_SESSION_DIR: Path | None = None


def write_secrets(folder: Path) -> SecuritySettings:
    """A cluster token and the `TEST_KEYS` keys file in `folder`, as `[security]`."""
    token = write_token_file(folder / "cluster_token")
    keys = write_api_keys_file(folder / "api_keys.toml", TEST_KEYS)
    return SecuritySettings(cluster_token_file=str(token), api_keys_file=str(keys))


def cluster_security() -> SecuritySettings:
    """`[security]` for servers a test starts in its own process: one cluster token file and
    one API keys file (`TEST_KEYS`) per test session (in a fresh temporary folder, removed
    when the session's process exits)."""
    global _SESSION_DIR
    if _SESSION_DIR is None:
        import atexit
        import shutil
        import tempfile

        _SESSION_DIR = Path(tempfile.mkdtemp(prefix="epd-test-"))
        atexit.register(shutil.rmtree, _SESSION_DIR, ignore_errors=True)
        write_secrets(_SESSION_DIR)
    return SecuritySettings(
        cluster_token_file=str(_SESSION_DIR / "cluster_token"),
        api_keys_file=str(_SESSION_DIR / "api_keys.toml"),
    )


def cluster_credentials() -> ChannelCredentials:
    """What a service of the session's deployment presents (the cluster bearer)."""
    return service_credentials(cluster_security())


def admin_credentials() -> ChannelCredentials:
    """What an operator presents (the admin key)."""
    return ChannelCredentials(ADMIN_KEY)


@dataclass
class Cluster:
    """A started deployment; `stop` it (idempotent)."""

    address: str  # router host:port
    model: Path  # checkpoint folder every process serves
    log_dir: Path  # one <name>.log per process
    block_size: int  # KV block size of prefill and decode
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    workers: int = 3  # worker processes started (registration waits for all of them)
    renewing: bool = True  # a test's note of how its deployment was configured
    security: SecuritySettings = field(default_factory=SecuritySettings)  # every process's
    client_key: str = CLIENT_KEY  # tenant-a's API key
    other_key: str = OTHER_KEY  # tenant-b's API key
    admin_key: str = ADMIN_KEY  # the operators' (admin) API key
    http_url: str | None = None  # the router's HTTP API, "http://host:port" (start `http=True`)
    # Every router (start `routers=N`): `address` first, then router-1, router-2, ...
    router_addresses: list[str] = field(default_factory=list)
    # How each process was started, (module, args), so `respawn` can start it again.
    commands: dict[str, tuple[str, list[str]]] = field(default_factory=dict)

    def status(
        self, timeout_s: float = 5.0, address: str | None = None
    ) -> admin_service_pb2.StatusResponse:
        """AdminService.Status of the router at `address` (None: the first; blocking; as
        admin)."""
        with ChannelCredentials(self.admin_key).open_blocking(address or self.address) as channel:
            stub = admin_service_pb2_grpc.AdminServiceStub(channel)
            response: admin_service_pb2.StatusResponse = stub.Status(
                admin_service_pb2.StatusRequest(), timeout=timeout_s
            )
            return response

    def worker(self, role: str) -> admin_service_pb2.WorkerStatus:
        """The (only) worker of `role` in Status."""
        (found,) = [w for w in self.status().workers if w.info.role == ROLES[role]]
        return found

    def logs(self, tail: int = 40) -> str:
        """The last lines of every process's log, for failure messages."""
        out = []
        for name in self.procs:
            path = self.log_dir / f"{name}.log"
            lines = path.read_text(errors="replace").splitlines() if path.exists() else []
            out.append(f"--- {name} ---\n" + "\n".join(lines[-tail:]))
        return "\n".join(out)

    def check_alive(self) -> None:
        """Raise RuntimeError (with logs) when a process has exited."""
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"processes exited: {dead}\n{self.logs()}")

    def respawn(self, name: str, log_suffix: str = "restarted") -> subprocess.Popen[bytes]:
        """Start process `name` again as it was first started (same flags, so a worker with
        a fixed `--port` comes back at the same address); logs to <name>.<log_suffix>.log.
        The old process must have exited."""
        old = self.procs.get(name)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"{name} is still running")
        module, args = self.commands[name]
        proc = _spawn(module, args, self.log_dir / f"{name}.{log_suffix}.log")
        self.procs[name] = proc
        return proc

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the workers, then the routers; kill what is still running after
        `timeout_s`."""
        routers = [n for n in self.procs if n == "router" or n.startswith("router-")]
        order = [n for n in self.procs if n not in routers] + routers
        for name in order:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name in order:
            proc = self.procs.get(name)
            if proc is None:
                continue
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


def kill(cluster: Cluster, name: str) -> None:
    """SIGKILL one process of `cluster` (no drain, no goodbye) and reap it."""
    proc = cluster.procs[name]
    proc.kill()
    proc.wait(10)


def listening_pid(port: int) -> int:
    """The pid of the process listening on 127.0.0.1:`port` (Linux /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # LISTEN
                    inodes.add(cols[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                return int(pid)
    raise AssertionError(f"nobody listens on port {port}")


def free_port() -> int:
    """A port free on 127.0.0.1 now, below the range the kernel picks port-0 binds from:
    the process given it binds it only seconds later, and meanwhile no worker, client or
    UCX listener of the machine (each binding port 0) can take it (flaky review, s33)."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(10_000, low) if low > 10_001 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # taken: another
                continue
            return int(sock.getsockname()[1])
    raise RuntimeError("no free port below the ephemeral range")


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for port 0 (Linux: 32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _spawn(module: str, args: list[str], log: Path, root: Path = ROOT) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def start_cluster(
    model: Path,
    log_dir: Path,
    *,
    block_size: int = 8,
    num_blocks: int = 512,
    heartbeat_interval_s: float = 0.2,
    encoder_args: tuple[str, ...] = (),
    prefill_args: tuple[str, ...] = (),
    decode_args: tuple[str, ...] = (),
    router_args: tuple[str, ...] = (),
    encoders: int = 1,
    http: bool = False,
    timeout_s: float = 120.0,
    routers: int = 1,
    root: Path = ROOT,
    prefills: int = 1,
    decodes: int = 1,
) -> Cluster:
    """Start router + `encoders` encoders + `prefills` prefill + `decodes` decode workers
    and wait until all registered (workers of a role after the first are named encoder-1,
    prefill-1, decode-1, ...). `http`: the router also serves its HTTP API on a free port
    (`Cluster.http_url`); off otherwise. `routers`: that many routers (router, router-1, ...;
    `Cluster.router_addresses`), every worker registered with all of them. `root`: the
    checkout whose code the processes run (another one's, e.g. a benchmark's baseline).

    Raises RuntimeError (with the logs) when a process dies or `timeout_s` passes first;
    nothing is left running then.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    security = write_secrets(log_dir)
    common = [
        "--model",
        str(model),
        "--log-level",
        "INFO",
        "--security-cluster-token-file",
        str(security.cluster_token_file),
    ]
    router_log = log_dir / "router.log"
    # The router's port is picked here so the workers can start alongside it (they retry
    # registering until it listens); its log line confirms the address it bound.
    cluster = Cluster(f"127.0.0.1:{free_port()}", model, log_dir, block_size, security=security)
    try:
        cluster.commands["router"] = (  # `respawn("router")` comes back at the same address
            "router",
            [
                *common,
                "--port",
                cluster.address.rsplit(":", 1)[1],
                "--heartbeat-interval-s",
                str(heartbeat_interval_s),
                "--worker-timeout-s",
                str(max(5.0, 20 * heartbeat_interval_s)),
                "--security-api-keys-file",
                str(security.api_keys_file),
                "--http-port",
                "0" if http else "-1",
                *router_args,
            ],
        )
        cluster.procs["router"] = _spawn(*cluster.commands["router"], router_log, root)
        _spawn_more_routers(cluster, routers)
        deadline = time.monotonic() + timeout_s
        kv = ["--block-size", str(block_size), "--num-blocks", str(num_blocks)]
        worker_args = {
            "encoder": list(encoder_args),
            "prefill": [*kv, *prefill_args],
            "decode": [*kv, *decode_args],
        }
        names = [("encoder", "encoder")]
        names += [("encoder", f"encoder-{i}") for i in range(1, encoders)]
        names += [("prefill", "prefill")]
        names += [("prefill", f"prefill-{i}") for i in range(1, prefills)]
        names += [("decode", "decode")]
        names += [("decode", f"decode-{i}") for i in range(1, decodes)]
        routers_flag = (
            ["--router-address", cluster.address]
            if routers == 1
            else ["--router-addresses", ",".join(cluster.router_addresses)]
        )
        for role, name in names:
            cluster.commands[name] = (
                f"{role}_worker",
                [*common, *routers_flag, "--name", name, *worker_args[role]],
            )
            cluster.procs[name] = _spawn(*cluster.commands[name], log_dir / f"{name}.log", root)
        bound = _wait_address(cluster, router_log, deadline)
        if bound != cluster.address:
            raise RuntimeError(f"router bound {bound}, not {cluster.address}")
        if http:
            cluster.http_url = "http://" + _wait_address(
                cluster, router_log, deadline, _HTTP_ADDRESS
            )
        cluster.workers = len(names)
        _wait_registered(cluster, deadline)
    except BaseException:
        cluster.stop(timeout_s=5.0)
        raise
    return cluster


def _spawn_more_routers(cluster: Cluster, routers: int) -> None:
    """Routers router-1 ... router-(routers-1), each started as the first one (same flags)
    on a port of its own, without the HTTP API; fills `cluster.router_addresses`."""
    cluster.router_addresses = [cluster.address]
    first = cast("list[str]", cluster.procs["router"].args)  # python -m router ...
    args = [str(a) for a in first][3:]
    args[args.index("--http-port") + 1] = "-1"
    for index in range(1, routers):
        name, address = f"router-{index}", f"127.0.0.1:{free_port()}"
        args[args.index("--port") + 1] = address.rsplit(":", 1)[1]
        cluster.commands[name] = ("router", list(args))
        cluster.procs[name] = _spawn("router", list(args), cluster.log_dir / f"{name}.log")
        cluster.router_addresses.append(address)


def _wait_address(
    cluster: Cluster, log: Path, deadline: float, pattern: re.Pattern[str] = _ADDRESS
) -> str:
    while time.monotonic() < deadline:
        cluster.check_alive()
        match = pattern.search(log.read_text(errors="replace")) if log.exists() else None
        if match:
            return match.group(1)
        time.sleep(0.1)
    raise RuntimeError(f"router did not start in time\n{cluster.logs()}")


def _wait_registered(cluster: Cluster, deadline: float) -> None:
    want = set(ROLES.values())
    waiting = list(cluster.router_addresses or [cluster.address])  # every router
    while time.monotonic() < deadline:
        cluster.check_alive()
        try:
            workers = cluster.status(address=waiting[0]).workers
        except grpc.RpcError:
            workers = []
        if want <= {w.info.role for w in workers} and len(workers) >= cluster.workers:
            waiting.pop(0)
            if not waiting:
                return
            continue
        time.sleep(0.1)
    raise RuntimeError(f"workers did not register in time\n{cluster.logs()}")
