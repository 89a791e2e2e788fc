"""Who may call what: the server side of authentication, and TLS for both sides.

Every epd server runs an `AuthInterceptor` (unless `[security] insecure`). It reads the
caller's `authorization: Bearer SECRET` metadata and compares it, in constant time, with the
cluster bearer (`SecuritySettings.cluster_bearer`) and the digests of the API keys
(`common.settings.api_keys`). Each method (its full name) needs one principal:

    method                                    needs      satisfied by
    /grpc.health.v1.Health/*                  open       anyone (Kubernetes probes)
    /grpc.reflection.v1alpha.ServerReflection/*
                                              open       anyone (schemas, never state: the
                                                         served services, and any other
                                                         public schema loaded in the
                                                         process, e.g. Ray's)
    /epd.v1.RouterService/*                   client     any API key (its tenant is the caller)
    /epd.v1.AdminService/*                    admin      an admin API key, or the cluster
    everything else (Register, Heartbeat,     cluster    the cluster bearer only
      Encode, Prefill, Decode, ReleaseKv, ...)

No credentials, or a secret that matches nothing: UNAUTHENTICATED. Valid credentials that do
not satisfy the method (a client key calling Register or Prefill, a non-admin key calling
AdminService): PERMISSION_DENIED. Either way the handler never runs, so nothing changes.
Unknown methods need the cluster, so a new service is closed until someone opens it here.
Handlers that need the caller (the router's Generate: its tenant) call `principal(context)`,
which re-reads the same metadata.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from common.server.credentials import AUTHORIZATION, ChannelCredentials
from common.settings.api_keys import ApiKey, key_digest, load_api_keys
from common.settings.schema import SettingsError
from common.settings.security import SecuritySettings

logger = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIX = "/grpc.reflection.v1alpha.ServerReflection/"
CLIENT_PREFIX = "/epd.v1.RouterService/"
ADMIN_PREFIX = "/epd.v1.AdminService/"


class Need(enum.Enum):
    """The principal a method needs."""

    OPEN = "open"
    CLIENT = "client"
    ADMIN = "admin"
    CLUSTER = "cluster"


def need_for(method: str) -> Need:
    """The principal the method with full name `method` needs (module docstring table)."""
    if method.startswith((HEALTH_PREFIX, REFLECTION_PREFIX)):
        return Need.OPEN
    if method.startswith(CLIENT_PREFIX):
        return Need.CLIENT
    if method.startswith(ADMIN_PREFIX):
        return Need.ADMIN
    return Need.CLUSTER


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated caller."""

    tenant: str | None  # the API key's tenant; None for the cluster and anonymous callers
    admin: bool = False  # an admin key (or the cluster)
    cluster: bool = False  # presented the cluster bearer: another service of the deployment
    cache_epoch: str = ""  # the tenant's (`ApiKey.cache_epoch`), salted into its caches

    def satisfies(self, need: Need) -> bool:
        """Whether this caller may call a method needing `need`."""
        if need is Need.OPEN:
            return True
        if need is Need.CLIENT:
            return self.tenant is not None
        if need is Need.ADMIN:
            return self.admin or self.cluster
        return self.cluster


CLUSTER = Caller(None, admin=True, cluster=True)
# Every caller of an insecure server: no tenant (one shared cache), may call anything.
ANONYMOUS = Caller(None, admin=True, cluster=True)


class Authenticator:
    """The secrets one server accepts: the cluster bearer and (router) the API keys."""

    def __init__(
        self,
        cluster_bearer: str | None,
        api_keys: Sequence[ApiKey] = (),
        need: Callable[[str], Need] = need_for,
    ) -> None:
        self._cluster = key_digest(cluster_bearer) if cluster_bearer else None
        self._keys = tuple(api_keys)
        self.need = need  # method full name -> the principal it needs
        # Tenants with a client key (not admin only: `epd serve` writes one of each).
        self.client_tenants = len({key.tenant for key in self._keys if not key.admin})

    @classmethod
    def from_settings(cls, security: SecuritySettings, *, api_keys: bool) -> Authenticator | None:
        """The authenticator `security` asks for (None when `insecure`, said in the log).
        The API keys file is required when `api_keys` (the router) and read whenever set
        (a worker that has it answers a client key PERMISSION_DENIED rather than
        UNAUTHENTICATED). SettingsError when a needed secret is missing or unreadable."""
        if security.insecure:
            logger.warning(
                "authentication is OFF (security.insecure): every caller may call every method"
            )
            return None
        security.check(api_keys=api_keys)
        keys: tuple[ApiKey, ...] = ()
        if security.api_keys_file:
            try:
                keys = load_api_keys(str(security.api_keys_file))
            except SettingsError as exc:
                if api_keys:
                    raise
                # A worker on a node without the router's keys file still refuses client
                # keys, as unknown ones.
                logger.warning("%s: client keys are answered UNAUTHENTICATED here", exc)
        return cls(security.cluster_bearer(), keys)

    def identify(self, metadata: Sequence[tuple[str, Any]] | None) -> Caller | None:
        """The caller the `authorization` metadata names; None when it names nobody."""
        secret = _bearer(metadata)
        if secret is None:
            return None
        digest = key_digest(secret)
        found: Caller | None = None
        if self._cluster is not None and hmac.compare_digest(digest, self._cluster):
            found = CLUSTER
        for key in self._keys:  # every entry compared: time does not depend on which matched
            if hmac.compare_digest(digest, key.digest) and found is None:
                found = Caller(key.tenant, admin=key.admin, cache_epoch=key.cache_epoch)
        return found

    def principal(self, context: Any) -> Caller:
        """The caller of the RPC behind `context` (the interceptor already let it through;
        UNAUTHENTICATED-worthy metadata here means a method the interceptor left open)."""
        caller = self.identify(context.invocation_metadata())
        return caller if caller is not None else Caller(None)

    def refusal(self, method: str, caller: Caller | None) -> tuple[grpc.StatusCode, str] | None:
        """The status refusing `caller` on `method`, or None when it may call it."""
        need = self.need(method)
        if need is Need.OPEN:
            return None
        if caller is None:
            return grpc.StatusCode.UNAUTHENTICATED, f"{method} needs valid credentials"
        if not caller.satisfies(need):
            return grpc.StatusCode.PERMISSION_DENIED, f"{method} needs {need.value} credentials"
        return None


