"""The decode stage: one request's decode stream, kept alive across decode-worker failures.

    stream(job, request, lease, ...):
      decode   the DecodeRequest (handoff without embeddings, sampling, first token, KvHandle)
               -> the ticket's decode worker (or the least loaded one) -> token chunks
      refused  ABORTED before the first chunk (the pulled KV was unusable): prefill again
               and decode with the new handle, up to `reprefills` times
      retried  UNAVAILABLE before the first chunk (the router still owns the lease): the
               same handle to another decode worker
      lapsed   a handle is sent only while its lease's TTL has not passed since it came
               (its holder may have let the blocks go): past it, a fresh one first, within
               the `reprefills` a request has (a worker that came back late, a slow reader)
      migrated UNAVAILABLE after the first chunk (the worker died or its stream was
               removed; the lease was handed over and is gone): the stream resumes on a
               decode worker not yet tried (else on one that failed a step and serves on,
               or one back from a restart), up to `migrations` times

A migration keeps what the router already has: the handoff and sampling (in the request)
and the tokens streamed so far. It prefills the prompt again (`prefill_again`: the prefill
worker with the longest cached prefix, so the prompt's full blocks are usually reused and a
multimodal item wholly inside them is not encoded again) for a fresh KvHandle under a new
lease the router owns, and sends the new decode worker `resume_tokens`: the tokens after
the first one. That worker computes their KV after the prompt's and samples on from the
next position; seeded draws depend only on (seed, position) (`common.sampling`), so the
continuation is token for token the stream the failed worker would have sent. The client
sees one stream: no token repeated or missing, and no empty chunk from the new worker.

A client resumes the same way across routers (`GenerateRequest.resume_tokens`, checked by
`check_resume`): when its router dies mid-stream it sends the request to another router
with the tokens it has; that router prefills the prompt, keeps the client's first token in
place of its own, and streams on from the next one (`stream(..., resumed=...)`).

Counted in the router's metrics (`epd:decode_migrations`: streams resumed,
`epd:decode_tokens_recomputed`: resume tokens whose KV a new decode worker computed,
`epd:reprefills`); each migration is logged.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from common.errors import DECODE_STEP_FAILED, LEASE_NOT_LIVE, NO_READ_STARTED
from common.roles import Role
from common.sampling import SamplingParams, StopChecker
from common.server.peers import PeerClient, stream_uncut
from epd.v1 import (
    decode_service_pb2,
    decode_service_pb2_grpc,
    prefill_service_pb2,
    router_service_pb2,
)
from router.admission import Admission, Ticket
from router.calls import Job, RouterError, WorkerCalls, suspect_if_failed
from router.detokenize import IncrementalDetokenizer
from router.inputs import InputError
from router.metrics import RouterMetrics
from router.registry import Registry
from router.workers import WorkerRecord

logger = logging.getLogger(__name__)

# A decode call whose stream reached its finish reason ends with the worker's status; one
# that has not within this long is cancelled (cancelled at once, it raced that status and
# the worker logged an ERROR: raypools review; left alone, it could stay until its deadline).
FINISHED_CALL_S = 2.0

# Prefill the job's prompt again (admitted, encoded where needed): response and holder.
PrefillAgain = Callable[[], Awaitable[tuple[prefill_service_pb2.PrefillResponse, str]]]


@dataclass(slots=True)
class KvLease:
    """The prefill worker's lease on a prompt's KV blocks and who must release it."""

    lease_id: str  # from the KvHandle
    address: str  # prefill worker holding the blocks
    owned: bool = True  # False once the decode worker has taken it over (first chunk)
    # time.monotonic() past which its holder may have let it go: the handle's TTL from when
    # it came (a decode worker waiting for blocks may have renewed it since); inf: none said.
    ends: float = math.inf

    @classmethod
    def of(cls, response: prefill_service_pb2.PrefillResponse, holder: str) -> KvLease:
        """The lease of a prefill's answer, owned by the router until a decode worker takes
        it (`holder`: where the prefill ran, unless the handle names its holder)."""
        lease = cls("", "")
        lease.renew(response, holder)
        return lease

    def renew(self, response: prefill_service_pb2.PrefillResponse, holder: str) -> None:
        """A new prefill's lease, owned by the router until a decode worker takes it."""
        self.lease_id = response.kv.lease_id
        self.address = response.kv.holder_address or holder
        self.owned = True
        ttl_s = response.kv.lease_ttl_ms / 1000
        self.ends = time.monotonic() + ttl_s if ttl_s else math.inf

    def ran_out(self) -> bool:
        """Whether the lease's TTL has passed since its handle came."""
        return time.monotonic() >= self.ends


