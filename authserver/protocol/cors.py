"""Which browser pages may read the authorization server's answers (the Fetch standard's CORS
protocol), decided on header values alone.

A browser lets a page read an answer from another origin only when the answer names the
page's origin in `Access-Control-Allow-Origin`, and asks first (a preflight: `OPTIONS` with
`Access-Control-Request-Method`) before a request it could not have sent from a form: one
with an `Authorization` header, say. What a request does at the server does not depend on
CORS; only whether the page may read the answer.

Three kinds of endpoint:
 - DOCUMENT (discovery, JWKS): public documents that take no credentials and are the same
   for everyone: `Access-Control-Allow-Origin: *` on every answer.
 - CLIENT (token, revocation, device authorization): the answer goes to the page only when
   the request is made by a browser client — a public client (`none`) of `application_type`
   web — and the page's origin is one of that client's (below).
 - BEARER (userinfo): any browser origin, since the access token is the credential.
A disallowed origin gets no CORS header at all, and its preflight 403. No answer ever carries
`Access-Control-Allow-Credentials`: browser clients authenticate with nothing a browser
would attach by itself (no cookie, no Basic), so their pages fetch without credentials.

A browser client's origins are those of its redirect URIs, plus the explicit list of the
configuration. Standard library only.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from urllib.parse import parse_qsl, urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}
# How long a browser may reuse a preflight's answer (browsers cap it: Chromium at 2 hours).
PREFLIGHT_MAX_AGE = timedelta(minutes=10)
# Parameters by which a client proves who it is; a browser client has none (RFC 6749 §2.3,
# RFC 7523 §2.2).
_CREDENTIAL_PARAMETERS = frozenset({"client_secret", "client_assertion", "client_assertion_type"})
_MAX_FORM_FIELDS = 200

_VARY = ("Vary", "Origin")
_PREFLIGHT_VARY = ("Vary", "Origin, Access-Control-Request-Method, Access-Control-Request-Headers")


class Kind(Enum):
    DOCUMENT = "document"
    CLIENT = "client"
    BEARER = "bearer"


@dataclass(frozen=True)
class Endpoint:
    kind: Kind
    methods: tuple[str, ...]
    # Request headers a preflight may ask for, beyond the CORS-safelisted ones.
    headers: tuple[str, ...] = ()
    # Answer headers a page may read beyond the CORS-safelisted ones.
    expose: tuple[str, ...] = ()


DOCUMENT = Endpoint(Kind.DOCUMENT, ("GET", "HEAD"), ("If-None-Match",))
# A browser client sends its DPoP proof (RFC 9449 §4.1) and reads the server's nonce (§8).
CLIENT = Endpoint(Kind.CLIENT, ("POST",), ("Content-Type", "DPoP"), ("DPoP-Nonce",))
# A page reads the RFC 6750 §3 (or RFC 9449 §7.1) challenge to learn why its token was
# refused.
BEARER = Endpoint(
    Kind.BEARER,
    ("GET", "POST"),
    ("Authorization", "Content-Type", "DPoP"),
    ("WWW-Authenticate", "DPoP-Nonce"),
)


class CorsRefused(Exception):
    """A preflight the policy does not allow; the message says which part, in the server's
    own words (never quoting the request)."""


def origin(url: str) -> str | None:
    """The origin of an http or https URL serialized as a browser sends it in `Origin`
    (RFC 6454 §6.2, the URL standard's host serializer): scheme and host in lower case, an
    IPv6 address compressed in brackets, a non-ASCII host in IDNA form, and the port only when
    it is not the scheme's default. None for any other URL (no tuple origin)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    host = parts.hostname  # lower case, brackets removed
    if scheme not in DEFAULT_PORTS or not host:
        return None
    if ":" in host:
        try:
            host = "[" + ipaddress.IPv6Address(host).compressed + "]"
        except ValueError:
            return None
    elif not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            return None
    if port is None or port == DEFAULT_PORTS[scheme]:
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port}"


