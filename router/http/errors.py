"""Failures -> OpenAI's error body `{"error": {"message", "type", "param", "code"}}` and the
HTTP status a client of OpenAI's API expects (the gRPC status the same failure gets on the
gRPC front door, mapped).

`param` names the field as the HTTP body spells it (`messages[0].content[1].image_url.url`),
both for the body's own validation (`validation_error`) and for what the router refuses later
under the gRPC message's names (`ApiError.from_router`, `http_field`)."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from fastapi.responses import JSONResponse

from common.errors import FieldError
from common.server.rpc import RpcStatusError
from router.calls import RouterError, TooLarge
from router.ids import loggable, shown_text

logger = logging.getLogger(__name__)

# gRPC status -> (HTTP status, OpenAI error type)
_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    # Full for now; a request that never fits (`router.calls.TooLarge`) is a 400 instead.
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}

# OpenAI's `code` where it has one for the status (clients branch on these); else the gRPC
# status's name.
_CODES = {
    grpc.StatusCode.UNAUTHENTICATED: "invalid_api_key",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "rate_limit_exceeded",
}

UNAVAILABLE_RETRY_S = 1.0  # a 503's Retry-After when the router named no time


class ApiError(Exception):
    """A failure the API answers with OpenAI's error body."""

    def __init__(
        self,
        grpc_code: grpc.StatusCode,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: float | None = None,
        code: str | None = None,
        error_type: str | None = None,
    ) -> None:
        """`grpc_code` picks the HTTP status, and the body's `type` and `code` unless
        `error_type` or `code` name OpenAI's own (`model_not_found`, ...)."""
        super().__init__(message)
        self.grpc_code = grpc_code  # the status it stands for (what a gRPC call would get)
        self.status, self.type = _STATUS.get(grpc_code, (500, "server_error"))  # OpenAI's
        self.type = error_type or self.type
        self.code = code or _CODES.get(grpc_code) or grpc_code.name.lower()
        self.param = param  # the request field at fault
        self.retry_after_s = retry_after_s  # 429: when to try again

    @classmethod
    def from_router(
        cls, grpc_code: grpc.StatusCode, message: str, trailing: tuple[tuple[str, str], ...]
    ) -> ApiError:
        """From a RouterError's status and trailing metadata (`epd-field`, `retry-after-ms`)."""
        meta = dict(trailing)
        retry = meta.get("retry-after-ms")
        field = meta.get("epd-field")  # a GenerateRequest field
        param = http_field(field) if field else None
        if field and param and param != field and message.startswith(field):
            message = param + message[len(field) :]
        return cls(
            grpc_code,
            message,
            param=param,
            retry_after_s=int(retry) / 1000 if retry and retry.isdigit() else None,
        )

    def body(self) -> dict[str, dict[str, str | None]]:
        """OpenAI's error object."""
        return {
            "error": {
                "message": str(self),
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        """The HTTP answer. A 429 carries `Retry-After` (whole seconds rounded up) when the
        router said when; a 503 always does, `UNAVAILABLE_RETRY_S` unless told otherwise (a
        worker registers or heartbeats within a second)."""
        headers = {}
        retry = self.retry_after_s
        if retry is None and self.status == 503:
            retry = UNAVAILABLE_RETRY_S
        if retry is not None:
            headers["Retry-After"] = str(max(1, math.ceil(retry)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# A GenerateRequest field path -> the HTTP body's name of it (sampling's are top-level there).
_GRPC_TO_HTTP = (
    (re.compile(r"^sampling\."), ""),
    (re.compile(r"(content\[\d+\])\.image\.data"), r"\1.image_url.url"),
    (re.compile(r"(content\[\d+\])\.video\.file"), r"\1.video_url.url"),
    (re.compile(r"(content\[\d+\])\.(?:image|video)\.(uuid|fps)"), r"\1.\2"),
)


def http_field(field: str) -> str:
    """`messages[0].content[1].image.data` -> `messages[0].content[1].image_url.url`."""
    for pattern, replacement in _GRPC_TO_HTTP:
        field = pattern.sub(replacement, field)
    return field


_PART_TAGS = frozenset({"text", "image_url", "video_url"})  # `schema.ContentPart`'s tags
MAX_MESSAGE = 1000  # characters of a validation message repeated (pydantic's may quote input)
# A union branch's label in pydantic's error locations (`bool | int`), besides those with
# brackets (`function-after[_utf8(), str]`); no field of the body has these names.
_UNION_LABELS = frozenset({"str", "bool", "int", "float"})


def validation_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """The body's validation errors (pydantic's, through FastAPI) as one 400.

    A field that may be a string or a list (`content`, `stop`) fails on both branches; the
    error that got deepest into the input names what is wrong (a part's missing `url`, an
    unknown part `type`), so it is the one reported; of errors equally deep, one that is not
    about the value's type (a string that is not valid UTF-8); else both shapes are named."""
    if not errors:
        return ApiError(grpc.StatusCode.INVALID_ARGUMENT, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error") or first.get("msg")
        where = first.get("loc", ())[-1:]
        at = f" (at character {where[0]})" if where and isinstance(where[0], int) else ""
        message = f"the body is not valid JSON: {detail}{at}"
        return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message)
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") == "model_attributes_type":
        # Not JSON at all (a form, or no Content-Type): FastAPI hands the app a string.
        message = "the body must be a JSON object, sent as Content-Type: application/json"
        return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message)
    deepest = max(len(e.get("loc", ())) for e in errors)
    tied = [e for e in errors if len(e.get("loc", ())) == deepest]
    about_value = [e for e in tied if not str(e.get("type", "")).endswith("_type")]
    if about_value or len(tied) == 1:
        best = (about_value or tied)[0]
        message = str(best.get("msg", "is invalid")).removeprefix("Value error, ")
    else:  # the value is neither shape: name both
        best = tied[0]
        shapes = dict.fromkeys(str(e.get("msg", "")).removeprefix("Input ") for e in tied)
        message = " or ".join(shapes)
    if best.get("type") == "union_tag_invalid":  # pydantic repeats the tag as sent
        tag = str((best.get("ctx") or {}).get("tag", ""))
        message = (
            f"unknown part type {shown_text(tag)}; expected 'text', 'image_url' or 'video_url'"
        )
    param = _param(tuple(best.get("loc", ())))
    message = loggable(message, MAX_MESSAGE)
    return ApiError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{param}: {message}" if param else message,
        param=param or None,
    )


def _param(loc: tuple[Any, ...]) -> str:
    """`("body", "messages", 0, "content", "list[...]", 0, "image_url", "image_url", "url")`
    -> `messages[0].content[0].image_url.url`: the body's path, without the labels pydantic
    puts in it for a union's branches (`str`, `list[...]`, a part's tag)."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    kept: list[Any] = []
    for i, part in enumerate(parts):
        if isinstance(part, str) and (part in _UNION_LABELS or "[" in part):
            continue  # a union branch's label
        after_part = i > 0 and isinstance(parts[i - 1], int) and kept[-2:-1] == ["content"]
        if after_part and part in _PART_TAGS and i + 1 < len(parts):
            continue  # a content part's tag, before the part's own field
        kept.append(part)
    out = ""
    for part in kept:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def model_not_found(model: str, served: str, param: str | None = None) -> ApiError:
    """OpenAI's 404 for a model this server does not serve (`served` is the one it does);
    `param` names the request field that asked for it (None: the URL's path did)."""
    return ApiError(
        grpc.StatusCode.NOT_FOUND,
        f"the model {shown_text(model)} does not exist (this server serves {served!r})",
        param=param,
        code="model_not_found",
        error_type="invalid_request_error",
    )


def api_error(exc: BaseException) -> ApiError:
    """Any failure of a request as the API answers it."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RouterError):
        error = ApiError.from_router(exc.code, str(exc), exc.trailing_metadata)
        if isinstance(exc, TooLarge):  # not 429: a client would retry what never fits
            error.status, error.type = 400, "invalid_request_error"
            error.code = "context_length_exceeded" if exc.kv_context else "invalid_argument"
        if exc.context_exceeded:
            error.code = "context_length_exceeded"
        return error
    if isinstance(exc, RpcStatusError):
        return ApiError(exc.code, exc.details)
    if isinstance(exc, FieldError):
        return ApiError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), param=exc.field)
    logger.exception("HTTP request failed")
    return ApiError(grpc.StatusCode.INTERNAL, "internal error")
