"""The `[security]` table every server reads, and the deployment's cluster key.

The cluster token is a secret shared by the workers of one deployment (a file, mounted from
a Kubernetes Secret or written by `epd serve`). KV workers derive the key that signs and
verifies `KvHandle`s from it (`common.handoff`); service-to-service calls present a bearer
derived from it (`cluster_bearer`), and the router derives each tenant's cache salt from it.
Clients present API keys from `api_keys_file` (format: `common.settings.api_keys`). A server
started without the secrets it needs refuses to start unless `insecure` is set, and then
says so in its log. TLS (`tls_*_file`) is independent of `insecure`: given a certificate and
key, servers serve TLS and channels dial TLS; given a CA too, services require client
certificates from each other (mutual TLS) while the router's port accepts clients without one.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import ssl
from dataclasses import dataclass, fields
from pathlib import Path

from common.settings.schema import SettingsError, setting

logger = logging.getLogger(__name__)

# Shortest token accepted (bytes of the file, after stripping whitespace).
MIN_TOKEN_BYTES = 16
# Largest token file read (a token is a line; anything bigger is a wrong path).
MAX_TOKEN_BYTES = 4096


@dataclass(frozen=True, slots=True)
class SecuritySettings:
    """Who may trust whom: the `[security]` table."""

    cluster_token_file: str | None = setting(
        None,
        "file holding the deployment's cluster token, shared by every worker (signs KV "
        "handles; `epd serve` makes one per deployment when unset)",
    )
    api_keys_file: str | None = setting(
        None,
        "TOML file of client API keys: [[keys]] entries with key, tenant and admin (read by "
        "the router; `epd serve` makes one per deployment when unset)",
    )
    tls_cert_file: str | None = setting(
        None, "PEM certificate chain this process serves (and presents to peers) over TLS"
    )
    tls_key_file: str | None = setting(None, "PEM private key of tls_cert_file")
    tls_ca_file: str | None = setting(
        None,
        "PEM CA bundle that verifies peers' certificates (unset: the system's public roots; "
        "a private CA needs it); with it, services require client certificates from each "
        "other (mutual TLS); the router's port does not",
    )
    insecure: bool = setting(
        False,
        "run without authentication: no cluster token, no API keys, KV handles unsigned "
        "(said in the log)",
    )

    def check(self, *, api_keys: bool = False) -> None:
        """SettingsError naming `security.cluster_token_file` (or `security.api_keys_file`
        when `api_keys`: the router) when it is unset and `insecure` is not set, or naming a
        `security.tls_*_file` given without its partner (the files themselves are read by
        `cluster_key`, `tls_files` and `common.settings.api_keys.load_api_keys`)."""
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise SettingsError("security.tls_key_file: tls_cert_file and tls_key_file go together")
        if self.tls_ca_file and not self.tls_cert_file:
            raise SettingsError("security.tls_ca_file: needs tls_cert_file and tls_key_file")
        if self.insecure:
            return
        if not self.cluster_token_file:
            raise SettingsError(
                "security.cluster_token_file: unset; give the deployment's cluster token "
                "file, or --insecure"
            )
        if api_keys and not self.api_keys_file:
            raise SettingsError(
                "security.api_keys_file: unset; give the file of client API keys, or --insecure"
            )

    def cluster_bearer(self) -> str | None:
        """What services present to each other (`authorization: Bearer ...`): a value
        derived from the cluster key, so the token itself never travels. None when
        `insecure` (raises like `cluster_key` otherwise)."""
        key = self.cluster_key() if not self.insecure else None
        if key is None:
            return None
        return "epd-cluster." + hashlib.sha256(b"epd-cluster-bearer-v1\x00" + key).hexdigest()

    def tls_files(self) -> TlsFiles | None:
        """The PEM bytes of the TLS files; None without `tls_cert_file`. SettingsError
        naming the file that cannot be read."""
        if not self.tls_cert_file or not self.tls_key_file:
            return None
        files = TlsFiles(
            cert_chain=_read("security.tls_cert_file", self.tls_cert_file),
            private_key=_read("security.tls_key_file", self.tls_key_file),
            ca=_read("security.tls_ca_file", self.tls_ca_file) if self.tls_ca_file else None,
        )
        # gRPC only logs why it refuses them, and the server then reported its port as the
        # one that "cannot be bound".
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        except ssl.SSLError as exc:
            raise SettingsError(
                "security.tls_cert_file, security.tls_key_file: not a PEM certificate chain "
                f"and the private key that goes with it ({exc.reason or exc})"
            ) from None
        if self.tls_ca_file:
            try:
                context.load_verify_locations(cafile=self.tls_ca_file)
            except ssl.SSLError as exc:
                raise SettingsError(
                    f"security.tls_ca_file: not PEM certificates ({exc.reason or exc})"
                ) from None
        return files

    def cluster_key(self, role: str = "server") -> bytes | None:
        """The 32-byte key derived from the cluster token; None when `insecure`.

        Raises SettingsError naming `security.cluster_token_file` when it is unset (and
        `insecure` is not), unreadable, too short or too long.
        """
        if self.insecure:
            logger.warning(
                "%s runs INSECURE (security.insecure): KV handles are neither signed nor "
                "checked for a signature",
                role,
            )
            return None
        self.check()
        key = "security.cluster_token_file"
        path = Path(str(self.cluster_token_file))
        try:
            with path.open("rb") as f:
                raw = f.read(MAX_TOKEN_BYTES + 1)
        except OSError as exc:
            raise SettingsError(f"{key}: cannot read {path}: {exc.strerror}") from None
        warn_if_others_may_read(key, path)
        token = raw.strip()
        if len(raw) > MAX_TOKEN_BYTES:
            raise SettingsError(f"{key}: {path} is larger than {MAX_TOKEN_BYTES} bytes")
        if len(token) < MIN_TOKEN_BYTES:
            raise SettingsError(f"{key}: {path} holds under {MIN_TOKEN_BYTES} bytes of token")
        return hashlib.sha256(b"epd-cluster-key-v1\x00" + token).digest()


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM contents of the `[security] tls_*_file` settings."""

    cert_chain: bytes  # this process's certificate chain
    private_key: bytes  # its private key
    ca: bytes | None  # CA bundle verifying peers; None: peers are not asked for certificates


