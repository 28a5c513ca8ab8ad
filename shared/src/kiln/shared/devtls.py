"""A private CA and a NATS server certificate for a deployment without a PKI of its own
(``kiln bus credentials --tls``: compose's TLS).

Invariants:

- the CA signs only what this module writes; its key stays in the secrets folder (mode
  600) and is needed only to issue again;
- the server certificate names every host clients and peers use (``nats``, ``nats-1`` ...,
  ``localhost``, ``127.0.0.1``) and serves both ways (server and client auth), so cluster
  routes authenticate each other with it (``verify: true``);
- files already present are kept: re-running never invalidates a running deployment.

Needs the ``cryptography`` package (``pip install cryptography``).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

DEFAULT_HOSTS = ("nats", "nats-1", "nats-2", "nats-3", "localhost", "127.0.0.1")


def write_tls(out: Path, hosts: tuple[str, ...] = DEFAULT_HOSTS, days: int = 825) -> list[Path]:
    """``nats-ca.crt``, ``nats-ca.key``, ``nats-server.crt``, ``nats-server.key`` in ``out``."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as e:
        raise RuntimeError("TLS material needs the cryptography package: pip install cryptography") from e

    out.mkdir(parents=True, exist_ok=True)
    ca_crt, ca_key_f, crt, key_f = (
        out / n for n in ("nats-ca.crt", "nats-ca.key", "nats-server.crt", "nats-server.key")
    )
    if all(p.is_file() for p in (ca_crt, ca_key_f, crt, key_f)):
        return [ca_crt, ca_key_f, crt, key_f]
    now = dt.datetime.now(dt.UTC)

    def pem_key(k) -> bytes:
        return k.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    if ca_crt.is_file() and ca_key_f.is_file():
        ca = x509.load_pem_x509_certificate(ca_crt.read_bytes())
        ca_key = serialization.load_pem_private_key(ca_key_f.read_bytes(), None)
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kiln NATS CA")])
        ca = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
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
        _write(ca_key_f, pem_key(ca_key), private=True)
        _write(ca_crt, ca.public_bytes(serialization.Encoding.PEM))
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write(key_f, pem_key(key), private=True)
    _write(crt, cert.public_bytes(serialization.Encoding.PEM))
    return [ca_crt, ca_key_f, crt, key_f]


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.touch(mode=0o600 if private else 0o644)
    path.chmod(0o600 if private else 0o644)
    path.write_bytes(data)
