"""What `epd.client` hands back: streamed chunks, whole results, failures (names importable
from `epd.client`), and how a router's responses and refusals become them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from epd.v1 import decode_service_pb2, router_service_pb2

_FINISH = {
    decode_service_pb2.FINISH_REASON_STOP: "stop",
    decode_service_pb2.FINISH_REASON_LENGTH: "length",
    decode_service_pb2.FINISH_REASON_CANCELLED: "cancelled",
}


class GenerateError(Exception):
    """A failed request: `code` is the gRPC status, `details` the router's message; `field`
    the request field at fault and `retry_after_s` the wait a refusal names, where the
    router said (its `epd-field` and `retry-after-ms` trailing metadata)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        field: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.field = field
        self.retry_after_s = retry_after_s

    @classmethod
    def of(cls, exc: grpc.aio.AioRpcError, details: str | None = None) -> GenerateError:
        """The error of a failed call (`details`: instead of the router's message)."""
        field = dict(exc.trailing_metadata() or ()).get("epd-field")
        text = (exc.details() or "") if details is None else details
        return cls(exc.code(), text, field if isinstance(field, str) else None, retry_after_s(exc))

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (a process pool's worker raising it) with its arguments: the default gives
        # `__init__` the message alone, and the pool broke unpickling it.
        return (type(self), (self.code, self.details, self.field, self.retry_after_s))


@dataclass(frozen=True, slots=True)
class Chunk:
    """One piece of a streamed answer."""

    text: str  # text of the new tokens (may be empty while a character is incomplete)
    token_ids: tuple[int, ...]  # new token ids
    finish_reason: str | None  # "stop", "length" or "cancelled" on the last chunk
    prompt_tokens: int = 0  # tokens in the prompt (first chunk)
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (first chunk)
    blocks_pulled: int = 0  # prompt KV blocks the decode worker pulled (first decode chunk)
    blocks_reused: int = 0  # prompt KV blocks the decode worker already held (same)


@dataclass(frozen=True, slots=True)
class Result:
    """A whole answer, with the stream's statistics and timings."""

    text: str  # the answer
    token_ids: list[int]  # every generated token, the stop token included
    finish_reason: str | None  # why it ended
    prompt_tokens: int  # tokens in the prompt
    cached_tokens: int  # prompt tokens served from a prefix cache
    blocks_pulled: int  # prompt KV blocks pulled by the decode worker
    blocks_reused: int  # prompt KV blocks the decode worker already held
    # Times count from the call, so they include building the request (PNG-encoding images
    # and frames given as arrays or PIL images; bytes and files are sent as they are).
    ttft_s: float  # seconds from the call to the first token
    token_times_s: list[float]  # arrival time (from the call) of each chunk with tokens
    total_s: float  # seconds from the call to the end of the stream


def retry_after_s(exc: grpc.aio.AioRpcError) -> float | None:
    """The wait a refusal names (`retry-after-ms`, seconds), None when it names none."""
    for key, value in exc.trailing_metadata() or ():
        if key == "retry-after-ms" and isinstance(value, str) and value.isdigit():
            return int(value) / 1000
    return None


def chunk_of(response: router_service_pb2.GenerateResponse) -> Chunk:
    """One streamed Generate response as the client hands it on."""
    return Chunk(
        text=response.text,
        token_ids=tuple(response.token_ids),
        finish_reason=_FINISH.get(response.finish_reason),
        prompt_tokens=response.prompt_tokens,
        cached_tokens=response.cached_tokens,
        blocks_pulled=response.blocks_pulled,
        blocks_reused=response.blocks_reused,
    )


async def collected(chunks: AsyncIterator[Chunk]) -> Result:
    """The whole answer of a stream of chunks, with its timings from now."""
    start = time.perf_counter()
    text: list[str] = []
    tokens: list[int] = []
    times: list[float] = []
    stats = dict.fromkeys(("prompt", "cached", "pulled", "reused"), 0)
    finish = None
    async for chunk in chunks:
        if chunk.token_ids:
            times.append(time.perf_counter() - start)
        text.append(chunk.text)
        tokens.extend(chunk.token_ids)
        stats["prompt"] = stats["prompt"] or chunk.prompt_tokens
        stats["cached"] = stats["cached"] or chunk.cached_tokens
        stats["pulled"] = stats["pulled"] or chunk.blocks_pulled
        stats["reused"] = stats["reused"] or chunk.blocks_reused
        finish = chunk.finish_reason or finish
    return Result(
        text="".join(text),
        token_ids=tokens,
        finish_reason=finish,
        prompt_tokens=stats["prompt"],
        cached_tokens=stats["cached"],
        blocks_pulled=stats["pulled"],
        blocks_reused=stats["reused"],
        ttft_s=times[0] if times else float("nan"),
        token_times_s=times,
        total_s=time.perf_counter() - start,
    )
