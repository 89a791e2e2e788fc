"""Sampling on the wire: `SamplingParams` to and from `epd.v1.SamplingParams`, and why
generation ended: the one map from `common.sampling.FinishReason` to `epd.v1.FinishReason`,
used by the decode worker (its last chunk) and the router (an answer that ends at the
prefill's first token)."""

from __future__ import annotations

from common.errors import FieldError
from common.models.generation import GenerationDefaults
from common.sampling import FinishReason, SamplingError, SamplingParams
from epd.v1 import decode_service_pb2, sampling_pb2

_FINISH: dict[FinishReason, decode_service_pb2.FinishReason] = {
    "stop": decode_service_pb2.FINISH_REASON_STOP,
    "length": decode_service_pb2.FINISH_REASON_LENGTH,
}


def finish_reason_to_proto(reason: FinishReason | None) -> decode_service_pb2.FinishReason:
    """The wire finish reason; `None` (still generating) is `FINISH_REASON_UNSPECIFIED`."""
    if reason is None:
        return decode_service_pb2.FINISH_REASON_UNSPECIFIED
    return _FINISH[reason]


def sampling_to_proto(params: SamplingParams) -> sampling_pb2.SamplingParams:
    """The wire form of `SamplingParams` (the inverse of `sampling_from_proto`). Every value
    is what was asked for and is sent, `top_p` 1.0 and `top_k` 0 (off) included: left unset,
    the router would take the checkpoint's instead."""
    msg = sampling_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def sampling_from_proto(
    msg: sampling_pb2.SamplingParams, defaults: GenerationDefaults | None = None
) -> SamplingParams:
    """Checked `SamplingParams`; `max_tokens` 0 (unset on the wire) means the default.

    With `defaults` (the checkpoint's `generation_config.json`), an unset `max_tokens`,
    `top_p` or `top_k` takes the checkpoint's value (`max_new_tokens`, ...) before
    `SamplingParams`' own; the temperature is always the request's (the wire cannot leave
    it unset). Raises `FieldError` naming the field (e.g. "sampling.top_p") for
    out-of-range values.
    """
    try:
        # Inside the try: a default the checkpoint sets out of range (refused at load by
        # `GenerationDefaults.from_dict`, but one built otherwise is not) is a FieldError.
        base = (defaults or GenerationDefaults()).sampling()
        return SamplingParams(
            temperature=float(msg.temperature),
            top_p=float(msg.top_p) if msg.HasField("top_p") else base.top_p,
            top_k=int(msg.top_k) if msg.HasField("top_k") else base.top_k,
            seed=int(msg.seed) if msg.HasField("seed") else None,
            max_tokens=int(msg.max_tokens) or base.max_tokens,
            stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
            ignore_eos=bool(msg.ignore_eos),
        )
    except SamplingError as exc:
        raise FieldError(f"sampling.{exc.field}", str(exc)) from None
