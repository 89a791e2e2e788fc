"""Media URLs of HTTP requests -> file bytes, under the router's settings.

    data:<mime>;base64,<payload>   always (the payload is the file)
    /path or file:///path          only inside `[router] http_media_dir` (default: refused);
    path, file:path                a path relative to that folder, inside it (a path is read
                                   as written; a file: URL is %-decoded)
    https://host/...               only with `[router] http_fetch_urls` (default: off); the
                                   host's addresses are resolved once and every one must be
                                   public (private, loopback, link-local, reserved: refused;
                                   for IPv6, the IPv4 address one embeds too: `is_public`);
                                   the connection goes to that checked address; no
                                   redirects; at most `http_fetch_max_bytes`, within
                                   `http_fetch_timeout_s`
    http://...                     refused

Errors are `FieldError`s naming the part's url field (the API answers 400 with it). Call
`load` off the event loop (it reads files and sockets).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import http.client
import ipaddress
import os
import socket
import ssl
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.errors import FieldError
from router.http.errors import ApiError


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """Where media may come from (the `[router] http_*` settings)."""

    media_dir: Path | None = None  # local files only inside it (None: none)
    fetch_urls: bool = False  # https URLs fetched by the router
    fetch_timeout_s: float = 10.0  # whole fetch, connect to last byte
    max_bytes: int = 64 << 20  # largest file from a path or URL
    max_request_bytes: int = 256 << 20  # one request's media in all (`max_message_mb`)


def load(
    url: str, field: str, policy: MediaPolicy, gone: Callable[[], bool] = lambda: False
) -> bytes:
    """The file `url` names; FieldError(field) when it is malformed or not allowed. A fetch
    is cut once `gone()` (ApiError CANCELLED)."""
    try:
        data = _load(url, field, policy, gone)
    except FieldError:
        raise
    except ValueError as exc:  # what urllib, the OS or the resolver cannot take (a bad
        # IPv6 host or port, a NUL byte in a path, a host name too long to encode)
        raise FieldError(field, f"is not a valid URL ({exc})") from None
    if not data:
        raise FieldError(field, "names an empty file")
    return data


def _load(url: str, field: str, policy: MediaPolicy, gone: Callable[[], bool]) -> bytes:
    if url[:5].lower() == "data:":  # a URL's scheme is case-insensitive
        return _data_url(url, field)
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme in ("http", "https"):
        if not policy.fetch_urls:
            raise FieldError(field, "fetching media URLs is off (send a data URL)")
        if parsed.scheme != "https":
            raise FieldError(field, "only https URLs are fetched")
        return _fetch(parsed, field, policy, gone)
    if parsed.scheme == "file":
        if parsed.netloc.lower() not in ("", "localhost"):  # RFC 8089: a file elsewhere
            raise FieldError(field, "names a file on another host (file:///path is local)")
        return _local(urllib.parse.unquote(parsed.path), field, policy)
    # A path, as written (no %-decoding, no ?query or #fragment): absolute, or relative to
    # the folder; also one whose first part has a colon ("img:1.png", no "scheme://").
    if url.startswith("/") or (url and policy.media_dir and url.partition(":")[2][:2] != "//"):
        return _local(url, field, policy)
    raise FieldError(field, "expected a data URL (data:<mime>;base64,...)")


# What base64 in lines may hold between its characters: stripped in one bytes pass (split
# made an object of every piece between them, 20x the payload for 2-character lines).
_LINE_SPACE = b" \t\r\n"
_URL_SAFE = bytes.maketrans(b"-_", b"+/")  # base64url's two letters, as standard base64's


def _data_url(url: str, field: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise FieldError(field, "expected a base64 data URL (data:<mime>;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        pass
    try:
        # Wrapped in lines, unpadded, or in the URL-safe alphabet: what encoders write.
        text = payload.encode("ascii").translate(_URL_SAFE, _LINE_SPACE).rstrip(b"=")
        return base64.b64decode(text + b"=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):  # UnicodeEncodeError is one
        pass
    raise FieldError(field, "the data URL's payload is not valid base64")


def _local(path: str, field: str, policy: MediaPolicy) -> bytes:
    """The file at `path` (relative: to the folder), a regular file inside the folder."""
    if policy.media_dir is None:
        raise FieldError(field, "local files are refused (no [router] http_media_dir)")
    root = policy.media_dir.resolve()
    # Inside the folder as written first (as set, or once its links are followed): a path
    # out of it is never looked up (a lookup tells whether it exists, and may hang on a
    # network mount); then once the path's links are followed. The folder is never named:
    # it is no client's business.
    written = os.path.normpath(os.path.join(root, path))
    # Made at each raise: one error bound to a local here closed a cycle through this
    # frame, which kept the request's media until a garbage collection (ownfixC C2).
    missing = functools.partial(FieldError, field, "no such file under http_media_dir")
    tops = (str(root), os.path.abspath(policy.media_dir))
    if not any(os.path.commonpath([top, written]) == top for top in tops):
        raise missing()
    try:
        target = Path(written).resolve(strict=True)
        if not target.is_relative_to(root):
            raise missing()
        # Not blocking on a FIFO put there after any check; a last link swapped in is refused.
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder, a FIFO, a device
                raise missing()
            with open(fd, "rb", closefd=False) as file:
                data = file.read(policy.max_bytes + 1)  # one growing meanwhile: no more
        finally:
            os.close(fd)  # every path: a folder's descriptor leaked one per request
    except FileNotFoundError:
        raise missing() from None
    except RuntimeError:  # a symlink loop (Python 3.11's resolve); 3.13 raises OSError
        raise FieldError(field, "cannot be read under http_media_dir (a symlink loop)") from None
    except OSError as exc:  # a name too long, no permission, gone meanwhile: a 500 before
        raise FieldError(field, f"cannot be read under http_media_dir ({exc.strerror})") from None
    if len(data) > policy.max_bytes:
        raise FieldError(field, f"file larger than {policy.max_bytes} bytes")
    return data


# IPv6 prefixes that carry an IPv4 address in their last 32 bits, which a translator on the
# way reaches: NAT64 (RFC 6052's well-known prefix, RFC 8215's local-use one).
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


def is_public(address: str) -> bool:
    """Whether `address` is globally reachable, and so is any IPv4 address it embeds (a
    mapped, IPv4-compatible, 6to4, Teredo or NAT64 address leads to that one: `::127.0.0.1`
    and `64:ff9b::a00:1` are "global" to Python 3.11, but reach 127.0.0.1 and 10.0.0.1)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if not ip.is_global:
        return False
    if isinstance(ip, ipaddress.IPv4Address):
        return True
    embedded = [ip.ipv4_mapped, ip.sixtofour, ip.teredo[1] if ip.teredo else None]
    if int(ip) >> 32 == 0 or any(ip in net for net in _NAT64):  # IPv4-compatible, NAT64
        embedded.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return all(v4 is None or v4.is_global for v4 in embedded)


