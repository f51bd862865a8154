"""rediss:// against a real TLS-only redis-server: the kit over TLS, an untrusted CA, mutual TLS.

The harness makes a throwaway CA and a server certificate for 127.0.0.1 (with ``cryptography``), starts
redis-server with ``--port 0 --tls-port P`` and stops it by PID.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tiercache.adapters.redis import RedisAdapter
from tiercache.errors import AdapterUnavailable
from tiercache.testing.adapters import AdapterConformance, AdapterFactory
from tiercache.testing.harness.backends import redis_argv
from tiercache.testing.harness.processes import ServerProcess, free_port, port_open, start_process

pytestmark = pytest.mark.asyncio


@dataclass
class Pki:
    ca: Path
    cert: Path
    key: Path
    other_ca: Path


def _key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: Any, path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


def _cert(subject_cn: str, key: Any, issuer_cn: str, issuer_key: Any, *, ca: bool, ip: str | None) -> Any:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_cn)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ip is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), critical=False
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write_cert(cert: Any, path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA, a server/client certificate signed by it (SAN 127.0.0.1), and an unrelated CA."""
    directory = tmp_path_factory.mktemp("pki")
    ca_key, other_key, leaf_key = _key(), _key(), _key()
    _write_cert(
        _cert("tiercache test CA", ca_key, "tiercache test CA", ca_key, ca=True, ip=None),
        directory / "ca.pem",
    )
    _write_cert(
        _cert("other CA", other_key, "other CA", other_key, ca=True, ip=None), directory / "other.pem"
    )
    _write_cert(
        _cert("127.0.0.1", leaf_key, "tiercache test CA", ca_key, ca=False, ip="127.0.0.1"),
        directory / "leaf.pem",
    )
    _write_key(leaf_key, directory / "leaf.key")
    return Pki(directory / "ca.pem", directory / "leaf.pem", directory / "leaf.key", directory / "other.pem")


def _start_tls(redis_binary: str, directory: Path, pki: Pki, auth_clients: str) -> tuple[ServerProcess, str]:
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    tls = ["--tls-port", str(port), "--tls-cert-file", str(pki.cert), "--tls-key-file", str(pki.key),
           "--tls-ca-cert-file", str(pki.ca), "--tls-auth-clients", auth_clients]  # fmt: skip
    argv = redis_argv(redis_binary, 0, directory, tls)  # TLS only: no plain port
    proc = start_process(argv, ready=lambda: port_open("127.0.0.1", port), timeout=15)
    return proc, f"rediss://127.0.0.1:{port}/0"


@pytest.fixture(scope="module")
def tls_server(redis_binary: str, tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[str]:
    proc, url = _start_tls(redis_binary, tmp_path_factory.mktemp("redis-tls"), pki, "no")
    yield url
    proc.stop()


@pytest.fixture(scope="module")
def mtls_server(redis_binary: str, tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[str]:
    proc, url = _start_tls(redis_binary, tmp_path_factory.mktemp("redis-mtls"), pki, "yes")
    yield url
    proc.stop()


class TestRedisTlsConformance(AdapterConformance):
    """The whole kit over TLS, the server verified against the test CA."""

    @pytest.fixture
    def adapter_factory(self, tls_server: str, pki: Pki) -> AdapterFactory:
        import uuid

        prefix = f"t{uuid.uuid4().hex[:12]}:"
        return lambda: RedisAdapter.open(
            tls_server, prefix=prefix, ssl_ca_certs=str(pki.ca), socket_timeout=10
        )


async def test_an_untrusted_server_certificate_is_refused_at_open(tls_server: str, pki: Pki) -> None:
    with pytest.raises(AdapterUnavailable):
        await RedisAdapter.open(tls_server, ssl_ca_certs=str(pki.other_ca), socket_timeout=3)


async def test_plain_redis_url_cannot_talk_to_a_tls_port(tls_server: str) -> None:
    with pytest.raises(AdapterUnavailable):
        await RedisAdapter.open(tls_server.replace("rediss://", "redis://"), socket_timeout=2)


async def test_mutual_tls_needs_the_client_certificate(mtls_server: str, pki: Pki) -> None:
    with pytest.raises(AdapterUnavailable):
        await RedisAdapter.open(mtls_server, ssl_ca_certs=str(pki.ca), socket_timeout=3)
    adapter = await RedisAdapter.open(
        mtls_server, ssl_ca_certs=str(pki.ca), ssl_certfile=str(pki.cert), ssl_keyfile=str(pki.key)
    )
    try:
        assert await adapter.batched_put(["tls-k"], [b"over mutual TLS"]) == [True]
        assert await adapter.batched_get(["tls-k"]) == [b"over mutual TLS"]
    finally:
        await adapter.aclose()
