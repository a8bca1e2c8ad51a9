"""Dynamic client registration (RFC 7591) and its management protocol (RFC 7592): what a
registration may ask for, and the client it makes.

A registration is read with the rules every client is held to (declarations.DeclaredClient:
exact redirect URIs, PKCE for public clients, keys for private_key_jwt), and these besides:
 1. only the RFC 7591 metadata this server implements is read: `redirect_uris`,
    `client_name`, `token_endpoint_auth_method`, `grant_types`, `response_types`, `scope`,
    `application_type`, `jwks`, `post_logout_redirect_uris`, `dpop_bound_access_tokens`,
    `id_token_signed_response_alg`, `default_acr_values` and `require_mfa` (both can only
    ask more of the user's sign-in); the rest is ignored (RFC 7591 §2), so nothing a client
    sends can make it first-party (`skip_consent`), a resource server (`introspection`) or
    give it an audience (`resources`). `jwks_uri` is refused: the keys must be given;
 2. `token_endpoint_auth_method` defaults to client_secret_basic (RFC 7591 §2): anything but
    `none` makes a confidential client, which only a request carrying the initial access
    token registers (RFC 7591 §3); a secret is then generated, never chosen;
 3. `grant_types` among authorization_code, refresh_token and the device grant;
    `client_credentials` is for confidential clients only; `response_types`, when given, is
    `["code"]` (RFC 7591 §2.1: it agrees with authorization_code);
 4. redirect URIs by `application_type` (OIDC Dynamic Client Registration §2): `web`, https
    only; `native`, the loopback IP literals `http://127.0.0.1` and `http://[::1]` (matched
    on any port for a public client, RFC 8252 §7.3; never `localhost`, §8.3) or a
    private-use scheme (reverse domain name, §7.1). Never a wildcard, user information or a
    fragment;
 5. `scope` within what clients that register themselves are offered (`offered`: the
    scopes of the registered resources and OpenID Connect's); a scope beyond it is dropped
    (RFC 7591 §3.2.1: the server may replace what was asked), and the answer says what was
    registered. None offered of those asked is `invalid_client_metadata`.
A failure is RFC 7591 §3.2.2's `invalid_redirect_uri` or `invalid_client_metadata`.

The client is stored managed by its registration (`MANAGED_BY_DYNAMIC`), with the SHA-256
of its registration access token (RFC 7592 §1: a bearer token for reading and deleting the
registration) and a time by which it must obtain a token, else it is removed.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from .admin import validation
from .admin.http import ApiError
from .declarations import DeclaredClient
from .registry import client_record, secret_digest
from .store.base import MANAGED_BY_DYNAMIC, ClientRecord

# RFC 7591 §2 and the OpenID Connect names this server implements (rule 1).
READ_METADATA = (
    "redirect_uris",
    "client_name",
    "token_endpoint_auth_method",
    "grant_types",
    "scope",
    "application_type",
    "jwks",
    "post_logout_redirect_uris",
    "dpop_bound_access_tokens",
    "id_token_signed_response_alg",
    "default_acr_values",
    "require_mfa",
)
GRANT_TYPES = frozenset(
    {
        "authorization_code",
        "refresh_token",
        "urn:ietf:params:oauth:grant-type:device_code",
        "client_credentials",
    }
)
DEFAULT_METHOD = "client_secret_basic"  # RFC 7591 §2
# RFC 8252 §7.1: a private-use scheme is a reverse domain name, so it holds a dot.
_PRIVATE_USE_SCHEME = re.compile(r"^[a-z][a-z0-9+-]*(\.[a-z0-9+-]+)+$")


class RegistrationError(Exception):
    """RFC 7591 §3.2.2: an error code and a description safe to show."""

    def __init__(self, code: str, description: str) -> None:
        super().__init__(description)
        self.code = code
        self.description = description


def invalid_metadata(description: str) -> RegistrationError:
    return RegistrationError("invalid_client_metadata", description)


def invalid_redirect(description: str) -> RegistrationError:
    return RegistrationError("invalid_redirect_uri", description)


@dataclass(frozen=True)
class RegistrationPolicy:
    """What the server offers clients that register themselves."""

    offered_scopes: frozenset[str]
    unused_lifetime: timedelta
    # The SHA-256 of the initial access token (RFC 7591 §3); None: none is accepted.
    initial_access_token_sha256: bytes | None = None

    def initial_access_token_valid(self, token: str) -> bool:
        expected = self.initial_access_token_sha256
        given = hashlib.sha256(token.encode()).digest()
        return expected is not None and hmac.compare_digest(given, expected)


@dataclass(frozen=True)
class Registered:
    """A registration made: the stored record, and what is shown only now."""

    record: ClientRecord
    registration_access_token: str
    client_secret: str | None


def register(
    body: Any, policy: RegistrationPolicy, *, confidential_allowed: bool, now: float
) -> Registered:
    """The client a registration request's JSON body makes (the rules above), or
    RegistrationError."""
    if not isinstance(body, Mapping):
        raise invalid_metadata("the registration must be a JSON object")
    data = {name: body[name] for name in READ_METADATA if body.get(name) is not None}
    if body.get("jwks_uri") is not None:
        raise invalid_metadata("jwks_uri is not supported: give the public keys as jwks")
    data.setdefault("token_endpoint_auth_method", DEFAULT_METHOD)
    confidential = data["token_endpoint_auth_method"] != "none"  # noqa: S105 - a method name
    if confidential and not confidential_allowed:
        raise invalid_metadata(
            "registering a confidential client needs the initial access token; a public "
            "client registers with token_endpoint_auth_method none"
        )
    _check_response_types(body.get("response_types"))
    grant_types = data.get("grant_types", ["authorization_code"])
    if not isinstance(grant_types, list) or not set(grant_types) <= GRANT_TYPES:
        raise invalid_metadata(
            "grant_types may hold authorization_code, refresh_token and "
            "urn:ietf:params:oauth:grant-type:device_code (client_credentials when confidential)"
        )
    application_type = data.get("application_type", "web")
    if application_type not in ("web", "native"):
        raise invalid_metadata("application_type is web or native")
    for uri in _strings(data.get("redirect_uris"), "redirect_uris"):
        check_redirect_uri(uri, application_type)
    data["scope"] = offered_scope(data.get("scope"), policy.offered_scopes)
    client_id = secrets.token_urlsafe(16)
    secret = secrets.token_urlsafe(32) if data["token_endpoint_auth_method"] in _SECRET else None
    if secret is not None:
        data["client_secret"] = secret
    declared = declared_client(client_id, data)
    token = secrets.token_urlsafe(32)
    record = replace(
        client_record(declared, MANAGED_BY_DYNAMIC, now),
        secret_sha256=None if secret is None else secret_digest(secret),
        registration_token_sha256=registration_token_digest(token),
        unused_until=now + policy.unused_lifetime.total_seconds(),
    )
    return Registered(record, token, secret)


_SECRET = ("client_secret_basic", "client_secret_post")


def registration_token_digest(token: str) -> bytes:
    """What is kept of a registration access token: it is random and long, a fast hash is
    enough (as for client secrets)."""
    return hashlib.sha256(token.encode()).digest()


def token_matches(record: ClientRecord, token: str) -> bool:
    expected = record.registration_token_sha256
    return expected is not None and hmac.compare_digest(registration_token_digest(token), expected)


def check_redirect_uri(uri: str, application_type: Any) -> None:
    """Rule 4 of the module docstring; RegistrationError otherwise."""
    if "*" in uri:
        raise invalid_redirect(f"{uri!r}: wildcards are not allowed, register each URI")
    parts = urlsplit(uri)
    if parts.fragment or "#" in uri:
        raise invalid_redirect(f"{uri!r}: a redirect URI has no fragment (RFC 6749 §3.1.2)")
    if parts.scheme in ("http", "https") and (parts.username is not None or "@" in parts.netloc):
        raise invalid_redirect(f"{uri!r}: a redirect URI has no user information")
    if application_type == "native":
        if parts.scheme == "http" and _loopback_literal(parts.hostname):
            return
        if _PRIVATE_USE_SCHEME.match(parts.scheme) and parts.scheme not in ("http", "https"):
            return
        raise invalid_redirect(
            f"{uri!r}: a native client redirects to http://127.0.0.1 or http://[::1] (any "
            "port; not localhost, RFC 8252 §8.3) or to a private-use scheme such as "
            "com.example.app:/callback (RFC 8252 §7.1)"
        )
    if parts.scheme != "https" or not parts.hostname:
        raise invalid_redirect(
            f"{uri!r}: a web client redirects to https only; an app on the user's device "
            "registers application_type native"
        )


def offered_scope(requested: Any, offered: frozenset[str]) -> str:
    """Rule 5: the scope registered for a request's `scope`."""
    if requested is None:
        return " ".join(sorted(offered))
    if not isinstance(requested, str):
        raise invalid_metadata("scope must be a string of space-separated scopes")
    asked = requested.split()
    kept = [s for s in dict.fromkeys(asked) if s in offered]
    if asked and not kept:
        raise invalid_metadata("none of the requested scopes is offered to registered clients")
    return " ".join(kept)


