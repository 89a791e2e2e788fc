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
JSON is read as JSON has it, not as Python's `json` would: a key named twice in an object is
refused by its path (`_Objects`), `NaN` and `Infinity` are not JSON, and a charset other than
UTF-8 (or the UTF-16 and UTF-32 `json.loads` detects) is answered 415, not read as UTF-8.
"""

from __future__ import annotations

import codecs
import json
from email.message import Message
from json.decoder import scanstring  # type: ignore[attr-defined]
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
# Strings a body may hold (keys and values; counted as its quotes, escaped ones not, before
# parsing): an object's keys are all read before the hook sees it, GIL held: one object of
# 2M keys (22 MiB, e.g. `logit_bias` or an ignored field) held the loop 1.7-2.5 s. A
# message or part object holds up to 6 (`{"role": "user", "name": "a", "content": "hi"}`).
MAX_BODY_STRINGS = 6 * MAX_BODY_OBJECTS
# Characters of a number: no field needs more (a seed is below 2^64, 20 digits), and
# `json.loads` converts digits to an int in C, GIL held: a body of 4299-digit integers
# stalled the router 8.5 s at 250 MiB, and was answered 200 (an ignored field's).
MAX_NUMBER_CHARS = 64

B = TypeVar("B", bound=BaseModel)

NOT_JSON = "the body must be a JSON object, sent as Content-Type: application/json"
MAX_SHOWN_PATH = 200  # characters of a caller's key path an error repeats
# What `json.loads` reads (`codecs.lookup` names; ASCII is UTF-8).
JSON_CHARSETS = frozenset(
    ("utf-8", "ascii", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be")
)


class _TooManyObjects(Exception):
    """The body holds more than `MAX_BODY_OBJECTS` objects."""


class _NotJson(ValueError):
    """What `json.loads` reads but JSON does not have (NaN, Infinity), or a number past
    `MAX_NUMBER_CHARS`; `token` is its text, for `_where` to find."""

    def __init__(self, message: str, token: str) -> None:
        super().__init__(message)
        self.token = token


def _where(data: bytes, token: str) -> int | None:
    """The character (as `json.JSONDecodeError.pos` counts them) where `token` first stands
    outside a string of the JSON text `data`: where `json.loads` raised `_NotJson`, which it
    does not say (its hooks are given the token alone). Strings are skipped by `json`'s own
    scanner, in C, as `json.loads` read them: a regex kept state per escape (a body of
    escapes held the loop 35 s and took GBs: ownfixD review)."""
    text = data.decode(json.detect_encoding(data), "surrogatepass")
    at = 0
    while True:
        quote = text.find('"', at)
        found = text.find(token, at, len(text) if quote < 0 else quote)
        if found >= 0:
            return found
        if quote < 0:
            return None
        try:
            at = scanstring(text, quote + 1, False)[1]  # just past the string's closing quote
        except ValueError:  # not a string after all (json.loads read it, so not before it)
            return None


def _media_type(content_type: str) -> Message:
    message = Message()
    message["content-type"] = content_type
    return message


def _is_json(content_type: str | None) -> bool:
    """No Content-Type, `application/json` or `application/*+json` (as FastAPI reads it)."""
    if not content_type:
        return True
    message = _media_type(content_type)
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def _unreadable_charset(content_type: str | None) -> str | None:
    """The charset `content_type` names, if `json.loads` cannot read it (it reads UTF-8,
    UTF-16 and UTF-32 only, whatever the header says: a Latin-1 body was read as UTF-8)."""
    charset = _media_type(content_type).get_param("charset") if content_type else None
    if not isinstance(charset, str):
        return None
    try:
        name = codecs.lookup(charset).name
    except LookupError:
        return charset
    return None if name in JSON_CHARSETS else charset


class _Twice(dict[str, Any]):
    """A JSON object that names `key` more than once (its last value kept, as `json` does)."""

    __slots__ = ("key",)

    def __init__(self, pairs: list[tuple[str, Any]], key: str) -> None:
        super().__init__(pairs)
        self.key = key


class _Objects:
    """A `json.loads` object_pairs_hook: refuses the object past `MAX_BODY_OBJECTS`, and
    marks one that names a key twice (`_Twice`), so `parse_body` can refuse it by its path.
    Which value of such a key is meant is unknown: a proxy in front that reads the first
    (as Go's and Java's decoders do) would check another model, prompt or limit than the
    router serves, which keeps the last."""

    def __init__(self) -> None:
        self.seen = 0
        self.twice = False  # some object names a key twice

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        self.seen += 1
        if self.seen > MAX_BODY_OBJECTS:
            raise _TooManyObjects
        obj = dict(pairs)
        if len(obj) == len(pairs):
            return obj
        self.twice = True
        keys: set[str] = set()
        for key, _ in pairs:
            if key in keys:
                return _Twice(pairs, key)
            keys.add(key)
        raise AssertionError("no key is named twice")


def _twice_at(body: Any) -> str:
    """The path (`messages[0].content[1].type`, as `router.http.errors` names fields) of the
    first key, in the body's order, that an object of `body` names twice."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, _Twice):
            return f"{path}.{value.key}" if path else value.key
        if isinstance(value, dict):
            items = [(f"{path}.{k}" if path else k, v) for k, v in value.items()]
        elif isinstance(value, list):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        else:
            continue
        stack.extend(reversed(items))
    raise AssertionError("no object names a key twice")


