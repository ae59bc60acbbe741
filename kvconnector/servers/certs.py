"""A throwaway CA and a CA-signed server cert for 127.0.0.1, for a local TLS Redis Cluster.

With the `openssl` CLI when it is on PATH, else with the `cryptography` package.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"


def _openssl() -> str | None:
    return shutil.which("openssl")


def make_certs(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a CA-signed cert for 127.0.0.1; returns (ca, cert, key) paths."""
    ca, cert, key = directory / "ca.crt", directory / "server.crt", directory / "server.key"
    openssl = _openssl()
    if openssl is not None:
        ca_key, csr, ext = directory / "ca.key", directory / "server.csr", directory / "server.ext"
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        ext.write_text("basicConstraints=critical,CA:FALSE\n"
                       "keyUsage=critical,digitalSignature,keyEncipherment\n"
                       # serverAuth for clients; clientAuth because nodes dial each other's bus
                       "extendedKeyUsage=serverAuth,clientAuth\n"
                       "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                       "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
        for args in (
            ["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2",
             "-subj", "/CN=kvconnector test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
            ["req", "-new", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
            ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
             "-out", cert, "-days", "2", "-extfile", ext],
        ):
            subprocess.run([openssl, *map(str, args)], check=True, capture_output=True)
        return ca, cert, key
    try:
        from cryptography import x509  # noqa: F401
    except ImportError:
        raise RuntimeError("tls=True needs the `openssl` CLI on PATH or the `cryptography` "
                           "package to make a throwaway CA") from None
    return _make_certs_cryptography(ca, cert, key)


def _make_certs_cryptography(ca: Path, cert: Path, key: Path) -> tuple[Path, Path, Path]:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvconnector test CA")])

    def builder(subject: x509.Name, public_key: Any) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name)
                .public_key(public_key).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=2))
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), False))

    ca_cert = (builder(ca_name, ca_key.public_key())
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
               .add_extension(x509.KeyUsage(False, False, False, False, False, True, True,
                                            False, False), True)
               .sign(ca_key, hashes.SHA256()))
    server_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOST)])
    server_cert = (
        builder(server_name, server_key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]), False)
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(HOST)),
                                                    x509.DNSName("localhost")]), False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
            ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    ca.write_bytes(ca_cert.public_bytes(pem))
    cert.write_bytes(server_cert.public_bytes(pem))
    key.write_bytes(server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()))
    return ca, cert, key
