"""Offline checks of deploy/: every manifest validates, and every command it runs is real.

- Core Kubernetes kinds validate against the schemas bundled with `kubernetes-validate`.
- KubeRay kinds validate against the KubeRay CRD schemas shipped in tests/data/kuberay/
  (trimmed copies; see the README there) with jsonschema.
- Container commands name entry points of this project (`python -m X` with an `X.__main__`,
  or the `epd` console script) and their flags parse with the real argparse parsers; the
  embedded epd.toml loads as `EpdSettings`; Services select pods that exist and target
  ports the containers declare.
- Every secret file a process is told to read (`[security] *_file`) is a key of a Secret
  mounted at that folder, the key the README's `kubectl create secret` makes; workers find
  the routers through the headless Service only; the README's `epd drain` reaches every
  router of plain mode.

The image (Dockerfile, .dockerignore) is checked in `tests.test_deploy_image`, the pods'
hardening and sizing in `tests.test_deploy_hardening`; both use the helpers here.
"""

from __future__ import annotations

import dataclasses
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
            # ... and only those: an address more (epd-router, the Service) is a router
            # it registers with at random, or one that does not exist
            assert settings.routers == (), f"{name}: routers {settings.routers}"
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


# -------------------------------------------------------------------------- services


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


# --------------------------------------------------------------------------- secrets


def _readme_secret_keys() -> dict[str, set[str]]:
    """The keys each `kubectl create secret generic NAME ...` of deploy/README.md makes."""
    made: dict[str, set[str]] = {}
    text = (DEPLOY / "README.md").read_text()
    for secret, flags in re.findall(r"kubectl create secret generic ([\w.-]+)([^\n#]*)", text):
        keys = made.setdefault(secret, set())
        keys.update(re.findall(r"--from-literal=([\w.-]+)=", flags))
        for key, source in re.findall(r"--from-file=(?:([\w.-]+)=)?(\S+)", flags):
            keys.add(key or Path(source).name)
    return made


def _secret_key_at(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) of the file `container` sees at `path`."""
    folder, file = str(Path(path).parent), Path(path).name
    for mount in container.get("volumeMounts", []):
        if mount["mountPath"].rstrip("/") == folder and not mount.get("subPath"):
            volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
            assert "secret" in volume, f"{path}: {folder} is not a Secret"
            assert mount.get("readOnly") is True, f"{path}: {folder} is writable"
            items = {i["path"]: i["key"] for i in volume["secret"].get("items", [])}
            assert not items or file in items, f"{path}: no such item in {folder}"
            return volume["secret"]["secretName"], items.get(file, file)
    raise AssertionError(f"{path}: no Secret is mounted at {folder}")


def _security_of(container: dict[str, Any], doc: dict[str, Any]) -> Any:
    """The `[security]` settings `container`'s epd processes run with."""
    command = container.get("command", [])
    if command[:2] == ["python", "-m"]:
        env = {e["name"]: "x" for e in container.get("env", [])}
        argv = [_substitute(a, env) for a in [*command[3:], *container.get("args", [])]]
        settings = _parse_module_args(command[2], argv)
        return (settings[0] if isinstance(settings, tuple) else settings).security
    # Ray mode: the head's `epd serve` reads the ConfigMap; its actors on the worker pods
    # run with the same settings.
    (config,) = [d for _, d in DOCUMENTS if d["metadata"]["name"] == "epd-ray-config"]
    return from_mapping(EpdSettings, tomllib.loads(config["data"]["epd.toml"])).security


@pytest.mark.parametrize(("name", "container", "doc"), CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_every_secret_file_is_a_key_of_a_mounted_secret_the_readme_creates(
    name: str, container: dict[str, Any], doc: dict[str, Any]
) -> None:
    # A path that is not mountPath/<key> (a misspelt key, a mount moved) is a process that
    # refuses to start: CrashLoopBackOff, which no schema check sees.
    made = _readme_secret_keys()
    assert made, "deploy/README.md creates no Secret"
    pod = next(p for p in _pod_specs(doc) if container in p["containers"])
    security = _security_of(container, doc)
    assert security.cluster_token_file and not security.insecure, name
    router = container.get("command", [])[2:3] == ["router"] or "ray-head" in name
    assert bool(security.api_keys_file) or not router, f"{name}: no API keys"
    for field in dataclasses.fields(security):
        path = getattr(security, field.name)
        if not field.name.endswith("_file") or not path:
            continue
        if field.name == "api_keys_file" and not router:
            continue  # read by the router only (on the Ray head in Ray mode)
        secret, key = _secret_key_at(pod, container, path)
        assert secret in made, f"{name}: {field.name} from Secret {secret}, never created"
        assert key in made[secret], f"{name}: {field.name} reads key {key!r} of {secret}"


def test_the_readme_drains_a_worker_at_every_router() -> None:
    """Plain mode runs several routers, each with its own registry: an `epd drain` sent
    through the Service reaches one of them, and the others keep routing to the worker."""
    (router,) = [
        d
        for _, d in DOCUMENTS
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "epd-router"
    ]
    replicas = router["spec"]["replicas"]
    commands = []
    for line in (DEPLOY / "README.md").read_text().splitlines():
        if line.startswith(("epd drain ", "epd status ")):
            commands.append(build_parser().parse_args(shlex.split(line, comments=True)[1:]))
    drains = [c for c in commands if c.command == "drain"]
    assert drains, "deploy/README.md shows no `epd drain`"
    for drain in drains:
        addresses = drain.address.split(",")
        assert len(set(addresses)) == replicas, f"`epd drain --address {drain.address}`"
        asked = {c.address for c in commands if c.command == "status"}
        assert set(addresses) <= asked, "`epd status` asks the first router only: ask each"
