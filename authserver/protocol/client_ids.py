"""Client identifiers that are URLs (draft-ietf-oauth-client-id-metadata-document §3): such
a `client_id` names the client's metadata document, which the server fetches.

A document URL has the `https` scheme, a host, a path component (more than `/`), no
single-dot or double-dot path segment (written plainly or percent-encoded, which RFC 3986
§6.2.2.2 reads alike), no fragment and no user name or password; it may have a port. A
query is allowed (the draft says a client SHOULD NOT use one). Characters no URI holds
(controls, spaces) are refused: such a URL could not be shown or compared as written.

Pure: standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

PREFIX = "https://"
MAX_LENGTH = 2048
_NOT_IN_URI = re.compile(r"[\x00-\x20\x7f-\x9f\\]")
_DOT_SEGMENT = re.compile(r"^(\.|%2e){1,2}$", re.IGNORECASE)


def names_document(client_id: str) -> bool:
    """Whether `client_id` is meant as a metadata document's URL: it says https://. Whether
    it is a valid one is `document_url`'s to tell."""
    return client_id.startswith(PREFIX)


@dataclass(frozen=True)
class DocumentUrl:
    url: str
    host: str  # as in the URL, lower case; an IPv6 literal without its brackets
    port: int

    @property
    def origin(self) -> str:
        """scheme://host[:port], the port left out when it is 443 (RFC 6454 §6.2)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return PREFIX + host + ("" if self.port == 443 else f":{self.port}")

    @property
    def shown_host(self) -> str:
        """The host as a person reads it on the consent page, with a port other than 443."""
        return self.origin.removeprefix(PREFIX)


def document_url(client_id: str) -> DocumentUrl:
    """The document URL `client_id` is, or ValueError saying which rule it breaks."""
    if len(client_id) > MAX_LENGTH:
        raise ValueError(f"a client_id URL is at most {MAX_LENGTH} characters")
    if _NOT_IN_URI.search(client_id):
        raise ValueError("the client_id URL holds characters no URL holds")
    if not names_document(client_id):
        raise ValueError("a client_id URL has the https scheme")
    parts = urlsplit(client_id)
    if "#" in client_id:
        raise ValueError("a client_id URL has no fragment")
    if "@" in parts.netloc:
        raise ValueError("a client_id URL has no user name or password")
    host = parts.hostname
    if not host:
        raise ValueError("a client_id URL names a host")
    try:
        port = parts.port or 443
    except ValueError:
        raise ValueError("the client_id URL's port is not a number from 1 to 65535") from None
    if parts.path in ("", "/"):
        raise ValueError("a client_id URL has a path (https://host/client.json)")
    if any(_DOT_SEGMENT.match(segment) for segment in parts.path.split("/")):
        raise ValueError("a client_id URL has no . or .. path segment")
    return DocumentUrl(client_id, host.lower(), port)


def host_matches(pattern: str, host: str) -> bool:
    """A host policy's pattern: `*` any host, `*.example.com` the subdomains of example.com
    (not example.com itself), else the host exactly (case-insensitive)."""
    pattern, host = pattern.lower(), host.lower()
    if pattern == "*":
        return True
    if pattern.startswith("*."):
        return host.endswith(pattern[1:])
    return host == pattern
