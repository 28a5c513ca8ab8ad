"""TLS and file-held credentials against a real nats-server (what compose runs):

- a server with a ``tls {}`` block and a certificate from a throwaway CA: a kiln ``Bus``
  given that CA (``nats.tls_ca_file``) connects, reads its password from a file
  (``nats.password_file``) and works; without the CA it fails with a reason that names
  TLS, never falling back to plain text;
- a client configured for TLS refuses a server that does not speak it;
- ``kiln bus credentials --tls`` writes what compose mounts as secrets, and compose's
  ``deploy/nats/nats.conf`` with them serves kiln over TLS, each service by its own
  password file.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kiln.ops.embedded import NatsServer
from kiln.shared import contracts as c
from kiln.shared.bus import Bus
from kiln.shared.bus.auth import Credentials, server_config
from kiln.shared.config import NatsSettings


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_ca_and_server_cert(folder: Path) -> tuple[Path, Path, Path]:
    """(ca.crt, server.crt, server.key): a CA valid for a day and a server certificate it
    signed for 127.0.0.1 and localhost."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kiln test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nats")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.crt", folder / "server.crt", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(_pem_key(key))
    return paths


@pytest.fixture
def tls_server(tmp_path):
    ca, cert, key = make_ca_and_server_cert(tmp_path)
    creds = Credentials.generate(["rollout"])
    conf = tmp_path / "nats.conf"
    conf.write_text(server_config(creds) + "tls " + json.dumps({"cert_file": str(cert), "key_file": str(key)}) + "\n")
    (tmp_path / "rollout.password").write_text(creds.users["rollout"] + "\n")
    server = NatsServer(tmp_path / "store", config_file=conf).start()
    yield server, ca, tmp_path / "rollout.password"
    server.stop()


async def test_a_bus_connects_over_tls_with_the_ca_and_a_password_file(tls_server):
    server, ca, password_file = tls_server
    for url in (server.url, server.url.replace("nats://", "tls://")):
        bus = await Bus.connect(
            NatsSettings(url=url, user="rollout", password_file=str(password_file), tls_ca_file=str(ca)), "rollout"
        )
        try:
            assert bus.nc._transport._io_writer.get_extra_info("ssl_object") is not None, "not encrypted"
            await bus.ensure_topology()
            ack = await bus.publish(c.RUN_EVENTS, c.RunEvent(run_id="r", kind="started"))
            assert ack.seq >= 1
        finally:
            await bus.close()


async def test_without_the_ca_the_connection_fails_and_says_why(tls_server):
    server, ca, password_file = tls_server
    with pytest.raises(ConnectionError, match="TLS failed .*certificate verify failed.*tls_ca_file"):
        await Bus.connect(
            NatsSettings(
                url=server.url.replace("nats://", "tls://"),
                user="rollout",
                password_file=str(password_file),
                connect_timeout_s=1,
            ),
            "rollout",
        )


async def test_a_tls_client_refuses_a_server_without_tls(tmp_path, tls_server):
    _, ca, _ = tls_server
    plain = NatsServer(tmp_path / "plain").start()
    try:
        with pytest.raises(ConnectionError, match="does not speak TLS"):
            await Bus.connect(NatsSettings(url=plain.url, tls_ca_file=str(ca), connect_timeout_s=2), "t")
    finally:
        plain.stop()


async def test_an_unreadable_password_file_fails_at_once(tmp_path):
    with pytest.raises(ConnectionError, match="cannot read nats.password_file"):
        await Bus.connect(
            NatsSettings(url="nats://127.0.0.1:1", user="rollout", password_file=str(tmp_path / "missing")), "t"
        )


async def test_kiln_bus_credentials_serve_the_compose_nats_config_over_tls(tmp_path):
    """``kiln bus credentials --tls`` writes compose's secrets; deploy/nats/nats.conf with
    them, started for real (on loopback ports instead of the container's), serves a service
    that logs in with its password file and the generated CA, to ``localhost`` as the
    host's ``kiln`` commands do; another service's password is refused."""
    from kiln.ops.embedded import _wait_port, free_port, nats_server_binary
    from kiln.shared.bus.auth import write_secrets

    root = Path(__file__).resolve().parents[1]
    secrets = tmp_path / "run" / "secrets"
    r = subprocess.run(
        [sys.executable, "-m", "kiln.ops.cli", "bus", "credentials", "--out", str(secrets), "--tls"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    conf = (secrets / "nats-auth.conf").read_text()
    assert conf.startswith("authorization")
    assert secrets.stat().st_mode & 0o077 == 0, "the secrets folder is open to other host users"
    for name in ("env-pool", "rollout", "reward", "learner", "weights", "launcher"):
        assert (secrets / f"nats-{name}.password").read_text().strip() in conf
    # Writing again keeps the credentials (a running deployment keeps working).
    before = (secrets / "nats-rollout.password").read_text()
    write_secrets(secrets)
    assert (secrets / "nats-rollout.password").read_text() == before

    etc = tmp_path / "etc" / "nats"
    etc.mkdir(parents=True)
    (etc / "nats.conf").write_text(
        (root / "deploy" / "nats" / "nats.conf").read_text().replace('"/run/secrets/', f'"{secrets}/')
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            nats_server_binary(),
            "-c",
            str(etc / "nats.conf"),
            "-a",
            "127.0.0.1",
            "-p",
            str(port),
            "-m",
            str(free_port()),
            "-js",
            "-sd",
            str(tmp_path / "data"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_port(port, 10, proc, "nats-server")

        def settings(password_of: str) -> NatsSettings:
            return NatsSettings(
                url=f"tls://localhost:{port}",
                user="learner",
                password_file=str(secrets / f"nats-{password_of}.password"),
                tls_ca_file=str(secrets / "nats-ca.crt"),
                connect_timeout_s=2,
            )

        bus = await Bus.connect(settings("learner"), "learner")
        try:
            await bus.ensure_topology()
            await bus.publish(
                c.WEIGHTS_CHECKPOINT, c.PolicyCheckpoint(run_id="r", version=1, step=1, parent_version=0, path="/x")
            )
        finally:
            await bus.close()
        with pytest.raises(ConnectionError, match="refused the credential"):
            await Bus.connect(settings("rollout"), "learner")
    finally:
        proc.terminate()
        proc.wait(10)
