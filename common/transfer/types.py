"""The transfer layer's value types: memory segment names, errors, and per-READ statistics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

# NIXL memory segment names.
HOST_MEMORY: Final = "DRAM"
DEVICE_MEMORY: Final = "VRAM"


class TransferError(RuntimeError):
    """A NIXL transfer could not be created, failed, or was refused."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A transfer did not complete within its timeout.

    `cancelled` is True when NIXL released (cancelled) the handle. When False the handle is
    parked and retried later, and the transfer may still write the local ranges: keep that
    memory allocated and registered.
    """

    def __init__(self, message: str, cancelled: bool = False) -> None:
        super().__init__(message)
        # True when NIXL cancelled and released the transfer.
        self.cancelled = cancelled


class UnknownPeerError(TransferError, KeyError):
    """A read named a peer whose metadata was never loaded with `add_peer`."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown peer"


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one READ moved and how long it took."""

    # Bytes moved.
    nbytes: int
    # Descriptors posted to NIXL, after merging.
    descriptors: int
    # Ranges the caller asked for, before merging.
    requested: int
    # Wall time from building descriptors to completion, in seconds.
    seconds: float

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")
