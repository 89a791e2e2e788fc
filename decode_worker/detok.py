"""Incremental detokenization: text for each new chunk of tokens of one sequence."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas whose concatenation is the full text.

    A delta is held back while the decoded text ends in an incomplete UTF-8 sequence
    (U+FFFD), and `flush` emits whatever is left at the end. Special tokens are skipped,
    as the offline engine's text does.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []  # every token so far
        self.text = ""  # text emitted so far

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the new stable text (possibly empty)."""
        self.token_ids.extend(token_ids)
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if full.endswith("\ufffd") or not full.startswith(self.text):
            return ""
        delta, self.text = full[len(self.text) :], full
        return delta

    def flush(self) -> str:
        """The text not yet emitted (call once the sequence ended)."""
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = full
        return delta
