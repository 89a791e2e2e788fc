"""Errors shared by every layer: a bad value in a named field, and the words a status's
details use where the caller acts on them.

`FieldError` is the root of the family the servers map to INVALID_ARGUMENT with the field in
the `epd-field` trailing metadata (`common.server.rpc`); `MultimodalLayoutError`
(`common.multimodal.validation`) is the multimodal kind, which also names the item.
"""

from __future__ import annotations

# In the details of a decode worker's UNAVAILABLE when one of its decode steps failed
# (`common.models.decode_loop.DecodeStepError`): the worker goes on serving, so the router
# may resume the stream on it too (with a single decode worker, the only place it can).
DECODE_STEP_FAILED = "decode step failed"
# In a KV pull's timeout when it never got to READ (the reader's own congestion, not the
# holder's): the router then does not hold it against the holder.
NO_READ_STARTED = "no READ was started"
# In a decode worker's ABORTED when the holder itself said the lease was gone (released,
# expired): no fault of the holder's, which the router then does not suspect. Any other
# refusal of pulled KV (a READ that failed or timed out, bytes that changed under a live
# lease, a holder that did not answer) is held against the holder.
LEASE_NOT_LIVE = "was not live"


class FieldError(ValueError):
    """A value that a request or message field may not hold. `field` names the field; the
    message reads "<where>: <message>"."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field  # wire field name, e.g. "sampling" or "dtype"
        self.reason = message  # what is wrong with it, without the field
        super().__init__(f"{self.where}: {message}")

    @property
    def where(self) -> str:
        """What the message blames: the field (subclasses may add more)."""
        return self.field


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be served: a file that cannot be read or parsed, a
    value out of range, or weights that do not match the config. The message names the file
    (and the key or tensor); each role's `main` exits 2 with it as one line."""
