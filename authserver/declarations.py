"""Clients and users as they are declared: by an entry of the configuration file's
`clients` and `users`, or by a body sent to the admin API (admin/validation.py). Both are
read by these declarations (portcullis.sections), so a client or user is held to the same
rules wherever it comes from: exact redirect URIs, https except on loopback, known grant
types, PKCE for public clients, secrets and keys as the authentication method needs them.

Clients use RFC 7591 metadata names; users carry the OpenID Connect claims (OIDC Core §5.1)
released about them. registry.py turns a declaration into the store's record and the domain
records the running server works with.
"""

# ruff: noqa: E501 - declarations: one line per key, so that the sections read as tables

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import re
from collections.abc import Mapping
from typing import Any, Literal, NewType

import jwt

from portcullis import yamlconf
from portcullis.addresses import is_loopback, split_url
from portcullis.sections import Check, accepts, section, section_line, setting
from portcullis.yamlconf import Withheld

from . import users as users_module
from .protocol import assurance

# Declarations are read as the configuration is loaded: their warnings are the loader's.
log = logging.getLogger("portcullis.authserver.settings")

_CLIENT_ID = re.compile(r"^[\x21-\x7E]{1,128}$")
ScopeList = NewType("ScopeList", tuple[str, ...])  # `scope: "openid email"`, split
JwkSet = NewType("JwkSet", dict[str, Any])


# ---------------------------------------------------------------------------- values


@accepts({"type": "string", "title": "URI", "pattern": ":"})
def redirect_uri(value: Any) -> str:
    text, parts = split_url(value)
    if not parts.scheme:
        raise ValueError(f"{text!r} is not an absolute URI")
    if parts.fragment or "#" in text:
        raise ValueError(f"{text!r} must not contain a fragment (RFC 6749 §3.1.2)")
    if parts.scheme == "http" and not is_loopback(parts.hostname):
        raise ValueError(f"{text!r}: plain http redirects are for loopback only (RFC 9700 §2.1)")
    return text


@accepts({"type": "string", "title": "scope"})
def scope_list(value: Any) -> ScopeList:
    return ScopeList(tuple(yamlconf.string(value).split()))


@accepts({"type": "object", "title": "JWK Set"})
def jwk_set(value: Any) -> JwkSet:
    """A client's public JWK Set (RFC 7517 §5)."""
    keys = value.get("keys") if isinstance(value, dict) else None
    if not isinstance(keys, list) or not keys:
        raise ValueError("must be a JWK Set: a mapping with a non-empty keys list")
    for index, key in enumerate(keys):
        if not isinstance(key, dict):
            raise ValueError(f"keys[{index}] must be a mapping")
        if any(member in key for member in ("d", "p", "q", "k")):
            raise ValueError(f"keys[{index}] holds private key material: give the public key only")
        try:
            jwt.PyJWK(dict(key))
        except (jwt.PyJWTError, ValueError, TypeError) as exc:
            raise ValueError(f"keys[{index}] is not a usable public key ({exc})") from None
    return JwkSet(value)


@accepts({"type": "string", "enum": list(assurance.SUPPORTED)})
def acr_value(value: Any) -> str:
    """An authentication context class this server asserts (protocol/assurance.py)."""
    text = yamlconf.non_empty_string(value)
    if not assurance.known(text):
        raise ValueError(
            f"{text!r} is not a level this server signs in at: {', '.join(assurance.SUPPORTED)}"
        )
    return text


# ---------------------------------------------------------------------------- declarations


# fmt: off
def _hash_plain_password(values: Mapping[str, Any]) -> str:
    password = values.get("password")
    if password is None or isinstance(password, Withheld):
        return password or ""  # neither given: reported by the user's validate()
    log.warning("plain-text password in the config: use hash-password outside development", extra={"username": values.get("username")})
    return users_module.hash_password(password)


