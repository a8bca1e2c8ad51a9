"""The identity of the TLS client certificate a request came with.

Only the gateway's own listener can know it, and only with `tls.client_ca_file`: the
handshake then fails for a certificate that does not chain to that CA, so a certificate
seen on a connection is a verified one. Without `client_ca_file` the listener asks for no
certificate and every request has none. Behind a proxy that terminates TLS there is none
either: the gateway never believes a certificate described in a header.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Protocol

from cryptography import x509


@dataclass(frozen=True, slots=True)
class ClientCertificate:
    subject: str  # the subject DN, RFC 4514 (`CN=batch,O=Example`)
    sans: tuple[str, ...]  # subject alternative names: `DNS:…`, `URI:…`, `email:…`, `IP:…`


class Connected(Protocol):
    @property
    def transport(self) -> asyncio.Transport | None: ...


def of(request: Connected) -> ClientCertificate | None:
    """The verified client certificate of the request's connection, if it has one."""
    transport = request.transport
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    if ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    return _identity(der) if der else None


# Keyed by the certificate's bytes: requests on one connection, and connections of one
# client, share the parsing. Bounded; a client can only fill it with certificates the CA signed.
@functools.lru_cache(maxsize=1024)
def _identity(der: bytes) -> ClientCertificate:
    certificate = x509.load_der_x509_certificate(der)
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ClientCertificate(certificate.subject.rfc4514_string(), ())
    sans = [
        *(f"DNS:{name}" for name in names.get_values_for_type(x509.DNSName)),
        *(f"URI:{uri}" for uri in names.get_values_for_type(x509.UniformResourceIdentifier)),
        *(f"email:{email}" for email in names.get_values_for_type(x509.RFC822Name)),
        *(f"IP:{address}" for address in names.get_values_for_type(x509.IPAddress)),
    ]
    return ClientCertificate(certificate.subject.rfc4514_string(), tuple(sans))