def browser_client(body: bytes, authorization: Sequence[str]) -> str | None:
    """The client a token, revocation or device authorization request names when it is made
    the way a browser client makes it: its `client_id` once in the url-encoded form, and no
    credential at all, neither an Authorization header nor a secret or assertion in the form.
    That is the whole of a public client's authentication (RFC 6749 §2.3, §3.2.1), so the
    client named is the client authenticated. None for any other request."""
    if authorization:
        return None
    try:
        pairs = parse_qsl(
            body.decode("utf-8"),
            keep_blank_values=True,
            max_num_fields=_MAX_FORM_FIELDS,
            errors="strict",
        )
    except ValueError:  # UnicodeDecodeError included
        return None
    if any(name in _CREDENTIAL_PARAMETERS for name, _ in pairs):
        return None
    named = [value for name, value in pairs if name == "client_id"]
    return named[0] if len(named) == 1 and named[0] else None


class CorsPolicy:
    """Built once at load from each browser client's origins and the configured extra ones;
    answers header lists for preflights and actual requests."""

    def __init__(
        self,
        client_origins: Mapping[str, Iterable[str]],
        extra_origins: Iterable[str] = (),
        max_age: timedelta = PREFLIGHT_MAX_AGE,
    ) -> None:
        self._clients = {client: frozenset(found) for client, found in client_origins.items()}
        self._extra = frozenset(extra_origins)
        self._browser = self._extra.union(*self._clients.values())
        self._max_age = str(int(max_age.total_seconds()))

    @property
    def origins(self) -> frozenset[str]:
        """Every origin some browser page may call from."""
        return self._browser

    def allows(self, endpoint: Endpoint, origin: str) -> bool:
        """Whether a page on `origin` may call the endpoint at all (what a preflight asks)."""
        return endpoint.kind is Kind.DOCUMENT or origin in self._browser

    def allows_client(self, client_id: str | None, origin: str) -> bool:
        """Whether a page on `origin` may read answers given under the name of `client_id`.

        Only on the client's own origins (or the configured extra ones): a page may act
        only as the browser client registered for its origin, and the tokens issued under
        another client's name (with the scopes the user granted that client) are not
        readable by it. Were any browser origin enough, every registered site would be
        trusted with every browser client's identity, and a script injected into the
        weakest of them could run flows as any. Confidential and native clients never
        qualify: a page cannot keep a secret, and a native app is no page.
        """
        if client_id is None or client_id not in self._clients:
            return False
        return origin in self._clients[client_id] or origin in self._extra

    def actual(
        self, endpoint: Endpoint, origin: str | None, client_id: str | None = None
    ) -> tuple[tuple[str, str], ...]:
        """Headers for the answer to an actual (non-preflight) request; for a CLIENT
        endpoint, `client_id` is the browser client the request names (`browser_client`)."""
        if endpoint.kind is Kind.DOCUMENT:
            # The same answer for every origin: no Vary needed (Fetch §3.2.4).
            return _with_expose((("Access-Control-Allow-Origin", "*"),), endpoint)
        if origin is None or not self.allows(endpoint, origin):
            return (_VARY,)
        if endpoint.kind is Kind.CLIENT and not self.allows_client(client_id, origin):
            return (_VARY,)
        return _with_expose((("Access-Control-Allow-Origin", origin), _VARY), endpoint)

    def preflight(
        self, endpoint: Endpoint, origin: str, method: str, request_headers: str | None
    ) -> list[tuple[str, str]]:
        """Headers of a 204 answering an allowed preflight; CorsRefused otherwise. A preflight
        carries no body, so for a CLIENT endpoint the client is not known yet: any browser
        origin passes here, and the actual answer decides."""
        if not self.allows(endpoint, origin):
            raise CorsRefused("the origin is not allowed")
        if method not in endpoint.methods:
            raise CorsRefused("the method is not allowed")
        allowed = {name.lower() for name in endpoint.headers}
        for name in (request_headers or "").split(","):
            if name.strip() and name.strip().lower() not in allowed:
                raise CorsRefused("a requested header is not allowed")
        headers = [
            ("Access-Control-Allow-Origin", "*" if endpoint.kind is Kind.DOCUMENT else origin),
            ("Access-Control-Allow-Methods", ", ".join(endpoint.methods)),
            ("Access-Control-Max-Age", self._max_age),
            _PREFLIGHT_VARY,
        ]
        if endpoint.headers:
            headers.insert(2, ("Access-Control-Allow-Headers", ", ".join(endpoint.headers)))
        return headers


def _with_expose(
    headers: tuple[tuple[str, str], ...], endpoint: Endpoint
) -> tuple[tuple[str, str], ...]:
    if not endpoint.expose:
        return headers
    return (*headers, ("Access-Control-Expose-Headers", ", ".join(endpoint.expose)))
