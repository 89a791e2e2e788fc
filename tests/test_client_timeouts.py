"""`epd.client`'s timeouts: one that is not a positive number is refused naming
`timeout_s`, infinity means none, and one past what gRPC's deadline can carry is sent as
`MAX_SECONDS`, for `generate` and `status` alike (clocks and ownfix reviews, s36)."""

from __future__ import annotations

from typing import Any, cast

import pytest

from epd.v1 import decode_service_pb2, router_service_pb2


@pytest.mark.parametrize("bad", [0.0, -5.0, float("nan")])
async def test_a_timeout_that_is_not_positive_is_refused_naming_it(bad: float) -> None:
    # Each was sent, and ended at once as DEADLINE_EXCEEDED, as if the router had timed out
    # (clocks review, s36; `status` too, ownfix review).
    from epd.client import Client

    client = Client("127.0.0.1:1", api_key="k")
    try:
        with pytest.raises(ValueError, match="timeout_s: must be a positive number"):
            await client.generate_text([{"role": "user", "content": "hi"}], timeout_s=bad)
        with pytest.raises(ValueError, match="timeout_s: must be a positive number"):
            await client.status(timeout_s=bad)
    finally:
        await client.close()


@pytest.mark.parametrize(("given", "sent"), [(float("inf"), None), (1e12, 1e7)])
async def test_a_request_is_sent_with_its_timeout_as_checked(given: float, sent: Any) -> None:
    # Checked but not used, inf and 1e12 ended at once again (ownfix review, s36).
    from epd.client import Client

    seen: list[float | None] = []

    class Call:  # a gRPC stream of one answer
        def __init__(self) -> None:
            self.answers = [
                router_service_pb2.GenerateResponse(
                    token_ids=[1], finish_reason=decode_service_pb2.FINISH_REASON_STOP
                )
            ]

        def __aiter__(self) -> Any:
            return self

        async def __anext__(self) -> Any:
            if not self.answers:
                raise StopAsyncIteration
            return self.answers.pop()

        def cancel(self) -> None:
            pass

    class Stub:
        def Generate(self, request: Any, timeout: Any = None, metadata: Any = None) -> Any:
            seen.append(timeout)
            return Call()

    client = Client("127.0.0.1:1", api_key="k")
    cast(Any, client._routers)[0] = Stub()
    try:
        await client.generate_text([{"role": "user", "content": "hi"}], timeout_s=given)
    finally:
        await client.close()
    (timeout,) = seen
    assert timeout is None if sent is None else timeout is not None and 0 < timeout <= sent


@pytest.mark.parametrize(("given", "sent"), [(float("inf"), None), (1e12, 1e7)])
async def test_status_is_asked_with_its_timeout_as_checked(
    given: float, sent: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import epd.client
    from epd.v1 import admin_service_pb2

    seen: list[float | None] = []

    class Admin:
        def __init__(self, channel: Any) -> None:
            pass

        async def Status(self, request: Any, timeout: Any = None) -> Any:
            seen.append(timeout)
            return admin_service_pb2.StatusResponse()

    monkeypatch.setattr(epd.client.admin_service_pb2_grpc, "AdminServiceStub", Admin)
    client = epd.client.Client("127.0.0.1:1", api_key="k")
    try:
        await client.status(timeout_s=given)
    finally:
        await client.close()
    (timeout,) = seen
    assert timeout is None if sent is None else timeout is not None and 0 < timeout <= sent


def test_an_endless_or_huge_timeout_is_sent_as_one_grpc_can_carry() -> None:
    # 1e12 s overflowed gRPC's int64 nanoseconds: DEADLINE_EXCEEDED at once (clocks review).
    from common.settings.schema import MAX_SECONDS
    from epd.request import checked_timeout

    assert checked_timeout(None) is None and checked_timeout(float("inf")) is None
    assert checked_timeout(1e12) == MAX_SECONDS
    assert checked_timeout(2.5) == 2.5
