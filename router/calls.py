"""What every stage of a request shares: the job, its failure type, and worker calls with
selection, in-flight counting and retries on UNAVAILABLE.

A call that fails with UNAVAILABLE (the worker died, its stream was removed, or it drains)
is tried again on another worker of the role not yet tried, up to `attempts` tries in all;
each retry is counted per stage (`retries`, the `epd:retries` metric) and logged. When no
untried worker of the role is left the request fails with UNAVAILABLE naming the role,
unless, with a deadline, one comes back from a restart in time (`pick_or_return`).
`WorkerCalls.with_retry` is that loop for encode; prefill and decode keep their own, as each
retry does more than call again (prefill encodes the items again, `Orchestrator.
_encode_and_prefill`; decode resumes the stream or prefills again, `DecodeStage.stream`),
and count their retries in the same `retries`."""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn, TypeVar

import grpc

from common.address import without_addresses, without_known
from common.errors import DECODE_STEP_FAILED
from common.handoff import EMBEDDINGS_LOST
from common.kv.block_pool import WHOLE_POOL, pool_full
from common.processing.processor import ProcessedPrompt
from common.roles import Role
from common.sampling import SamplingParams
from common.server.rpc import clipped
from router.registry import Registry
from router.workers import NoWorkerError, WorkerRecord

if TYPE_CHECKING:
    from common.server.peers import PeerClient
    from router.returns import Returns

logger = logging.getLogger(__name__)

T = TypeVar("T")

# gRPC core's words for a connection that could not be made, or was cut under a call (a
# killed process resets its connections; a frozen one leaves them open until keepalive).
CONNECTION_LOST = (
    "failed to connect to all addresses",
    "Connection reset by peer",
    "Socket closed",
)

# The back-off a worker's full KV pool is passed on with (its blocks are in use for now).
POOL_FULL_RETRY_S = 1.0

# Worker failures the client caused or should see as they are; others become INTERNAL.
_PASS_THROUGH = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.ABORTED,
}


def worker_failed(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a call's UNAVAILABLE says its worker cannot be reached or serve (killed,
    frozen, draining), not that an encoder lost the embeddings it was to pull
    (`EMBEDDINGS_LOST`) or that one decode step failed on a worker that serves on."""
    details = exc.details() or ""
    return (
        exc.code() == grpc.StatusCode.UNAVAILABLE
        and EMBEDDINGS_LOST not in details
        and DECODE_STEP_FAILED not in details
    )


def suspect_if_failed(
    registry: Registry,
    worker: WorkerRecord,
    exc: grpc.aio.AioRpcError,
    channel: grpc.aio.Channel | None = None,
) -> None:
    """Mark `worker` suspect when `exc` says it failed (`worker_failed`), and unreachable
    when its connection was lost (`CONNECTION_LOST`: the process is gone or not yet back; a
    wedged one keeps its connections) and `channel`, the call's, is not connected now (a
    live worker may answer UNAVAILABLE in those words, relaying a peer's failure). Requests
    arriving after a kill passed the restart wait until their own calls found the worker
    gone: the first failure is usually a call in flight, cut, not a connect refused. A
    live worker's next heartbeat clears the mark."""
    if worker_failed(exc):
        details = exc.details() or ""
        lost = any(words in details for words in CONNECTION_LOST)
        if lost and channel is not None:
            lost = channel.get_state() != grpc.ChannelConnectivity.READY
        registry.suspect(worker, unreachable=lost)