def named_by_table(role: str, message: str, own: SecuritySettings, shared: SecuritySettings) -> str:
    """A `role`'s SettingsError `message`, each `security.<key>` it names named by the table
    that sets that key: the role's own (`own`: `[<role>.security]`), or `shared`
    (`[security]`); a key neither sets (a missing partner) by the role's where the role's
    sets another key the message names."""
    if not message.startswith("security."):
        return f"{role}.{message}"
    unset = SecuritySettings()
    head, colon, reason = message.partition(": ")  # "security.<key>[, ...]: why"
    said = reason  # the keys it names, not the values it repeats (a path may hold a name)
    for value in {getattr(t, f.name) for t in (own, shared) for f in fields(unset)}:
        if isinstance(value, str) and value:
            said = re.sub(rf"(?<!\w){re.escape(value)}(?!\w)", " ", said)
    names = {f.name for f in fields(unset)} & set(re.findall(r"\w+", f"{head} {said}"))
    sets = {k for k in names if getattr(own, k) != getattr(unset, k)}

    def table(key: str) -> str:
        if key in sets or (sets and getattr(shared, key, None) == getattr(unset, key, None)):
            return f"{role}.security.{key}"
        return f"security.{key}"

    # The keys it names lead it; what follows (a path, say) is left as it is.
    return re.sub(r"\bsecurity\.(\w+)", lambda m: table(m[1]), head) + colon + reason


def warn_if_others_may_read(key: str, path: Path) -> None:
    """Log a warning naming `key` when the secret file at `path` is open to every user of the
    machine (the docs say: readable by its owner only; its group is left alone, as a
    Kubernetes secret volume with an `fsGroup` is group-readable)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # the read that follows or preceded says why
    if mode & 0o007:
        logger.warning(
            "%s: %s is open to other users (mode %03o); make it readable by its owner only "
            "(chmod 600)",
            key,
            path,
            mode & 0o777,
        )


def _read(key: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SettingsError(f"{key}: cannot read {path}: {exc.strerror}") from None


def write_token_file(path: str | Path) -> Path:
    """Write a fresh random cluster token to `path`, readable by this user only."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.touch(mode=0o600, exist_ok=True)
    target.chmod(0o600)
    target.write_text(secrets.token_urlsafe(32) + "\n")
    return target
