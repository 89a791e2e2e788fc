"""API keys: the file that names every client key with its tenant, and where `epd serve`
leaves a deployment's keys for the `epd` commands and the Python client.

The file (`[security] api_keys_file`, TOML, readable by its owner only) holds one `[[keys]]`
table per key:

    [[keys]]
    key = "epd-3q0V..."     # the secret a client presents (`authorization: Bearer KEY`)
    tenant = "acme"         # who the key belongs to: the tenant owns its caches
    admin = false           # true: may also call AdminService (Status, Scale, Drain)

Keys are at least `MIN_KEY_CHARS` characters and unique; tenants are non-empty. Several keys
may share a tenant (they then share its caches). Only the router reads the file.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import tomllib
from dataclasses import dataclass
from pathlib import Path

from common.settings.schema import SettingsError
from common.settings.security import warn_if_others_may_read

# Shortest key accepted, in characters.
MIN_KEY_CHARS = 16
# Largest keys file read.
MAX_KEYS_FILE_BYTES = 1 << 20
MAX_EPOCH_CHARS = 64  # a `cache_epoch`
# Where `epd serve` writes the deployment's keys, under `state_dir(namespace)`.
CLIENT_KEY_FILE = "client_key"
ADMIN_KEY_FILE = "admin_key"
API_KEYS_FILE = "api_keys.toml"
DEFAULT_NAMESPACE = "epd"  # `[ray] namespace`'s default
# The environment a client reads: its key, and the namespace whose key files it reads.
API_KEY_VAR = "EPD_API_KEY"
NAMESPACE_VAR = "EPD_NAMESPACE"


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One entry of the keys file. `digest` (sha256 of the key) is what servers compare."""

    digest: bytes  # sha256 of the key's UTF-8 bytes; the key itself is not kept
    tenant: str  # the tenant the key belongs to
    admin: bool  # may call AdminService
    cache_epoch: str = ""  # salted into the tenant's caches: a new one leaves the old behind

    @classmethod
    def of(cls, key: str, tenant: str, admin: bool = False, cache_epoch: str = "") -> ApiKey:
        """The entry for a plain key."""
        return cls(key_digest(key), tenant, admin, cache_epoch)


def key_digest(key: str) -> bytes:
    """sha256 of a presented key: fixed length, so comparing digests takes constant time."""
    return hashlib.sha256(key.encode()).digest()


def new_api_key() -> str:
    """A fresh random key ("epd-" + 43 URL-safe characters)."""
    return "epd-" + secrets.token_urlsafe(32)


def load_api_keys(path: str | Path) -> tuple[ApiKey, ...]:
    """Every key in the file at `path`; SettingsError naming `security.api_keys_file` and
    the entry when the file is unreadable, not TOML, or an entry is malformed."""
    where = "security.api_keys_file"
    target = Path(path)
    try:
        with target.open("rb") as f:
            raw = f.read(MAX_KEYS_FILE_BYTES + 1)
    except OSError as exc:
        raise SettingsError(f"{where}: cannot read {target}: {exc.strerror}") from None
    if len(raw) > MAX_KEYS_FILE_BYTES:
        raise SettingsError(f"{where}: {target} is larger than {MAX_KEYS_FILE_BYTES} bytes")
    warn_if_others_may_read(where, target)
    try:
        data = tomllib.loads(raw.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"{where}: {target} is not TOML: {exc}") from None
    entries = data.get("keys")
    if not isinstance(entries, list) or not entries:
        raise SettingsError(f"{where}: {target} has no [[keys]] entries")
    keys: list[ApiKey] = []
    for i, entry in enumerate(entries):
        at = f"{where}: keys[{i}]"
        if not isinstance(entry, dict):
            raise SettingsError(f"{at}: expected a table of key, tenant, admin and cache_epoch")
        unknown = sorted(set(entry) - {"key", "tenant", "admin", "cache_epoch"})
        if unknown:  # a typo (`admn`) is named, with what is expected
            raise SettingsError(
                f"{at}.{unknown[0]}: unknown; expected only key, tenant, admin and cache_epoch"
            )
        key, tenant, admin = entry.get("key"), entry.get("tenant"), entry.get("admin", False)
        epoch = entry.get("cache_epoch", "")
        if not isinstance(key, str) or len(key) < MIN_KEY_CHARS:
            raise SettingsError(f"{at}.key: must be a string of at least {MIN_KEY_CHARS} chars")
        if not key.isprintable() or any(c.isspace() for c in key):
            # A client's `Bearer KEY` is stripped of spaces: such a key could never match.
            raise SettingsError(f"{at}.key: must not hold spaces or control characters")
        if not isinstance(tenant, str) or not tenant:
            raise SettingsError(f"{at}.tenant: must be a non-empty string")
        if not isinstance(admin, bool):
            raise SettingsError(f"{at}.admin: must be true or false")
        if not isinstance(epoch, str) or len(epoch) > MAX_EPOCH_CHARS:
            raise SettingsError(
                f"{at}.cache_epoch: must be a string of at most {MAX_EPOCH_CHARS} characters"
            )
        parsed = ApiKey.of(key, tenant, admin, epoch)
        if any(k.digest == parsed.digest for k in keys):
            raise SettingsError(f"{at}.key: appears twice")
        if any(k.tenant == tenant and k.cache_epoch != epoch for k in keys):
            # The tenant's keys share its caches: one epoch for all of them.
            raise SettingsError(f"{at}.cache_epoch: differs from tenant {tenant!r}'s other keys")
        keys.append(parsed)
    return tuple(keys)


