"""Offline checks of deploy/: every manifest validates, and every command it runs is real.

- Core Kubernetes kinds validate against the schemas bundled with `kubernetes-validate`.
- KubeRay kinds validate against the KubeRay CRD schemas shipped in tests/data/kuberay/
  (trimmed copies; see the README there) with jsonschema.
- Container commands name entry points of this project (`python -m X` with an `X.__main__`,
  or the `epd` console script) and their flags parse with the real argparse parsers; the
  embedded epd.toml loads as `EpdSettings`; Services select pods that exist and target
  ports the containers declare; the Dockerfile installs every package and the pinned torch.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.cli import build_parser, load_settings
from cluster.settings import EpdSettings
from common.settings.schema import from_mapping

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUBERAY_SCHEMAS = ROOT / "tests" / "data" / "kuberay"
K8S_VERSION = "1.33"
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append(
                    (f"{path.relative_to(ROOT)}:{doc['kind']}/{doc['metadata']['name']}", doc)
                )
    return docs


DOCUMENTS = _documents()
CORE = [(name, doc) for name, doc in DOCUMENTS if not doc["apiVersion"].startswith("ray.io/")]
KUBERAY = [(name, doc) for name, doc in DOCUMENTS if doc["apiVersion"].startswith("ray.io/")]


def _ids(items: list[tuple[str, Any]]) -> list[str]:
    return [name for name, _ in items]


def test_deploy_has_both_modes() -> None:
    kinds = {doc["kind"] for _, doc in DOCUMENTS}
    assert {"Deployment", "Service", "ConfigMap", "RayCluster"} <= kinds
    deployments = {doc["metadata"]["name"] for _, doc in DOCUMENTS if doc["kind"] == "Deployment"}
    assert deployments == {"epd-router", "epd-encoder", "epd-prefill", "epd-decode"}
    assert (DEPLOY / "Dockerfile").is_file()
    assert (DEPLOY / "README.md").is_file()


# ---------------------------------------------------------------------------- schemas


@pytest.mark.parametrize(("name", "doc"), CORE, ids=_ids(CORE))
def test_core_manifest_validates(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    # strict: unknown fields are errors too (a misspelt key would otherwise pass silently)
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _kuberay_schema(doc: dict[str, Any]) -> dict[str, Any]:
    return _crd_schema(doc["apiVersion"], doc["kind"])


@functools.cache
def _crd_schema(api_version: str, kind: str) -> dict[str, Any]:
    group, version = api_version.split("/")
    path = KUBERAY_SCHEMAS / f"{group}_{kind.lower()}s.yaml"
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are large
    crd = yaml.load(path.read_text(), Loader=loader)
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind, path
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return dict(v["schema"]["openAPIV3Schema"])
    raise AssertionError(f"{path} has no version {version}")


@pytest.mark.parametrize(("name", "doc"), KUBERAY, ids=_ids(KUBERAY))
def test_kuberay_manifest_validates(name: str, doc: dict[str, Any]) -> None:
    import jsonschema

    schema = _kuberay_schema(doc)
    jsonschema.validate(doc, schema, cls=jsonschema.Draft7Validator)
    # CRD schemas allow unknown fields only where they say so; also catch misspelt top-level
    # spec keys, which a structural schema would prune silently in a real cluster.
    unknown = set(doc["spec"]) - set(schema["properties"]["spec"]["properties"])
    assert not unknown, f"unknown spec fields {unknown}"


def test_kuberay_schema_check_catches_errors() -> None:
    """The schema check is not vacuous: a wrong type in the RayCluster is rejected."""
    import jsonschema

    doc = next(d for _, d in KUBERAY if d["kind"] == "RayCluster")
    schema = _kuberay_schema(doc)
    broken = yaml.safe_load(yaml.safe_dump(doc))
    broken["spec"]["workerGroupSpecs"][0]["replicas"] = "three"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema, cls=jsonschema.Draft7Validator)


# -------------------------------------------------------------------------- commands


def _pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] in WORKLOAD_KINDS:
        return [doc["spec"]["template"]["spec"]]
    if doc["kind"] == "RayCluster":
        spec = doc["spec"]
        groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
        return [g["template"]["spec"] for g in groups]
    return []


def _containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    out = []
    for name, doc in DOCUMENTS:
        for pod in _pod_specs(doc):
            for container in pod["containers"]:
                out.append((f"{name}/{container['name']}", container, doc))
    return out


CONTAINERS = _containers()


def _substitute(arg: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion with stand-in values for downward-API variables."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), "x"), arg)


def _parse_module_args(module: str, argv: list[str]) -> Any:
    """Parse `python -m module argv` with that module's own parser (SystemExit = refused)."""
    assert importlib.util.find_spec(f"{module}.__main__") is not None, f"no {module}.__main__"
    main = importlib.import_module(f"{module}.__main__")
    parse = getattr(main, "parse_args", None) or getattr(main, "parse", None)
    assert parse is not None, f"{module}.__main__ exposes no parse_args/parse function"
    try:
        return parse(argv)
    except SystemExit as exc:
        raise AssertionError(f"python -m {module} refused {argv}") from exc


