"""Incremental detokenization of a token stream.

The router owns the text of a stream: the first token comes from the prefill worker and
the rest from the decode worker, and a byte-level BPE token may end inside a UTF-8
character, so text is emitted only once the decoded tail is a complete character. The
concatenation of every `add` plus `flush` equals `decode(all ids)` for byte-level BPE.

Tokens are taken one at a time whatever the calls carry (a decode worker's chunk may hold
several: `stream_interval`), so the text out after any token is the same however the tokens
were grouped: a chunk whose last token ends inside a character still yields the characters
before it. That is what lets another router `skip` a resumed stream's tokens and go on
where this one stopped, and `router.stop` find a stop string in the chunk that holds it.

Given each token's bytes (`token_bytes`, a byte-level tokenizer's: Qwen's), the text is an
incremental UTF-8 decoding of them: exact, whatever the tokens hold (a token may end one
character and begin the next), and each token costs the same however many came before.
Without them, each token decodes a window of tokens again: a token that adds no text (a
special token) moves it on, and so does a run of more than `MAX_HELD_TOKENS` tokens that
ends inside a character (invalid bytes, each a replacement character for good); 20,000 of
either re-decoded a growing window, 10 to 18 s of the router's event loop. There the
concatenation can differ from `decode(all)` in one place: a character begun in the last
bytes of such a run.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.processing.processor import Processor
    from common.sampling import SamplingParams

REPLACEMENT = "\ufffd"
# Tokens held back while their text ends inside a character. A character is at most 4
# bytes, so a longer run holds invalid bytes: it is let go with its replacement characters.
MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Text deltas of a growing token sequence (the read-offset scheme of vLLM)."""

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        token_bytes: Sequence[bytes] | None = None,
        silent: Collection[int] = (),
    ) -> None:
        self._decode = decode
        self._bytes = token_bytes  # token id -> its bytes (None: decode windows of tokens)
        # Tokens whose text is not shown: a request's stop tokens, as in vLLM (the one that
        # ended the answer stays in its token ids and counts).
        self._silent = frozenset(silent)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._ids: list[int] = []
        self._prefix = 0  # start of the window that is decoded again for context
        self._read = 0  # tokens whose text has been emitted

    @classmethod
    def of_answer(
        cls, processor: Processor, sampling: SamplingParams, resumed: Sequence[int] = ()
    ) -> IncrementalDetokenizer:
        """The detokenizer of an answer in `processor`'s tokens, past the `resumed` tokens
        its client already has (`skip`); `sampling`'s stop tokens show no text."""
        detok = cls(processor.decode, processor.token_bytes, sampling.stop_token_ids)
        detok.skip(resumed)
        return detok

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the new complete text (may be empty), the same as adding
        them one by one would have returned in all."""
        if self._silent:
            token_ids = [t for t in token_ids if t not in self._silent]
        if self._bytes is not None:
            table = self._bytes
            size = len(table)  # an id past the vocabulary decodes to nothing, as decode's
            data = b"".join(table[t] if 0 <= t < size else b"" for t in token_ids)
            return self._utf8.decode(data)
        text = ""
        for token_id in token_ids:
            text += self._add_one(token_id)
        return text

    def skip(self, token_ids: Sequence[int]) -> None:
        """Take tokens whose text the client already has (a stream resumed on this router),
        so what follows comes out as it would have on the router that sent them (a character
        they end inside is sent whole with the next token)."""
        self.add(token_ids)

    def flush(self) -> str:
        """Whatever text is still held back (an incomplete character at the very end)."""
        if self._bytes is not None:
            return self._utf8.decode(b"", final=True)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]

    def _add_one(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        held = len(self._ids) - self._read
        if new_text.endswith(REPLACEMENT) and held <= MAX_HELD_TOKENS:
            return ""  # inside a character: wait for its other bytes
        if len(new_text) < len(prefix_text) and held <= MAX_HELD_TOKENS:
            return ""
        # Text, none (a special token), or a run too long to be one character's bytes:
        # the window moves on, so each token costs the same however many came before.
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]
