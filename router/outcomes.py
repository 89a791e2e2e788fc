"""How each request ended: counted once (`epd:requests_finished{outcome}`) and logged once
(one INFO line per request, whatever the front door).

Before, only answers that finished and refusals of bad input were logged (the latter twice
over gRPC), and no metric counted how requests ended: a cancelled or timed-out request left
no trace, and an error rate could not be read off the metrics page.

Outcomes, a fixed set (a label value each):

    stop, length  the answer finished (its finish reason)
    cancelled     the client went away (cancelled, hung up, its own deadline passed once
                  the request ran)
    deadline      a deadline passed: the router's (`request_timeout_s`), or the client's
                  before its request was read
    invalid       refused for its input (INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE),
                  and one that can never fit (RESOURCE_EXHAUSTED `TooLarge`: the HTTP API's
                  400; it was counted refused, for load: operator2 review L4, s44)
    refused       refused for load (RESOURCE_EXHAUSTED: queue, tenant share, held bytes)
    unavailable   no worker, or the router drains (UNAVAILABLE)
    error         anything else (INTERNAL: a bug)

Requests refused before they reach `RouterServicer.generate` count too (`refused_before`):
a body the HTTP API refuses (its JSON, types, fields, model, the bytes held), a gRPC
request refused before it is read (the bytes held). Not counted: callers refused their
credentials, framing errors the HTTP layer answers before any endpoint, and requests to
other paths.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc

from common.server.rpc import RpcStatusError
from epd.v1 import decode_service_pb2, router_service_pb2
from router.calls import RouterError, TooLarge
from router.ids import loggable

logger = logging.getLogger("router.server")  # the router's request log, as before

OUTCOMES = (
    "stop",
    "length",
    "cancelled",
    "deadline",
    "invalid",
    "refused",
    "unavailable",
    "error",
)

_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
    grpc.StatusCode.NOT_FOUND: "invalid",  # another model (HTTP 404)
    grpc.StatusCode.FAILED_PRECONDITION: "invalid",
    grpc.StatusCode.OUT_OF_RANGE: "invalid",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "refused",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.CANCELLED: "cancelled",
}


_FINISH = {
    decode_service_pb2.FINISH_REASON_LENGTH: "length",
    decode_service_pb2.FINISH_REASON_CANCELLED: "cancelled",
}


@dataclass(slots=True)
class Outcome:
    """One request's course, filled as it runs; `ended` says how it ended."""

    request_id: str  # as shown in logs (escaped)
    tenant: str | None  # None: the deployment runs without tenants
    started: float  # time.monotonic() at arrival
    prompt_tokens: int = 0  # once processed
    tokens: int = 0  # generated, streamed to the client
    finish: str = ""  # the last chunk's finish reason ("stop", "length"), once seen
    failure: str = ""  # an outcome of the module docstring, when it did not finish
    detail: str = ""  # the error, for the log line

    def saw(self, chunk: router_service_pb2.GenerateResponse) -> None:
        """A chunk went to the client."""
        self.tokens += len(chunk.token_ids)
        if chunk.finish_reason:
            self.finish = _FINISH.get(chunk.finish_reason, "stop")

    def failed(self, exc: BaseException) -> None:
        """The request ends with `exc` (raised on, or the generator closed)."""
        if isinstance(exc, asyncio.CancelledError | GeneratorExit):
            self.failure = "cancelled"
        elif isinstance(exc, TooLarge):
            self.failure, self.detail = "invalid", f"{exc.code.name} {exc}"
        elif isinstance(exc, RouterError | RpcStatusError):
            self.failure = _BY_CODE.get(exc.code, "error")
            self.detail = f"{exc.code.name} {exc}"
        else:
            self.failure = "error"
            self.detail = f"{type(exc).__name__}: {exc}"

    @property
    def outcome(self) -> str:
        """How it ended (one of `OUTCOMES`); a stream closed before its finish reason was
        left by its client."""
        return self.failure or self.finish or "cancelled"

    def log(self) -> None:
        """The request's one INFO line."""
        took = time.monotonic() - self.started
        if not self.failure and self.finish:
            logger.info(
                "request %s (%s) %s: %d prompt tokens, %d generated in %.3f s",
                self.request_id,
                self.tenant,
                self.outcome,
                self.prompt_tokens,
                self.tokens,
                took,
            )
            return
        logger.info(
            "request %s (%s) %s after %d tokens in %.3f s%s",
            self.request_id,
            self.tenant,
            self.outcome,
            self.tokens,
            took,
            f": {self.detail}" if self.detail else "",
        )


def refused_before(finished: Any, tenant: str | None, code: grpc.StatusCode, detail: str) -> None:
    """A request refused before `generate` ran it: counted in `finished` (the metric) by
    outcome, and its one INFO line (it has no id yet)."""
    outcome = _BY_CODE.get(code, "error")
    finished.labels(outcome).inc()
    shown = loggable(detail, 1000)  # the error may repeat what the caller sent
    logger.info("a request (%s) %s before it ran: %s %s", tenant, outcome, code.name, shown)
