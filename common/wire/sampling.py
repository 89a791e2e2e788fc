"""Why generation ended, on the wire: the one map from `common.sampling.FinishReason` to
`epd.v1.FinishReason`, used by the decode worker (its last chunk) and the router (an answer
that ends at the prefill's first token)."""

from __future__ import annotations

from common.sampling import FinishReason
from epd.v1 import decode_service_pb2

_FINISH: dict[FinishReason, decode_service_pb2.FinishReason] = {
    "stop": decode_service_pb2.FINISH_REASON_STOP,
    "length": decode_service_pb2.FINISH_REASON_LENGTH,
}


def finish_reason_to_proto(reason: FinishReason | None) -> decode_service_pb2.FinishReason:
    """The wire finish reason; `None` (still generating) is `FINISH_REASON_UNSPECIFIED`."""
    if reason is None:
        return decode_service_pb2.FINISH_REASON_UNSPECIFIED
    return _FINISH[reason]
