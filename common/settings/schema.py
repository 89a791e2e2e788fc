"""Typed settings: frozen dataclasses read from TOML, overridden by command-line flags.

Each component declares its settings as a frozen dataclass whose fields carry a default and
a one-line help text (`setting(default, "help")`). This module turns such a class into:

- `from_mapping(cls, data)`: build from a TOML table; an unknown key is an error naming it
  (with the closest known key), and a value of the wrong type is an error naming the field;
- `add_flags(parser, cls)` / `apply_flags(obj, args)`: one `--field-name` flag per field
  (nested dataclasses get `--section-field` flags), applied over the loaded values;
- `describe(cls)`: the documented default of every field, for `--help` and the docs.

Only the types settings need are supported: bool, int, float, str, Optional of those,
tuples of str/int, and nested settings dataclasses.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class SettingsError(ValueError):
    """A settings file or flag that cannot be used; the message names the key."""


# The longest a seconds setting (`*_s`) may be: gRPC keeps deadlines in int64 nanoseconds, so
# a `request_timeout_s` of 1e10 ("never") overflowed and every call ended as it began.
MAX_SECONDS = 1e7  # 115 days


# The shortest lease a holder may lend bytes under: one shorter ends before a reader can pull
# (a prefill lease of 1 ms failed every request, ABORTED, naming no setting: clocks review).
MIN_LEASE_TTL_S = 0.1


def check_lease_ttl(settings: object, name: str = "lease_ttl_s") -> None:
    """SettingsError unless `name` is a usable lease lifetime (`MIN_LEASE_TTL_S` to
    `MAX_SECONDS`)."""
    check_positive(settings, name)
    if getattr(settings, name) < MIN_LEASE_TTL_S:
        raise SettingsError(
            f"{name}: must be at least {MIN_LEASE_TTL_S:g} s (a lease shorter than a hand-off "
            "ends before its reader can pull what it lends)"
        )


def check_positive(settings: object, *names: str) -> None:
    """SettingsError naming the first of `names` not above 0 (NaN included), or, for a
    seconds setting, past `MAX_SECONDS` (infinity included)."""
    for name in names:
        if not getattr(settings, name) > 0:
            raise SettingsError(f"{name}: must be positive")
        _check_ceiling(settings, name)


def check_not_negative(settings: object, *names: str) -> None:
    """SettingsError naming the first of `names` below 0 (or NaN), or, for a seconds
    setting, past `MAX_SECONDS`."""
    for name in names:
        if not getattr(settings, name) >= 0:
            raise SettingsError(f"{name}: must not be negative")
        _check_ceiling(settings, name)


# The largest integer setting: counts reach C longs (gRPC's channel arguments, torch's
# threads), where a larger one failed at start with an overflow naming no setting.
MAX_INT = (1 << 63) - 1


def _check_ceiling(settings: object, name: str) -> None:
    value = getattr(settings, name)
    if name.endswith("_s") and not value <= MAX_SECONDS:
        raise SettingsError(f"{name}: must be at most {MAX_SECONDS:.0e} s (115 days)")
    if name.endswith("_ms") and not value <= MAX_SECONDS * 1000:
        raise SettingsError(f"{name}: must be at most {MAX_SECONDS * 1000:.0e} ms (115 days)")
    if isinstance(value, int) and value > MAX_INT:
        raise SettingsError(f"{name}: must be at most {MAX_INT}")


MAX_THREADS = 1024  # a worker's torch threads: more than any node's cores


def check_threads(settings: object) -> None:
    """SettingsError unless `threads` is 0 (auto) to `MAX_THREADS` (20000, a typo, would
    start as many OpenMP threads)."""
    check_not_negative(settings, "threads")
    check_at_most(settings, "threads", MAX_THREADS, "more threads than any node has cores")


def check_at_most(settings: object, name: str, most: float, why: str) -> None:
    """SettingsError naming `name` when it is past `most` (`why`: what makes it so);
    `check_not_negative`'s ceilings too."""
    if not getattr(settings, name) <= most:
        raise SettingsError(f"{name}: must be at most {most:g} ({why})")
    _check_ceiling(settings, name)


def setting(default: Any, help: str) -> Any:
    """A settings field with its default and one-line documentation."""
    if isinstance(default, list | dict | set):
        raise TypeError("use an immutable default (tuple) for settings fields")
    return dataclasses.field(default=default, metadata={"help": help})


def _fields(cls: type) -> dict[str, tuple[dataclasses.Field[Any], Any]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls)}


