"""A Generate request with several faults, refused on its wire bytes (`router.request_bytes`)
naming the first in the order the checks after parsing meet them: the ids, the stop strings,
the prompt field, then message by message (its role, then each part's text or uuid). Before,
it named them as they came on the wire (s41 review F2; ownfixA review F5)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import FieldError
from common.processing.limits import InputLimits, check_text_bytes
from epd.v1 import router_service_pb2
from router.request_bytes import decode_request
from tests.test_request_bytes import _delimited, same_refusal, texts, wire_refusal

wire_visible_uuids = st.one_of(  # within the checks after parsing, or past 4 bytes a character
    st.text("u\u00fc\U0001f600", max_size=8), st.just("\U0001f600" * 257), st.just("u" * 1025)
)
pieces_of_parts = st.lists(
    st.one_of(
        st.builds(lambda t: router_service_pb2.ContentPart(text=t), texts),
        st.builds(
            lambda u: router_service_pb2.ContentPart(image={"data": b"png", "uuid": u}),
            wire_visible_uuids,
        ),
        st.builds(
            lambda u: router_service_pb2.ContentPart(video={"frames": [b"f"], "uuid": u}),
            wire_visible_uuids,
        ),
        st.just(router_service_pb2.ContentPart(video={"fps": 1.0})),
        st.just(router_service_pb2.ContentPart(image={})),
    ),
    min_size=1,
    max_size=3,
)


def parsed_refusal(messages: list[router_service_pb2.ChatMessage], limit: int) -> FieldError | None:
    """The first of the text and uuid checks after parsing to refuse the chat, in their
    order: message by message, its role, then each part's text or its media's uuid."""
    limits, used = InputLimits(max_text_bytes=limit), 0
    try:
        for i, message in enumerate(messages):
            used += len(message.role.encode())
            check_text_bytes(used, limits, f"messages[{i}].role")
            for j, part in enumerate(message.content):
                kind = part.WhichOneof("content")
                if kind == "text":
                    used += len(part.text.encode())
                    check_text_bytes(used, limits, f"messages[{i}].content[{j}].text")
                elif kind is not None and len(getattr(part, kind).uuid) > 256:
                    raise FieldError(
                        f"messages[{i}].content[{j}].{kind}.uuid", "is over 256 characters"
                    )
    except FieldError as exc:
        return exc
    return None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(pieces_of_parts, min_size=1, max_size=3), min_size=1, max_size=3),
    st.integers(0, 80),
)
def test_a_chat_with_several_faults_is_refused_naming_the_first_as_after_parsing(
    chats: list[list[list[router_service_pb2.ContentPart]]], limit: int
) -> None:
    # The wire check named the faults as they came on the wire, the checks after parsing
    # message by message, part by part (s41 review F2); where every fault shows on the wire
    # (a uuid past 4 bytes a character), the two name the same.
    wire = b"".join(
        _delimited(
            2,
            router_service_pb2.ChatMessage(role="user").SerializeToString()
            + b"".join(
                _delimited(2, b"".join(piece.SerializeToString() for piece in pieces))
                for pieces in parts
            ),
        )
        for parts in chats
    )
    expected = parsed_refusal(
        list(router_service_pb2.GenerateRequest.FromString(wire).messages), limit
    )
    same_refusal(wire_refusal(wire, limit), expected)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"cache_salt": "s" * 2000, "request_id": "r" * 2000}, "request_id"),
        ({"stop": ["x" * 2000], "request_id": "r" * 2000}, "request_id"),
        ({"stop": ["x" * 2000], "cache_salt": "s" * 2000}, "cache_salt"),
    ],
)
def test_ids_come_before_stop_strings_whatever_order_they_are_sent_in(
    fields: dict[str, object], named: str
) -> None:
    # Refused as they came on the wire: `cache_salt` or `stop` where `check_ids` names the
    # request id first (s41 review F2).
    wire = b"".join(
        router_service_pb2.GenerateRequest(**{name: value}).SerializeToString()  # type: ignore[arg-type]
        for name, value in fields.items()
    )
    with pytest.raises(FieldError) as err:
        decode_request(wire, 1024, 1 << 20)
    assert err.value.field == named


@pytest.mark.parametrize("stops", [["", "x" * 2000], ["x" * 2000, ""], ["ok", "", "y" * 2000]])
def test_the_first_faulty_stop_string_is_named_as_after_parsing(stops: list[str]) -> None:
    # An empty one before one too long was refused for the long one (ownfixA review, s41).
    from router.stop import check_stop

    with pytest.raises(FieldError) as after:
        check_stop(stops)
    wire = router_service_pb2.GenerateRequest(stop=stops).SerializeToString()
    with pytest.raises(FieldError) as err:
        decode_request(wire, 1024, 1 << 20)
    assert (err.value.field, str(err.value)) == (after.value.field, str(after.value))


@pytest.mark.parametrize(
    ("request_", "field", "reason"),
    [
        ({"prompt": ""}, "prompt", "is empty"),
        (  # both, the prompt past the text limit too: named for both first, as after parsing
            {"prompt": "p" * 200, "messages": [{"role": "user"}]},
            "prompt",
            "give either messages or a prompt, not both",
        ),
        ({"prompt": "p", "messages": [{}]}, "prompt", "give either messages or a prompt, not both"),
        ({"stop": ["s"] * 17}, "stop", "at most 16 stop strings"),
    ],
)
def test_the_prompt_field_and_the_stop_count_are_refused_as_after_parsing(
    request_: dict[str, object], field: str, reason: str
) -> None:
    # Each was refused on the wire for something the checks after parsing meet later, or
    # in other words (ownfixA review, s41).
    wire = router_service_pb2.GenerateRequest(**request_).SerializeToString()  # type: ignore[arg-type]
    with pytest.raises(FieldError) as err:
        decode_request(wire, 1024, 100)
    assert (err.value.field, err.value.reason) == (field, reason)
