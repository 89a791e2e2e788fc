"""The NIXL agent's progress thread waits between idle polls instead of spinning
(`common.transfer.nixl.make_agent`): the package hard-codes a zero delay, which kept one core
busy per worker."""

from __future__ import annotations

import sys
import time
import types
from typing import Any

from common.transfer.agent import TransferAgent
from common.transfer.nixl import make_agent


def test_an_idle_agent_does_not_keep_a_core_busy() -> None:
    agent = TransferAgent("idle-test")
    try:
        start = time.process_time()
        time.sleep(1.0)
        busy = time.process_time() - start
    finally:
        agent.close()
    # A spinning progress thread burns ~1 CPU second per second; a waiting one ~0.02.
    assert busy < 0.3, f"idle agent used {busy:.2f} CPU s in 1 s"


def test_make_agent_replaces_only_the_hard_coded_delay_and_restores_the_binding() -> None:
    class Config:  # stands in for the binding's config class
        pthrDelay = -1
        useProgThread = None

    made: list[Any] = []
    bind = types.SimpleNamespace(nixlAgentConfig=Config)

    def nixl_agent(name: str, conf: Any) -> str:  # as the package's wrapper does
        config = bind.nixlAgentConfig()
        config.useProgThread = True
        config.pthrDelay = 0
        made.append(config)
        return name

    api = types.ModuleType("fake_nixl_api")
    api.nixlBind = bind  # type: ignore[attr-defined]
    nixl_agent.__module__ = api.__name__
    sys.modules[api.__name__] = api
    try:
        package = types.SimpleNamespace(nixl_agent=nixl_agent)
        assert make_agent(package, "a", None, 250) == "a"
    finally:
        del sys.modules[api.__name__]
    assert (made[0].pthrDelay, made[0].useProgThread) == (250, True)
    assert bind.nixlAgentConfig is Config


def test_an_unknown_package_layout_gets_the_plain_agent() -> None:
    package = types.SimpleNamespace(nixl_agent=lambda name, conf: ("plain", name))
    assert make_agent(package, "b", None, 100) == ("plain", "b")
