"""The HTTP API's endpoints and its server, run in the router's own event loop.

    POST /v1/chat/completions   chat with text, image_url and video_url parts; streamed
                                (server-sent chat.completion.chunk events) or not
    POST /v1/completions        a text prompt
    GET  /v1/models             the served model
    GET  /v1/models/{model}     the served model's entry; 404 model_not_found for others
    GET  /health                200 when every role has a serving worker, else 503 naming
                                the roles without one (HEAD too)

A request is converted to a `GenerateRequest` and runs through `RouterServicer.generate`,
the code the gRPC Generate runs, in-process: the same checks, limits, admission and tenants.
Authentication is the gRPC front door's: `Authorization: Bearer KEY` names an API key, its
tenant salts the caches (`[security] insecure`: no keys, no tenants). Failures come back in
OpenAI's error shape (`router.http.errors`).

Lifecycle: `router.http.server.HttpServer.start` binds the port and serves until `stop`
(the router stops it first among its cleanup steps, after gRPC). Requests count in the
router's lifecycle, so a draining router refuses new ones (503) and lets running ones
finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from common.errors import FieldError
from common.server.auth import Authenticator, Caller
from common.tasks import cancel_and_wait
from epd.v1 import router_service_pb2
from router.calls import RouterError
from router.http.body import ARRIVED_KEY, CALLER_KEY, HELD_KEY, identify
from router.http.convert import (
    as_sent,
    chat_request,
    check_text_length,
    completion_request,
    names_media,
)
from router.http.errors import ApiError, api_error, model_not_found
from router.http.media import MediaPolicy
from router.http.parse import MAX_BODY_VALUES, parse_body
from router.http.schema import ChatCompletionRequest, CompletionRequest, SamplingBody
from router.http.stream import CUT_AFTER_DEADLINE_S, Answer, TimedStream, events
from router.http.template_inputs import (
    check_reasoning,
    check_template_inputs,
    reasoning_to_check,
)
from router.outcomes import refused_before
from router.prepare_threads import LIGHT_BODY_BYTES
from router.request_bytes import decoded_bytes
from router.stopping import STOPPING

if TYPE_CHECKING:
    from router.server import RouterServicer


# What a parsed body holds per message and content part (pydantic objects) beside the
# `GenerateRequest` made of it: measured ~650 B for a one-letter message, against ~30 B of
# JSON (`router.request_bytes.decoded_bytes`).
PARSED_PART_BYTES = 640

Chunks = AsyncGenerator[router_service_pb2.GenerateResponse, None]
T = TypeVar("T")
B = TypeVar("B", bound=SamplingBody)


async def _caller(request: Request) -> Caller:
    """The authenticated caller: of a POST, the one `limit_body` identified before it read
    the body (it refused others: refusals come first). A coroutine: FastAPI runs a plain
    function dependency on its thread pool (a 60-request burst grew the router by 36
    threads)."""
    caller = request.scope.get(CALLER_KEY)
    if caller is None:
        caller = identify(request.app.state.auth, request.headers.get("authorization"))
    return caller


Who = Annotated[Caller, Depends(_caller)]


def build_app(
    servicer: RouterServicer,
    model_id: str,
    policy: MediaPolicy,
    unready: Callable[[], Sequence[object]],
    auth: Authenticator | None,
) -> FastAPI:
    """The API over `servicer` serving `model_id`; `unready()` (the roles without a serving
    worker) decides /health."""
    # No redirect to the path with(out) its trailing slash: it was a bare 307 to a Location
    # built from the Host header, which a following client re-sent the body and key to.
    app = FastAPI(
        title="epd", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False
    )
    app.state.auth = auth
    finished = servicer.orchestrator.metrics.finished  # how requests end (router.outcomes)
    app.state.refused = functools.partial(refused_before, finished)  # limit_body's refusals

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(ClientDisconnect)
    async def _gone(_request: Request, _exc: ClientDisconnect) -> Response:
        return Response(status_code=499)  # nobody reads it (an ERROR traceback before)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI's own refusals in OpenAI's shape, as every other: 404 for a path, 405 for
        # a method (with its Allow header). Bodies are parsed by `router.http.parse`.
        if exc.status_code not in (404, 405):
            return await http_exception_handler(request, exc)
        if exc.status_code == 404:
            error = ApiError(grpc.StatusCode.NOT_FOUND, f"no such endpoint: {request.url.path}")
        else:
            message = f"{request.method} is not allowed on {request.url.path}"
            error = ApiError(grpc.StatusCode.INVALID_ARGUMENT, message)
            error.status = 405
        response = error.response()
        response.headers.update(exc.headers or {})
        return response

    def check_model(body: SamplingBody) -> None:
        if body.model != model_id:
            raise model_not_found(body.model, model_id, param="model")

    async def answer(
        body: SamplingBody,
        request: router_service_pb2.GenerateRequest,
        who: Caller,
        chat: bool,
        raw: Request,
        arrived: float,
        deadline: float | None = None,
    ) -> Response:
        """Run the request (which came at `arrived`, time.monotonic()); until its response
        starts, a client that hangs up cancels it (and what the workers hold for it), as a
        streamed response's does afterwards."""
        prefix = "chatcmpl-" if chat else "cmpl-"
        result = Answer(prefix + request.request_id, model_id, chat)
        # Held until the response ends (taken by the endpoint): the body's bytes, and the
        # parsed body and request made of them (429 beyond the bound), beside which its
        # media are held.
        hold = raw.scope.get(HELD_KEY)
        # A chat that sets no length runs to its end, as OpenAI's: up to `chat_max_tokens`
        # (or the checkpoint's `max_new_tokens`, if less), or the context the prompt leaves.
        # A completion's is the checkpoint's `max_new_tokens`, else 16 (OpenAI's).
        default = chat and not (body.max_tokens or body.max_completion_tokens)
        if default:
            most = servicer.processor.generation.max_new_tokens
            chat_max = servicer.settings.chat_max_tokens
            request.sampling.max_tokens = min(chat_max, most) if most else chat_max
        held = hold.bytes if hold is not None else 0
        # The router's own budget (`request_timeout_s`), from when a chat's media were read.
        timeout_s = servicer.settings.request_timeout_s
        since = time.monotonic() if deadline is None else deadline - timeout_s
        chunks = servicer.generate(request, who, None, held, default, arrived, since)

        def sent(exc: BaseException) -> ApiError:
            error = api_error(exc)
            as_sent(error, body)  # the field as the body spells it
            return error

        try:
            try:
                async with servicer.stopping.answering():  # 503 when the drain runs out
                    first = await _unless_gone(raw, _first(chunks))
                    if not body.stream:
                        return JSONResponse(await _unless_gone(raw, _all(result, first, chunks)))
            except (ApiError, RouterError) as error:
                raise sent(error) from None
        except _ClientGone:
            await chunks.aclose()
            return Response(status_code=499)  # nobody reads it
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        stream = events(result, _chain(first, chunks), include_usage, lambda e: sent(e).body())
        # Cut past the request's own deadline, whose error event is then sent first (cut at
        # `request_timeout_s` from its first token, a loop lagging more than the TTFT let the
        # cut win, the answer ending with no event: s44 operator2 review L1).
        seconds = since + timeout_s + CUT_AFTER_DEADLINE_S - time.monotonic()
        return TimedStream(stream, seconds, servicer.stopping, _stopped, f"answer {result.id}")

    threads = servicer.prepare_threads  # off the event loop, within a tenant's share
    template = servicer.processor.template  # None: the built-in layout, which reads none

    async def parsed(raw: Request, schema: type[B], who: Caller) -> B:
        """The body as `schema`, parsed and validated off the event loop (`router.http.parse`)."""
        data = await raw.body()
        content_type = raw.headers.get("content-type")
        commas = MAX_BODY_VALUES + servicer.settings.max_prompt_text_bytes  # text may be all
        heavy = len(data) > LIGHT_BODY_BYTES
        body = await threads.run(heavy, who.tenant, parse_body, data, content_type, schema, commas)
        check_model(body)
        if isinstance(body, ChatCompletionRequest | CompletionRequest):
            check_text_length(body, servicer.settings.max_prompt_text_bytes)
        if isinstance(body, ChatCompletionRequest):
            check_template_inputs(body, template)
            if template is not None and reasoning_to_check(body):  # renders twice
                await threads.run(True, who.tenant, check_reasoning, body, template)
        return body

    @contextlib.contextmanager
    def counted(who: Caller) -> Iterator[None]:
        """A refusal before `generate` runs the request, counted and logged as its end
        (`router.outcomes.refused_before`; `generate` counts the rest)."""
        try:
            yield
        except (ApiError, FieldError) as exc:
            error = api_error(exc)
            refused_before(finished, who.tenant, error.grpc_code, str(error))
            try:
                raise error from None
            finally:  # its traceback holds this frame: a cycle kept the body (and the text
                del error  # it was refused for) until a garbage collection (attacker2, s40)
        except ClientDisconnect:  # gone while sending its body: answered 499 (`_gone`)
            gone = "the client went away while sending its body"
            refused_before(finished, who.tenant, grpc.StatusCode.CANCELLED, gone)
            raise

    @app.post("/v1/chat/completions")
    async def chat_completions(who: Who, raw: Request) -> Response:
        arrived = raw.scope.get(ARRIVED_KEY, time.monotonic())  # TTFT counts the body's upload
        with counted(who):
            body = await parsed(raw, ChatCompletionRequest, who)
            request_id = uuid.uuid4().hex
            hold = raw.scope.get(HELD_KEY)
            held = hold.more if hold is not None else lambda size: None
            media = names_media(body)
            deadline = time.monotonic() + servicer.settings.request_timeout_s
            gone = threading.Event()  # the client hung up: no more of its media are read
            args = (body, request_id, policy, held, deadline, gone.is_set)
            try:
                request = await _unless_gone(
                    raw, threads.run(media, who.tenant, chat_request, *args), gone.set
                )
            except _ClientGone:
                left = "the client went away while its media were read"
                refused_before(finished, who.tenant, grpc.StatusCode.CANCELLED, left)
                return Response(status_code=499)  # nobody reads it
            held(decoded_bytes(request, PARSED_PART_BYTES))  # held until the response ends
        return await answer(body, request, who, True, raw, arrived, deadline)  # one budget

    @app.post("/v1/completions")
    async def completions(who: Who, raw: Request) -> Response:
        arrived = raw.scope.get(ARRIVED_KEY, time.monotonic())
        with counted(who):
            body = await parsed(raw, CompletionRequest, who)
            request = completion_request(body, uuid.uuid4().hex)
            hold = raw.scope.get(HELD_KEY)
            if hold is not None:
                hold.more(decoded_bytes(request, PARSED_PART_BYTES))
        return await answer(body, request, who, False, raw, arrived)

    served = {"id": model_id, "object": "model", "created": 0, "owned_by": "epd"}

    @app.get("/v1/models")
    async def models(_who: Who) -> dict[str, Any]:
        return {"object": "list", "data": [served]}

    # `:path`: a served name may hold slashes (`org/model`), as Hugging Face ids do.
    @app.get("/v1/models/{model:path}")
    async def model(model: str, _who: Who) -> dict[str, Any]:
        if not model:  # `/v1/models/`: a path with a trailing slash, as any other
            raise StarletteHTTPException(404)
        if model != model_id:
            raise model_not_found(model, model_id)
        return served

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' checks
    async def health() -> Response:
        missing, draining = unready(), servicer.lifecycle.draining
        if not missing and not draining:
            return JSONResponse({"status": "ok"})
        # Why, as `epd status` would tell: the roles without a serving worker, a drain.
        why = {"status": "unavailable", "draining": draining, "missing": [str(r) for r in missing]}
        return JSONResponse(why, 503)

    return app