@section
class DeclaredUser:
    """A user who can sign in, with the OpenID Connect claims (§5.1) released about them."""

    username: str = setting("What they sign in with.")
    password_hash: str = setting("scrypt hash from `portcullis-authserver hash-password`.", default="", secret=True, from_file=True, derive=_hash_plain_password)
    password: str | None = setting("Plain text, for development only: hashed at load, with a warning.", default=None, secret=True, from_file=True)
    subject: str | None = setting("The `sub`; a stable opaque value from the username when absent.", default=None, key="sub")
    roles: tuple[str, ...] = setting("Roles: the `roles` claim; `admin` opens the admin API to the user's tokens.", default=())
    line: int = section_line()
    name: str | None = setting("Claim.", default=None)
    given_name: str | None = setting("Claim.", default=None)
    family_name: str | None = setting("Claim.", default=None)
    middle_name: str | None = setting("Claim.", default=None)
    nickname: str | None = setting("Claim.", default=None)
    preferred_username: str | None = setting("Claim.", default=None)
    profile: str | None = setting("Claim (a URL).", default=None)
    picture: str | None = setting("Claim (a URL).", default=None)
    website: str | None = setting("Claim (a URL).", default=None)
    gender: str | None = setting("Claim.", default=None)
    birthdate: str | None = setting("Claim (YYYY-MM-DD).", default=None)
    zoneinfo: str | None = setting("Claim (like Europe/Paris).", default=None)
    locale: str | None = setting("Claim (like en-GB).", default=None)
    email: str | None = setting("Claim.", default=None)
    email_verified: bool | None = setting("Claim.", default=None)
    phone_number: str | None = setting("Claim.", default=None)
    phone_number_verified: bool | None = setting("Claim.", default=None)
    address: Mapping[str, str] | None = setting("Claim: formatted, street_address, locality, region, postal_code, country.", default=None)

    @property
    def claims(self) -> dict[str, Any]:
        """The OpenID Connect claims given, by name."""
        return {name: value for name in claim_names() if (value := getattr(self, name)) is not None}

    def validate(self, check: Check) -> None:
        given = [key for key in ("password_hash", "password") if check.has(key)]
        if len(given) == 2:
            check.problem_at(check.line_of("password"), f"{check.where}: give password_hash or password, not both")
        elif not given:
            check.problem("give password_hash (or password for development)")
        elif given == ["password_hash"] and not isinstance(self.password_hash, Withheld) and self.password_hash and not users_module.is_hash(self.password_hash):
            check.problem("not a scrypt hash", key="password_hash")


@functools.cache
def claim_names() -> tuple[str, ...]:
    """The fields of a user that are OpenID Connect claims (OIDC Core §5.1): all but these."""
    others = {"username", "password_hash", "password", "subject", "roles", "line"}
    return tuple(f.name for f in dataclasses.fields(DeclaredUser) if f.name not in others)


def _default_method(values: Mapping[str, Any]) -> str:
    return "client_secret_basic" if values.get("client_secret") is not None else "none"


