"""Finding the NIXL Python package: the CUDA 12 wheel (`nixl_cu12`) first, then `nixl`."""

from __future__ import annotations

from typing import Any


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
