"""Finding the NIXL Python package (the CUDA 12 wheel `nixl_cu12` first, then `nixl`), and
making its agent with a progress thread that does not spin.

The package's `nixl_agent` sets the progress thread's delay between polls (`pthrDelay`, in
microseconds) to 0, so every agent's progress thread keeps one core busy even when no
transfer is in flight (measured: 1.00 CPU s/s idle; 0.025 with a 100 us delay, 0.000
without the thread). A deployment runs one agent per worker, so on a small machine those
threads took the cores the models needed. `make_agent` gives the thread a delay instead:
the wrapper's config is built as usual, and only the delay it hard-codes is replaced.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

PROGRESS_DELAY_US = 100  # the agent's progress thread waits this long between idle polls

_config_swap = threading.Lock()  # make_agent swaps a module attribute of the package


def import_nixl() -> Any:
    """Import the NIXL Python package (CUDA 12 wheel first, then the generic name)."""
    try:
        import nixl_cu12

        return nixl_cu12
    except ImportError:
        pass
    try:
        from nixl import _api as nixl_api

        return nixl_api
    except ImportError as exc:
        raise ImportError(
            "NIXL is not installed: install the 'nixl-cu12' (or 'nixl') package to move KV "
            "blocks and tensors between workers"
        ) from exc


def make_agent(nixl: Any, name: str, config: Any, progress_delay_us: int) -> Any:
    """`nixl.nixl_agent(name, config)` whose progress thread waits `progress_delay_us`
    between polls rather than spinning (see the module docstring). Falls back to the plain
    agent when the package's layout is not the one this knows."""
    api = sys.modules.get(getattr(nixl.nixl_agent, "__module__", ""))
    bind: Any = getattr(api, "nixlBind", None)
    base: Any = getattr(bind, "nixlAgentConfig", None)
    if base is None:
        return nixl.nixl_agent(name, config)

    class _Delayed(base):
        def __setattr__(self, key: str, value: Any) -> None:
            base.__setattr__(self, key, progress_delay_us if key == "pthrDelay" else value)

    with _config_swap:
        bind.nixlAgentConfig = _Delayed
        try:
            return nixl.nixl_agent(name, config)
        finally:
            bind.nixlAgentConfig = base
