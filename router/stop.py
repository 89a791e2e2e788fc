"""Stop strings (`GenerateRequest.stop`): the answer ends before the first one its text holds.

The router owns the text (`router.detokenize`), so it alone can see a stop string, which may
span tokens and chunks. `stop_at(chunks, stops, decode)` passes the orchestrator's chunks
through, holding back the tail of the text that could still begin a stop string; once the
text holds one, it sends the text before it with finish reason STOP and closes the
orchestrator's stream, whose `finally` cancels the decode call and releases what the request
holds.

A chunk may carry several tokens (a decode worker's `stream_interval`): its tokens are
looked at one at a time, each with the text it completes (a detokenizer of the answer's
own, `router.detokenize`), so the answer ends where a one-token stream's would, whatever
the chunks: at the token that completes the first stop string to be complete, before that
string; the tokens after it are not part of the answer, in `token_ids` or the token count.
(Cutting a chunk's whole text at the stop string that begins first, and its tokens by
decoding prefixes of them, gave another answer when a chunk completed two stop strings,
and found a U+FFFD stop string inside a character a prefix ended in.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from common.errors import FieldError
from epd.v1 import decode_service_pb2, router_service_pb2
from router.detokenize import IncrementalDetokenizer

MAX_STOP_STRINGS = 16  # most stop strings one request may name
MAX_STOP_CHARS = 256  # longest stop string
EMPTY_STOP = "stop strings must not be empty"
TOO_MANY_STOPS = f"at most {MAX_STOP_STRINGS} stop strings"


def check_stop(stops: Sequence[str]) -> None:
    """FieldError("stop") for an empty, too long or too many stop strings."""
    if len(stops) > MAX_STOP_STRINGS:
        raise FieldError("stop", TOO_MANY_STOPS)
    for text in stops:
        if not text:
            raise FieldError("stop", EMPTY_STOP)
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


async def stop_at(
    chunks: AsyncIterator[router_service_pb2.GenerateResponse],
    stops: Sequence[str],
    detok: IncrementalDetokenizer,
) -> AsyncIterator[router_service_pb2.GenerateResponse]:
    """`chunks` cut at the first of `stops` (some; the module docstring).
    `detok`: a detokenizer of its own for the answer, past the tokens a resumed stream's
    client has (`IncrementalDetokenizer.skip`), as the orchestrator's is."""
    cutter = StopStrings(stops)
    try:
        async for chunk in chunks:
            text = ""
            for k, token_id in enumerate(chunk.token_ids):
                text += cutter.add(detok.add([token_id]))
                if cutter.stopped:
                    del chunk.token_ids[k + 1 :]
                    break
            ended = chunk.finish_reason != decode_service_pb2.FINISH_REASON_UNSPECIFIED
            if ended and not cutter.stopped:
                text += cutter.add(detok.flush())
                text += "" if cutter.stopped else cutter.flush()
            chunk.text = text
            if cutter.stopped:
                chunk.finish_reason = decode_service_pb2.FINISH_REASON_STOP
                yield chunk
                return
            yield chunk
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
