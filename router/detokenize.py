"""Incremental detokenization of a token stream.

The router owns the text of a stream: the first token comes from the prefill worker and
the rest from the decode worker, and a byte-level BPE token may end inside a UTF-8
character, so text is emitted only once the decoded tail is a complete character. The
concatenation of every `add` plus `flush` equals `decode(all ids)` for byte-level BPE.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas of a growing token sequence (the read-offset scheme of vLLM)."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the window that is decoded again for context
        self._read = 0  # tokens whose text has been emitted

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the new complete text (may be empty)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]

    def skip(self, token_ids: Sequence[int]) -> None:
        """Take tokens whose text the client already has (a stream resumed on this router):
        added one by one, as the stream that sent them did, so what follows comes out as it
        would have there (a character they end inside is sent whole with the next token)."""
        for token_id in token_ids:
            self.add([token_id])

    def flush(self) -> str:
        """Whatever text is still held back (an incomplete character at the very end)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]