class RouterError(Exception):
    """A request failure with the gRPC status the client gets."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        # Sent with the status (e.g. `retry-after-ms` when admission refuses).
        self.trailing_metadata: tuple[tuple[str, str], ...] = ()
        # The worker whose call failed and its stage ("" when no worker call did).
        self.address = ""
        self.stage = ""
        # The prompt (with max_tokens) does not fit the model's context: the HTTP API's
        # code `context_length_exceeded`. Not sent on gRPC (INVALID_ARGUMENT says it there).
        self.context_exceeded = False


def told(exc: BaseException, timeout_s: float, client_s: float | None) -> BaseException:
    """`exc` as the client is told it (`client_s`: the client's own time, where it ended
    before the router's; None: the router's ended first). A DEADLINE_EXCEEDED that the
    router's `request_timeout_s` set says so: a worker's "Stream removed (Deadline
    Exceeded)" named neither the limit nor the router (s42 operator review L6). A worker's
    FAILED_PRECONDITION (a KV handle, layout or prompt digest that does not match), or its
    INVALID_ARGUMENT naming a `kv` field (the handle prefill made), is the deployment's
    fault, never the request's: INTERNAL. HTTP clients got a 400 for it, which they do not
    retry (openai review F3, ownfixA L1, s44)."""
    if not isinstance(exc, RouterError):
        return exc
    kv_field = str(exc).startswith((f"{exc.stage} failed: kv.", f"{exc.stage} failed: kv:"))
    if exc.stage and (
        exc.code == grpc.StatusCode.FAILED_PRECONDITION
        or (exc.code == grpc.StatusCode.INVALID_ARGUMENT and kv_field)
    ):
        said = RouterError(grpc.StatusCode.INTERNAL, str(exc))
    elif exc.code != grpc.StatusCode.DEADLINE_EXCEEDED:
        return exc
    elif client_s is not None:
        return exc  # the client's own deadline
    else:
        said = RouterError(
            exc.code, f"past the router's request_timeout_s ({timeout_s:g} s): {exc}"
        )
    said.trailing_metadata, said.address, said.stage = exc.trailing_metadata, exc.address, exc.stage
    return said


def raise_told(exc: BaseException, timeout_s: float, client_s: float | None) -> NoReturn:
    """Raise `told(exc, ...)` (re-raise `exc` where it is that), from an `except` clause of
    `exc`. Bound to no name left in the caller's frame, which its traceback holds: a cycle
    that kept the request until a garbage collection (CI, s42)."""
    said = told(exc, timeout_s, client_s)
    try:
        if said is exc:
            raise
        raise said from None
    finally:
        del said, exc


def invalid(message: str, field: str, context_exceeded: bool = False) -> RouterError:
    """INVALID_ARGUMENT for a request's bad `field`, named in the `epd-field` trailer. Made
    here, not bound to a name in the handler that raises it: its traceback would hold that
    frame, a cycle keeping the request until a garbage collection (attacker2 review, s40)."""
    error = RouterError(grpc.StatusCode.INVALID_ARGUMENT, message)
    error.trailing_metadata = (("epd-field", field),)
    error.context_exceeded = context_exceeded
    return error


class KvPoolFull(RouterError):
    """A prefill worker (`address`) answered RESOURCE_EXHAUSTED: its pool was full then
    (`router.admission` queues the request again)."""

    @classmethod
    def of(cls, exc: RouterError) -> KvPoolFull:
        full = cls(exc.code, str(exc))
        full.address, full.stage = exc.address, exc.stage
        return full


class Refused(RouterError):
    """RESOURCE_EXHAUSTED for now: `limit` (what the router holds or queues) names the bound,
    and the client is told how long to back off, in the message and as trailing metadata
    `retry-after-ms` (the HTTP API's Retry-After, `epd.client`'s retries)."""

    def __init__(self, limit: str, retry_after_s: float) -> None:
        super().__init__(
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"{limit}; retry after {retry_after_s:.1f} s"
        )
        self.retry_after_s = retry_after_s
        self.trailing_metadata = (("retry-after-ms", str(round(retry_after_s * 1000))),)


class TooLarge(RouterError):
    """RESOURCE_EXHAUSTED for good: the request needs more than the router or any worker
    gives one request (`message` names the sizes and the limit), so sending it again cannot
    help: no back-off hint, and the HTTP API answers 400, not 429 (which clients retry)."""

    def __init__(self, message: str, *, context: bool = False) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        # The prompt and its length need more KV blocks than a worker has: the HTTP API's
        # `context_length_exceeded` (a shorter history helps; with inline bytes it does not).
        self.kv_context = context


@dataclass(frozen=True, slots=True)
class Job:
    """One checked request, ready to run."""

    request_id: str  # the caller's id, or one the router made
    prompt: ProcessedPrompt  # tokens, item layout and pixels
    sampling: SamplingParams  # checked sampling parameters
    cache_salt: str | None  # tenant salt for the prefix caches
    deadline: float  # `time.monotonic()` by which the request must be done
    resumed: tuple[int, ...] = ()  # tokens the client already has (`resume_tokens`)
    tenant: str | None = None  # the caller's tenant (its share of the queue)
    prompt_field: str = "messages"  # the request's field the prompt is in (or `prompt`)
    default_length: bool = False  # `sampling.max_tokens` is the router's default: none sent
    # The router's own for this request: callers may reuse a request id (and so may two
    # tenants), but an encoder keeps one call per id out of each batch (`encode_request`).
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:16])

    def time_left(self, stage: str) -> float:
        """Seconds left; RouterError(DEADLINE_EXCEEDED) naming `stage` when none are."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline passed before {stage}")
        return left


KNOWN_ADDRESSES = 1024  # worker addresses kept to keep them out of a client's errors


