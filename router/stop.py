"""Stop strings (`GenerateRequest.stop`): the answer ends before the first one its text holds.

The router owns the text (`router.detokenize`), so it alone can see a stop string, which may
span tokens and chunks. `stop_at(chunks, stops, decode)` passes the orchestrator's chunks
through, holding back the tail of the text that could still begin a stop string; once the
text holds one, it sends the text before it with finish reason STOP and closes the
orchestrator's stream, whose `finally` cancels the decode call and releases what the request
holds.

A chunk may carry several tokens (a decode worker's `stream_interval`): the stopping chunk
keeps its tokens up to the one that completes the stop string (the fewest whose text holds
it), as a one-token stream would have ended there; the tokens after it are not part of the
answer, in `token_ids` or the token count. That search looks only in the stopping chunk's
tokens: the detokenizer gives each chunk the text of every character its tokens complete,
however they are chunked (`router.detokenize`), so no earlier chunk's tokens completed it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

from common.errors import FieldError
from epd.v1 import decode_service_pb2, router_service_pb2

MAX_STOP_STRINGS = 16  # most stop strings one request may name
MAX_STOP_CHARS = 256  # longest stop string


def check_stop(stops: Sequence[str]) -> None:
    """FieldError("stop") for an empty, too long or too many stop strings."""
    if len(stops) > MAX_STOP_STRINGS:
        raise FieldError("stop", f"at most {MAX_STOP_STRINGS} stop strings")
    for text in stops:
        if not text:
            raise FieldError("stop", "stop strings must not be empty")
        if len(text) > MAX_STOP_CHARS:
            raise FieldError("stop", f"a stop string may have at most {MAX_STOP_CHARS} characters")


class StopStrings:
    """Text deltas cut at the first stop string (held back while it could still begin one)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._hold = max(len(s) for s in self.stops) - 1  # characters that may begin one
        self._pending = ""  # text not yet sent: it may be the start of a stop string
        self.stopped = False  # a stop string was found; no more text

    def add(self, text: str) -> str:
        """The part of `pending + text` that is safe to send (before any stop string)."""
        self._pending += text
        found = [i for i in (self._pending.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            out, self._pending = self._pending[: min(found)], ""
            return out
        keep = min(self._hold, len(self._pending))
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """What is held back, at the end of a stream that never stopped."""
        out, self._pending = self._pending, ""
        return out


def completing(
    token_ids: Sequence[int],
    known: int,
    stops: Sequence[str],
    decode: Callable[[Sequence[int]], str],
) -> int:
    """The fewest leading tokens of `token_ids` (more than `known`, whose text holds none of
    `stops`) whose text holds one, by binary search; all of them if none does."""
    lo, hi = known + 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        text = decode(token_ids[:mid])
        if any(s in text for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return hi


async def stop_at(
    chunks: AsyncIterator[router_service_pb2.GenerateResponse],
    stops: Sequence[str],
    decode: Callable[[Sequence[int]], str],
) -> AsyncIterator[router_service_pb2.GenerateResponse]:
    """`chunks` cut at the first stop string (the module docstring); unchanged without any.
    `decode` is the detokenizer's (token ids -> text of the whole answer so far)."""
    if not stops:
        async for chunk in chunks:
            yield chunk
        return
    cutter = StopStrings(stops)
    answer: list[int] = []  # every token so far
    try:
        async for chunk in chunks:
            known = len(answer)
            answer.extend(chunk.token_ids)
            chunk.text = cutter.add(chunk.text)
            if cutter.stopped:
                if len(chunk.token_ids) > 1:
                    del chunk.token_ids[completing(answer, known, cutter.stops, decode) - known :]
                chunk.finish_reason = decode_service_pb2.FINISH_REASON_STOP
                yield chunk
                return
            if chunk.finish_reason != decode_service_pb2.FINISH_REASON_UNSPECIFIED:
                chunk.text += cutter.flush()
            yield chunk
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
