"""Checking and processing one Generate request before any worker is called: sampling,
the chat's media (decoded under the request's limits) and text, tokenized, then its context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from common.errors import FieldError
from common.models.prompt_check import check_context
from common.processing.image_cache import ImageStore
from common.processing.processor import ProcessedPrompt, Processor
from common.sampling import SamplingParams
from common.wire.sampling import sampling_from_proto
from epd.v1 import router_service_pb2
from router.held import MediaHold
from router.inputs import ContextTooLong, InputError, messages_from_proto
from router.request_bytes import EMPTY_PROMPT, PROMPT_AND_MESSAGES
from router.settings import RouterSettings


def prepare_request(
    settings: RouterSettings,
    processor: Processor,
    request: router_service_pb2.GenerateRequest,
    cache_salt: str | None = None,
    media: MediaHold | None = None,
    fit_max_tokens: bool = False,
    ended: Callable[[], bool] | None = None,
    store: ImageStore | None = None,
) -> tuple[SamplingParams, ProcessedPrompt]:
    """Check and process one request (blocking: a worker thread); InputError naming the
    field. `fit_max_tokens`: the request's `max_tokens` is a default, not the caller's: it is
    cut to the context the prompt leaves (at least 1) rather than refused past it.
    `ended()`: the request has ended (its caller left, its deadline passed): video
    files stop decoding. `store`: where processed images are looked up and stored (the
    router's `StagedImages`, kept once the request is answered; None: the processor's cache).

    Every limit (`RouterSettings.input_limits`) is checked before the work it bounds:
    sampling first, text bytes and media headers before anything is decoded or
    tokenized, then prompt tokens + `max_tokens` against the context; no worker is
    called for a request refused here."""
    limits = settings.input_limits(processor.config.text.max_position_embeddings)
    if request.HasField("prompt") and not request.prompt:
        raise InputError("prompt", EMPTY_PROMPT)
    try:
        sampling = sampling_from_proto(request.sampling, processor.generation)
    except FieldError as exc:  # sampling errors and multimodal layout errors alike
        raise InputError(exc.field, exc.reason) from None
    if request.HasField("prompt") and request.messages:
        raise InputError("prompt", PROMPT_AND_MESSAGES)
    messages = (
        []
        if request.HasField("prompt")
        else messages_from_proto(
            request.messages,
            limits,
            processor,
            cache_salt,
            None if media is None else media.reserve,
            ended,
        )
    )
    allow_special = settings.allow_special_tokens_in_text
    text_field = "prompt" if request.HasField("prompt") else "messages"  # what errors name
    try:
        if request.HasField("prompt"):
            prompt = processor.process_text(
                request.prompt, allow_special_tokens=allow_special, limits=limits
            )
        else:
            prompt = processor.process(
                messages, allow_special_tokens=allow_special, limits=limits, store=store
            )
    except InputError:
        raise
    except FieldError as exc:
        field = text_field if exc.field == "prompt_token_ids" else exc.field
        raise InputError(field, exc.reason) from None
    except (ValueError, TypeError) as exc:
        raise InputError(text_field, str(exc)) from None
    assert limits.max_model_len is not None
    left = limits.max_model_len - len(prompt.prompt_token_ids)
    if fit_max_tokens and sampling.max_tokens > left:
        sampling = replace(sampling, max_tokens=max(1, left))
    try:
        check_context(len(prompt.prompt_token_ids), sampling.max_tokens, limits.max_model_len)
    except FieldError as exc:
        field = text_field if exc.field == "prompt_token_ids" else exc.field
        raise ContextTooLong(field, exc.reason) from None
    return sampling, prompt