def represent(record: ClientRecord, registration_client_uri: str) -> dict[str, Any]:
    """RFC 7591 §3.2.1 / RFC 7592 §3: the client information response, without the secret
    (shown once, when made) or the registration access token."""
    metadata = record.metadata
    shown = {name: metadata[name] for name in READ_METADATA if metadata.get(name) is not None}
    if "authorization_code" in shown.get("grant_types", ()):
        shown["response_types"] = ["code"]
    return {
        "client_id": record.client_id,
        "client_id_issued_at": int(record.created_at),
        **shown,
        "registration_client_uri": registration_client_uri,
    }


def _check_response_types(value: Any) -> None:
    if value is not None and value != ["code"]:
        raise invalid_metadata('response_types must be ["code"]: the only one served')


def _strings(value: Any, name: str) -> Iterable[str]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise invalid_metadata(f"{name} must be a list of strings")
    return value


def _loopback_literal(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def declared_client(client_id: str, data: dict[str, Any]) -> DeclaredClient:
    """The client as every client's rules read it (declarations.py), or RegistrationError
    naming the first problem, at the RFC 7591 name it was found under."""
    try:
        return validation.build(DeclaredClient, {"client_id": client_id, **data}, lambda k: k)
    except ApiError as exc:
        field, issue = exc.details[0] if exc.details else ("", exc.message)
        problem = f"{field}: {issue}" if field else issue
        if "redirect_uris" in problem:
            raise invalid_redirect(problem) from None
        raise invalid_metadata(problem) from None
