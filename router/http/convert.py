"""An HTTP request body -> the gRPC front door's `GenerateRequest` (run off the event loop:
media are read here). Field errors name the body's field as OpenAI clients know it (e.g.
`messages[0].content[1].image_url.url`, `temperature`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import grpc

from common.errors import FieldError
from common.sampling import SamplingParams
from epd.v1 import router_service_pb2, sampling_pb2
from router.http.errors import ApiError
from router.http.media import MediaPolicy, load
from router.http.schema import (
    FLOAT32_TINY,
    ChatCompletionRequest,
    CompletionRequest,
    ImageContent,
    SamplingBody,
    TextContent,
)

# Fields a SamplingParams message names at the start of its ValueError.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop_token_ids")


def sampling(body: SamplingBody) -> sampling_pb2.SamplingParams:
    """The body's sampling as the wire message (checked here, so errors name the field)."""
    both = (body.max_tokens, body.max_completion_tokens)
    if None not in both and both[0] != both[1]:  # which one is meant is unknown
        raise FieldError(
            "max_completion_tokens",
            f"is {both[1]} but max_tokens is {both[0]}: send one of them (or the same in both)",
        )
    max_tokens = body.max_completion_tokens or body.max_tokens
    top_k = None if body.top_k is None else max(body.top_k, 0)  # -1 or 0: off (sent as 0)
    temperature = 1.0 if body.temperature is None else body.temperature
    seed = body.seed
    if seed is not None and seed < 0:  # vLLM's: -1 asks for a random seed
        seed = None if seed == -1 else seed % 2**63
    stop_ids = body.stop_token_ids or []
    top_p = None if body.top_p is None else max(body.top_p, FLOAT32_TINY)  # 0 is 0 on the wire
    try:
        SamplingParams(
            temperature=temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=top_k or 0,
            seed=seed,
            max_tokens=max_tokens or SamplingParams().max_tokens,
            stop_token_ids=tuple(stop_ids),
            ignore_eos=body.ignore_eos,
        )
    except ValueError as exc:
        text = str(exc)
        field = next((f for f in _SAMPLING_FIELDS if text.startswith(f)), "sampling")
        raise FieldError(field, text) from None
    msg = sampling_pb2.SamplingParams(
        temperature=temperature, ignore_eos=body.ignore_eos, stop_token_ids=stop_ids
    )
    if top_p is not None:
        msg.top_p = top_p
    if top_k is not None:
        msg.top_k = top_k
    if seed is not None:
        msg.seed = seed
    if max_tokens:
        msg.max_tokens = max_tokens
    return msg


def refuse_unsupported(body: SamplingBody) -> None:
    """FieldError naming the first field that asks for what this server does not do
    (log probabilities, penalties, logit bias, tool calls, structured output, web search,
    moderation, storing, echo, best-of): refused, since an answer without it would look
    like one with it to a client that does not check."""
    if body.stream_options is not None and not body.stream:  # as OpenAI answers it
        raise FieldError("stream_options", "is only allowed when stream is true")
    if body.logprobs is not None and body.logprobs is not False:  # a completion's 0 asks too
        raise FieldError("logprobs", "log probabilities are not supported by this server")
    if body.top_logprobs:
        raise FieldError("top_logprobs", "log probabilities are not supported by this server")
    for field, penalty in (
        ("presence_penalty", body.presence_penalty),
        ("frequency_penalty", body.frequency_penalty),
    ):
        if penalty:
            raise FieldError(field, "penalties are not supported by this server (only 0)")
    if body.logit_bias:
        raise FieldError("logit_bias", "logit bias is not supported by this server")
    neutral: tuple[tuple[str, float | None, float], ...] = (
        ("repetition_penalty", body.repetition_penalty, 1.0),
        ("min_p", body.min_p, 0.0),
        ("min_tokens", body.min_tokens, 0),
    )
    for field, value, off in neutral:
        if value is not None and value != off:
            raise FieldError(field, f"is not supported by this server (only {off:g})")
    if body.bad_words:
        raise FieldError("bad_words", "is not supported by this server")
    if body.include_stop_str_in_output:
        raise FieldError("include_stop_str_in_output", "is not supported by this server")
    if body.prompt_logprobs is not None:
        raise FieldError("prompt_logprobs", "log probabilities are not supported by this server")
    if body.use_beam_search:
        raise FieldError("use_beam_search", "beam search is not supported by this server")
    for name in GUIDED:
        if getattr(body, name) is not None:
            raise FieldError(name, "structured output is not supported by this server")
    _refuse_extensions(body)
    fmt = body.response_format  # no type, or text with a schema: which is meant is unknown
    if fmt is not None and (
        fmt.get("type") != "text" or any(v is not None for k, v in fmt.items() if k != "type")
    ):
        raise FieldError("response_format", 'only {"type": "text"} is supported')
    if body.echo:
        raise FieldError("echo", "echoing the prompt is not supported by this server")
    if body.n != 1:  # pydantic's "less than or equal to 1" said no why (openai F6, s44)
        raise FieldError("n", "only 1 is supported (one choice per request)")
    if body.best_of not in (None, 1):
        raise FieldError("best_of", "only 1 is supported (one completion per request)")
    if isinstance(body, ChatCompletionRequest):
        _refuse_unsupported_chat(body)
    if isinstance(body, CompletionRequest) and body.suffix:
        raise FieldError("suffix", "a suffix is not supported by this server")