class _ClientGone(Exception):
    """The HTTP client hung up before its response started."""


async def _unless_gone(
    raw: Request, work: Coroutine[Any, Any, T], on_gone: Callable[[], None] = lambda: None
) -> T:
    """`work`'s result, or `_ClientGone` (with `work` cancelled, after `on_gone()`: work on
    a thread is not stopped by a cancel) once the client of `raw` disconnects first (the
    body has been read: the next ASGI message is the disconnect)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(raw))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler cancelled: so is the work
        task.cancel()
        gone.cancel()
        raise
    gone.cancel()
    if not task.done():
        on_gone()
        await cancel_and_wait(task)
        raise _ClientGone
    try:
        return task.result()
    finally:  # its error's traceback holds this frame: a cycle through the task kept the
        del task, gone, work  # body and its media until a garbage collection (ownfixC C1)


def _stopped() -> dict[str, Any]:
    """A stream's error body where the router's drain runs out (`router.stopping`): a
    function of nothing the request holds (a closure over the body kept it in a cycle with
    a stream whose client left: `test_refusal_memory`)."""
    return api_error(RouterError(grpc.StatusCode.UNAVAILABLE, STOPPING)).body()


async def _disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _first(chunks: Chunks) -> router_service_pb2.GenerateResponse | None:
    """The first chunk (None: none came); the API's error for a failure."""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None
    except Exception as exc:
        await chunks.aclose()
        raise api_error(exc) from None


async def _all(
    result: Answer, first: router_service_pb2.GenerateResponse | None, chunks: Chunks
) -> dict[str, Any]:
    """Every chunk added to `result` (from `first` on); its final body."""
    try:
        if first is not None:
            result.add(first)
        async for chunk in chunks:
            result.add(chunk)
    except Exception as exc:
        raise api_error(exc) from None
    finally:
        await chunks.aclose()
    return result.final()


async def _chain(first: router_service_pb2.GenerateResponse | None, rest: Chunks) -> Chunks:
    try:
        if first is not None:
            yield first
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()
