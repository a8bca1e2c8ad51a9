"""Authorization server metadata (RFC 8414) and OpenID Provider metadata (Discovery 1.0 §3).

One document, served at both well-known paths, built when a configuration is loaded (at
start and on each reload), cacheable with an
ETag. It lists only what the server really does.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import math
from collections.abc import Iterable
from typing import Any

import orjson
from aiohttp import web

from portcullis.dpop import ASYMMETRIC_ALGORITHMS
from portcullis.http import error_response

from ..clients import ASSERTION_ALGORITHMS
from ..keys import SigningRing
from ..protocol import assurance
from ..protocol.claims import supported_claims
from ..protocol.scopes import STANDARD_SCOPES

log = logging.getLogger("portcullis.authserver")

DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
AUTH_METHODS = ["client_secret_basic", "client_secret_post", "private_key_jwt", "none"]
# One list with client authentication, so what is advertised is what is accepted.
ASSERTION_ALGS = list(ASSERTION_ALGORITHMS)


def metadata(
    issuer: str,
    scopes: Iterable[str],
    id_token_algs: list[str],
    grant_types: list[str],
    *,
    registration_endpoint: str | None = None,
    metadata_documents: bool = False,
) -> dict[str, Any]:
    """The document of a server that issues as `issuer`, knows `scopes` beyond the built-in
    ones, signs ID tokens with `id_token_algs`, has `grant_types`, registers clients at
    `registration_endpoint` (RFC 7591 §3) when it is given, and takes clients identified by
    the URL of their metadata document when `metadata_documents`."""
    # The admin API's scopes are left out (RFC 8414 §2: a server may omit some): only the
    # clients registered with them use them.
    supported = list(dict.fromkeys([*STANDARD_SCOPES, "roles", *scopes]))
    document: dict[str, Any] = {
        "issuer": issuer,
        "authorization_endpoint": f"{issuer}/authorize",
        "token_endpoint": f"{issuer}/token",
        "userinfo_endpoint": f"{issuer}/userinfo",
        "jwks_uri": f"{issuer}/jwks",
        "revocation_endpoint": f"{issuer}/revoke",
        "introspection_endpoint": f"{issuer}/introspect",
        # Not registered: the stream of signed revocation events (authserver/events.py).
        "revocation_events_endpoint": f"{issuer}/revocation_events",
        "end_session_endpoint": f"{issuer}/logout",
        "scopes_supported": supported,
        "response_types_supported": ["code"],
        "response_modes_supported": ["query"],
        "grant_types_supported": grant_types,
        "code_challenge_methods_supported": ["S256"],
        "token_endpoint_auth_methods_supported": AUTH_METHODS,
        "token_endpoint_auth_signing_alg_values_supported": ASSERTION_ALGS,
        "revocation_endpoint_auth_methods_supported": AUTH_METHODS,
        "revocation_endpoint_auth_signing_alg_values_supported": ASSERTION_ALGS,
        "introspection_endpoint_auth_methods_supported": AUTH_METHODS[:3],
        "introspection_endpoint_auth_signing_alg_values_supported": ASSERTION_ALGS,
        "id_token_signing_alg_values_supported": id_token_algs,
        "subject_types_supported": ["public"],
        "claims_supported": supported_claims(),
        # OIDC Discovery §3; protocol/assurance.py says what each level means.
        "acr_values_supported": list(assurance.SUPPORTED),
        "claims_parameter_supported": False,
        "request_parameter_supported": False,
        "request_uri_parameter_supported": False,
        "require_request_uri_registration": False,
        "prompt_values_supported": ["none", "login", "consent", "select_account"],
        "authorization_response_iss_parameter_supported": True,
        "dpop_signing_alg_values_supported": list(ASYMMETRIC_ALGORITHMS),  # RFC 9449 §5.1
        "backchannel_logout_supported": False,
        "frontchannel_logout_supported": False,
    }
    if metadata_documents:
        # draft-ietf-oauth-client-id-metadata-document §"Authorization Server Metadata".
        document["client_id_metadata_document_supported"] = True
    if registration_endpoint is not None:
        document["registration_endpoint"] = registration_endpoint  # RFC 8414 §2
    if DEVICE_GRANT in grant_types:
        document["device_authorization_endpoint"] = f"{issuer}/device_authorization"  # RFC 8628 §4
    return document


class Document:
    """A JSON document served with a strong ETag and a cache lifetime."""

    def __init__(self, data: Any, max_age: int) -> None:
        self.body = orjson.dumps(data)
        self.etag = (
            '"' + base64.urlsafe_b64encode(hashlib.sha256(self.body).digest()[:12]).decode() + '"'
        )
        self.cache_control = f"public, max-age={max_age}"

    async def respond(self, request: web.Request) -> web.Response:
        headers = {"ETag": self.etag, "Cache-Control": self.cache_control}
        if not_modified(request, self.etag):
            return web.Response(status=304, headers=headers)
        return web.Response(body=self.body, content_type="application/json", headers=headers)


def not_modified(request: web.Request, etag: str) -> bool:
    """If-None-Match uses the weak comparison (RFC 9110 §13.1.2): `*`, or a listed tag equal
    to ours once any `W/` prefix is dropped."""
    header = request.headers.get("If-None-Match")
    if header is None:
        return False
    for candidate in header.split(","):
        tag = candidate.strip()
        if tag == "*" or tag.removeprefix("W/") == etag:
            return True
    return False


class Jwks:
    """GET /jwks: the key ring's public keys, with the Cache-Control `keys.publish_ahead` is
    measured against (keys.jwks_max_age), or less when the ring may soon lack a key."""

    def __init__(self, keyring: SigningRing, max_age: int) -> None:
        self.keyring = keyring
        self.max_age = max_age
        self.cache_control = f"public, max-age={max_age}"

    async def respond(self, request: web.Request) -> web.Response:
        ring = self.keyring
        cache_control = self.cache_control
        cacheable = ring.jwks_cacheable_for(ring.clock())
        if cacheable is not None and cacheable < self.max_age:
            if cacheable < 1:
                # A verifier must not keep a set that may lack a key about to sign: it keeps
                # the copy it has (or asks another replica) until this one has read the ring.
                log.warning("JWKS withheld: the key ring is not current")
                return error_response(
                    503,
                    "temporarily_unavailable",
                    "the key set is being refreshed; try again",
                    headers={"Retry-After": "1", "Cache-Control": "no-store"},
                )
            cache_control = f"public, max-age={math.floor(cacheable)}"
        headers = {"ETag": ring.jwks_etag, "Cache-Control": cache_control}
        if not_modified(request, ring.jwks_etag):
            return web.Response(status=304, headers=headers)
        return web.Response(body=ring.jwks_body, content_type="application/json", headers=headers)
