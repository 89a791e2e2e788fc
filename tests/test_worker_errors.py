"""A worker's failed call as the client sees it (`router.calls.WorkerCalls.error`): no
worker's address in its words (`common.address.without_addresses`), the worker named once by
its role, and a full KV pool passed on with a back-off hint where waiting can help."""

from __future__ import annotations

import grpc
import pytest

from common.roles import Role
from router.calls import RouterError


def test_no_address_reaches_a_client_in_a_workers_error() -> None:
    # A decode worker's refusal named the prefill worker holding the KV, and gRPC's own
    # text names the address it dialled (resolved, or encoded).
    from common.address import without_addresses

    for text in (
        "kv.lease_id: the lease on 10.1.2.3:50062 was not live until the READ was confirmed",
        "UNAVAILABLE: ipv4:127.0.0.1:1: Failed to connect to remote host",
        "ipv6:%5B::1%5D:50062: Connection refused",
        "the channel to [fd00::1]:50062 closed",
        "epd-prefill-0.epd.svc.cluster.local:50062 went away",
    ):
        cleaned = without_addresses(text)
        assert "a worker" in cleaned and not any(c.isdigit() for c in cleaned), cleaned
    for kept in (  # a client's own words, its fields, a library's text stay as they are
        "messages[0].content[1].image.data: is not a decodable image (max_tokens=8)",
        "stop at 2024-05-01T10:00:00Z, retry after 12:30, a 16:9 frame, id:12345, 'Answer:1'",
        "c10::Error at CUDAException.cpp:44, arr[::2], rows [0:3], version 2.35:1",
    ):
        assert without_addresses(kept) == kept
    for text in (  # bare, port-less, zoned, full, DNS names and an OS error's tuple
        "the holder fd00::1:50062 left",
        "peer 10.0.0.5 left",
        "[fe80::1%eth0]:50062 closed",
        "2600:1f18:4a3:6900:8c15:4b2a:96d1:3e0f:50062 gone",
        "DNS resolution failed for epd-prefill-0:50062: qtype=A name=epd-prefill-0",
        "localhost:50062 refused",
        "dns:///[fd00::1]:50062 refused",  # it left "::1]:50062" (ownfixD review, s41)
        "connect(('10.0.0.5', 50062)) failed",
    ):
        cleaned = without_addresses(text)
        assert "a worker" in cleaned and "50062" not in cleaned and "prefill" not in cleaned
    # Whole: a pod's name left its IP in dashes, and underscored names stayed (s41diff F2).
    for text in (
        "10-244-1-5.ns.pod.cluster.local:50062 refused",
        "gpu_node.cluster.local:50062 refused",
        "gpu_node-1:50062 refused",
    ):
        assert without_addresses(text) == "a worker refused", text


def test_a_peer_known_by_a_one_word_host_is_not_named_to_a_client() -> None:
    # A decode worker's refusal named the prefill worker holding the lease as `vm:47820`,
    # which is no address by its form alone (s41 attacker3 F1): the router knows it.
    from common.address import without_addresses, without_known
    from router.calls import WorkerCalls
    from router.registry import Registry
    from tests.registry_helpers import Clock, info

    registry = Registry(worker_timeout_s=3.0, heartbeat_interval_s=1.0, clock=Clock())
    prefill = info(Role.PREFILL, 1)
    prefill.address = "vm:47820"
    registry.register(prefill)
    decode = registry.register(info(Role.DECODE, 7))
    said = "kv.lease_id: the lease on vm:47820 was not live (ipv4:vm:47820 too)"
    error = WorkerCalls(registry).error("decode", decode, aborted(said))
    assert (
        str(error)
        == "decode failed: kv.lease_id: the lease on a worker was not live (a worker too)"
    )
    # Alone only: not inside a longer port or name, and nothing the router does not know.
    known = ["vm:4782", "gpu01:50062"]
    kept = "vm:47820, xgpu01:50062, gpu01:500620, id:12345, gpu01:50062.5"
    assert without_known(kept, known) == kept
    assert without_known("to gpu01:50062: refused", known) == "to a worker: refused"
    # At a sentence's end; in gRPC's `dns:` forms (it read "a worker worker": ownfixA, s41).
    assert without_known("lease on gpu01:50062.", known) == "lease on a worker."
    # In a URL, or after another's colon (ownfixC review, s41); a known address of another
    # form that ends with a plain one is replaced whole.
    for said in ("grpc://gpu01:50062/x", "tcp://gpu01:50062", "target:gpu01:50062"):
        assert "50062" not in without_known(said, known), said
    assert without_known("at a+b:1 and b:1", ["b:1", "a+b:1"]) == "at a worker and a worker"
    for said in ("dns:///gpu01:50062 gone", "dns:gpu01:50062 gone"):
        assert without_addresses(without_known(said, known)) == "a worker gone"
    # After `...` or a dash, before a dash or `.x` (s41diff F1); not in another's name.
    for said, seen in (
        ("tried a, b...gpu01:50062", "tried a, b...a worker"),
        ("holder -gpu01:50062", "holder -a worker"),
        ("gpu01:50062- gone", "a worker- gone"),
        ("gpu01:50062.x", "a worker.x"),
        ("x.gpu01:50062 x-gpu01:50062", "x.gpu01:50062 x-gpu01:50062"),
    ):
        assert without_known(said, known) == seen, said