def _refuse_unsupported_chat(body: ChatCompletionRequest) -> None:
    """`refuse_unsupported`'s fields of a chat only."""
    for name, tools in (("tools", body.tools), ("functions", body.functions)):
        if tools:
            raise FieldError(name, "tool calls are not supported by this server")
    for name, choice in (("tool_choice", body.tool_choice), ("function_call", body.function_call)):
        if choice not in (None, "none", "auto"):
            raise FieldError(name, 'tool calls are not supported by this server ("none" or "auto")')
    if body.modalities not in (None, ["text"]):
        raise FieldError("modalities", 'only ["text"] is supported')
    for name in ("audio", "prediction", "web_search_options", "moderation", "chat_template"):
        if getattr(body, name) is not None:
            raise FieldError(name, "is not supported by this server")
    if body.mm_processor_kwargs:
        raise FieldError("mm_processor_kwargs", "is not supported by this server (only {})")
    if body.add_special_tokens:
        raise FieldError("add_special_tokens", "is not supported by this server (only false)")
    if body.store:
        raise FieldError("store", "only false is supported (nothing is stored to fetch later)")
    if body.continue_final_message:
        raise FieldError("continue_final_message", "is not supported by this server")
    if not body.add_generation_prompt:
        raise FieldError("add_generation_prompt", "only true is supported")
    for m, message in enumerate(body.messages):
        for name in ("tool_calls", "function_call", "refusal", "audio"):
            if getattr(message, name):  # [] or "": what clients send back with an answer
                raise FieldError(f"messages[{m}].{name}", "is not supported by this server")


def _refuse_extensions(body: SamplingBody) -> None:
    """`refuse_unsupported`'s vLLM extensions that would change the answer."""
    for name in ("allowed_token_ids", "truncate_prompt_tokens"):
        if getattr(body, name) is not None:
            raise FieldError(name, "is not supported by this server")
    for name in ("logits_processors", "vllm_xargs"):  # none, [] or {}: neutral
        if getattr(body, name):
            raise FieldError(name, "is not supported by this server")
    if body.typical_p is not None and body.typical_p != 1:
        raise FieldError("typical_p", "is not supported by this server (only 1)")
    if not body.skip_special_tokens:
        raise FieldError("skip_special_tokens", "is not supported by this server (only true)")


# vLLM's guided decoding (structured output): refused when set.
GUIDED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "structural_tag",
)


def _request(body: SamplingBody, request_id: str) -> router_service_pb2.GenerateRequest:
    refuse_unsupported(body)
    request = router_service_pb2.GenerateRequest(
        request_id=request_id, sampling=sampling(body), stop=body.stop_strings
    )
    if body.cache_salt is not None:
        request.cache_salt = body.cache_salt
    return request


def check_text_length(body: ChatCompletionRequest | CompletionRequest, max_bytes: int) -> None:
    """FieldError naming the role or text part (as the body spells it) where the body's text
    passes `max_bytes` (`max_prompt_text_bytes`) in UTF-8 bytes, counted where the processor
    counts them (each message's role as converted, then its text parts), before any copy of
    the text is made: a text past what is left is encoded only as far as it crosses the
    limit, so the bytes said are at least those (as the processor says, "N+"). Converted
    first, a 250 MiB text was copied into the request, then again at each read of it,
    holding the GIL (attacker review, s40); counted in characters, the part named was not
    always the processor's (s41 review F3)."""
    if isinstance(body, CompletionRequest):
        texts = [("prompt", body.prompt)]
    else:
        texts = []
        for m, message in enumerate(body.messages):
            texts.append((f"messages[{m}].role", _role(message.role)))
            if isinstance(message.content, str):
                texts.append((f"messages[{m}].content", message.content))
                continue
            for p, part in enumerate(message.content):
                if isinstance(part, TextContent):
                    texts.append((f"messages[{m}].content[{p}].text", part.text))
    used = 0
    for field, text in texts:
        # Past the limit in characters, its first `left + 1` characters cross it.
        left = max_bytes - used
        used += len(text) if text.isascii() else len(text[: left + 1].encode())
        if used > max_bytes:
            raise FieldError(
                field, f"prompt text of {used}+ bytes exceeds max_prompt_text_bytes = {max_bytes}"
            )


