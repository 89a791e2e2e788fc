"""`GenerateRequest.resume_tokens` (a client resuming a stream on another router): the
router's check names the field; a resumed stream sends only what follows the tokens."""

from __future__ import annotations

import pytest

from epd.v1 import router_service_pb2
from router.decode import check_resume
from router.inputs import InputError


def _request(tokens: list[int], stop: tuple[str, ...] = ()) -> router_service_pb2.GenerateRequest:
    return router_service_pb2.GenerateRequest(resume_tokens=tokens, stop=list(stop))


def test_no_resume_tokens_is_a_fresh_request() -> None:
    assert check_resume(_request([]), 8) == ()


def test_resume_tokens_come_back_in_order() -> None:
    assert check_resume(_request([5, 3, 9]), 8) == (5, 3, 9)


@pytest.mark.parametrize(
    ("tokens", "stop", "reason"),
    [
        ([1] * 8, (), "leave none to generate (max_tokens=8)"),
        ([4, -1], (), "must not be negative"),
        ([4], ("END",), "stop strings cannot be resumed"),
        ([4, 100], (), "token id 100 is outside the vocab"),
    ],
)
def test_bad_resume_tokens_are_refused_naming_the_field(
    tokens: list[int], stop: tuple[str, ...], reason: str
) -> None:
    with pytest.raises(InputError) as info:
        check_resume(_request(tokens, stop), 8, vocab_size=100)
    assert info.value.field == "resume_tokens" and reason in str(info.value)