class WorkerCalls:
    """Picks workers from the registry and runs calls on them (see `with_retry`)."""

    def __init__(
        self, registry: Registry, attempts: int = 3, channels: PeerClient | None = None
    ) -> None:
        self.registry = registry
        self.channels = channels  # the workers' channels (None: not looked at on a failure)
        self.attempts = attempts  # tries of one stage, on different workers
        self.retries: Counter[str] = Counter()  # calls tried again, per stage (metrics)
        self.returns: Returns | None = None  # the wait for a restarting role (set by `serve`)
        # Every address a worker registered at, the latest `KNOWN_ADDRESSES`: a peer named in
        # another's error may have registered again elsewhere since (a Ray restart).
        self._known: OrderedDict[str, None] = OrderedDict()
        registry.on_register.append(self._registered)

    def pick(self, role: Role, tried: Collection[str]) -> WorkerRecord:
        """The least loaded worker of `role` not yet tried; RouterError(UNAVAILABLE) naming
        the role (and how many were tried) when there is none."""
        try:
            return self.registry.pick(role, exclude=frozenset(tried))
        except NoWorkerError as exc:
            if not tried:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
            raise RouterError(  # logged by the caller (the request's line), or waited out
                grpc.StatusCode.UNAVAILABLE,
                f"no {role} worker left: {len(tried)} failed and no other is registered and "
                "available",
            ) from None

    async def pick_or_return(
        self, role: Role, tried: set[str], deadline: float, pick: Callable[[], WorkerRecord]
    ) -> WorkerRecord:
        """`pick()`; when it finds none (RouterError) because every worker of `role` is gone
        and it restarts (`router.returns`), wait for one, take out of `tried` the addresses a
        fresh registration holds (a worker back at its address) and `pick()` again. A
        request whose own call found its worker killed failed though the worker came back
        seconds later (1-8 a kill)."""
        try:
            return pick()
        except RouterError:
            if self.returns is None or not self.returns.restarting(role):
                raise
        failed = ", ".join(sorted(tried))
        if self.returns.full:  # it said it waited (openai review F5, s44)
            most = self.returns.max_waiting
            why = f"{self.returns.waiting} wait already (max_queued_requests: {most})"
            logger.info("no %s worker left to try (%s failed); not waiting: %s", role, failed, why)
            return pick()
        logger.info("no %s worker left to try (%s failed); waiting for one back", role, failed)
        await self.returns.wait((role,), deadline)
        tried -= {w.address for w in self.registry.workers(role) if not w.suspect}
        return pick()

    def error(self, stage: str, worker: WorkerRecord, exc: grpc.aio.AioRpcError) -> RouterError:
        """The client-facing error of a failed worker call: the worker's address, which is
        the operator's to know (docs/security.md), is in the log, not in the error."""
        code = exc.code() if exc.code() in _PASS_THROUGH else grpc.StatusCode.INTERNAL
        # Its own address as "the prefill worker" (not "a worker prefill worker"), then the
        # addresses of others it names; clipped first: the scrub of a long run costs its
        # length squared (this version's workers clip theirs; gRPC's and others may not).
        said = exc.details() or ""
        own = without_known(clipped(said), [worker.address], f"the {worker.role} worker")
        details = without_addresses(without_known(own, self._addresses()))
        logger.warning("%s on %s failed: %s %s", stage, worker.shown, exc.code(), exc.details())
        error: RouterError = RouterError(code, f"{stage} failed: {details}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and pool_full(said):  # blocks in use now
            error = Refused(f"{stage} failed: {details}", POOL_FULL_RETRY_S)
        elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # never fits (HTTP: 400, not a 429)
            error = TooLarge(f"{stage} failed: {details}", context=WHOLE_POOL in said)
        error.address = worker.address
        error.stage = stage
        return error

    def _registered(self, record: WorkerRecord) -> None:
        self._known[record.address] = None
        self._known.move_to_end(record.address)
        while len(self._known) > KNOWN_ADDRESSES:
            self._known.popitem(last=False)

    def _addresses(self) -> list[str]:
        """Every worker address this router knows (a peer's, named in another's error)."""
        return [*self._known, *(w.address for w in self.registry.workers(timed_out=True))]

    async def with_retry(
        self,
        role: Role,
        stage: str,
        call: Callable[[WorkerRecord], Awaitable[T]],
        *,
        first: WorkerRecord | None = None,
        exclude: Collection[str] = (),
        attempts: int | None = None,
        deadline: float | None = None,
    ) -> T:
        """`call(worker)` on `first` (or the least loaded worker of `role` not in
        `exclude`), counted in flight; on UNAVAILABLE again on another worker, up to
        `attempts` tries (default `self.attempts`), or, with a `deadline` and none left,
        on one back from a restart (`pick_or_return`). Raises RouterError."""
        tried: set[str] = set(exclude)
        tries = 0
        limit = self.attempts if attempts is None else attempts
        while True:
            if first is not None and not tries:
                worker = first
            elif tries and deadline is not None:
                pick = functools.partial(self.pick, role, tried)
                worker = await self.pick_or_return(role, tried, deadline, pick)
            else:
                worker = self.pick(role, tried)
            if tries:  # counted once another worker is found to try (`pick` may raise)
                self.retries[stage] += 1
            tried.add(worker.address)
            tries += 1
            with self.registry.using(worker):
                try:
                    return await call(worker)
                except grpc.aio.AioRpcError as exc:
                    channel = self.channels.get(worker.address) if self.channels else None
                    suspect_if_failed(self.registry, worker, exc, channel)
                    if exc.code() != grpc.StatusCode.UNAVAILABLE or tries >= limit:
                        raise self.error(stage, worker, exc) from None
                    logger.warning(
                        "%s on %s failed (%s); trying again", stage, worker.shown, exc.code()
                    )
