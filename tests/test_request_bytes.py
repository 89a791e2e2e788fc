"""A Generate request's strings checked on its wire bytes, before it is parsed
(`router.request_bytes`): the text against `max_prompt_text_bytes` exactly as the processor
counts it after parsing (the same refusals, naming the same field), the ids, salt, uuids
and stop strings never refused where the checks after parsing accept them. A refused 255 MiB
prompt was parsed and copied at each read first: two of them took a router to 5-8 GB and
stalled its loop 18 s of 25 (attacker review, s40)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import FieldError
from common.processing.limits import InputLimits, LimitError, check_text_bytes
from common.processing.messages import Message, TextPart, check_text_limits
from epd.v1 import router_service_pb2
from router.request_bytes import decode_request

ROLES = ("system", "user", "assistant")
texts = st.text(max_size=24)  # any code point: 1 to 4 UTF-8 bytes each


def processor_refusal(chat: list[tuple[str, list[str]]], limit: int) -> FieldError | None:
    """What the processor's own check (after parsing) says of the chat's text."""
    messages = [Message(role, tuple(TextPart(t) for t in parts)) for role, parts in chat]
    try:
        check_text_limits(messages, InputLimits(max_text_bytes=limit))
    except LimitError as exc:
        return exc
    return None


def wire_refusal(request: router_service_pb2.GenerateRequest, limit: int) -> FieldError | None:
    try:
        decode_request(request.SerializeToString(), 1024, limit)
    except FieldError as exc:
        return exc
    return None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(ROLES), st.lists(texts, max_size=3)), max_size=4),
    st.integers(0, 120),
)
def test_the_wire_refuses_the_text_the_processor_refuses(
    chat: list[tuple[str, list[str]]], limit: int
) -> None:
    request = router_service_pb2.GenerateRequest()
    for role, parts in chat:
        request.messages.add(role=role, content=[{"text": t} for t in parts])
    expected, got = processor_refusal(chat, limit), wire_refusal(request, limit)
    assert (got is None) == (expected is None)
    if expected is not None and got is not None:
        assert (got.field, str(got)) == (expected.field, str(expected))


@settings(max_examples=200, deadline=None)
@given(texts, st.integers(0, 100))
def test_a_prompt_is_refused_on_the_wire_as_after_parsing(prompt: str, limit: int) -> None:
    request = router_service_pb2.GenerateRequest(prompt=prompt)
    expected: FieldError | None = None
    try:
        check_text_bytes(len(prompt.encode()), InputLimits(max_text_bytes=limit), "prompt")
    except LimitError as exc:
        expected = exc
    got = wire_refusal(request, limit)
    assert (got is None) == (expected is None)
    if expected is not None and got is not None:
        assert (got.field, str(got)) == (expected.field, str(expected))


def test_a_large_prompt_is_refused_before_it_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[int] = []
    real = router_service_pb2.GenerateRequest.FromString

    def parse(data: bytes) -> router_service_pb2.GenerateRequest:
        parsed.append(len(data))
        return real(data)

    monkeypatch.setattr(router_service_pb2.GenerateRequest, "FromString", parse)
    data = router_service_pb2.GenerateRequest(prompt="a" * (8 << 20)).SerializeToString()
    with pytest.raises(FieldError, match="max_prompt_text_bytes = 1048576") as err:
        decode_request(data, 1024, 1 << 20)
    assert err.value.field == "prompt" and parsed == []
    decode_request(router_service_pb2.GenerateRequest(prompt="a" * 100).SerializeToString(), 9, 100)
    assert parsed != []


@pytest.mark.parametrize(
    ("request_", "field", "reason"),
    [
        ({"request_id": "x" * 1025}, "request_id", "is over 256 characters"),
        ({"cache_salt": "s" * 1025}, "cache_salt", "is over 256 characters"),
        ({"stop": ["ok", "z" * 1025]}, "stop", "at most 256 characters"),
        (
            {"messages": [{"role": "user", "content": [{"image": {"uuid": "u" * 1025}}]}]},
            "messages[0].content[0].image.uuid",
            "is over 256 characters",
        ),
    ],
)
def test_ids_and_stop_strings_past_any_length_allowed_are_refused_on_the_wire(
    request_: dict[str, object], field: str, reason: str
) -> None:
    request = router_service_pb2.GenerateRequest(**request_)  # type: ignore[arg-type]
    with pytest.raises(FieldError, match=reason) as err:
        decode_request(request.SerializeToString(), 1024, 1 << 20)
    assert err.value.field == field
    # 256 characters of 4 bytes each pass here: the checks after parsing count characters.
    wide = router_service_pb2.GenerateRequest(
        request_id="\U0001f600" * 256, stop=["\U0001f600" * 256]
    )
    decode_request(wide.SerializeToString(), 1024, 1 << 20)


def test_an_http_bodys_text_past_the_limit_in_characters_is_refused_before_conversion() -> None:
    from router.http.convert import check_text_length
    from router.http.schema import ChatCompletionRequest, CompletionRequest

    chat = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "ab"},
                {"role": "user", "content": [{"type": "text", "text": "ü" * 3}]},
            ],
        }
    )
    check_text_length(chat, 5)  # 5 characters (the processor counts 8 bytes and the roles)
    with pytest.raises(FieldError, match="prompt text of 5\\+ bytes") as err:
        check_text_length(chat, 4)
    assert err.value.field == "messages[1].content[0].text"
    with pytest.raises(FieldError) as err:
        check_text_length(chat, 1)
    assert err.value.field == "messages[0].content"  # a string content, as the body has it
    with pytest.raises(FieldError) as err:
        check_text_length(CompletionRequest.model_validate({"model": "m", "prompt": "abc"}), 2)
    assert err.value.field == "prompt"
