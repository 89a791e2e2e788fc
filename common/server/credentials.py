"""The caller's side of authentication: what a channel presents, and over what.

A `ChannelCredentials` is a bearer (an API key, or the cluster bearer of
`SecuritySettings.cluster_bearer`) sent as `authorization: Bearer ...` metadata on every
call, plus optional TLS (the CA that verifies the server, and a client certificate for mutual
TLS). The bearer is added by client interceptors, so it travels over plaintext channels too
(`--insecure`-free deployments without certificates); a call that already carries an
`authorization` entry (a per-call key) keeps it. Importing this module loads only grpc.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

AUTHORIZATION = "authorization"  # the metadata key (gRPC metadata keys are lower case)


def checked_key(key: str, field: str = "api_key") -> str:
    """An API key as presented: stripped, as the key files and $EPD_API_KEY are (a key read
    with `open(...).read()` ends in a newline; "": none); ValueError naming `field` when no
    header can carry it (gRPC failed the call INTERNAL "Invalid metadata", naming nothing)."""
    stripped = key.strip()
    if not stripped.isascii() or not stripped.isprintable():
        raise ValueError(f"{field}: must be printable ASCII")
    return stripped


def read_ca(path: str | Path, field: str = "tls_ca_file") -> bytes:
    """The PEM certificates of the CA file at `path`; ValueError naming `field` and the
    file when it holds none (gRPC said only "Failed to create security handshaker")."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{field}: cannot read {path}: {exc.strerror or exc}") from None
    if b"CERTIFICATE-----" not in data:  # BEGIN CERTIFICATE, TRUSTED or X509 CERTIFICATE
        raise ValueError(f"{field}: {path} holds no PEM certificate")
    return data


def bearer_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """The metadata entry presenting `secret`."""
    return ((AUTHORIZATION, f"Bearer {secret}"),)


@dataclass(frozen=True, slots=True)
class ChannelCredentials:
    """What a channel presents: a bearer and TLS material (any may be None)."""

    bearer: str | None = None  # sent on every call; None: no authorization metadata
    root_certificates: bytes | None = None  # PEM CA verifying the server; None: system roots
    private_key: bytes | None = None  # PEM client key, for mutual TLS
    certificate_chain: bytes | None = None  # PEM client certificate, for mutual TLS
    tls: bool = False  # dial TLS (set whenever any certificate material is given)

    def open(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """A grpc.aio channel to `address` presenting these credentials."""
        interceptors = _interceptors(self.bearer) if self.bearer else None
        if not self.tls:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        ssl = grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )
        return grpc.aio.secure_channel(address, ssl, options=options, interceptors=interceptors)

    def open_blocking(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A synchronous channel to `address` presenting these credentials."""
        if self.tls:
            ssl = grpc.ssl_channel_credentials(
                self.root_certificates, self.private_key, self.certificate_chain
            )
            ch = grpc.secure_channel(address, ssl, options=options)
        else:
            ch = grpc.insecure_channel(address, options=options)
        if self.bearer:
            ch = grpc.intercept_channel(ch, _BlockingBearer(self.bearer))
        return ch


NO_CREDENTIALS = ChannelCredentials()


def _with_bearer(details: Any, bearer: str) -> Any:
    metadata = list(details.metadata or ())
    if any(k == AUTHORIZATION for k, _ in metadata):
        return details
    metadata.extend(bearer_metadata(bearer))
    return details._replace(metadata=metadata)  # grpc.aio.ClientCallDetails: a namedtuple


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, bearer: str) -> None:
        self.bearer = bearer

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_bearer(details, self.bearer), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, bearer: str) -> None:
        self.bearer = bearer

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_bearer(details, self.bearer), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, bearer: str) -> None:
        self.bearer = bearer

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with_bearer(details, self.bearer), requests)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, bearer: str) -> None:
        self.bearer = bearer

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with_bearer(details, self.bearer), requests)


def _interceptors(bearer: str) -> list[Any]:
    return [_UnaryUnary(bearer), _UnaryStream(bearer), _StreamUnary(bearer), _StreamStream(bearer)]


class _BlockingBearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
):
    """The bearer on a synchronous channel (tests and launchers poll Status with one)."""

    def __init__(self, bearer: str) -> None:
        self.bearer = bearer

    def _details(self, details: Any) -> Any:
        metadata = list(details.metadata or ())
        if not any(k == AUTHORIZATION for k, _ in metadata):  # a call's own key wins, as async
            metadata.extend(bearer_metadata(self.bearer))
        return _SyncDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(
        self,
        method: Any,
        timeout: Any,
        metadata: Any,
        credentials: Any,
        wait_for_ready: Any,
        compression: Any,
    ) -> None:
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression
