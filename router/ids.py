"""A caller's request id and cache salt: each travels with the request to every worker and
into their logs, and the salt into every cache key the encoder makes of it."""

from __future__ import annotations

import re

from epd.v1 import router_service_pb2
from router.inputs import InputError

MAX_ID_CHARS = 256  # a caller's request id and cache salt (logged, sent to every worker)


def check_ids(request: router_service_pb2.GenerateRequest) -> None:
    """InputError naming `request_id` or `cache_salt` when it is over `MAX_ID_CHARS` or holds
    a line break or control character (a line break would forge lines of every log it is
    written to): each travels with the request to every worker, and the encoder hashes the
    salt into every unit's cache key (without tenants it is the caller's own string)."""
    for name in ("request_id", "cache_salt"):
        value = getattr(request, name)
        if len(value) > MAX_ID_CHARS:
            raise InputError(name, f"is over {MAX_ID_CHARS} characters")
        if breaks_lines(value):
            raise InputError(name, "holds a line break or a control character")


def breaks_lines(text: str) -> bool:
    """Whether `text` holds a control character (tab aside), a line or paragraph separator
    or a bidirectional override: what could forge or reorder a line of a log. (Spaces,
    joiners, marks and other format characters of real text pass: `str.isprintable`
    refused a Persian salt.)"""
    return any(_forges(c) for c in text)


def _forges(c: str) -> bool:
    return (c < " " and c != "\t") or "\x7f" <= c <= "\x9f" or c in _FORGERS


def escaped(text: str) -> str:
    """`text` with what `breaks_lines` finds escaped (`\\n`, `\\u202e`), the rest as it is."""
    return "".join(ascii(c)[1:-1] if _forges(c) else c for c in text)


# Line and paragraph separators, and the bidirectional embeddings, overrides and isolates,
# which make a log line read in another order (U+202E).
_FORGERS = frozenset("\u2028\u2029\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def shown_id(request_id: str) -> str:
    """A caller's request id as log lines and workers show it: as it is when it is one word
    (letters, digits, `-_.:/@+=#`), else quoted, what does not print escaped (other scripts
    stay readable). A tenant's id "x (tenant-b) length: ..." made its request's log line
    read as another tenant's (metrics review). One too long for `check_ids` is cut (it is
    logged before that check refuses it: a 50 MiB id held the router's loop for a second and
    grew its log by as much: fuzz review)."""
    if len(request_id) > MAX_ID_CHARS:
        return shown_text(request_id, MAX_ID_CHARS)
    plain = _ONE_WORD.fullmatch(request_id) and not _BLANK_LETTERS.intersection(request_id)
    return request_id if plain else repr(request_id)


_ONE_WORD = re.compile(r"[\w\-.:/@+=#]*")
# Letters that print as blanks (Hangul fillers): "a\u3164b" reads as two words.
_BLANK_LETTERS = frozenset("\u115f\u1160\u3164\uffa0")


def shown_text(text: str, limit: int = 200) -> str:
    """Anything a caller sent, as an error or a log line may repeat it: cut to `limit`
    characters (saying how many there were), in quotes, what could break a line escaped
    (a field's value repeated whole wrote forged log lines, and a 16 MiB one grew the log
    by as much)."""
    cut = text if len(text) <= limit else text[:limit]
    quoted = repr(cut)  # which escapes every character `str.isprintable` refuses
    return quoted if cut is text else f"{quoted}... ({len(text)} characters)"


def loggable(text: str, limit: int) -> str:
    """A message that may repeat what a caller sent (an error's), for an answer or a log
    line: cut to `limit` characters and escaped, without quotes, if it could break a line."""
    return escaped(text if len(text) <= limit else text[:limit] + "...")
