"""`common.wire.counts.check_counts`: element counts read from a message's wire bytes, before
it is parsed (the router refuses a Generate of too many elements with it; stalls review).

Pins: the counts equal the parsed message's own (packed and unpacked fields, sub-messages
summed); a bound passed names the element; bytes the parser takes are never refused as
malformed; the walk stops at its bounds, whatever the size.
"""

from __future__ import annotations

import time

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import FieldError
from common.wire.counts import check_counts
from epd.v1 import router_service_pb2

DESCRIPTOR = router_service_pb2.GenerateRequest.DESCRIPTOR
BIG = 1 << 30


def counts(data: bytes, bounds: dict[str, int] | None = None, default: int = BIG) -> dict:
    return check_counts(data, DESCRIPTOR, bounds or {}, default, BIG)


parts = st.one_of(
    st.text(max_size=5).map(lambda t: router_service_pb2.ContentPart(text=t)),
    st.binary(max_size=5).map(
        lambda b: router_service_pb2.ContentPart(image=router_service_pb2.ImageInput(data=b))
    ),
    st.lists(st.binary(max_size=3), max_size=4).map(
        lambda f: router_service_pb2.ContentPart(video=router_service_pb2.VideoInput(frames=f))
    ),
)
requests = st.builds(
    lambda messages, stop, resume, ids: router_service_pb2.GenerateRequest(
        messages=[router_service_pb2.ChatMessage(role="user", content=m) for m in messages],
        stop=stop,
        resume_tokens=resume,
        sampling={"stop_token_ids": ids},
    ),
    st.lists(st.lists(parts, max_size=4), max_size=4),
    st.lists(st.text(max_size=3), max_size=4),
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40),
    st.lists(st.integers(0, 2**31 - 1), max_size=40),
)


@given(requests)
@settings(max_examples=200, deadline=None)
def test_counts_are_the_parsed_messages(request: router_service_pb2.GenerateRequest) -> None:
    found = counts(request.SerializeToString())
    content = [p for m in request.messages for p in m.content]
    frames = sum(len(p.video.frames) for p in content if p.HasField("video"))
    assert found.get("messages", 0) == len(request.messages)
    assert found.get("messages.content", 0) == len(content)
    assert found.get("messages.content.video.frames", 0) == frames
    assert found.get("stop", 0) == len(request.stop)
    assert found.get("resume_tokens", 0) == len(request.resume_tokens)  # packed
    assert found.get("sampling.stop_token_ids", 0) == len(request.sampling.stop_token_ids)


def test_unpacked_and_repeated_singular_fields_count_each_time() -> None:
    token = b"\x38\x05"  # resume_tokens = 5, unpacked (field 7, varint): parsers take both
    request_id = b"\x0a\x01x"  # a singular field sent again is parsed again
    found = counts(token * 7 + request_id * 3 + b"\xa0\x06\x01")  # and an unknown field 100
    assert found == {"resume_tokens": 7, "request_id": 3}  # unknown: read, not counted


def test_a_bound_passed_names_the_element() -> None:
    request = router_service_pb2.GenerateRequest()
    for _ in range(3):
        request.messages.add().content.add().video.frames.extend([b""] * 3)
    data = request.SerializeToString()
    with pytest.raises(FieldError) as err:
        counts(data, {"messages.content.video.frames": 8})
    assert err.value.field == "messages[2].content[0].video.frames"
    with pytest.raises(FieldError) as err:
        counts(data, {"messages": 2})
    assert err.value.field == "messages"
    with pytest.raises(FieldError, match="too many fields"):
        check_counts(data, DESCRIPTOR, {}, BIG, 10)


@given(requests, st.data())
@settings(max_examples=200, deadline=None)
def test_bytes_the_parser_takes_are_never_malformed_here(request, data) -> None:
    wire = bytearray(request.SerializeToString())
    for _ in range(data.draw(st.integers(0, 3))):  # cut, or a byte changed
        if not wire:
            break
        if data.draw(st.booleans()):
            del wire[data.draw(st.integers(0, len(wire) - 1)) :]
        else:
            wire[data.draw(st.integers(0, len(wire) - 1))] = data.draw(st.integers(0, 255))
    try:
        router_service_pb2.GenerateRequest.FromString(bytes(wire))
    except DecodeError:
        return
    counts(bytes(wire))


def test_the_walk_stops_at_its_bounds_whatever_the_size() -> None:
    body = b"\x12\x00" * (8 << 20)  # 8M empty messages, 16 MiB
    started = time.process_time()
    with pytest.raises(FieldError):
        counts(body, {"messages": 1000})
    assert time.process_time() - started < 0.5  # not 8M fields walked
    packed = b"\x3a\x80\x80\x80\x40" + b"\x01" * (1 << 27)  # 128 MiB of resume tokens
    started = time.process_time()
    with pytest.raises(FieldError, match="resume_tokens"):
        counts(packed, {"resume_tokens": 1000})
    assert time.process_time() - started < 0.1  # refused from its length, not copied
    with pytest.raises(DecodeError):
        counts(b"\x12\x05ab")  # a length past the end
    with pytest.raises(DecodeError):
        counts(b"\x13")  # a group


def test_a_field_sent_in_another_wire_type_is_unknown_as_the_parser_reads_it() -> None:
    # 17 stop strings sent as varints were refused on the wire ("more than 16"), though the
    # parser keeps them as unknown fields and the request holds none (ownfixA, s41).
    def tag(number: int, wire: int) -> bytes:
        return bytes([number << 3 | wire])

    top_k_packed = tag(3, 2) + b"\x01\x05"  # sampling.top_k (a singular int32) packed
    odd = b"".join(
        [
            (tag(5, 0) + b"\x01") * 17,  # stop (strings) as varints
            (tag(2, 5) + b"\0\0\0\0") * 3,  # messages (messages) as fixed32
            tag(7, 1) + b"\0" * 8,  # resume_tokens (int32: varints or packed) as fixed64
            tag(3, 2) + bytes([len(top_k_packed)]) + top_k_packed,
        ]
    )
    parsed = router_service_pb2.GenerateRequest.FromString(odd)
    assert not (parsed.stop or parsed.messages or parsed.resume_tokens)
    assert parsed.sampling.top_k == 0
    got = check_counts(odd, DESCRIPTOR, {"stop": 16}, BIG, BIG)
    assert "stop" not in got and "messages" not in got and "resume_tokens" not in got
    assert "sampling.top_k" not in got and got["sampling"] == 1
    # Their own wire types still count, a repeated number packed or not.
    fine = (tag(7, 0) + b"\x05") + (tag(7, 2) + b"\x02\x06\x07")
    assert check_counts(fine, DESCRIPTOR, {}, BIG, BIG)["resume_tokens"] == 3