def public_address(host: str, port: int, field: str) -> str:
    """The first address `host` resolves to; FieldError unless every one is public
    (`is_public`)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise FieldError(field, f"cannot resolve {host}") from None
    addresses = [str(info[4][0]) for info in infos]
    for address in addresses:
        if not is_public(address):
            raise FieldError(field, f"{host} resolves to a non-public address")
    if not addresses:
        raise FieldError(field, f"cannot resolve {host}")
    return addresses[0]


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to a checked address, verifying the certificate for the URL's host name."""

    def __init__(self, host: str, address: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    _twin: socket.socket | None = None  # the connection's own descriptor, for `abort`
    _aborted = False  # `abort` was called: a connection made after fails at once

    def connect(self) -> None:
        family = socket.AF_INET6 if ":" in self._address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        # Twinned before connecting, so `abort` ends a connect to a host that never answers
        # too (TLS takes `sock` over and detaches it; the twin stays ours).
        self._twin = sock.dup()
        try:
            if self._aborted:
                raise OSError("aborted before it connected")
            sock.settimeout(self.timeout)
            sock.connect((self._address, self.port))
        except BaseException:
            sock.close()
            raise
        if self._aborted:  # while it connected, before the twin could end it
            self.abort()
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]

    def abort(self) -> None:
        """From any thread: fail whatever read or handshake is blocked on it now, or the
        connection when it is made."""
        self._aborted = True
        if self._twin is not None:
            with contextlib.suppress(OSError):
                self._twin.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        super().close()
        if self._twin is not None:
            self._twin.close()


WATCH_S = 0.05  # how often a fetch's watcher looks at its time and whether its client left


def _fetch(
    url: urllib.parse.SplitResult,
    field: str,
    policy: MediaPolicy,
    gone: Callable[[], bool] = lambda: False,
) -> bytes:
    host, port = url.hostname or "", url.port or 443
    address = public_address(host, port, field)
    conn = _PinnedHTTPS(host, address, port, policy.fetch_timeout_s)
    # The whole fetch is timed, not each read (a server trickling its head or body a byte at
    # a time kept one of the router's threads for as long as it liked), and it is cut once
    # the client is gone (a stalled host held the thread to the timeout for nobody).
    end = time.monotonic() + policy.fetch_timeout_s
    timed_out, done = threading.Event(), threading.Event()

    def watch() -> None:
        while not done.wait(WATCH_S):
            late = time.monotonic() >= end
            if late or gone():
                if late:
                    timed_out.set()
                conn.abort()
                return

    threading.Thread(target=watch, name="epd-fetch-watch", daemon=True).start()
    try:
        path = url.path or "/"
        conn.request("GET", path + (f"?{url.query}" if url.query else ""))
        response = conn.getresponse()
        if response.status != 200:
            raise FieldError(field, f"fetching it answered HTTP {response.status}")
        body = bytearray()
        while chunk := response.read1(1 << 16):
            body += chunk
            if len(body) > policy.max_bytes:
                raise FieldError(field, f"larger than {policy.max_bytes} bytes")
        if timed_out.is_set() or gone():  # cut short: what arrived is not the whole file
            raise OSError("cut short")
        return bytes(body)
    except (OSError, http.client.HTTPException) as exc:
        if timed_out.is_set() or time.monotonic() >= end:  # the socket's own timeout, first
            raise FieldError(field, f"fetching took over {policy.fetch_timeout_s} s") from None
        if gone():
            raise ApiError(grpc.StatusCode.CANCELLED, f"{field}: the client went away") from None
        raise FieldError(field, f"fetching failed: {exc}") from None
    finally:
        done.set()
        conn.close()
