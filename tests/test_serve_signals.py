"""`epd serve`'s signals, without Ray: the first SIGINT/SIGTERM stops the deployment (drain,
then stop), and one during that stop forces it (the drain is cut, the controller killed, Ray
shut down, exit 130). The deployment is a stand-in; test_serve.py runs the real one."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import pytest

import cluster.deployment
from cluster.serve import StopSignals, _serve
from cluster.settings import EpdSettings, RaySettings
from common.settings.schema import from_mapping


class FakeDeployment:
    """Starts at once, is ready at once, and drains until cancelled (long streams)."""

    address, addresses = "127.0.0.1:1", ["127.0.0.1:1"]

    def __init__(self) -> None:
        self.http_addresses: list[str] = []
        self.log: list[str] = []
        self.stopping = asyncio.Event()

    @classmethod
    async def start(cls, settings: Any, *, started_ray: bool) -> FakeDeployment:
        return cls.made

    async def wait_ready(self, timeout_s: float, on_wait: Any) -> dict[str, int]:
        return {"encoder": 1, "prefill": 1, "decode": 1}

    async def alive(self) -> bool:
        return True

    async def stop(self, on_step: Any) -> None:
        self.log.append("stop")
        self.stopping.set()
        try:
            await asyncio.sleep(3600)  # draining
        except asyncio.CancelledError:
            self.log.append("stop cancelled")
            raise

    def kill(self) -> None:
        self.log.append("kill")

    made: FakeDeployment


def test_the_first_signal_stops_and_one_during_the_stop_forces_it() -> None:
    signals = StopSignals()
    signals()
    assert signals.stop.is_set() and not signals.force.is_set()
    signals()
    assert signals.force.is_set()


async def test_a_second_signal_during_the_stop_cuts_the_drain_and_exits_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Once the stop began, further Ctrl-Cs did nothing for up to drain_timeout_s + 30 s;
    # kill -9 then left Ray's agents running.
    deployment = FakeDeployment.made = FakeDeployment()
    monkeypatch.setattr(cluster.deployment, "Deployment", FakeDeployment)
    served = asyncio.create_task(_serve(EpdSettings(), False, 0.0))
    for _ in range(200):  # until it serves (its signal handlers are in place)
        if "ready in" in capsys.readouterr().out:
            break
        await asyncio.sleep(0.01)
    signal.raise_signal(signal.SIGINT)
    await asyncio.wait_for(deployment.stopping.wait(), 10)
    signal.raise_signal(signal.SIGTERM)
    assert await asyncio.wait_for(served, 10) == 130
    assert deployment.log == ["stop", "stop cancelled", "kill"]
    out = capsys.readouterr().out
    assert "stopping now: the drain is cut" in out
    assert out.rstrip().endswith("stopped")


def test_the_suggested_command_finds_the_key_of_another_namespace() -> None:
    # With `[ray] namespace = "s28cfg"`, the printed `epd generate` read the default
    # namespace's key and failed UNAUTHENTICATED.
    from cluster.serve import try_line

    def line(namespace: str) -> str:
        return try_line(["127.0.0.1:50051"], EpdSettings(ray=RaySettings(namespace=namespace)))

    assert line("epd").startswith("try: epd generate ")
    assert line("epd").endswith("--address 127.0.0.1:50051")
    assert line("s28cfg").startswith("try: EPD_NAMESPACE=s28cfg epd ")
    assert "EPD_NAMESPACE='a b' " in line("a b")


def test_the_suggested_command_names_every_router_the_ca_and_the_key_it_needs(
    tmp_path, monkeypatch
) -> None:
    # With docs/security.md's own keys file and TLS, the printed command failed as printed
    # ("Socket closed", then UNAUTHENTICATED); with `--routers 2` it named one router.
    from cluster.serve import try_line, with_api_keys, with_cluster_token

    monkeypatch.setenv("EPD_HOME", str(tmp_path))
    tls = {"tls_cert_file": "/t/cert.pem", "tls_key_file": "/t/key.pem", "tls_ca_file": "/t/ca"}
    own = from_mapping(EpdSettings, {"security": {**tls, "api_keys_file": "/t/keys.toml"}})
    line = try_line(["127.0.0.1:1", "127.0.0.1:2"], with_cluster_token(own))
    assert line.endswith("--address 127.0.0.1:1,127.0.0.1:2 --tls-ca-file /t/ca --api-key KEY")
    written = with_api_keys(with_cluster_token(EpdSettings()))  # serve's own keys: found
    assert try_line(["127.0.0.1:1"], written).endswith("--address 127.0.0.1:1")