def _role(role: str) -> str:
    """A chat message's role as the router reads it (OpenAI's `developer` is `system`)."""
    return "system" if role == "developer" else role


def names_media(body: ChatCompletionRequest) -> bool:
    """Whether a message of `body` holds an image or a video part (its URL is read by
    `chat_request`: a file, a fetch, or a data URL decoded)."""
    return any(
        not isinstance(part, TextContent)
        for message in body.messages
        if not isinstance(message.content, str)
        for part in message.content
    )


def chat_request(
    body: ChatCompletionRequest,
    request_id: str,
    policy: MediaPolicy,
    hold: Callable[[int], None] = lambda size: None,
    deadline: float = math.inf,
    gone: Callable[[], bool] = lambda: False,
) -> router_service_pb2.GenerateRequest:
    """`POST /v1/chat/completions` -> GenerateRequest (media read under `policy`). Each
    medium's bytes, once read, are given to `hold` before the next is read (which raises
    to refuse them), and FieldError names the part whose bytes take the request's media past
    `policy.max_request_bytes`, as they would a gRPC request past `max_message_mb`: a body
    of a few bytes may name the same file of `policy.max_bytes` again and again. No medium
    is read past `deadline` (time.monotonic; ApiError DEADLINE_EXCEEDED): fetches of
    `http_fetch_timeout_s` each held a thread for as many of them as a body named. Nor once
    `gone()` (the client hung up; ApiError CANCELLED), and a fetch under way is cut: a gone
    client's URLs were all fetched, holding its tenant's threads."""
    request = _request(body, request_id)
    loaded = 0

    def read(url: str, field: str) -> bytes:
        nonlocal loaded
        if time.monotonic() > deadline:
            raise ApiError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"{field}: not read: the request's time (request_timeout_s) ran out reading "
                "its media",
            )
        if gone():
            raise ApiError(grpc.StatusCode.CANCELLED, f"{field}: not read: the client went away")
        data = load(url, field, policy, gone)
        loaded += len(data)
        if loaded > policy.max_request_bytes:
            mib = policy.max_request_bytes >> 20
            raise FieldError(field, f"takes the request's media past {mib} MiB (max_message_mb)")
        hold(len(data))
        return data

    for m, message in enumerate(body.messages):
        out = request.messages.add(role=_role(message.role))
        if isinstance(message.content, str):
            out.content.add(text=message.content)
            continue
        for p, part in enumerate(message.content):
            where = f"messages[{m}].content[{p}]"
            if isinstance(part, TextContent):
                out.content.add(text=part.text)
            elif isinstance(part, ImageContent):
                image = router_service_pb2.ImageInput(
                    data=read(part.image_url.url, f"{where}.image_url.url")
                )
                if part.uuid is not None:
                    image.uuid = part.uuid
                out.content.add(image=image)
            else:
                video = router_service_pb2.VideoInput(
                    file=read(part.video_url.url, f"{where}.video_url.url"), fps=part.fps or 0.0
                )
                if part.uuid is not None:
                    video.uuid = part.uuid
                out.content.add(video=video)
    return request


def completion_request(
    body: CompletionRequest, request_id: str
) -> router_service_pb2.GenerateRequest:
    """`POST /v1/completions` -> GenerateRequest: the plain-text prompt, no chat template."""
    request = _request(body, request_id)
    request.prompt = body.prompt
    return request


def as_sent(error: ApiError, body: SamplingBody) -> None:
    """Name `error`'s field as `body` spells it: `max_completion_tokens` where the body set
    that and not `max_tokens`; `messages[m].content` where that content is a string (the
    router names its one text part `messages[m].content[0].text`, a path the body lacks)."""
    param = error.param
    if param is None:
        return
    sent = param
    if param == "max_tokens":
        if body.max_completion_tokens is not None and body.max_tokens is None:
            sent = "max_completion_tokens"
    elif isinstance(body, ChatCompletionRequest) and param.endswith(".content[0].text"):
        head = param[: -len("[0].text")]  # messages[m].content
        m = head.removeprefix("messages[").removesuffix("].content")
        messages = body.messages
        if m.isdigit() and int(m) < len(messages) and isinstance(messages[int(m)].content, str):
            sent = head
    if sent != param:
        error.param = sent
        error.args = (str(error).replace(param, sent),)