def check_resume(
    request: router_service_pb2.GenerateRequest,
    max_tokens: int,
    vocab_size: int | None = None,
    ends: tuple[StopChecker, SamplingParams] | None = None,
) -> tuple[int, ...]:
    """`request.resume_tokens` as a tuple, or InputError naming the field: fewer than
    `max_tokens`, each in `[0, vocab_size)`, none ending the answer (by `ends`: the model's
    stop checker and the request's sampling; else found only once the request was encoded
    and prefilled, by the decode worker, and reported as its failure), and not with stop
    strings (text a failed router held back for a possible stop string never reached the
    client, so it could not be resumed exactly). Checked before any worker is called; the
    decode worker checks them again."""
    count = len(request.resume_tokens)  # counted before copied: a request may hold millions
    if not count:
        return ()
    if count >= max_tokens:
        raise InputError(
            "resume_tokens", f"{count} tokens leave none to generate (max_tokens={max_tokens})"
        )
    tokens = tuple(request.resume_tokens)
    if min(tokens) < 0:
        raise InputError("resume_tokens", "token ids must not be negative")
    if vocab_size is not None and max(tokens) >= vocab_size:
        raise InputError("resume_tokens", f"token id {max(tokens)} is outside the vocab")
    if request.stop:
        raise InputError("resume_tokens", "a request with stop strings cannot be resumed")
    if ends is not None and (at := ends[0].first_end(ends[1], tokens)) is not None:
        raise InputError("resume_tokens", f"the answer already ended at token {at}")
    return tokens


