"""Offline checks that the deploy/ manifests are hardened and sized: pods run as non-root
without privileges; every gRPC Deployment has a startup probe, and the probes ask the right
health service over a transport the kubelet speaks; worker pods have a memory-backed
/dev/shm and a read-only /models; every worker reads the cluster token from a Secret;
NetworkPolicies open only the router's client port; Ray requires its token and its
dashboard is not exposed; pods outlive their drain and hold what their settings let them;
and every `epd scale` the deploy docs show fits the RayCluster.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any

import pytest

from cluster.settings import EpdSettings
from common.server.rpc import LIVENESS_SERVICE
from common.settings.schema import from_mapping
from tests.test_deploy import (
    CONTAINERS,
    DEPLOY,
    DOCUMENTS,
    _ids,
    _parse_module_args,
    _pod_specs,
    _security_of,
    _substitute,
)

POD_DOCUMENTS = [(n, d) for n, d in DOCUMENTS if _pod_specs(d)]


@pytest.mark.parametrize(("name", "doc"), POD_DOCUMENTS, ids=_ids(POD_DOCUMENTS))
def test_pods_run_as_non_root_without_privileges(name: str, doc: dict[str, Any]) -> None:
    for pod in _pod_specs(doc):
        context = pod.get("securityContext", {})
        assert context.get("runAsNonRoot") is True and context.get("runAsUser", 0) > 0, name
        for container in pod["containers"]:
            own = container.get("securityContext", {})
            assert own.get("allowPrivilegeEscalation", True) is False, name
            assert "ALL" in own.get("capabilities", {}).get("drop", []), name


WORKER_DEPLOYMENTS = [
    (n, d)
    for n, d in DOCUMENTS
    if d["kind"] == "Deployment" and d["metadata"]["name"] != "epd-router"
]


def _shm_mounted(pod: dict[str, Any], container: dict[str, Any]) -> bool:
    """`container` mounts a memory-backed emptyDir at /dev/shm."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if mount["mountPath"] == "/dev/shm":
            return volumes[mount["name"]].get("emptyDir", {}).get("medium") == "Memory"
    return False


@pytest.mark.parametrize(("name", "doc"), WORKER_DEPLOYMENTS, ids=_ids(WORKER_DEPLOYMENTS))
def test_worker_pods_have_shm_and_models(name: str, doc: dict[str, Any]) -> None:
    (pod,) = _pod_specs(doc)
    for container in pod["containers"]:
        assert _shm_mounted(pod, container), f"{name}: no memory-backed /dev/shm"
        models = [m for m in container["volumeMounts"] if m["mountPath"] == "/models"]
        assert len(models) == 1 and models[0].get("readOnly") is True, f"{name}: /models"
    assert len(WORKER_DEPLOYMENTS) == 3


DEPLOYMENTS = [(n, d) for n, d in DOCUMENTS if d["kind"] == "Deployment"]


@pytest.mark.parametrize(("name", "doc"), DEPLOYMENTS, ids=_ids(DEPLOYMENTS))
def test_every_grpc_container_has_a_startup_probe(name: str, doc: dict[str, Any]) -> None:
    # The router had none: before its port opens it hashes every weight file (about a second
    # per GB), and its liveness probe killed it after 60 s, again at every restart.
    (pod,) = _pod_specs(doc)
    serving = [c for c in pod["containers"] if any(p.get("name") == "grpc" for p in c["ports"])]
    assert serving, name
    for container in serving:
        startup = container.get("startupProbe")
        assert startup is not None and "grpc" in startup, f"{name}: no gRPC startupProbe"
        ports = {p["containerPort"] for p in container["ports"]}
        assert startup["grpc"]["port"] in ports, name
        # generous: loading (or hashing) a model may take minutes before liveness counts
        assert startup["failureThreshold"] * startup.get("periodSeconds", 10) >= 300, name
        # Readiness ("") waits for routers or workers: a pod is not restarted for that.
        assert startup["grpc"].get("service") == LIVENESS_SERVICE, name


