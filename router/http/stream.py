"""`GenerateResponse` chunks -> OpenAI's response objects: `chat.completion` and its
`chat.completion.chunk` stream (server-sent events ending `data: [DONE]`), and
`text_completion` for `/v1/completions`.

The first chunk of the router's stream carries prompt_tokens and cached_tokens, the last
one the finish reason; `Answer` folds them into the usage and the finish reason."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import traceback
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.responses import StreamingResponse

from epd.v1 import decode_service_pb2, router_service_pb2

if TYPE_CHECKING:
    from router.stopping import Stopping

logger = logging.getLogger(__name__)

_FINISH = {
    decode_service_pb2.FINISH_REASON_STOP: "stop",
    decode_service_pb2.FINISH_REASON_LENGTH: "length",
    decode_service_pb2.FINISH_REASON_CANCELLED: "abort",
}


@dataclass(slots=True)
class Answer:
    """What one request's chunks add up to."""

    id: str  # the response id ("chatcmpl-..." / "cmpl-...")
    model: str  # the served model id
    chat: bool  # chat.completion (True) or text_completion
    created: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None

    def add(self, chunk: router_service_pb2.GenerateResponse) -> None:
        """Fold in one chunk."""
        self.text += chunk.text
        self.prompt_tokens = max(self.prompt_tokens, chunk.prompt_tokens)
        self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
        self.completion_tokens += len(chunk.token_ids)
        if chunk.finish_reason != decode_service_pb2.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = _FINISH.get(chunk.finish_reason, "stop")

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object (cached tokens: from the prefix cache)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def final(self) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": self.text},
                "finish_reason": self.finish_reason,
                "logprobs": None,
            }
        else:
            choice = {
                "index": 0,
                "text": self.text,
                "finish_reason": self.finish_reason,
                "logprobs": None,
            }
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [choice], "usage": self.usage()}

    def delta(
        self, text: str, finish: str | None, first: bool, usage: bool = False
    ) -> dict[str, Any]:
        """One streamed chunk carrying `text` (`usage`: the stream ends with a usage chunk,
        and every chunk before it says `"usage": null`, as OpenAI's)."""
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if first:
                delta["role"] = "assistant"
            choice: dict[str, Any] = {"index": 0, "delta": delta}
            obj = "chat.completion.chunk"
        else:
            choice, obj = {"index": 0, "text": text}, "text_completion"
        choice |= {"logprobs": None, "finish_reason": finish}
        out = {**self._head(obj), "choices": [choice]}
        return out | {"usage": None} if usage else out

    def usage_chunk(self) -> dict[str, Any]:
        """`stream_options.include_usage`: the last chunk, no choices."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage()}


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


async def events(
    answer: Answer,
    chunks: AsyncIterator[router_service_pb2.GenerateResponse],
    include_usage: bool,
    on_error: Any,
) -> AsyncIterator[str]:
    """The SSE stream of `chunks`: one event per chunk with text or a finish reason, the
    usage chunk when asked, then `[DONE]`. A failure mid-stream (the status line is sent
    already) becomes one event with OpenAI's error body, `on_error(exc)`."""
    first = True
    try:
        async for chunk in chunks:
            answer.add(chunk)
            finish = answer.finish_reason if chunk.finish_reason else None
            if chunk.text or finish is not None or first:
                yield sse(answer.delta(chunk.text, finish, first, include_usage))
                first = False
    except Exception as exc:
        yield sse(on_error(exc))
        return
    except BaseException as exc:  # the client left: anyio keeps the cancellation in a cycle
        traceback.clear_frames(exc.__traceback__)  # with its frames, which held the request
        del on_error  # (job, prompt, pixels; and here, through `on_error`, the parsed body)
        raise  # until a garbage collection (ownfixC C4, ownfixD D1)
    finally:
        if isinstance(chunks, AsyncGenerator):  # closed with this one (`TimedStream`)
            await chunks.aclose()
    if include_usage:
        yield sse(answer.usage_chunk())
    yield sse("[DONE]")


_JSON = [(b"content-type", b"application/json")]

# How long past its request's deadline an HTTP answer is cut (`TimedStream`): its deadline
# error is an event of the stream, sent first unless the client reads nothing.
CUT_AFTER_DEADLINE_S = 5.0


class TimedStream(StreamingResponse):
    """A streamed response that ends within `seconds`, sent or not: a client that stops
    reading holds its connection, its held bytes and the router's drain only so long (its
    KV reservation goes back when the workers are done, `router.decode`). Past it, the
    stream's generator is closed and so is the connection (uvicorn closes a response the
    app left unfinished)."""

    def __init__(
        self,
        content: AsyncIterator[str],
        seconds: float,
        stopping: Stopping,
        stopped: Callable[[], dict[str, Any]],
        name: str = "an answer",
    ) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.seconds = seconds
        self.name = name  # for the log: "answer chatcmpl-..."
        self.stopping = stopping  # the router's: ends the answer when its drain runs out
        self.stopped = stopped  # the error body that then ends it (`router.stopping`), made then

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        started = ended = False

        async def sending(message: Any) -> None:
            nonlocal started, ended
            await send(message)  # (a client not reading: it may never return, unsent)
            started = started or message["type"] == "http.response.start"
            body = message["type"] == "http.response.body"
            ended = ended or (body and not message.get("more_body", False))

        try:
            async with asyncio.timeout(self.seconds) as timeout:
                with self.stopping.ending(timeout):
                    await super().__call__(scope, receive, sending)
        except TimeoutError:
            if isinstance(self.body_iterator, AsyncGenerator):  # its request's `finally`s
                await self.body_iterator.aclose()
            if ended:  # the time ran out as its end went out: nothing may follow (s42diff F3)
                return
            if self.stopping.now and started:  # its last event, then the end of its body
                with contextlib.suppress(TimeoutError):  # (a client not reading: cut)
                    async with asyncio.timeout(self.stopping.grace_s / 2):
                        await send(
                            {"type": "http.response.body", "body": sse(self.stopped()).encode()}
                        )
                        return
                logger.info("a stopping router's last event of %s was not taken", self.name)
            elif self.stopping.now:  # its status line not taken either (ownfixB G2, s43): a
                with contextlib.suppress(TimeoutError):  # 503 for a client that reads soon
                    async with asyncio.timeout(self.stopping.grace_s / 2):  # (ownfixC C2)
                        await send({"type": "http.response.start", "status": 503, "headers": _JSON})
                        why = json.dumps(self.stopped()).encode()
                        await send({"type": "http.response.body", "body": why})
                        return
                logger.info(
                    "a stopping router's %s was not taken: its client reads nothing", self.name
                )
            else:
                logger.info("%s was not taken in time: its connection is closed", self.name)
            _CUT.left += 1  # uvicorn's error line about it is ours to drop


class _Cut(logging.Filter):
    """Drops uvicorn's "ASGI callable returned without completing response." error once for
    each answer `TimedStream` cut (on purpose: logged above at INFO), not for another."""

    left = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.left and record.getMessage().startswith("ASGI callable returned without"):
            self.left -= 1
            return False
        return True


_CUT = _Cut()
logging.getLogger("uvicorn.error").addFilter(_CUT)
