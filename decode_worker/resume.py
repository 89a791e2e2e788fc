"""What a resumed `Decode` request must satisfy before this worker takes it on.

A router resumes a stream whose decode worker failed mid-way by sending another one the
same request plus `resume_tokens`: the tokens already streamed after `first_token_id`. The
worker computes their KV after the prompt's (`LmRunner.resume`) and samples on from the
next position, so they must be tokens this model could have produced for an answer that
has not ended yet.
"""

from __future__ import annotations

import grpc

from common.models.runner import LmRunner
from common.sampling import SamplingParams
from common.server.rpc import RpcStatusError
from epd.v1 import decode_service_pb2


def resume_tokens(
    runner: LmRunner, request: decode_service_pb2.DecodeRequest, sampling: SamplingParams
) -> list[int]:
    """`request.resume_tokens`, checked: in the vocabulary, none ending the answer (with
    `first_token_id`), and room left under `max_tokens` for at least one more token.
    RpcStatusError(INVALID_ARGUMENT) naming the field otherwise."""
    resume = list(request.resume_tokens)
    if not resume:
        return resume
    if len(resume) + 1 >= sampling.max_tokens:
        raise RpcStatusError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"resume_tokens: {len(resume)} tokens after the first leave nothing to "
            f"generate under max_tokens {sampling.max_tokens}",
        )
    vocab = runner.config.text.vocab_size
    tokens = [request.first_token_id, *resume]
    if not 0 <= min(tokens) <= max(tokens) < vocab:
        wrong = next(t for t in tokens if not 0 <= t < vocab)
        raise RpcStatusError(
            grpc.StatusCode.INVALID_ARGUMENT, f"resume_tokens: {wrong} outside the vocab"
        )
    at = runner.stop.first_end(sampling, tokens)
    if at is not None:
        raise RpcStatusError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"resume_tokens: the answer already ended at token {at} ({tokens[at]})",
        )
    return resume