@pytest.mark.parametrize(("name", "doc"), POD_DOCUMENTS, ids=_ids(POD_DOCUMENTS))
def test_readiness_probes_ask_the_readiness_service(name: str, doc: dict[str, Any]) -> None:
    # `liveness` says SERVING from start to shutdown: a readiness probe asking it made a
    # worker Ready before any router accepted it, and a router with no workers.
    for pod in _pod_specs(doc):
        for container in pod["containers"]:
            ready = container.get("readinessProbe")
            if ready is not None and "grpc" in ready:
                assert ready["grpc"].get("service", "") == "", name


@pytest.mark.parametrize(("name", "doc"), POD_DOCUMENTS, ids=_ids(POD_DOCUMENTS))
def test_a_process_serving_tls_has_no_kubelet_grpc_probe(name: str, doc: dict[str, Any]) -> None:
    """The kubelet's `grpc:` probes speak plaintext only; a process with a TLS certificate
    speaks only TLS on its port, health included: every such probe fails and the pod is
    restarted. TLS needs `exec:` probes that speak it (deploy/README.md, "TLS and the
    probes")."""
    for pod in _pod_specs(doc):
        for container in pod["containers"]:
            command = container.get("command", [])
            if command[:2] != ["python", "-m"] and "epd serve" not in str(container):
                continue
            if _security_of(container, doc).tls_cert_file:
                for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                    assert "grpc" not in container.get(kind, {}), f"{name}: {kind} over TLS"


@pytest.mark.parametrize(("name", "doc"), POD_DOCUMENTS, ids=_ids(POD_DOCUMENTS))
def test_liveness_probes_ask_the_liveness_service(name: str, doc: dict[str, Any]) -> None:
    # "" is readiness: a router with no worker of some role yet says NOT_SERVING there, and
    # a liveness probe on it restarted the router while it waited for its workers.
    for pod in _pod_specs(doc):
        for container in pod["containers"]:
            live = container.get("livenessProbe")
            if live is not None and "grpc" in live:
                assert live["grpc"].get("service") == LIVENESS_SERVICE, name


