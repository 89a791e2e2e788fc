"""The HTTP API names things as the client knows them: a field as its body spells it, and
the caller, identified on the event loop (no thread hop per request)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import grpc

from router.http.convert import as_sent
from router.http.errors import ApiError
from router.http.schema import ChatCompletionRequest
from tests.model_fixtures import user
from tests.test_http_api import CLIENT_KEY, MODEL_ID, FakeCluster, call, url_of
from tests.test_http_api import ckpt as ckpt  # fixtures: the module's checkpoint, a router
from tests.test_http_api import fake as fake


def test_a_field_is_named_as_the_body_spells_it() -> None:
    # A string content is one text part on the wire: "messages[1].content[0].text: ..."
    # named a path the body did not have (new-user review).
    body = ChatCompletionRequest.model_validate(
        {
            "model": MODEL_ID,
            "max_completion_tokens": 5,
            "messages": [{"role": "system", "content": "Be brief."}, *user("Hi.")],
        }
    )

    def named(field: str) -> tuple[str | None, str]:
        error = ApiError.from_router(
            grpc.StatusCode.INVALID_ARGUMENT, f"{field}: too long", (("epd-field", field),)
        )
        as_sent(error, body)
        return error.param, str(error)

    assert named("messages[0].content[0].text") == (
        "messages[0].content",
        "messages[0].content: too long",
    )
    assert named("messages[1].content[0].text")[0] == "messages[1].content[0].text"  # parts
    assert named("max_tokens") == ("max_completion_tokens", "max_completion_tokens: too long")
    assert named("messages[7].content[0].text")[0] == "messages[7].content[0].text"


async def test_the_caller_is_identified_on_the_event_loop(fake: FakeCluster, monkeypatch) -> None:
    # A plain-function dependency runs on FastAPI's thread pool: a thread hop per request,
    # and a 60-request burst grew the router by 36 threads (overload review).
    import router.http.app as app_module

    threads = []
    identify = app_module.identify

    def recorded(*args: Any) -> Any:
        threads.append(threading.get_ident())
        return identify(*args)

    monkeypatch.setattr(app_module, "identify", recorded)
    status, _, _ = await asyncio.to_thread(call, f"{url_of(fake)}/v1/models", None, CLIENT_KEY)
    assert status == 200 and threads == [threading.get_ident()]
