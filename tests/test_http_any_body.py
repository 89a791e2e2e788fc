"""Any JSON body the HTTP API may receive (hypothesis): it is converted, or refused by the
schema with a `param` free of pydantic's union labels, or refused with a FieldError;
nothing else escapes (which the API would answer 500). `tests/test_bad_input.py` has the
cases found by hand."""

from __future__ import annotations

import contextlib
from typing import Any

import pydantic
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import FieldError
from router.http.convert import chat_request
from router.http.errors import validation_error
from router.http.media import MediaPolicy
from router.http.schema import ChatCompletionRequest

MODEL = "tiny"
_KEYS = ["model", "messages", "role", "content", "type", "text", "image_url", "video_url"]
_KEYS += ["url", "uuid", "fps", "temperature", "top_p", "top_k", "seed", "max_tokens", "stop"]
_KEYS += ["n", "stream", "stream_options", "logprobs", "tools", "response_format", "prompt"]
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "user", "text", "image_url", "video_url", MODEL, "\ud800", "data:,"]),
    st.text(max_size=8),
)


def _nested(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_KEYS), inner, max_size=4)


_VALUES = st.recursive(_SCALARS, _nested, max_leaves=12)


@given(
    st.fixed_dictionaries(
        {"model": st.just(MODEL), "messages": _VALUES},
        optional={k: _VALUES for k in ("stop", "max_tokens", "temperature", "top_k", "tools")},
    )
)
@settings(max_examples=300, deadline=None)
def test_any_body_is_converted_or_refused_naming_a_field(body: dict[str, Any]) -> None:
    """Whatever the JSON, the body is converted, or refused by the schema with a path
    free of union labels, or refused with a FieldError: nothing else escapes (a 500)."""
    try:
        parsed = ChatCompletionRequest.model_validate(body)
    except pydantic.ValidationError as err:
        error = validation_error([{**e, "loc": ("body", *e["loc"])} for e in err.errors()])
        assert error.status == 400
        assert error.param is None or not any(
            part == "str" or "[" in part.split("]")[-1] for part in error.param.split(".")
        ), error.param
        return
    with contextlib.suppress(FieldError):
        chat_request(parsed, "r", MediaPolicy())
