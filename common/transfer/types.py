"""The transfer layer's value types: memory segment names, errors, and per-READ statistics."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Final

# NIXL memory segment names.
HOST_MEMORY: Final = "DRAM"
DEVICE_MEMORY: Final = "VRAM"


class TransferError(RuntimeError):
    """A NIXL transfer could not be created, failed, or was refused.

    Raised as is for what may pass (the peer is unreachable, disconnected, or failed the
    transfer); refusals that retrying cannot fix are the subclass `TransferRefusedError`.
    """


class TransferRefusedError(TransferError):
    """NIXL refused what it was given: peer metadata it cannot load, or remote ranges outside
    the memory the peer registered (after one refresh of the peer's metadata).

    The fault lies with whoever sent the metadata or the ranges, not with the network: a
    server answers INVALID_ARGUMENT, not UNAVAILABLE.
    """


class TransferDigestError(TransferError):
    """A READ brought back bytes that are not those the holder lent (the handle's digest):
    the range was reused after its lease ran out, or changed meanwhile. Nothing read may be
    used; the reader asks for the tensor again."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A transfer did not complete within its timeout.

    `cancelled` is True when nothing can write the local ranges any more (no READ was
    started). When False the transfer may still write them, whatever NIXL says of a
    release (over TCP a frozen holder's bytes land once it gets going again): its handle
    is parked until it ends (`released`), and that memory must stay allocated and
    registered until then.
    """

    def __init__(self, message: str, cancelled: bool = False) -> None:
        super().__init__(message)
        # True when nothing can write the local ranges any more (no READ was started).
        self.cancelled = cancelled
        # Not cancelled: set once NIXL lets the parked handle go at last (the local ranges
        # may be reused then: `common.transfer.parked`); None when nothing was parked.
        self.released: Future[None] | None = None

    def when_released(self, free: Callable[[], object]) -> None:
        """`free()` once the local ranges may be reused: now if the transfer was cancelled,
        else when its parked handle is released (on another thread), if ever."""
        if self.cancelled:
            free()
        elif self.released is not None:
            self.released.add_done_callback(lambda _: free())


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


# NIXL's exception classes (its bindings) for refusals: what it was given is not loadable or
# not inside what the peer registered. Others (disconnects, backend errors) may pass.
_NIXL_REFUSALS: Final = frozenset(
    {"nixlNotFoundError", "nixlMismatchError", "nixlInvalidParamError", "nixlNotAllowedError"}
)


def nixl_refused(exc: BaseException) -> bool:
    """Whether a NIXL binding exception is a refusal (see `TransferRefusedError`)."""
    return type(exc).__name__ in _NIXL_REFUSALS
