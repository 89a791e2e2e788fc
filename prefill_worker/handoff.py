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
from common.wire import TensorResolver, params_from_proto
from epd.v1 import multimodal_pb2


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