def principal(auth: Authenticator | None, context: Any) -> Caller:
    """The caller behind `context`; ANONYMOUS on a server without authentication."""
    return auth.principal(context) if auth is not None else ANONYMOUS


def _bearer(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The bearer secret of the one `authorization` entry; None for none, or for two (which
    one a proxy in front checked is unknown, as the HTTP API says of two headers)."""
    found = [value for key, value in metadata or () if key == AUTHORIZATION]
    if len(found) != 1:
        return None
    text = found[0].decode() if isinstance(found[0], bytes) else str(found[0])
    scheme, _, secret = text.partition(" ")
    return secret.strip() if scheme.lower() == "bearer" and secret.strip() else None


class RefusalLog:
    """Logs refused calls: each kind (method and code) at its first refusal, then at most
    once every `every_s` with how many were refused since. Calls without credentials cost
    their sender nothing: a line each grew a server's log by ~300 KB/s from one client (s41
    attacker3 F2). Methods are the server's own (an unknown one is never refused here).

    The first refusal a line leaves out arranges (`later`: the running event loop's
    `call_later`, when there is one) a line at the window's end, so a burst that stops is
    still counted, within `every_s`."""

    def __init__(
        self,
        every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        later: Callable[[float, Callable[[], None]], object] | None = None,
    ):
        self.every_s = every_s
        self.clock = clock
        self.later = later or _call_later
        self._kinds: dict[tuple[str, str], tuple[float, int]] = {}  # -> (last line, since)

    def __call__(self, method: str, code: grpc.StatusCode) -> None:
        kind, now = (method, code.name), self.clock()
        last, since = self._kinds.get(kind, (-math.inf, 0))
        if now - last >= self.every_s:
            self._line(kind, now)
            return
        self._kinds[kind] = (last, since + 1)
        if since == 0:
            self.later(last + self.every_s - now, lambda: self._due(kind, last))

    def _due(self, kind: tuple[str, str], window: float) -> None:
        """The window begun at `window` has ended: say how many it left out, unless a
        refusal since has already said it (a line began another window)."""
        last, since = self._kinds[kind]
        if last == window and since:
            self._line(kind, self.clock())

    def _line(self, kind: tuple[str, str], now: float) -> None:
        last, since = self._kinds.get(kind, (-math.inf, 0))
        self._kinds[kind] = (now, 0)
        more = f" (and {since} more since {now - last:.0f} s ago)" if since else ""
        logger.info("refused %s: %s%s", *kind, more)


def _call_later(delay_s: float, callback: Callable[[], None]) -> None:
    """`callback` after `delay_s` on the running event loop; nothing outside one (the
    next refusal's line then says the count)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    loop.call_later(delay_s, callback)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls whose credentials do not satisfy their method (module docstring)."""

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth
        self.log = RefusalLog()

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        caller = self.auth.identify(details.invocation_metadata)
        refused = self.auth.refusal(details.method, caller)
        if refused is None:
            return handler
        self.log(details.method, refused[0])
        return _refusing(handler, *refused)


def _refusing(handler: Any, code: grpc.StatusCode, message: str) -> Any:
    """A handler that only aborts with `code`, without reading the request.

    It is request-streaming whatever the method: gRPC receives a unary method's request
    message whole before calling its handler, so a refusal of that kind would first take
    in up to `max_message_mb` from a caller without credentials (four anonymous 200 MB
    calls took the router from 264 MB to 1.46 GB resident). A streaming handler reads
    nothing it does not ask for; the caller gets the status alone, as it would anyway."""

    async def refuse(_requests: Any, context: Any) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover  (abort raises; this makes it an async generator)

    return grpc.stream_stream_rpc_method_handler(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


# ------------------------------------------------------------------------------------- TLS


def server_tls(security: SecuritySettings, *, client_certs: bool) -> grpc.ServerCredentials | None:
    """TLS for a server from `[security] tls_*` (None without a certificate). With a CA,
    peers' certificates are verified, and required when `client_certs` (service ports; the
    router's port passes False so clients without a certificate still reach it)."""
    files = security.tls_files()
    if files is None:
        return None
    return grpc.ssl_server_credentials(
        [(files.private_key, files.cert_chain)],
        root_certificates=files.ca,
        require_client_auth=client_certs and files.ca is not None,
    )


def service_credentials(security: SecuritySettings) -> ChannelCredentials:
    """What this process presents when it calls another service of the deployment: the
    cluster bearer (none when `insecure`) and, with TLS configured, the CA and this
    process's certificate (mutual TLS)."""
    bearer = security.cluster_bearer() if not security.insecure else None
    files = security.tls_files()
    if files is None:
        return ChannelCredentials(bearer)
    return ChannelCredentials(
        bearer,
        root_certificates=files.ca,
        private_key=files.private_key,
        certificate_chain=files.cert_chain,
        tls=True,
    )
