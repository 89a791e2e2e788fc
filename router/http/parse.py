"""A request body into its schema (`router.http.schema`), off the event loop and bounded.

FastAPI would parse and validate a body on the event loop, which also runs every stream,
the gRPC front door and the workers' heartbeats: a body of millions of tiny messages (a
quarter of `max_message_mb`) took 8 s to validate there, dropped every worker for missed
heartbeats and broke other tenants' streams. Here the endpoints take the raw body and
`parse_body` runs in a worker thread, where the validators (Python, per object) let the
loop run between them; a body of more than `MAX_BODY_OBJECTS` JSON objects (messages,
content parts, their URLs) is refused while it is being parsed, before any is validated;
and one of more commas than its text and structure can hold, before it is parsed.

Refusals read as FastAPI's did (`router.http.errors.validation_error`): a body that is not
JSON names where it broke, one that is not sent as JSON says so, a field's error names it.
"""

from __future__ import annotations

import json
from email.message import Message
from typing import Any, TypeVar

import grpc
from pydantic import BaseModel, ValidationError

from router.http.errors import ApiError, validation_error

# JSON objects a body may hold: a chat of thousands of messages with images holds ~3 per
# message; validating each costs ~4 µs.
MAX_BODY_OBJECTS = 1 << 16
# Commas a body may hold beyond its text's bytes (`[router] max_prompt_text_bytes`, which
# may all be commas): a bound on its values, counted before parsing. `json.loads` holds the
# GIL throughout, whatever thread runs it: a 248 MiB array of zeros held the loop 6 s.
MAX_BODY_VALUES = 1 << 20

B = TypeVar("B", bound=BaseModel)

NOT_JSON = "the body must be a JSON object, sent as Content-Type: application/json"


class _TooManyObjects(Exception):
    """The body holds more than `MAX_BODY_OBJECTS` objects."""


def _is_json(content_type: str | None) -> bool:
    """No Content-Type, `application/json` or `application/*+json` (as FastAPI reads it)."""
    if not content_type:
        return True
    message = Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def _counting() -> Any:
    """A `json.loads` object hook that refuses the object past `MAX_BODY_OBJECTS`."""
    seen = 0

    def hook(obj: dict[str, Any]) -> dict[str, Any]:
        nonlocal seen
        seen += 1
        if seen > MAX_BODY_OBJECTS:
            raise _TooManyObjects
        return obj

    return hook


def parse_body(
    data: bytes, content_type: str | None, schema: type[B], max_commas: int = MAX_BODY_VALUES
) -> B:
    """`data` as `schema`; ApiError (400) naming what is wrong. Blocking: run it in a
    thread. More than `max_commas` commas is refused before parsing (module docstring)."""
    if not data or not _is_json(content_type):
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, NOT_JSON)
    if data.count(b",") > max_commas:
        raise ApiError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the body holds more than {max_commas} commas: more values than a request has",
        )
    try:
        body = json.loads(data, object_hook=_counting())
    except _TooManyObjects:
        raise ApiError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the body holds more than {MAX_BODY_OBJECTS} JSON objects (messages, content "
            "parts and their URLs)",
        ) from None
    except json.JSONDecodeError as exc:
        error = {"type": "json_invalid", "loc": ("body", exc.pos), "ctx": {"error": exc.msg}}
        raise validation_error([error]) from None
    except RecursionError:
        message = "the body is not valid JSON: nested too deep to parse"
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, message) from None
    except ValueError as exc:  # not UTF-8 (UnicodeDecodeError), an integer of 4300+ digits
        message = f"the body is not valid JSON: {exc}"
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, message) from None
    if not isinstance(body, dict):
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, NOT_JSON)
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        raise validation_error(errors) from None