def _is_settings(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check and convert one TOML (or flag) value to the field type `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key)
    if _is_settings(tp):
        if not isinstance(value, Mapping):
            raise SettingsError(f"{key}: expected a table, got {type(value).__name__}")
        return from_mapping(tp, value, prefix=f"{key}.")
    if origin is tuple:
        (item_tp, *_rest) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]  # "a:1, b:2"
        if not isinstance(value, list | tuple):
            raise SettingsError(f"{key}: expected a list, got {type(value).__name__}")
        return tuple(_coerce(v, item_tp, key) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise SettingsError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        # A fraction is refused, not truncated (port = 50062.9 is not port 50062).
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise SettingsError(f"{key}: expected an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise SettingsError(f"{key}: expected an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool):
            raise SettingsError(f"{key}: expected a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise SettingsError(f"{key}: expected a number, got {value!r}") from None
        # nan passes every `> 0` check and then breaks whatever it times (a lease TTL of nan
        # is never reaped); no setting means "forever" by inf.
        if not math.isfinite(number):
            raise SettingsError(f"{key}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise SettingsError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{key}: unsupported settings type {tp!r}")


def from_mapping(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build settings of type `cls` from a mapping; unknown keys are an error."""
    known = _fields(cls)
    unknown = [k for k in data if k not in known]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, list(known), n=1)
        hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
        raise SettingsError(
            f"unknown setting {prefix}{key}{hint}; known: {', '.join(sorted(known))}"
        )
    values = {name: _coerce(data[name], known[name][1], prefix + name) for name in data}
    return cls(**values)


def load(cls: type[T], path: str | Path | None) -> T:
    """Read a TOML settings file (or the defaults when `path` is None)."""
    if path is None:
        return cls()
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"settings file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"settings file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise SettingsError(f"settings file {path} is not UTF-8 text") from None
    except OSError as exc:  # a folder (a ConfigMap mounted whole), unreadable
        raise SettingsError(f"settings file {path} cannot be read: {exc.strerror}") from None
    try:
        return from_mapping(cls, data)
    except SettingsError as exc:
        raise SettingsError(f"{path}: {exc}") from None


def _flag_items(cls: type, prefix: str = "") -> list[tuple[str, str, Any, dataclasses.Field[Any]]]:
    """(dotted key, flag, type, field) for every leaf field of `cls`."""
    out = []
    for name, (f, tp) in _fields(cls).items():
        key = prefix + name
        if _is_settings(tp):
            out.extend(_flag_items(tp, key + "."))
        else:
            out.append((key, "--" + key.replace(".", "-").replace("_", "-"), tp, f))
    return out


def add_flags(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """One flag per leaf field; each defaults to "not given" so files are not overridden."""
    for key, flag, _tp, f in _flag_items(cls, prefix):
        default = f.default if f.default is not dataclasses.MISSING else None
        parser.add_argument(
            flag,
            dest=key.replace(".", "__"),
            default=argparse.SUPPRESS,
            metavar="VALUE",
            help=f"{f.metadata.get('help', '')} (default: {default!r})",
        )


def apply_flags(obj: T, args: argparse.Namespace, prefix: str = "") -> T:
    """A copy of `obj` with every flag given on the command line applied."""
    given = vars(args)
    return _apply(obj, given, prefix)


def _apply(obj: Any, given: Mapping[str, Any], prefix: str) -> Any:
    changes: dict[str, Any] = {}
    for name, (_f, tp) in _fields(type(obj)).items():
        key = prefix + name
        if _is_settings(tp):
            changes[name] = _apply(getattr(obj, name), given, key + ".")
            continue
        dest = key.replace(".", "__")
        if dest in given:
            raw = given[dest]
            changes[name] = (
                None if raw in ("none", "None", "") and _optional(tp) else _coerce(raw, tp, key)
            )
    return dataclasses.replace(obj, **changes)


def _optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in (
        typing.get_args(tp)
    )


def describe(cls: type, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, help) of every leaf field, grouped by table: a table's own
    keys together (a nested table declared between them, such as a role's `security`,
    comes after them), tables in the order they first appear, fields in declaration order."""
    tables: dict[str, list[tuple[str, Any, str]]] = {}
    for key, _flag, _tp, f in _flag_items(cls, prefix):
        default = f.default if f.default is not dataclasses.MISSING else None
        head = key.rpartition(".")[0]
        tables.setdefault(head, []).append((key, default, str(f.metadata.get("help", ""))))
    return [item for items in tables.values() for item in items]


def to_toml(cls: type, prefix: str = "") -> str:
    """A commented TOML document listing every field with its default.

    A field with a default is written `# key = value`: uncommented, that line is valid TOML
    and loads as the default. TOML has no null, so a field that is unset by default is written
    `# key: unset (a string)` instead, naming the type it takes: that line is not a value and
    is not meant to be uncommented as it is; write `key = ...` to set it."""
    types_ = {key: tp for key, _flag, tp, _f in _flag_items(cls, prefix)}
    lines: list[str] = []
    section = None
    for key, default, help_text in describe(cls, prefix):
        head, _, leaf = key.rpartition(".")
        if head != section:
            section = head
            lines.extend(["", f"[{head}]"] if head else [])
        lines.append(f"# {help_text}")
        if default is None:
            lines.append(f"# {leaf}: unset ({_type_name(types_[key])})")
        else:
            lines.append(f"# {leaf} = {_toml_value(default)}")
    return "\n".join(lines).lstrip("\n") + "\n"


def _type_name(tp: Any) -> str:
    """How `to_toml` names the type an unset field takes ("a string", "an integer", ...)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] if _optional(tp) else [tp]
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
    base = args[0] if len(args) == 1 else tp
    if typing.get_origin(base) is tuple or base is tuple:
        return "a list"
    return names.get(base, "a value")


def _toml_value(value: Any) -> str:
    """`value` as a TOML value (strings escaped as TOML basic strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, float) and value != value:
        return "nan"
    return repr(value)
