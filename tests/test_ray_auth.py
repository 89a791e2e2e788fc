"""The local Ray cluster `epd serve` starts (`cluster.ray_start.init_ray`) takes only callers
with its token: Ray's servers listen on every interface, and anyone who reached one could
join the cluster and run code as the deployment's user (read its cluster token, scale its
pools). Run in a child process, so that this one's environment and Ray stay untouched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import os, grpc, ray
from cluster.ray_start import init_ray
from cluster.settings import RaySettings
init_ray(RaySettings(num_cpus=1, object_store_mb=100))
from ray.core.generated import gcs_service_pb2 as pb, gcs_service_pb2_grpc as rpc
stub = rpc.NodeInfoGcsServiceStub(grpc.insecure_channel(ray.get_runtime_context().gcs_address))
try:
    stub.GetAllNodeInfo(pb.GetAllNodeInfoRequest(), timeout=10)
    print("stranger: answered")
except grpc.RpcError as exc:
    print("stranger:", exc.code().name)
token = [("authorization", "Bearer " + os.environ["RAY_AUTH_TOKEN"])]
nodes = stub.GetAllNodeInfo(pb.GetAllNodeInfoRequest(), timeout=10, metadata=token)
print("insider nodes:", len(nodes.node_info_list))

@ray.remote(num_cpus=0.1)
def pid() -> int:
    return os.getpid()

print("task ran:", ray.get(pid.remote()) > 0)
ray.shutdown()
"""


def test_a_caller_without_the_clusters_token_is_refused(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    if "RAY_TMPDIR" in os.environ:  # its session folder goes with the run's (conftest)
        env["RAY_TMPDIR"] = os.environ["RAY_TMPDIR"]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # 8 s alone, 59 s on a loaded machine
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "stranger: UNAUTHENTICATED" in lines
    assert "insider nodes: 1" in lines and "task ran: True" in lines


def test_a_signal_while_ray_starts_is_held_until_it_has() -> None:
    # SIGINT or SIGTERM in the seconds `ray.init` took (Ray's own SIGTERM handler exits at
    # once) left its dashboard and runtime-env agents running for good.
    import os
    import signal

    import pytest

    from cluster.ray_start import signals_held

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match="while Ray started"), signals_held():
        os.kill(os.getpid(), signal.SIGTERM)
        survived = True  # it did not end the block
    assert survived and signal.getsignal(signal.SIGTERM) is before
    with signals_held():  # no signal: nothing raised
        pass
    # A start that fails after the signal is a stop all the same.
    with pytest.raises(KeyboardInterrupt), signals_held():
        os.kill(os.getpid(), signal.SIGTERM)
        raise RuntimeError("the node timed out during startup")
    # A second signal does not wait for a start that may hang.
    with pytest.raises(KeyboardInterrupt, match="again"), signals_held():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("not reached")
    assert signal.getsignal(signal.SIGTERM) is before
