"""TLS from `[security] tls_*_file`: a router and an encoder worker on 127.0.0.1 with
certificates made here (one CA, one certificate for the services). The encoder registers
over mutual TLS with the cluster bearer; a client reaches the router with the CA and an API
key but no certificate; plaintext clients, and clients without a certificate on a service
port, are refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import ipaddress
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.models.tiny import make_tiny_checkpoint
from common.server.auth import service_credentials
from common.server.credentials import ChannelCredentials
from common.server.rpc import channel
from common.settings.security import SecuritySettings
from encoder_worker.server import serve as serve_encoder
from encoder_worker.settings import EncoderSettings
from epd.v1 import admin_service_pb2, admin_service_pb2_grpc
from router.server import serve as serve_router
from router.settings import RouterSettings
from tests.cluster import ADMIN_KEY, cluster_security

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_certificates(folder: Path) -> SecuritySettings:
    """A CA and a certificate for 127.0.0.1/localhost signed by it, as `[security]` TLS files
    (with the session's cluster token and API keys)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("epd test CA"))
        .issuer_name(_name("epd test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("epd service"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(_pem(key))
    return dataclasses.replace(
        cluster_security(),
        tls_cert_file=str(folder / "cert.pem"),
        tls_key_file=str(folder / "key.pem"),
        tls_ca_file=str(folder / "ca.pem"),
    )


@dataclasses.dataclass
class TlsDeployment:
    security: SecuritySettings
    router: Any
    encoder: Any


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tls(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TlsDeployment]:
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    security = make_certificates(tmp_path_factory.mktemp("tls"))
    router = await serve_router(
        RouterSettings(model=str(ckpt), port=0, http_port=-1, security=security)
    )
    encoder = await serve_encoder(
        EncoderSettings(model=str(ckpt), router_address=router.address, security=security)
    )
    assert encoder.registrar is not None
    await encoder.registrar.wait_registered(30)  # over mutual TLS, with the cluster bearer
    yield TlsDeployment(security, router, encoder)
    await encoder.stop(0)
    await router.stop(0)


async def _status(address: str, credentials: ChannelCredentials) -> Any:
    async with channel(address, credentials=credentials) as ch:
        stub = admin_service_pb2_grpc.AdminServiceStub(ch)
        return await stub.Status(admin_service_pb2.StatusRequest(), timeout=5)


async def test_a_client_with_the_ca_and_a_key_but_no_certificate_reaches_the_router(
    tls: TlsDeployment,
) -> None:
    ca = Path(str(tls.security.tls_ca_file)).read_bytes()
    status = await _status(tls.router.address, ChannelCredentials(ADMIN_KEY, ca, tls=True))
    assert [w.info.address for w in status.workers] == [tls.encoder.address]


async def test_services_talk_mutual_tls(tls: TlsDeployment) -> None:
    async with channel(tls.encoder.address, credentials=service_credentials(tls.security)) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_plaintext_and_certificate_less_callers_are_refused(tls: TlsDeployment) -> None:
    ca = Path(str(tls.security.tls_ca_file)).read_bytes()
    with pytest.raises(grpc.aio.AioRpcError) as plain:
        await _status(tls.router.address, ChannelCredentials(ADMIN_KEY))
    assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    # A service port requires a client certificate: the CA alone does not get in.
    no_cert = service_credentials(tls.security)
    no_cert = ChannelCredentials(no_cert.bearer, ca, tls=True)
    async with channel(tls.encoder.address, credentials=no_cert) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_bad_certificate_or_key_is_named_not_blamed_on_the_port(tmp_path: Path) -> None:
    # gRPC logged "Invalid private key." and the server said its port "cannot be bound".
    from common.settings.schema import SettingsError

    good = make_certificates(tmp_path)
    assert good.tls_files() is not None
    (tmp_path / "other").mkdir()
    other = make_certificates(tmp_path / "other")
    for bad, named in (
        (dataclasses.replace(good, tls_key_file=other.tls_key_file), "tls_key_file"),  # another
        (dataclasses.replace(good, tls_cert_file=str(good.cluster_token_file)), "tls_cert_file"),
        (dataclasses.replace(good, tls_ca_file=str(good.cluster_token_file)), "tls_ca_file"),
    ):
        with pytest.raises(SettingsError, match=named):
            bad.tls_files()


async def test_epd_commands_without_the_ca_are_told_to_give_it(
    tls: TlsDeployment, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # "UNAVAILABLE: ... Socket closed" said nothing of TLS (walkthrough review, s39).
    from cluster.cli import main

    monkeypatch.delenv("EPD_TLS_CA_FILE", raising=False)
    argv = ["status", "--address", tls.router.address, "--api-key", ADMIN_KEY]
    with pytest.raises(SystemExit) as exc:
        await asyncio.to_thread(main, argv)
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err and "give --tls-ca-file" in err, err


async def test_the_tls_hint_is_hedged_and_needs_no_tls_flag() -> None:
    # `serve` and `config` have no --tls-ca-file: reading it raised inside the error
    # handler; a plaintext server that closes is no TLS router (ownfixG review).
    import argparse

    from cluster.hints import failure_hint

    closed = "ipv4:1.2.3.4:1: Socket closed"
    for ca in (None, ""):  # an empty $EPD_TLS_CA_FILE dials plaintext too
        hint = failure_hint(argparse.Namespace(tls_ca_file=ca), grpc.StatusCode.UNAVAILABLE, closed)
        assert hint.startswith(" (if the router serves TLS")
    for args in (argparse.Namespace(command="serve"), argparse.Namespace(tls_ca_file="ca.pem")):
        assert failure_hint(args, grpc.StatusCode.UNAVAILABLE, closed) == ""