def _epd_commands(script: str) -> list[list[str]]:
    """The `epd ...` command lines inside a shell script (after `exec` or `;`)."""
    commands = []
    for part in re.split(r"[;&|\n]+", script):
        words = shlex.split(part)
        if words and words[0] == "exec":
            words = words[1:]
        if words and words[0] == "epd":
            commands.append(words[1:])
    return commands


@pytest.mark.parametrize(("name", "container", "doc"), CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_container_command_is_a_real_entry_point(
    name: str, container: dict[str, Any], doc: dict[str, Any]
) -> None:
    command = container.get("command", [])
    args = container.get("args", [])
    env = {
        e["name"]: "10.0.0.7" if "IP" in e["name"] else "pod-0" for e in container.get("env", [])
    }
    if command[:2] == ["python", "-m"]:
        module = command[2]
        argv = [_substitute(a, env) for a in [*command[3:], *args]]
        settings = _parse_module_args(module, argv)
        if isinstance(settings, tuple):
            settings = settings[0]
        if module.endswith("_worker"):
            assert settings.router_dns == "epd-router-pods:50051"  # every router
            assert settings.host == "0.0.0.0"
            assert settings.advertise_address == f"10.0.0.7:{settings.port}"
            ports = {p["containerPort"] for p in container["ports"]}
            assert settings.port in ports
        return
    assert command == ["/bin/bash", "-lc", "--"], f"{name}: unexpected command {command}"
    script = " ".join(args)
    assert "$KUBERAY_GEN_RAY_START_CMD" in script, f"{name}: must start Ray"
    assert doc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    for argv in _epd_commands(script):
        parsed = build_parser().parse_args(argv)
        assert parsed.command == "serve"
        assert parsed.ray__address == "auto"
        config = _configmap_toml(doc, container, parsed.config)
        settings = load_settings_from_text(config, parsed)
        assert settings.ray.address == "auto"
        assert settings.router.host == "0.0.0.0"
        router_ports = {p["containerPort"] for p in container["ports"]}
        assert settings.router.port in router_ports


def load_settings_from_text(text: str, parsed: Any) -> EpdSettings:
    """`load_settings` for a config given as text (flags applied over it)."""
    from common.settings.schema import apply_flags

    settings = from_mapping(EpdSettings, tomllib.loads(text))
    return apply_flags(settings, parsed)


def _configmap_toml(doc: dict[str, Any], container: dict[str, Any], path: str) -> str:
    """The text of `path` as mounted into `container` from a ConfigMap of the same files."""
    pod = next(p for p in _pod_specs(doc) if container in p["containers"])
    for mount in container.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
            cm_name = volume["configMap"]["name"]
            cm = next(
                d
                for _, d in DOCUMENTS
                if d["kind"] == "ConfigMap" and d["metadata"]["name"] == cm_name
            )
            return str(cm["data"][Path(path).name])
    raise AssertionError(f"{path} is not mounted from a ConfigMap")


def test_epd_console_script_points_at_cli_main() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = pyproject["project"]["scripts"]["epd"]
    module, _, func = target.partition(":")
    assert callable(getattr(importlib.import_module(module), func))
    assert module == "cluster.cli"


def test_load_settings_reads_the_file_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "epd.toml"
    path.write_text("[pools]\nprefill_replicas = 2\n")
    args = build_parser().parse_args(["serve", "--config", str(path), "--address", "auto"])
    settings = load_settings(args)
    assert settings.pools.prefill_replicas == 2
    assert settings.ray.address == "auto"


# -------------------------------------------------------------------- services, image


@pytest.mark.parametrize(
    ("name", "doc"),
    [(n, d) for n, d in DOCUMENTS if d["kind"] == "Service"],
    ids=[n for n, d in DOCUMENTS if d["kind"] == "Service"],
)
def test_service_selects_pods_and_ports_exist(name: str, doc: dict[str, Any]) -> None:
    selector = doc["spec"]["selector"]
    matches = []
    for _, other in DOCUMENTS:
        templates = []
        if other["kind"] in WORKLOAD_KINDS:
            templates = [other["spec"]["template"]]
        elif other["kind"] == "RayCluster":
            spec = other["spec"]
            templates = [g["template"] for g in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]]
        for template in templates:
            labels = template["metadata"].get("labels", {})
            if all(labels.get(k) == v for k, v in selector.items()):
                matches.append(template)
    assert len(matches) == 1, f"{name} selects {len(matches)} pod templates"
    ports = matches[0]["spec"]["containers"][0]["ports"]
    for port in doc["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        known = {p.get("name") for p in ports} | {p["containerPort"] for p in ports}
        assert target in known, f"{name}: targetPort {target} not declared by the pods"


def test_dockerfile_installs_the_project() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert text.splitlines()[
        next(i for i, x in enumerate(text.splitlines()) if x.startswith("FROM"))
    ] == ("FROM python:3.11-slim")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch=="))
    assert f"ARG TORCH_VERSION={torch_pin.removeprefix('torch==')}" in text
    assert "download.pytorch.org/whl/${TORCH_INDEX}" in text
    for package in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        folder = package.rstrip("*")
        assert re.search(rf"^COPY {folder} \./{folder}$", text, re.M), f"{folder} not copied"


def _dockerignore_excludes(path: str) -> bool:
    """Whether the root .dockerignore keeps `path` (relative, "/"-separated) out of the build
    context: the last matching pattern wins, a "!" pattern re-includes; a folder's exclusion
    covers what is inside it."""
    import fnmatch

    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        if any(
            fnmatch.fnmatch(p, pattern) or fnmatch.fnmatch(p, pattern.removeprefix("**/"))
            for p in prefixes
        ):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_local_state_out_and_what_the_image_copies_in() -> None:
    for path in (".venv", ".venv/bin/python", ".git", ".git/config", "a.log", "x/y.log"):
        assert _dockerignore_excludes(path), f".dockerignore does not exclude {path}"
    assert _dockerignore_excludes("common/__pycache__/x.cpython-311.pyc")
    copied = re.findall(r"^COPY (.+?) \S+$", (DEPLOY / "Dockerfile").read_text(), re.M)
    sources = [s for line in copied for s in line.split()]
    assert "pyproject.toml" in sources
    for source in sources:
        assert not _dockerignore_excludes(source), f".dockerignore excludes {source}"


def test_dockerfile_pins_ray_within_pyproject() -> None:
    from packaging.requirements import Requirement

    text = (DEPLOY / "Dockerfile").read_text()
    version = re.search(r"^ARG RAY_VERSION=(\S+)$", text, re.M)
    assert version, "the Dockerfile must pin Ray (ARG RAY_VERSION=...)"
    assert '"ray[default]==${RAY_VERSION}"' in text
    assert re.search(r"^RUN pip install \. ", text, re.M), "installs the project's own pins"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (ray,) = [
        Requirement(d) for d in pyproject["project"]["dependencies"] if Requirement(d).name == "ray"
    ]
    assert ray.specifier.contains(version.group(1)), f"ray=={version.group(1)} is not {ray}"


# ------------------------------------------------------------------------- hardening


@pytest.mark.parametrize(
    ("name", "doc"),
    [(n, d) for n, d in DOCUMENTS if _pod_specs(d)],
    ids=[n for n, d in DOCUMENTS if _pod_specs(d)],
)
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
def test_worker_pods_have_a_startup_probe_shm_and_models(name: str, doc: dict[str, Any]) -> None:
    (pod,) = _pod_specs(doc)
    for container in pod["containers"]:
        startup = container.get("startupProbe")
        assert startup is not None and "grpc" in startup, f"{name}: no gRPC startupProbe"
        ports = {p["containerPort"] for p in container["ports"]}
        assert startup["grpc"]["port"] in ports, name
        # generous: model loading may take minutes before liveness starts counting
        assert startup["failureThreshold"] * startup.get("periodSeconds", 10) >= 300, name
        assert _shm_mounted(pod, container), f"{name}: no memory-backed /dev/shm"
        models = [m for m in container["volumeMounts"] if m["mountPath"] == "/models"]
        assert len(models) == 1 and models[0].get("readOnly") is True, f"{name}: /models"
    assert len(WORKER_DEPLOYMENTS) == 3


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