def _not_a_json_value(name: str) -> Any:
    """`json.loads`'s `parse_constant`: NaN and Infinity are Python's, not JSON's."""
    raise _NotJson(f"{name} is not a JSON value", name)


def _unescaped_quotes(data: bytes) -> int:
    """The quotes of a JSON text that open or close a string: those after an even run of
    backslashes, as the alternating sum of the counts of quotes after at least k of them
    (in C, no copy), to k = 8: a quote after more counts as one (never fewer)."""
    return sum((-1) ** k * data.count(b"\\" * k + b'"') for k in range(9))


def _int(text: str) -> int:
    """`json.loads`'s `parse_int`: a number of at most `MAX_NUMBER_CHARS` (a Python call
    per number also lets go of the GIL between them)."""
    if len(text) > MAX_NUMBER_CHARS:
        raise _NotJson(f"a number of more than {MAX_NUMBER_CHARS} characters", text)
    return int(text)


def _float(text: str) -> float:
    """`json.loads`'s `parse_float`, bounded as `_int`."""
    if len(text) > MAX_NUMBER_CHARS:
        raise _NotJson(f"a number of more than {MAX_NUMBER_CHARS} characters", text)
    return float(text)


def parse_body(
    data: bytes, content_type: str | None, schema: type[B], max_commas: int = MAX_BODY_VALUES
) -> B:
    """`data` as `schema`; ApiError (400) naming what is wrong. Blocking: run it in a
    thread. More than `max_commas` commas is refused before parsing (module docstring)."""
    if not data or not _is_json(content_type):
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, NOT_JSON)
    charset = _unreadable_charset(content_type)
    if charset is not None:
        unsupported = ApiError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"charset {charset} is not supported: send the body as UTF-8",
        )
        unsupported.status = 415
        raise unsupported
    if data.count(b",") > max_commas:
        raise ApiError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the body holds more than {max_commas} commas: more values than a request has",
        )
    if data.count(b'"') > 2 * MAX_BODY_STRINGS and _unescaped_quotes(data) > 2 * MAX_BODY_STRINGS:
        raise ApiError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the body holds more than {MAX_BODY_STRINGS} strings (keys and values)",
        )
    objects = _Objects()
    try:
        body = json.loads(
            data,
            object_pairs_hook=objects,
            parse_constant=_not_a_json_value,
            parse_int=_int,
            parse_float=_float,
        )
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
    except UnicodeDecodeError as exc:
        message = f"the body is not valid JSON: {exc}: send it as UTF-8"
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, message) from None
    except _NotJson as exc:
        at = _where(data, exc.token)
        loc = ("body",) if at is None else ("body", at)
        error = {"type": "json_invalid", "loc": loc, "ctx": {"error": str(exc)}}
        raise validation_error([error]) from None
    except ValueError as exc:  # none known: `_int` and `_float` bound the digits
        message = f"the body is not valid JSON: {exc}"
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, message) from None
    if objects.twice:
        # The caller's key: escaped (a lone surrogate could not be encoded: a 500) and cut.
        where = ascii(_twice_at(body))[1:-1][:MAX_SHOWN_PATH]
        message = f"the body names '{where}' twice"
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param=where)
    if not isinstance(body, dict):
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, NOT_JSON)
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        raise validation_error(errors) from None