@section
class DeclaredClient:
    """A client, described with RFC 7591 metadata names."""

    client_id: str = setting("The client's id (printable ASCII).")
    client_name: str = setting("Shown to users; the client_id when absent.", default="", derive=lambda v: v.get("client_id"))
    token_endpoint_auth_method: Literal["client_secret_basic", "client_secret_post", "private_key_jwt", "none"] = setting(
        "How it authenticates; client_secret_basic with a secret, none (a public client) without.", default="none", derive=_default_method)
    client_secret: str | None = setting("At least 32 random characters.", default=None, secret=True, from_file=True)
    redirect_uris: tuple[str, ...] = setting("Where codes may be sent (exact match; loopback http only).", default=(), parser=redirect_uri)
    post_logout_redirect_uris: tuple[str, ...] = setting("Where logout may return to.", default=(), parser=redirect_uri)
    grant_types: tuple[Literal["authorization_code", "client_credentials", "refresh_token", "urn:ietf:params:oauth:grant-type:device_code"], ...] = setting(
        "Grants it may use.", default=("authorization_code",))
    scope: ScopeList = setting("Space-separated scopes it may ask for.", default=ScopeList(()), parser=scope_list)
    resources: tuple[str, ...] = setting("RFC 8707 audiences it may ask for.", default=())
    jwks: JwkSet | None = setting("Public keys, for private_key_jwt.", default=None, parser=jwk_set)
    require_pkce: bool = setting("PKCE on authorization codes (public clients always).", default=True)
    skip_consent: bool = setting("No consent page (first-party clients).", default=False)
    id_token_signed_response_alg: Literal["ES256", "RS256", "EdDSA"] | None = setting("ID token algorithm; keys.id_token_alg when absent.", default=None)
    introspection: bool = setting("May call the introspection endpoint.", default=False)
    dpop_bound_access_tokens: bool = setting("Every token request must carry a DPoP proof (RFC 9449 §5.2).", default=False)
    application_type: Literal["web", "native"] = setting("OIDC Dynamic Client Registration §2.", default="web")
    require_mfa: bool = setting("Its users sign in with a second factor; one without is led to set one up.", default=False)
    default_acr_values: tuple[str, ...] = setting("Levels asked for when a request has no acr_values (OIDC Dynamic Client Registration §2): urn:portcullis:acr:pwd or urn:portcullis:acr:mfa.", default=(), parser=acr_value)
    line: int = section_line()

    @functools.cached_property
    def client_secret_sha256(self) -> bytes | None:
        """Secrets are high-entropy: a fast hash is enough. A withheld one authenticates nobody."""
        secret = self.client_secret
        return None if secret is None or isinstance(secret, Withheld) else hashlib.sha256(secret.encode()).digest()

    @property
    def public(self) -> bool:
        return self.token_endpoint_auth_method == "none"  # noqa: S105 - a method name

    @property
    def loopback_any_port(self) -> bool:
        """Whether a loopback IP redirect URI matches on any port. RFC 8252 §7.3 gives that
        to native apps, which are public clients (§8.4): the port is picked when the app
        runs. A native app registered with a secret or keys is held to exact matching like
        every other client (RFC 9700 §2.1)."""
        return self.application_type == "native" and self.public

    def validate(self, check: Check) -> None:
        where, method, secret = check.where, self.token_endpoint_auth_method, self.client_secret
        if not _CLIENT_ID.match(self.client_id):
            check.problem_at(check.line_of("client_id"), f"{where}: client_id must be printable ASCII")
        if method in ("client_secret_basic", "client_secret_post") and not check.has("client_secret"):
            check.problem(f"{method} needs client_secret")
        if method in ("none", "private_key_jwt") and check.has("client_secret"):
            check.problem_at(check.line_of("client_secret"), f"{where}: {method} clients have no secret")
        if secret and not isinstance(secret, Withheld) and len(secret) < 32:
            check.problem("use at least 32 random characters (secrets are stored with a fast hash, so they must not be guessable)", key="client_secret")
        if method == "private_key_jwt" and not check.has("jwks"):
            check.problem("private_key_jwt needs jwks (the client's public keys)")
        if self.public and not self.require_pkce:
            check.problem_at(check.line_of("require_pkce"), f"{where}: public clients always use PKCE")
        if self.public and "client_credentials" in self.grant_types:
            check.problem_at(check.line_of("grant_types"), f"{where}: client_credentials needs a confidential client")
        # An invalid URI is reported on its own line; here only a missing or empty list.
        if "authorization_code" in self.grant_types and not check.written("redirect_uris"):
            check.problem("authorization_code needs redirect_uris")
# fmt: on


def unknown_scopes(scope: tuple[str, ...], known: frozenset[str]) -> list[str]:
    """The scopes of a client that the server does not know."""
    return [token for token in scope if token not in known]