class DecodeStage:
    """Runs and resumes decode streams; see the module docstring."""

    def __init__(
        self,
        registry: Registry,
        calls: WorkerCalls,
        channels: PeerClient,
        admission: Admission,
        metrics: RouterMetrics,
        *,
        reprefills: int = 2,
        migrations: int = 2,
    ) -> None:
        self.registry = registry
        self.calls = calls
        self.channels = channels  # decode channels and KV lease releases
        self.admission = admission
        self.reprefills = reprefills  # prefills again after decode refused the KV (ABORTED)
        self.migrations = migrations  # resumes of one stream after its decode worker failed
        self.metrics = metrics  # reprefills, migrations, tokens_recomputed
        self._ending: set[asyncio.Task[None]] = set()  # finished calls' waits for a status

    def _pick(self, tried: set[str], stepped: set[str], need: int = 0) -> WorkerRecord:
        """The least loaded decode worker not in `tried` whose pool holds `need` blocks (as
        far as its heartbeats say: a stream moved to a smaller one failed mid-answer though
        a larger one served); when none is left, one of `stepped` (tried workers that failed
        a step and serve on), which leave `tried` and `stepped` then. Raises RouterError
        (UNAVAILABLE) when there is neither."""
        small = {
            w.address
            for w in self.registry.workers(Role.DECODE)
            if (capacity := self.admission.capacity(w)) is not None and capacity < need
        }
        try:
            return self.calls.pick(Role.DECODE, tried | small)
        except RouterError:
            if not stepped:
                raise
        tried -= stepped
        stepped.clear()
        return self.calls.pick(Role.DECODE, tried | small)

    async def stream(
        self,
        job: Job,
        request: decode_service_pb2.DecodeRequest,
        lease: KvLease,
        detok: IncrementalDetokenizer,
        ticket: Ticket,
        prefill_again: PrefillAgain,
        resumed: Sequence[int] = (),
    ) -> AsyncIterator[router_service_pb2.GenerateResponse]:
        """The chunks after the first token, to the finish reason. `lease` follows the
        handle in `request` (the caller releases it while `owned`); `resumed`: the tokens
        the client already has, first one included (`Job.resumed`). Raises RouterError."""
        tries = _Tries()
        streamed = list(resumed[1:])  # tokens after the first one already sent to the client
        while True:
            worker = await self._next_worker(job, ticket, tries)
            if lease.owned and lease.ran_out() and tries.reprefills < self.reprefills:
                # Past its TTL (a decode worker came back late, or the client read the
                # first token slowly): its holder may have let the blocks go; a fresh handle
                # costs a prefill where a READ the holder refuses costs that and the READ.
                tries.reprefills += 1
                self.metrics.reprefills.inc()
                logger.warning("request %s: KV lease ran out; prefilling again", job.request_id)
                await self._fresh_handle(request, lease, prefill_again)
                continue  # a prefill pool's refusal re-placed the ticket: its decode worker too
            if tries.retrying:
                self.calls.retries["decode"] += 1
            if tries.migrating:
                self.metrics.migrations.inc()
                self.metrics.tokens_recomputed.inc(len(streamed))
            tries.retrying = tries.migrating = False
            tries.tried.add(worker.address)
            del request.resume_tokens[:]
            request.resume_tokens.extend(streamed)
            channel = self.channels.get(worker.address)
            stub = decode_service_pb2_grpc.DecodeServiceStub(channel)
            finished = None  # the chunk with the finish reason
            with self.registry.using(worker):
                call = stub.Decode(request, timeout=job.time_left("decode"))
                try:
                    async for response in stream_uncut(call, worker.address):
                        if lease.owned:  # the decode worker has it once it answers
                            lease.owned = False
                            self.admission.release(ticket, Role.PREFILL)
                        resuming = tries.migrations or resumed
                        if resuming and not response.token_ids and not response.finish_reason:
                            continue  # the resumed worker's first chunk: nothing new
                        streamed.extend(response.token_ids)
                        if response.finish_reason != decode_service_pb2.FINISH_REASON_UNSPECIFIED:
                            finished = _chunk(response, detok)
                            break
                        yield _chunk(response, detok)
                    else:  # ended without a finish reason: a broken stream, not a whole answer
                        raise ended_early()
                except grpc.aio.AioRpcError as exc:
                    suspect_if_failed(self.registry, worker, exc, channel)
                    if self._same_handle_again(exc, job, worker, lease, tries, len(streamed)):
                        continue
                finally:
                    if finished is None:
                        call.cancel()
                    else:
                        task = asyncio.get_running_loop().create_task(_let_end(call))
                        self._ending.add(task)
                        task.add_done_callback(self._ending.discard)
            if finished is not None:
                # The workers are done with it: a client that reads the last chunks slowly
                # (or not at all) must not keep its KV reservation from other requests.
                self.admission.release(ticket)
                yield finished
                return
            # Refused or broken: a fresh handle under a new lease for the next worker.
            await self._fresh_handle(request, lease, prefill_again)

    async def _fresh_handle(
        self, request: decode_service_pb2.DecodeRequest, lease: KvLease, prefill: PrefillAgain
    ) -> None:
        """The lease given back (if owned), the prompt prefilled: `request`, `lease` anew."""
        if lease.owned:
            self.channels.release_kv(lease.address, lease.lease_id)
            lease.owned = False
        again, holder = await prefill()
        request.kv.CopyFrom(again.kv)
        lease.renew(again, holder)

    async def _next_worker(self, job: Job, ticket: Ticket, tries: _Tries) -> WorkerRecord:
        """The ticket's decode worker while it is untried and trusted, else another
        (`_pick`; none left: one back from a restart), moved onto the ticket."""
        reserved = ticket.workers.get(Role.DECODE)
        if reserved is not None and reserved.address not in tries.tried and not reserved.suspect:
            return reserved
        need = ticket.need.blocks(Role.DECODE)
        pick = functools.partial(self._pick, tries.tried, tries.stepped, need)
        worker = await self.calls.pick_or_return(Role.DECODE, tries.tried, job.deadline, pick)
        self.admission.move(ticket, Role.DECODE, worker)
        return worker

    def _same_handle_again(
        self,
        exc: grpc.aio.AioRpcError,
        job: Job,
        worker: WorkerRecord,
        lease: KvLease,
        tries: _Tries,
        streamed: int,
    ) -> bool:
        """After `worker`'s stream failed with `exc`: True to send the same handle to
        another worker (the router still owns the lease: nothing was streamed), False for a
        fresh handle first (the KV refused: prefill again; the stream broke after its first
        chunk: resume). Raises RouterError when that kind of try is spent, or for a failure
        no other worker can help (the worker's error, passed on)."""
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE and DECODE_STEP_FAILED in (exc.details() or ""):
            # The worker failed one step and goes on serving: it may take the stream again,
            # but only when no other worker is left (`_pick`; with one decode worker, the
            # only place to). The retries below stay bounded by `reprefills` and
            # `migrations`, and the failed steps themselves by `migrations` (by the attempts
            # of a call while the router still holds the handle: nothing was streamed yet).
            limit = self.calls.attempts if lease.owned else self.migrations
            if tries.failed_steps >= limit:
                raise self.calls.error("decode", worker, exc) from None
            tries.failed_steps += 1
            tries.stepped.add(worker.address)
        if lease.owned and code == grpc.StatusCode.ABORTED:
            if tries.reprefills >= self.reprefills:
                raise self.calls.error("decode", worker, exc) from None
            tries.reprefills += 1
            self.metrics.reprefills.inc()
            tries.tried.discard(worker.address)
            # Its holder did not serve the KV (frozen, slow, changed bytes): the prompt goes
            # to another prefill worker, unless it heartbeats first. Not when the decode
            # worker never got to READ (its own congestion), nor when the holder said the
            # lease was gone (run out, or released by a decode worker that took it and died
            # before its first chunk: this worker was sent the same handle).
            details = exc.details() or ""
            if NO_READ_STARTED not in details and LEASE_NOT_LIVE not in details:
                for held_on in self.registry.workers(Role.PREFILL):
                    if held_on.address == lease.address:
                        self.registry.suspect(held_on)
            logger.warning(
                "request %s: decode on %s refused the KV (%s); prefilling again",
                job.request_id,
                worker.shown,
                exc.details(),
            )
            return False
        if code != grpc.StatusCode.UNAVAILABLE:
            raise self.calls.error("decode", worker, exc) from None
        if lease.owned:
            if len(tries.tried) >= self.calls.attempts:
                raise self.calls.error("decode", worker, exc) from None
            tries.retrying = True
            logger.warning("decode on %s failed (%s); trying again", worker.shown, code)
            return True  # the same handle (unless its lease ran out: `stream`), another worker
        if tries.migrations >= self.migrations:
            raise self.calls.error("decode", worker, exc) from None
        tries.migrations += 1
        tries.migrating = True
        logger.warning(
            "request %s: decode stream on %s broke after %d tokens (%s); "
            "resuming on a decode worker not tried yet, if there is one",
            job.request_id,
            worker.shown,
            1 + streamed,
            exc.details(),
        )
        return False


