"""The stage handoff at the gRPC edge: protobuf <-> in-process types, checked once.

Shared by the prefill and decode workers (and usable by the router): sampling parameters,
the `(prompt_token_ids, MultimodalParams)` pair validated against a runner's model, and the
mapping of worker-specific failures to gRPC statuses. Everything here raises
`MultimodalLayoutError` / `ValueError` (INVALID_ARGUMENT via `common.rpc.rpc_errors`) naming
the offending field, before any cache is touched.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.multimodal import MultimodalLayoutError, MultimodalParams
from common.runner import LmRunner
from common.sampling import SamplingParams
from common.wire import TensorResolver, params_from_proto
from epd.v1 import multimodal_pb2, sampling_pb2

# What `max_tokens` 0 (unset on the wire) means: the `SamplingParams` default.
DEFAULT_MAX_TOKENS = 16


def sampling_from_proto(msg: sampling_pb2.SamplingParams) -> SamplingParams:
    """The request's `SamplingParams`; `max_tokens` 0 (unset) means the default (16).

    Raises `MultimodalLayoutError` with field "sampling" for out-of-range values.
    """
    try:
        return SamplingParams(
            temperature=float(msg.temperature),
            top_p=float(msg.top_p) if msg.HasField("top_p") else 1.0,
            top_k=int(msg.top_k) if msg.HasField("top_k") else 0,
            seed=int(msg.seed) if msg.HasField("seed") else None,
            max_tokens=int(msg.max_tokens) or DEFAULT_MAX_TOKENS,
            stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
            ignore_eos=bool(msg.ignore_eos),
        )
    except ValueError as exc:
        raise MultimodalLayoutError("sampling", str(exc)) from None


def sampling_to_proto(params: SamplingParams) -> sampling_pb2.SamplingParams:
    """The wire form of `SamplingParams` (the inverse of `sampling_from_proto`)."""
    msg = sampling_pb2.SamplingParams(
        temperature=params.temperature,
        max_tokens=params.max_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.top_p != 1.0:
        msg.top_p = params.top_p
    if params.top_k:
        msg.top_k = params.top_k
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def read_handoff(
    runner: LmRunner,
    prompt_token_ids: Sequence[int],
    multimodal: multimodal_pb2.MultimodalParams,
    *,
    with_embeddings: bool,
    resolve: TensorResolver | None = None,
) -> MultimodalParams:
    """Decode and validate the multimodal half of a handoff against `runner`'s model.

    The layout and the prompt (vocabulary, placeholders exactly at the runs, positions) are
    checked before `resolve` pulls any embedding held by a transfer handle; embedding widths
    after. Raises `MultimodalLayoutError` naming the field. Blocking (NIXL
    pulls): call it from a worker thread in a server.
    """
    if not prompt_token_ids:
        raise MultimodalLayoutError("prompt_token_ids", "empty prompt")
    layout = params_from_proto(multimodal, with_embeddings=False)
    runner.check_prompt(prompt_token_ids, layout)
    if not with_embeddings:
        return layout
    params = params_from_proto(multimodal, resolve=resolve)
    runner.check_embeddings(params)
    return params