def write_api_keys_file(path: str | Path, entries: list[tuple[str, str, bool]]) -> Path:
    """Write (key, tenant, admin) entries as a keys file readable by this user only."""
    lines = []
    for key, tenant, admin in entries:
        lines += ["[[keys]]", f'key = "{key}"', f'tenant = "{tenant}"']
        lines += [f"admin = {'true' if admin else 'false'}", ""]
    return _write_private(Path(path), "\n".join(lines))


def _write_private(target: Path, text: str) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.touch(mode=0o600, exist_ok=True)
    target.chmod(0o600)
    target.write_text(text)
    return target


def write_key_file(path: str | Path, key: str) -> Path:
    """Write one key (a line) to `path`, readable by this user only."""
    return _write_private(Path(path), key + "\n")


def state_dir(namespace: str = DEFAULT_NAMESPACE) -> Path:
    """Where `epd serve` keeps a deployment's secrets: $EPD_HOME (default ~/.epd)/<namespace>."""
    return Path(os.environ.get("EPD_HOME", "~/.epd")).expanduser() / namespace


def key_file(kind: str = CLIENT_KEY_FILE, namespace: str | None = None) -> Path:
    """The `kind` key file (CLIENT_KEY_FILE or ADMIN_KEY_FILE) of `namespace`'s deployment:
    where `epd serve` writes it, and where a client given no key reads it. None: the
    client's namespace, $EPD_NAMESPACE, else DEFAULT_NAMESPACE."""
    if namespace is None:
        namespace = os.environ.get(NAMESPACE_VAR, DEFAULT_NAMESPACE)
    return state_dir(namespace) / kind


def env_api_key() -> str:
    """$EPD_API_KEY, stripped (set from a file, it ends in a newline); "": none."""
    return os.environ.get(API_KEY_VAR, "").strip()


def default_api_key(kind: str = CLIENT_KEY_FILE) -> str | None:
    """The key a client uses when given none: $EPD_API_KEY, else the one in its `kind` key
    file (`key_file`), else None."""
    env = env_api_key()
    if env:
        if not env.isascii() or not env.isprintable():  # no header could carry it
            raise SettingsError(f"${API_KEY_VAR}: must be printable ASCII")
        return env
    path = key_file(kind)
    try:
        key = path.read_bytes().decode("utf-8-sig").strip()  # a BOM (Notepad) is no key
    except OSError:
        return None
    except UnicodeDecodeError:
        raise SettingsError(f"{path}: not UTF-8 text") from None
    if not key.isascii() or not key.isprintable():  # no header could carry it
        raise SettingsError(f"{path}: must be printable ASCII")
    return key or None
