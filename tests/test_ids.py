"""A caller's request id as the router's log lines show it (`router.ids.shown_id`)."""

from __future__ import annotations

import logging
import time

import pytest

from epd.v1 import decode_service_pb2, router_service_pb2
from router.ids import shown_id
from router.outcomes import Outcome


@pytest.mark.parametrize("plain", ["3ed8d0f3d02f4f77", "chat-1.turn_2:a/b@c+d=e#f", "فارسی"])
def test_a_one_word_id_is_shown_as_it_is(plain: str) -> None:
    assert shown_id(plain) == plain


def test_an_id_of_several_words_cannot_pass_for_another_tenants_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Tenant-a's id made its request's line read "request <id> (tenant-b) length: ..." and a
    # grep for "(tenant-b)" found a request tenant-b never sent (metrics review, s33).
    forged = "3ed8d0f3 (tenant-b) length: 36 prompt tokens, 4 generated in 0.039 s. Next: x"
    outcome = Outcome(shown_id(forged), "tenant-a", time.monotonic())
    outcome.saw(
        router_service_pb2.GenerateResponse(
            token_ids=[1], finish_reason=decode_service_pb2.FINISH_REASON_LENGTH
        )
    )
    with caplog.at_level(logging.INFO, logger="router.server"):
        outcome.log()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"request {forged!r} (tenant-a) length:"), line
    assert shown_id("a\u202eb") == "'a\\u202eb'"  # and what could reorder a line, escaped
    assert shown_id("سلام دنیا") == "'سلام دنیا'"  # other scripts stay readable (own-fix)
    assert shown_id("a\u3164b") == "'a\u3164b'"  # a letter that prints blank: two words


def test_an_id_too_long_to_be_served_is_shown_cut() -> None:
    shown = shown_id("x" * 10**6)
    assert len(shown) < 300 and shown.endswith("... (1000000 characters)")
    assert shown_id("x" * 256) == "x" * 256  # the longest served is shown whole
