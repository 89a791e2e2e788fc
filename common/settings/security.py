"""The `[security]` table every server reads, and the deployment's cluster key.

The cluster token is a secret shared by the workers of one deployment (a file, mounted from
a Kubernetes Secret or written by `epd serve`). KV workers derive the key that signs and
verifies `KvHandle`s from it (`common.handoff`); service-to-service authentication uses the
same file. A server started without one refuses to start unless `insecure` is set, and then
says so in its log.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass
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
    insecure: bool = setting(
        False, "run without a cluster token: KV handles go unsigned (said in the log)"
    )

    def check(self) -> None:
        """SettingsError naming `security.cluster_token_file` when it is unset and
        `insecure` is not set (the file itself is read by `cluster_key`)."""
        if not self.insecure and not self.cluster_token_file:
            raise SettingsError(
                "security.cluster_token_file: unset; give the deployment's cluster token "
                "file, or --insecure"
            )

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
        token = raw.strip()
        if len(raw) > MAX_TOKEN_BYTES:
            raise SettingsError(f"{key}: {path} is larger than {MAX_TOKEN_BYTES} bytes")
        if len(token) < MIN_TOKEN_BYTES:
            raise SettingsError(f"{key}: {path} holds under {MIN_TOKEN_BYTES} bytes of token")
        return hashlib.sha256(b"epd-cluster-key-v1\x00" + token).digest()


def write_token_file(path: str | Path) -> Path:
    """Write a fresh random cluster token to `path`, readable by this user only."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.touch(mode=0o600, exist_ok=True)
    target.chmod(0o600)
    target.write_text(secrets.token_urlsafe(32) + "\n")
    return target
