"""Certificates made in the test: a private CA, server and client certificates it signs,
and the TLS client contexts tests connect with.

EC P-256 keys (fast to make); certificates valid from a minute ago for a day. Nothing here is
a fixture of a real PKI: every test makes its own, so trust between tests is impossible.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCAL_HOSTS = ("127.0.0.1", "localhost")


def _name(common_name: str, organisation: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organisation is not None:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organisation))
    return x509.Name(attributes)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return builder.not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(
        now + datetime.timedelta(days=1)
    )


@dataclass
class Issued:
    """A certificate and its private key."""

    certificate: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def cert_pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return _pem_key(self.key)

    @property
    def common_name(self) -> str:
        return str(self.certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)

    def write(self, directory: Path, name: str) -> tuple[Path, Path]:
        """Write `name.crt` and `name.key` (replaced whole, as a secret volume does)."""
        cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
        replace_file(cert_path, self.cert_pem)
        replace_file(key_path, self.key_pem)
        return cert_path, key_path


def replace_file(path: Path, data: bytes) -> None:
    """Write `data` to a new file and rename it over `path`, as rotation tools do."""
    fresh = path.with_name(path.name + ".new")
    fresh.write_bytes(data)
    os.replace(fresh, path)


class CertificateAuthority:
    """A private CA that signs server and client certificates."""

    def __init__(self, name: str = "Portcullis Test CA") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = _name(name)
        self.certificate = (
            _validity(x509.CertificateBuilder())
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )

    @property
    def cert_pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def write(self, directory: Path, name: str = "ca") -> Path:
        path = directory / f"{name}.crt"
        replace_file(path, self.cert_pem)
        return path

    def _issue(
        self,
        subject: x509.Name,
        names: Sequence[x509.GeneralName],
        usage: x509.ObjectIdentifier,
    ) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            _validity(x509.CertificateBuilder())
            .subject_name(subject)
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return Issued(builder.sign(self.key, hashes.SHA256()), key)

    def server(self, common_name: str = "server", hosts: Sequence[str] = LOCAL_HOSTS) -> Issued:
        """A server certificate for `hosts` (IP addresses and DNS names)."""
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        return self._issue(_name(common_name), names, ExtendedKeyUsageOID.SERVER_AUTH)

    def client(
        self,
        common_name: str = "client",
        organisation: str | None = None,
        *,
        dns: Sequence[str] = (),
        uris: Sequence[str] = (),
    ) -> Issued:
        """A client certificate, with the subject alternative names given."""
        names: list[x509.GeneralName] = [x509.DNSName(name) for name in dns]
        names += [x509.UniformResourceIdentifier(uri) for uri in uris]
        return self._issue(_name(common_name, organisation), names, ExtendedKeyUsageOID.CLIENT_AUTH)


# ---------------------------------------------------------------------------- clients


def client_context(
    ca: CertificateAuthority | None = None, identity: Issued | None = None, tmp: Path | None = None
) -> ssl.SSLContext:
    """A client context trusting `ca`, presenting `identity` (written under `tmp`) if given."""
    context = ssl.create_default_context()
    if ca is not None:
        context.load_verify_locations(cadata=ca.cert_pem.decode())
    if identity is not None:
        assert tmp is not None, "a client certificate is loaded from files"
        cert_path, key_path = identity.write(tmp, f"client-{identity.common_name}")
        context.load_cert_chain(cert_path, key_path)
    return context


def legacy_client_context(ca: CertificateAuthority) -> ssl.SSLContext:
    """A client that offers nothing newer than TLS 1.1 (and the old ciphers it needs)."""
    context = client_context(ca)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the point is the old versions
        context.minimum_version = ssl.TLSVersion.TLSv1
        context.maximum_version = ssl.TLSVersion.TLSv1_1
    context.set_ciphers("DEFAULT:@SECLEVEL=0")
    return context


def server_context(identity: Issued, directory: Path, name: str = "server") -> ssl.SSLContext:
    """A plain server context for test peers (upstreams, issuers) presenting `identity`."""
    cert_path, key_path = identity.write(directory, name)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_path, key_path)
    return context