def test_ray_worker_pods_have_shm() -> None:
    (cluster,) = [d for _, d in DOCUMENTS if d["kind"] == "RayCluster"]
    for group in cluster["spec"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        assert all(_shm_mounted(pod, c) for c in pod["containers"]), group["groupName"]


def test_every_worker_reads_the_cluster_token_from_a_secret() -> None:
    for name, container, doc in CONTAINERS:
        if "router" in name and doc["kind"] == "Deployment":
            continue
        mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
        assert "/var/run/epd/cluster-token" in mounts, name
        pods = _pod_specs(doc)
        secrets = {
            v["secret"]["secretName"] for p in pods for v in p.get("volumes", []) if "secret" in v
        }
        assert "epd-cluster-token" in secrets, name


def test_network_policies_open_only_the_router_client_port() -> None:
    for folder, router in (("kubernetes", "router"), ("kuberay", "ray-head")):
        docs = [d for n, d in DOCUMENTS if n.startswith(f"deploy/{folder}/")]
        policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        assert policies, folder
        open_ports = []
        for policy in policies:
            selector = policy["spec"]["podSelector"]["matchLabels"]
            assert selector["app.kubernetes.io/name"] == "epd"
            for rule in policy["spec"]["ingress"]:
                if "from" in rule:  # only the namespace's epd pods
                    assert all(
                        f["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "epd"}
                        for f in rule["from"]
                    )
                else:  # from anywhere: must be the router's client port only
                    assert selector.get("app.kubernetes.io/component") == router
                    open_ports += [p["port"] for p in rule["ports"]]
        assert open_ports == [50051], folder


def test_ray_requires_its_token() -> None:
    """Ray's servers on the pod IPs (GCS, Ray Client, the dashboard agent, which takes job
    submissions) let anyone who reaches a pod run code on the head unless Ray's token auth
    is on: KubeRay's `authOptions` (v1.5.1+) turns it on, for Ray 2.52 or newer."""
    (cluster,) = [d for _, d in DOCUMENTS if d["kind"] == "RayCluster"]
    assert cluster["spec"].get("authOptions", {}).get("mode") == "token"
    ray_version = cluster["spec"]["rayVersion"]
    assert tuple(int(p) for p in ray_version.split(".")[:2]) >= (2, 52), ray_version
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    image = re.search(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.MULTILINE)
    assert image is not None and image.group(1) == ray_version, "image's Ray != rayVersion"
    for pod in _pod_specs(cluster):  # none turns it off again
        for container in pod["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert env.get("RAY_AUTH_MODE", "token") == "token", container["name"]


def test_ray_dashboard_is_not_exposed() -> None:
    (cluster,) = [d for _, d in DOCUMENTS if d["kind"] == "RayCluster"]
    params = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    assert params.get("dashboard-host", "127.0.0.1") in ("127.0.0.1", "localhost")


def _quantity(value: str | int) -> float:
    """A Kubernetes CPU or count quantity ("4", "500m") as a number."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_kuberay_scale_commands_fit_the_raycluster() -> None:
    """Every `epd scale` the deploy docs show fits the RayCluster: the pools' GPUs within the
    GPU pods the cluster can have (maxReplicas with the autoscaler, else replicas), and
    each worker's Ray CPU request (its threads, `cluster.placement`) within a pod's CPUs."""
    from cluster.placement import CpuPlanner

    (cluster,) = [d for _, d in DOCUMENTS if d["kind"] == "RayCluster"]
    (config,) = [d for _, d in DOCUMENTS if d["metadata"]["name"] == "epd-ray-config"]
    settings = from_mapping(EpdSettings, tomllib.loads(config["data"]["epd.toml"]))
    spec = cluster["spec"]
    autoscaled = spec.get("enableInTreeAutoscaling", False)
    (group,) = spec["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    requests = container["resources"]["requests"]
    pod_gpus, pod_cpus = _quantity(requests["nvidia.com/gpu"]), _quantity(requests["cpu"])
    pods = group["maxReplicas"] if autoscaled else group["replicas"]
    gpus_per_worker = settings.pools.gpus_per_worker(pod_gpus * group["replicas"])
    text = (DEPLOY / "README.md").read_text() + (DEPLOY / "kuberay" / "raycluster.yaml").read_text()
    scales = re.findall(r"epd scale --role (\w+) --replicas (\d+)", text)
    assert scales, "the deploy docs show no `epd scale`"
    for role, replicas in scales:
        pools = {**settings.pools.initial_replicas(), role: int(replicas)}
        need = sum(pools.values()) * gpus_per_worker
        assert need <= pods * pod_gpus, f"`epd scale --role {role} --replicas {replicas}`"
    starting = sum(settings.pools.initial_replicas().values())
    plan = CpuPlanner.for_cluster(
        tuple(range(int(pod_cpus))), group["replicas"], starting, settings.pools.num_cpus
    )
    for threads in (settings.encoder.threads, settings.prefill.threads, settings.decode.threads):
        assert plan.take("worker", threads)[1] <= pod_cpus


def test_every_worker_runs_as_many_threads_as_its_pod_requests_cpus() -> None:
    """A worker left at `threads` 0 takes every core of the node (in a pod too: no cgroup
    quota is read), not the CPUs its pod requests: it oversubscribes the node."""
    for name, container, _doc in CONTAINERS:
        if container.get("command", [])[:2] != ["python", "-m"]:
            continue
        module = container["command"][2]
        if module == "router":
            continue
        parsed = _parse_module_args(module, [_substitute(a, {}) for a in container["args"]])
        cpus = _quantity(container["resources"]["requests"]["cpu"])
        assert parsed.threads == cpus, f"{name}: {parsed.threads} threads, {cpus} CPUs"
    (config,) = [d for _, d in DOCUMENTS if d["metadata"]["name"] == "epd-ray-config"]
    settings = from_mapping(EpdSettings, tomllib.loads(config["data"]["epd.toml"]))
    (cluster,) = [d for _, d in DOCUMENTS if d["kind"] == "RayCluster"]
    (group,) = cluster["spec"]["workerGroupSpecs"]
    (worker,) = group["template"]["spec"]["containers"]
    cpus = _quantity(worker["resources"]["requests"]["cpu"])
    for role in (settings.encoder, settings.prefill, settings.decode):
        assert role.threads == cpus


def test_the_ray_head_has_time_to_drain() -> None:
    """`epd serve` on the head drains on SIGTERM for up to `[pools] drain_timeout_s` + 30 s;
    Kubernetes kills the pod after its grace period (30 s unless set)."""
    (config,) = [d for _, d in DOCUMENTS if d["metadata"]["name"] == "epd-ray-config"]
    settings = from_mapping(EpdSettings, tomllib.loads(config["data"]["epd.toml"]))
    (cluster,) = [d for _, d in DOCUMENTS if d["kind"] == "RayCluster"]
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    assert head.get("terminationGracePeriodSeconds", 30) > settings.pools.drain_timeout_s + 30


def test_the_routers_memory_limit_covers_what_its_settings_let_it_hold() -> None:
    """The router holds up to `requests_in_flight_mb` of requests and its caches' budgets,
    beside ~300 MiB at rest: a limit below that OOM-kills it under load, not at start.
    The margin: 1 GiB for the router's process (at rest, and a request's transient copies);
    on the Ray head 3 GiB more for Ray's head processes (GCS, raylet, dashboard and its
    agent, log monitor, runtime-env agent) and the `epd serve` driver, which imports torch,
    beside the Controller actor the router runs in. An OOM-killed head takes the whole Ray
    cluster down."""
    checked = []
    for name, container, doc in CONTAINERS:
        command = container.get("command", [])
        if command[:3] == ["python", "-m", "router"]:
            argv = [_substitute(a, {}) for a in container["args"]]
            parsed = _parse_module_args("router", argv)
            settings = parsed[0] if isinstance(parsed, tuple) else parsed
            margin = 1 << 30
        elif "epd serve" in " ".join(container.get("args", [])):
            (config,) = [d for _, d in DOCUMENTS if d["metadata"]["name"] == "epd-ray-config"]
            settings = from_mapping(EpdSettings, tomllib.loads(config["data"]["epd.toml"])).router
            margin = (1 << 30) + (3 << 30)
        else:
            continue
        holds = (
            settings.requests_in_flight_mb
            + settings.processed_image_cache_mb
            + settings.embedding_cache_mb
        ) << 20
        memory = str(container["resources"]["limits"]["memory"])
        units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
        limit = int(memory[:-2]) * units[memory[-2:]] if memory[-2:] in units else int(memory)
        assert limit >= holds + margin, f"{name}: {limit} bytes for {holds} held"
        checked.append(doc["kind"])
    assert sorted(checked) == ["Deployment", "RayCluster"]


def test_routers_wait_for_their_service_to_forget_them_before_draining() -> None:
    """On deletion, Kubernetes sends SIGTERM while the Service still lists the pod for a few
    seconds; a router that drained at once refused the requests still sent to it. A preStop
    pause comes first, and the grace period covers it and the drain."""
    for name, container, doc in CONTAINERS:
        if container.get("command", [])[:3] != ["python", "-m", "router"]:
            continue
        pause = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pause[0] == "sleep" and int(pause[1]) >= 5, name
        parsed = _parse_module_args("router", [_substitute(a, {}) for a in container["args"]])
        settings = parsed[0] if isinstance(parsed, tuple) else parsed
        (spec,) = _pod_specs(doc)
        grace = spec.get("terminationGracePeriodSeconds", 30)
        assert grace > int(pause[1]) + settings.drain_timeout_s, name


# Seconds a process needs after its drain ends: the ordered stop (registrations, gRPC,
# background loops, the role's cleanup: NIXL agent, model thread, ...).
STOP_MARGIN_S = 10


@pytest.mark.parametrize(("name", "doc"), DEPLOYMENTS, ids=_ids(DEPLOYMENTS))
def test_every_deployment_outlives_its_drain(name: str, doc: dict[str, Any]) -> None:
    """On SIGTERM a process drains for up to `drain_timeout_s`, after its preStop pause;
    Kubernetes SIGKILLs it at the grace period's end, mid-drain if that comes first: the
    work in flight is cut off, and the routers learn it from failed calls."""
    (pod,) = _pod_specs(doc)
    grace = pod.get("terminationGracePeriodSeconds", 30)
    for container in pod["containers"]:
        command = container["command"]
        parsed = _parse_module_args(command[2], [_substitute(a, {}) for a in container["args"]])
        settings = parsed[0] if isinstance(parsed, tuple) else parsed
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {})
        pause = int(pre_stop["command"][1]) if pre_stop.get("command", [""])[0] == "sleep" else 0
        need = pause + settings.drain_timeout_s + STOP_MARGIN_S
        assert grace >= need, (
            f"{name}: grace {grace} s < {need} s (drain {settings.drain_timeout_s})"
        )