def test_a_peer_registered_again_elsewhere_is_not_named_by_its_old_address() -> None:
    # A Ray restart registers it again at a new port: its old address, in a lease error
    # another worker sent, reached the client (ownfixA review, s41).
    from router.calls import WorkerCalls
    from router.registry import Registry
    from tests.registry_helpers import Clock, info

    registry = Registry(worker_timeout_s=3.0, heartbeat_interval_s=1.0, clock=Clock())
    calls = WorkerCalls(registry)
    prefill = info(Role.PREFILL, 1)
    prefill.address, prefill.name = "vm:47820", "epd-prefill-0"
    old = registry.register(prefill)
    registry.remove(old.worker_id)
    prefill.address = "vm:47821"
    registry.register(prefill)
    decode = registry.register(info(Role.DECODE, 7))
    said = "kv.lease_id: the lease on vm:47820 was not live"
    assert "47820" not in str(calls.error("decode", decode, aborted(said)))


def test_the_called_workers_own_address_is_named_by_its_role_in_every_form() -> None:
    # gRPC's `dns:` form read "a worker prefill worker", and a longer port kept its last
    # digit ("the prefill worker1": ownfixB review, s41).
    for said, seen in (
        ("dns:///{address}: refused", "the prefill worker: refused"),
        ("ipv6:{address} and {address}.", "the prefill worker and the prefill worker."),
        ("{address}1 is another", "a worker is another"),  # an address, not this one
    ):
        error = worker_error(Role.PREFILL, grpc.StatusCode.UNAVAILABLE, said)
        assert str(error) == f"prefill failed: {seen}", said


def test_a_long_error_is_clipped_before_its_addresses_are_looked_for() -> None:
    # Not clipped, 16 KiB of `a-` took the router's loop 2.5 s (ownfixE review, s41).
    from common.server.rpc import MAX_DETAILS

    error = worker_error(Role.DECODE, grpc.StatusCode.INTERNAL, "a-" * 8192 + " at {address}")
    assert len(str(error)) < MAX_DETAILS + 100 and str(error).endswith(" characters)")


@pytest.mark.parametrize("into", [1, 7, 20, 23])  # the cut at that character of the address
def test_an_address_the_clip_cuts_in_two_reaches_no_client(into: int) -> None:
    # "prefill-0.prefill.epd.svc.cluster.local:" and "gpu01:5006" reached clients, the rest
    # cut off by the clip, the half left no address to the scrub (chaos5 review, s41).
    from common.server.rpc import MAX_DETAILS, clipped

    address = "gpu01.epd.svc.local:50062"
    said = "x" * (MAX_DETAILS - 41 - into) + " " + address + " and more" * 200
    error = worker_error(Role.DECODE, grpc.StatusCode.INTERNAL, said)
    assert str(error).endswith(f"x ... ({len(said)} characters)"), str(error)[-60:]
    assert clipped(said).endswith(f"... ({len(said)} characters)")


def aborted(said: str, code: grpc.StatusCode = grpc.StatusCode.ABORTED) -> grpc.aio.AioRpcError:
    """A worker call's failure with `code` and details `said`."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), said)


def worker_error(role: Role, code: grpc.StatusCode, said: str) -> RouterError:
    """The client-facing error `WorkerCalls.error` makes of a `role` worker's call that
    failed with `code` and details `said` (the worker's address is in `said` as {address})."""
    from router.calls import WorkerCalls
    from router.registry import Registry
    from tests.registry_helpers import Clock, info

    registry = Registry(worker_timeout_s=3.0, heartbeat_interval_s=1.0, clock=Clock())
    worker = registry.register(info(role, 7))
    exc = aborted(said.format(address=worker.address), code)
    return WorkerCalls(registry).error(str(role), worker, exc)


def test_a_failed_calls_error_names_the_worker_once() -> None:
    # gRPC names the address it dialled as "ipv4:host:port": the error read "a worker
    # prefill worker" (kill review).
    said = "failed to connect to all addresses; last error: UNKNOWN: ipv4:{address}: x"
    error = worker_error(Role.PREFILL, grpc.StatusCode.UNAVAILABLE, said)
    assert str(error) == (
        "prefill failed: failed to connect to all addresses; last error: UNKNOWN: "
        "the prefill worker: x"
    )


def test_a_workers_full_kv_pool_is_passed_on_with_a_back_off_hint() -> None:
    # A decode worker's "KV pool full" (blocks in use for now) reached the client as a
    # RESOURCE_EXHAUSTED without retry-after-ms, which says "for good": epd.client did not
    # send it again, and the HTTP API answered 429 without Retry-After (multi-router review).
    from common.kv.block_pool import KV_POOL_FULL, PoolTooSmallError
    from router.http.errors import api_error

    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    full = f"{KV_POOL_FULL}: wanted 26 KV blocks, only 25 free"
    error = worker_error(Role.DECODE, exhausted, full)
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(error.trailing_metadata)["retry-after-ms"] == "1000"
    # What never fits gets no hint: a message past gRPC's limit, a request past the pool.
    for never in (
        "Received message larger than max (300 vs. 256)",
        f"{KV_POOL_FULL}: {PoolTooSmallError(40, 32, 'sampling.max_tokens')}",
    ):
        error = worker_error(Role.DECODE, exhausted, never)
        # for good: the HTTP API's 400, not a 429 the openai client would send again
        assert error.trailing_metadata == () and api_error(error).status == 400
