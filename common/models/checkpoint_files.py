"""Reading a checkpoint folder's small files: bounded, typed, every error naming the file.

`read_checkpoint_text`, `read_checkpoint_json` and `read_tokenizer` read one file (config.json,
generation_config.json, tokenizer.json, a chat template, ...) and raise `CheckpointError`
naming its path when it is not a regular file (a FIFO would hang the start, `/dev/zero`
would fill the memory), is larger than `MAX_FILE_BYTES`, is not UTF-8 or not valid JSON.

`JsonObject` reads one JSON object of such a file key by key: a boolean must be a JSON
boolean, an integer a JSON integer (a whole float such as 64.0 is taken as that integer;
64.9 is refused), a number finite; ranges are checked where the key is read. Its errors
read "<file>: <dotted key> <what is wrong>", e.g. "config.json: text_config.vocab_size
must be an integer >= 1, got 0". A null value is an absent key, as `transformers` reads it.
`unread` lists the keys nobody asked for, which the caller warns about (`warn_once`): a
setting is never dropped silently.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from common.errors import CheckpointError

logger = logging.getLogger(__name__)

# Larger than any real checkpoint's JSON (a Qwen tokenizer.json is about 11 MB).
MAX_FILE_BYTES = 64 << 20

_warned: set[tuple[str, str]] = set()


def read_checkpoint_text(path: str | Path, *, limit: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of the regular file `path`, at most `limit` bytes."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO does not wait for a writer (no effect on a file).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointError(f"{path}: not a regular file")
            if info.st_size > limit:
                raise CheckpointError(f"{path}: {info.st_size} bytes, more than {limit}")
            data = f.read(limit + 1)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    if len(data) > limit:  # it grew since the fstat
        raise CheckpointError(f"{path}: more than {limit} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text: {exc}") from None


def read_checkpoint_json(path: str | Path) -> Any:
    """The JSON value of the file `path` (`read_checkpoint_text`'s checks, then JSON)."""
    text = read_checkpoint_text(path)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from None


def read_checkpoint_object(path: str | Path) -> dict[str, Any] | None:
    """The JSON object of the optional file `path`; None when there is no such file."""
    path = Path(path)
    if not path.exists():
        return None
    raw = read_checkpoint_json(path)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, not {_kind(raw)}")
    return raw


def read_tokenizer(path: str | Path) -> Tokenizer:
    """The `tokenizers` tokenizer of the file `path` (a `tokenizer.json`)."""
    text = read_checkpoint_text(path)
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # the library raises a bare Exception for any bad file
        raise CheckpointError(f"{path}: not a tokenizer tokenizers can read: {exc}") from None


def warn_once(file: str, key: str, why: str) -> None:
    """Log a warning once per (file, key) per process."""
    if (file, key) in _warned:
        return
    _warned.add((file, key))
    logger.warning("checkpoint %s: setting %s %s", file, key, why)


class JsonObject:
    """One JSON object of a checkpoint file, read key by key (module docstring)."""

    def __init__(self, raw: object, file: str, prefix: str = "") -> None:
        """`file`: the name errors give (e.g. "config.json"); `prefix`: this object's
        dotted key in the file ("" for the file's top level)."""
        if not isinstance(raw, dict):
            where = prefix or "the file"
            raise CheckpointError(f"{file}: {where} must be a JSON object, not {_kind(raw)}")
        self.file = file
        self._raw: dict[str, Any] = raw
        self._prefix = prefix
        self._read: set[str] = set()

    def key(self, key: str) -> str:
        """`key`'s dotted name in the file."""
        return f"{self._prefix}.{key}" if self._prefix else key

    def error(self, key: str, message: str) -> CheckpointError:
        """A `CheckpointError` "<file>: <dotted key> <message>"."""
        return CheckpointError(f"{self.file}: {self.key(key)} {message}")

    def get(self, key: str) -> Any:
        """The raw value (None when absent or null); `key` counts as read."""
        self._read.add(key)
        return self._raw.get(key)

    def present(self, key: str) -> bool:
        """Whether `key` holds a value other than null (does not count as read)."""
        return self._raw.get(key) is not None

    def section(self, key: str) -> JsonObject:
        """The nested object at `key` (empty when absent or null)."""
        value = self.get(key)
        return JsonObject({} if value is None else value, self.file, self.key(key))

    def integer(self, key: str, default: int | None = None, *, minimum: int | None = None) -> int:
        """An integer >= `minimum`; `default` when absent (None: the key is required)."""
        value = self.get(key)
        if value is None:
            if default is None:
                raise self.error(key, "is missing")
            return default
        return self._integer(key, value, minimum)

    def integers(
        self, key: str, default: Sequence[int], *, minimum: int | None = None
    ) -> tuple[int, ...]:
        """A list of integers (each >= `minimum`), or one integer as a list of one."""
        value = self.get(key)
        if value is None:
            return tuple(default)
        if not isinstance(value, list):
            value = [value]
        return tuple(self._integer(key, v, minimum) for v in value)

    def number(self, key: str, default: float, *, positive: bool = True) -> float:
        """A finite number (> 0 when `positive`, else >= 0); `default` when absent."""
        value = self.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"must be a number, got {value!r}")
        number = float(value)
        if not math.isfinite(number) or number < 0 or (positive and number == 0):
            raise self.error(
                key, f"must be a finite number {'>' if positive else '>='} 0, got {value!r}"
            )
        return number

    def boolean(self, key: str, default: bool) -> bool:
        """true or false (a JSON boolean, not "false" or 0); `default` when absent."""
        value = self.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r}")
        return value

    def string(self, key: str, default: str, *, allowed: Collection[str] = ()) -> str:
        """A string (one of `allowed` when given); `default` when absent."""
        value = self.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, got {value!r}")
        if allowed and value not in allowed:
            raise self.error(key, f"{value!r} is not supported (only {', '.join(allowed)})")
        return value

    def unread(self, ignored: Collection[str] = ()) -> list[str]:
        """Dotted names of the keys present (not null) that were never read, but `ignored`."""
        return [
            self.key(k)
            for k, v in self._raw.items()
            if v is not None and k not in self._read and k not in ignored
        ]

    def _integer(self, key: str, value: Any, minimum: int | None) -> int:
        whole = isinstance(value, float) and math.isfinite(value) and value.is_integer()
        if isinstance(value, bool) or not (isinstance(value, int) or whole):
            raise self.error(key, f"must be an integer, got {value!r}")
        number = int(value)
        if minimum is not None and number < minimum:
            raise self.error(key, f"must be an integer >= {minimum}, got {value!r}")
        return number


def _kind(value: object) -> str:
    """The JSON kind of a parsed value, for messages."""
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    return type(value).__name__