@dataclass(slots=True)
class _Tries:
    """One stream's tries so far; each kind is bounded (`DecodeStage._same_handle_again`)."""

    tried: set[str] = field(default_factory=set)  # decode workers tried
    stepped: set[str] = field(default_factory=set)  # tried, failed a step, serve on: last resort
    failed_steps: int = 0
    reprefills: int = 0  # prefills again after a worker refused the KV
    migrations: int = 0  # resumes after a stream broke
    retrying: bool = False  # counted once another worker is found (`_pick` may raise)
    migrating: bool = False


async def _let_end(call: grpc.aio.UnaryStreamCall) -> None:
    """Wait for a finished call's status; cancel it past `FINISHED_CALL_S`."""
    try:
        async with asyncio.timeout(FINISHED_CALL_S):
            await call.code()
    except TimeoutError:
        call.cancel()


# A decode stream that ends with status OK but no finish reason: handled as a stream that
# broke (resumed on another worker, else UNAVAILABLE to the client), never passed on as an
# answer that ended there.
def ended_early() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, details="the decode stream ended without a finish reason"
    )


def _chunk(
    response: decode_service_pb2.DecodeResponse, detok: IncrementalDetokenizer
) -> router_service_pb2.GenerateResponse:
    text = detok.add(response.token_ids)
    if response.finish_reason != decode_service_pb2.FINISH_REASON_UNSPECIFIED:
        text += detok.flush()
    return router_service_pb2.GenerateResponse(
        token_ids=response.token_ids,
        text=text,
        finish_reason=response.finish_reason,
        blocks_pulled=response.blocks_pulled,
        blocks_reused=response.blocks_reused,
    )
