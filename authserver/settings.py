"""The authorization server's configuration, declared once: each section a frozen dataclass
whose fields carry their documentation, parser and bounds (portcullis.sections reads them from
YAML with FILE:LINE problems, and describes them as JSON Schema and the README's reference).
A key is one line in the section that holds it; what spans several keys is its `validate`.

Its clients and users are declared in declarations.py, which reads admin API bodies too:
clients use RFC 7591 metadata names; users may carry a `password_hash` (scrypt, from
`portcullis-authserver hash-password`) or, for development only, a plain `password` that is
hashed at load with a warning. Secrets may come from files (`client_secret_file`,
`${file:PATH}`).

Only the composition root (app.py) and the command line read these sections: the running
code is given the values and records it uses, never a section. Loading also checks that the TLS certificate and key load; `check` (and
`run`) besides that the SQLite database's directory is there and writable.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
import os
import re
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

from portcullis import sections, tls, yamlconf
from portcullis.addresses import Address, IPNetwork, address, is_loopback, network, split_url
from portcullis.extras import missing_driver
from portcullis.sections import (
    DURATION_SCHEMA,
    Check,
    accepts,
    named,
    section,
    section_line,
    setting,
    source_file,
)
from portcullis.tls import ServerTls
from portcullis.yamlconf import ConfigError, LocatedMap, Problem, Rate, Withheld

from .declarations import DeclaredClient, DeclaredUser, unknown_scopes
from .federation import Provider
from .federation_keys import load_signing_key
from .keys import RotationPolicy
from .metadata_documents import DocumentPolicy, FetchRules
from .protocol import webauthn
from .protocol.cors import origin
from .protocol.federation import ClaimNames
from .protocol.resources import Audiences, ProtectedResource
from .protocol.scopes import BUILTIN_SCOPES, KNOWN_SCOPES, STANDARD_SCOPES
from .protocol.throttle import Cap
from .registration import RegistrationPolicy
from .stored_keys import ENCRYPTION_KEY_BYTES, encryption_key_bytes

log = logging.getLogger("portcullis.authserver.settings")
T = TypeVar("T")

SIGNING_ALGORITHMS = ("ES256", "RS256", "EdDSA")
ADMIN_API_PATH = "/admin/v1"  # admin/api.py's PREFIX: the admin API's audience is issuer + this
ADMIN_SCOPES = frozenset(s for s in BUILTIN_SCOPES if s.startswith("admin:"))
_SCOPE_TOKEN = re.compile(r"^[\x21\x23-\x5B\x5D-\x7E]+$")
_PROVIDER_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
_DOMAIN = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$")
ZERO = timedelta(0)
# A retry of a lost refresh response gets that response again for this long (README,
# security notes: a server killed between the commit and the answer logs nobody out).
REFRESH_GRACE = timedelta(seconds=5)
BACKOFF_FIRST_DELAY = timedelta(seconds=1)


# ---------------------------------------------------------------------------- values


@accepts({"type": "string", "title": "URL", "pattern": "^https?://"})
def issuer_url(value: Any) -> str:
    text, parts = split_url(value)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise ValueError(f"{text!r} is not an https URL")
    if parts.query or parts.fragment or text.endswith("/"):
        raise ValueError("an issuer has no query, fragment or trailing slash (RFC 8414 §2)")
    if parts.scheme == "http" and not is_loopback(parts.hostname):
        raise ValueError("the issuer must be https (plain http only on loopback, for development)")
    return text


@accepts({"type": "string", "pattern": "^(sqlite:///|sqlite://:memory:$|postgres(ql)?://)"})
def storage_url(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if text.startswith(("sqlite:///", "postgresql://", "postgres://")) or text == "sqlite://:memory:":
        return text
    raise ValueError("storage is sqlite:///PATH or postgresql://user@host/db")


@accepts(DURATION_SCHEMA)
def whole_seconds(value: Any) -> timedelta:
    """A duration of at least one second, in whole seconds (HTTP and RFC 8628 count so)."""
    result = yamlconf.duration(value)
    seconds = result.total_seconds()
    if seconds < 1 or seconds != int(seconds):
        raise ValueError(f"{value!r} must be a whole number of seconds, at least 1s")
    return result


@accepts(DURATION_SCHEMA)
def assertion_lifetime(value: Any) -> timedelta:
    lifetime = yamlconf.duration(value)
    if not timedelta(seconds=1) <= lifetime <= timedelta(days=1):
        raise ValueError("between 1s and 1d: each assertion's jti is kept that long")
    return lifetime


@accepts(DURATION_SCHEMA)
def grace(value: Any) -> timedelta:
    result = yamlconf.duration(value)
    if result > timedelta(seconds=10):
        raise ValueError("at most 10s: the grace only covers an immediate retry")
    return result


@accepts({"type": "string", "title": "scope", "pattern": _SCOPE_TOKEN.pattern})
def scope_name(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if not _SCOPE_TOKEN.match(text):
        raise ValueError(f"{text!r} is not a scope token")
    return text


@accepts({"type": "string", "title": "URI", "pattern": "^[A-Za-z][A-Za-z0-9+.-]*:[^#]+$"})
def resource_uri(value: Any) -> str:
    """A protected resource's identifier: an absolute URI without a fragment (RFC 8707 §2),
    compared as written with the `resource` of requests."""
    text, parts = split_url(value)
    if not parts.scheme or not (parts.netloc or parts.path):
        raise ValueError(f"{text!r} is not an absolute URI (RFC 8707 §2)")
    if "#" in text:
        raise ValueError(f"{text!r}: a resource has no fragment (RFC 8707 §2)")
    return text


@accepts({"type": "string", "title": "rate", "pattern": "^[0-9]+/[0-9]*(ms|s|m|h|d)$"})
def registration_rate(value: Any) -> Rate:
    """A whole number of registrations per period, counted per client address."""
    result = yamlconf.rate(value)
    if result.count < 1 or result.count != int(result.count) or result.per < timedelta(seconds=1):
        raise ValueError(f"{value!r}: a whole number of registrations per period of at least 1s (10/m)")
    return result


@accepts({"type": "string", "title": "host pattern", "pattern": "^(\\*|(\\*\\.)?[^*/:@ ]+)$"})
def host_pattern(value: Any) -> str:
    text = yamlconf.non_empty_string(value).lower()
    bare = text.removeprefix("*.")
    if text != "*" and ("*" in bare or any(c in bare for c in "/:@ ") or not bare.strip(".")):
        raise ValueError(f"{text!r} is not a host pattern: *, *.example.com or a host")
    return text


@accepts({"type": "string", "title": "https origin", "pattern": "^https://[^/]+$"})
def document_origin(value: Any) -> str:
    """An https origin whose documents may be fetched from a special-use address."""
    text = yamlconf.non_empty_string(value)
    parts = urlsplit(text)
    serialized = origin(text)
    if parts.scheme.lower() != "https" or serialized is None or parts.path or parts.query or "@" in text:
        raise ValueError(f"{text!r} is not an https origin (https://host[:port], no path)")
    return serialized


@accepts({"type": "string", "title": "origin", "pattern": "^[^:/]+://[^/]+$"})
def allowed_origin(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if text == "*":
        raise ValueError("'*' is not allowed: the token endpoint never answers every origin")
    parts = urlsplit(text)
    serialized = origin(text)
    if serialized is None or parts.path or parts.query or parts.fragment or "@" in text:
        raise ValueError(f"{text!r} is not an origin (scheme://host[:port], no path or trailing slash)")
    if parts.scheme.lower() == "http" and not is_loopback(parts.hostname):
        # A page served over plain http can be rewritten on the way: it would read tokens.
        raise ValueError(f"{text!r}: plain http origins are for loopback only")
    # As browsers send it: lower case, no default port (RFC 6454 §6.2).
    return serialized


# ---------------------------------------------------------------------------- sections


@section
class KeySettings:
    """Signing keys: where they are kept and which algorithms sign what."""

    dir: str | None = setting("Directory of the key ring, with SQLite storage; without it the keys live in the storage, encrypted with encryption_key.", default=None)
    encryption_key: str | None = setting("Base64 of 32 random bytes (openssl rand -base64 32), e.g. ${PORTCULLIS_KEY_SECRET}: encrypts the private keys kept in the storage (AES-256-GCM). Required without dir.", default=None, secret=True, from_file=True)
    access_token_alg: Literal["ES256", "RS256", "EdDSA"] = setting("Signs access tokens.", default="ES256")
    id_token_alg: Literal["ES256", "RS256", "EdDSA"] = setting("Signs ID tokens (RS256 is always offered too).", default="RS256")
    jwks_max_age: timedelta = setting("Cache-Control max-age of the JWKS (whole seconds).", default=timedelta(minutes=5), parser=whole_seconds)
    # A verifier that fetched the key set just before a key appeared keeps that copy for
    # jwks_max_age, so a key is published at least that long before it signs.
    publish_ahead: timedelta = setting("How long a new key is published before it signs; jwks_max_age when absent.", default=timedelta(minutes=5), derive=lambda v: v.get("jwks_max_age"))
    rotate_every: timedelta | None = setting("Automatic rotation; only by command when absent.", default=None)
    # Every server reads the ring again this often, to publish keys another replica or
    # `keys rotate` wrote; a new key waits two of these on top of publish_ahead.
    reload_every: timedelta = setting("How often each server reads the key ring again (at most jwks_max_age).", default=timedelta(seconds=1), minimum=timedelta(milliseconds=100))

    @property
    def in_storage(self) -> bool:
        """Whether the ring is kept in the storage (no `dir`) rather than a directory."""
        return self.dir is None

    def validate(self, check: Check) -> None:
        if self.publish_ahead < self.jwks_max_age:
            check.problem(
                f"must be at least keys.jwks_max_age ({_seconds(self.jwks_max_age)}): verifiers may keep "
                "the key set that long, and a key published for less could sign tokens they cannot verify yet",
                key="publish_ahead",
            )
        if self.rotate_every is not None and self.rotate_every < max(self.publish_ahead, timedelta(seconds=1)):
            check.problem(f"must be at least keys.publish_ahead ({_seconds(self.publish_ahead)}) and at least 1s", key="rotate_every")
        if self.reload_every > self.jwks_max_age:
            check.problem(f"must be at most keys.jwks_max_age ({_seconds(self.jwks_max_age)})", key="reload_every")
        secret = self.encryption_key
        if secret is not None and not isinstance(secret, Withheld) and encryption_key_bytes(secret) is None:
            check.problem(f"must be the base64 encoding of exactly {ENCRYPTION_KEY_BYTES} bytes (make one with: openssl rand -base64 32); the value is not shown", key="encryption_key")


@section
class Lifetimes:
    """How long what the server issues lives."""

    authorization_code: timedelta = setting("Authorization codes.", default=timedelta(seconds=60))
    access_token: timedelta = setting("Access tokens.", default=timedelta(minutes=5))
    id_token: timedelta = setting("ID tokens.", default=timedelta(minutes=5))
    refresh_token_idle: timedelta = setting("A refresh token unused this long expires.", default=timedelta(days=14))
    refresh_token_absolute: timedelta = setting("A refresh family ends this long after the login.", default=timedelta(days=90))
    session: timedelta = setting("The login session.", default=timedelta(hours=12))
    device_code: timedelta = setting("Device codes (RFC 8628 §3.2 expires_in).", default=timedelta(minutes=10), more_than=ZERO)

    def validate(self, check: Check) -> None:
        if self.refresh_token_idle > self.refresh_token_absolute:
            check.problem("refresh_token_idle exceeds refresh_token_absolute")


@section
class LoginThrottle:
    """Wrong passwords, counted when tried (endpoints/signin.py has the policy and its bounds)."""

    max_failures: int = setting("Per username at one client address, within window.", default=5, minimum=1, maximum=1000)
    # Higher than per username: many people may share one address.
    max_failures_per_address: int = setting("Per client address, any username.", default=20, minimum=1, maximum=100_000)
    window: timedelta = setting("How long failures count.", default=timedelta(minutes=15), more_than=ZERO)
    # Delays, not a lock: anyone can send wrong passwords for a username.
    backoff_after: int = setting("Failures of a username from anywhere before its attempts are delayed.", default=10, minimum=1, maximum=1000)
    backoff_max: timedelta = setting("Longest delay (doubling from 1s).", default=timedelta(minutes=1), minimum=BACKOFF_FIRST_DELAY)


@section
class SecondFactorSettings:
    """Second factors after the password: one-time codes of an authenticator app (TOTP,
    RFC 6238) and recovery codes (endpoints/second_factor.py), and passkeys where the issuer
    is https (or http://localhost). Users enrol at /factors."""

    encryption_key: str | None = setting("Base64 of 32 random bytes (openssl rand -base64 32): seals the authenticator secrets kept in the storage (AES-256-GCM). keys.encryption_key when absent; without either, nobody can set up an authenticator app (passkeys need no key).", default=None, secret=True, from_file=True)
    required_for_everyone: bool = setting("Every user signs in with a second factor; one without is led to set one up after the password (an authenticator app, or a passkey where the issuer allows them: without an encryption key, passkeys alone, which needs an https or http://localhost issuer).", default=False)
    required_for_roles: tuple[str, ...] = setting("Users with any of these roles (e.g. admin) sign in with a second factor; one without is led to set one up, as for required_for_everyone.", default=())

    def validate(self, check: Check) -> None:
        secret = self.encryption_key
        if secret is not None and not isinstance(secret, Withheld) and encryption_key_bytes(secret) is None:
            check.problem(f"must be the base64 encoding of exactly {ENCRYPTION_KEY_BYTES} bytes (make one with: openssl rand -base64 32); the value is not shown", key="encryption_key")

    @property
    def required(self) -> bool:
        return self.required_for_everyone or bool(self.required_for_roles)


@section
class DeviceSettings:
    """The device authorization grant (RFC 8628): polling and the user-code page's throttle."""

    interval: timedelta = setting("Least time between two polls (whole seconds).", default=timedelta(seconds=5), parser=whole_seconds)
    max_failures: int = setting("Wrong user codes per browser session, within window.", default=5, minimum=1, maximum=1000)
    max_failures_per_address: int = setting("Wrong user codes per client address.", default=20, minimum=1, maximum=100_000)
    window: timedelta = setting("How long failures count.", default=timedelta(minutes=15), more_than=ZERO)


@section
class DpopSettings:
    """DPoP (RFC 9449): proofs of possession at the token and userinfo endpoints. Proofs are
    always accepted; a client registered with dpop_bound_access_tokens must send one."""

    proof_max_age: timedelta = setting("How old a proof's iat may be.", default=timedelta(seconds=60), more_than=ZERO, maximum=timedelta(minutes=10))
    leeway: timedelta = setting("Clock skew allowed on iat (a proof from slightly ahead).", default=timedelta(seconds=5), maximum=timedelta(minutes=1))
    nonce: bool = setting("Proofs must carry a nonce the server gave (DPoP-Nonce, RFC 9449 §8).", default=False)
    nonce_key: str | None = setting("Keys the nonces (at least 32 characters); the same on every replica. Required with nonce.", default=None, secret=True, from_file=True)
    nonce_lifetime: timedelta = setting("How long a nonce is accepted; each is handed out for a quarter of it.", default=timedelta(minutes=5), minimum=timedelta(seconds=4))

    def validate(self, check: Check) -> None:
        if self.nonce and not check.has("nonce_key"):
            check.problem("nonce: true needs nonce_key: every replica must accept the nonces of the others")
        secret = self.nonce_key
        if secret and not isinstance(secret, Withheld) and len(secret) < 32:
            check.problem("use at least 32 random characters", key="nonce_key")


@section
class RevocationEventSettings:
    """The revocation events stream (GET /revocation_events) read by resource servers."""

    heartbeat: timedelta = setting("Idle time after which a comment line keeps the stream open through proxies.", default=timedelta(seconds=15), more_than=ZERO)
    poll_interval: timedelta = setting("How often the log is read besides wake-ups (events written by other processes on one SQLite file).", default=timedelta(seconds=1), more_than=ZERO)


@section
class PasswordHashing:
    """Password checks (scrypt, about 32 MiB and tens of milliseconds each): how many run at
    once, and how many may wait for them before a sign-in is answered 503. Read at start."""

    workers: int = setting("Checks at once, each on a thread of its own.", default=2, minimum=1, maximum=64)
    max_waiting: int = setting("Checks queued behind them; a sign-in beyond gets a 503 page.", default=16, minimum=0, maximum=10_000)


@section
class StoragePool:
    """The connections a postgresql:// storage keeps open, and how long a call waits."""

    min_size: int = setting("Connections opened at start and kept.", default=1, minimum=0, maximum=1000)
    max_size: int = setting("Connections at most; replicas × max_size must fit the database's max_connections.", default=10, minimum=1, maximum=1000)
    connect_timeout: timedelta = setting("A new connection, login included; then 503.", default=timedelta(seconds=5), more_than=ZERO)
    command_timeout: timedelta = setting("One statement, lock waits included; then it is cancelled, 503.", default=timedelta(seconds=5), more_than=ZERO)
    acquire_timeout: timedelta = setting("Waiting for a free connection when all are busy; then 503.", default=timedelta(seconds=5), more_than=ZERO)
    migration_timeout: timedelta = setting("Each migration at start or by `migrate`, waiting for another replica's included; then it is rolled back.", default=timedelta(minutes=5), more_than=ZERO)

    def validate(self, check: Check) -> None:
        if self.min_size > self.max_size:
            check.problem("exceeds max_size", key="min_size")


@section
class ScopeSettings:
    """A scope clients may ask for, beyond the OpenID Connect ones."""

    name: str = setting("The scope token.", parser=scope_name)
    description: str = setting("Shown on the consent page; the name when absent.", default="", derive=lambda v: KNOWN_SCOPES.get(v.get("name", ""), v.get("name", "")))


@section
class ResourceSettings:
    """A protected resource (an API, an MCP server) any client may ask tokens for, with the
    RFC 8707 `resource` parameter: its tokens carry `uri` as `aud`."""

    uri: str = setting("Its RFC 8707 identifier, the `aud` of its tokens: an absolute URI without a fragment (an MCP server's canonical URI), matched exactly.", parser=resource_uri)
    name: str = setting("Shown on the consent page, beside the URI; the URI when absent.", default="", derive=lambda v: v.get("uri"))
    scopes: tuple[str, ...] = setting("The scopes it accepts: a token for it carries only these and OpenID Connect's.", default=(), parser=scope_name)


@section
class RegistrationSettings:
    """Dynamic client registration (RFC 7591) at {issuer}/register, and reading and deleting
    a registration with its registration access token (RFC 7592). Public clients register
    freely; a confidential one (a secret or keys) only with the initial access token."""

    enabled: bool = setting("Serve the registration endpoint and advertise it (registration_endpoint).", default=False)
    rate: Rate = setting("Registrations from one client address: at most this many per period of time (10/m).", default=Rate(10, timedelta(minutes=1)), parser=registration_rate)
    unused_client_lifetime: timedelta = setting("A registered client that has obtained no token this long after registering is removed.", default=timedelta(days=1), minimum=timedelta(minutes=1))
    initial_access_token: str | None = setting("The Bearer token a registration of a confidential client must carry (RFC 7591 §3); at least 32 random characters. Without it only public clients register.", default=None, secret=True, from_file=True)

    def validate(self, check: Check) -> None:
        secret = self.initial_access_token
        if secret and not isinstance(secret, Withheld) and len(secret) < 32:
            check.problem("use at least 32 random characters", key="initial_access_token")


@section
class HostPolicy:
    """A rule on the hosts Client ID Metadata Documents are fetched from."""

    pattern: str = setting("`*` any host, `*.example.com` its subdomains (not itself), else one host.", parser=host_pattern)
    policy: Literal["allow", "deny"] = setting("allow: fetched (the address checks still apply); deny: refused before any lookup.")


@section
class MetadataDocumentSettings:
    """Clients whose client_id is the https URL of their own metadata document
    (draft-ietf-oauth-client-id-metadata-document), as MCP clients are: fetched when named,
    checked, cached. Off by default: turned on, anyone may make the server fetch a URL and
    ask its users to consent to a client nobody registered (README, MCP clients)."""

    enabled: bool = setting("Accept such clients, and advertise client_id_metadata_document_supported.", default=False)
    timeout: timedelta = setting("A fetch, from the address lookup to the last byte; then the request is refused.", default=timedelta(seconds=3), more_than=ZERO, maximum=timedelta(seconds=30))
    max_size: int = setting("Largest document in bytes (the draft recommends 5 KB); a larger one is refused.", default=5120, minimum=256, maximum=65536)
    cache_min: timedelta = setting("A document is kept at least this long, whatever its Cache-Control says (no-store, max-age=0).", default=timedelta(minutes=5), minimum=ZERO)
    cache_max: timedelta = setting("A document is kept at most this long, whatever its Cache-Control says.", default=timedelta(days=1), more_than=ZERO)
    hosts: tuple[HostPolicy, ...] = setting("Host policies; the first whose pattern matches decides, none matching: allowed.", default=())
    allow_origins: tuple[str, ...] = setting("https origins fetched even from special-use addresses (loopback, private): for development only, e.g. https://127.0.0.1:8443.", default=(), parser=document_origin)
    ca_file: str | None = setting("CA certificates documents' servers are verified against, instead of the system's.", default=None)

    def validate(self, check: Check) -> None:
        if self.cache_min > self.cache_max:
            check.problem("exceeds cache_max", key="cache_min")
        if check.secrets and self.ca_file is not None:
            tls.check_ca(check, "ca_file", self.ca_file)


@accepts({"type": "string", "title": "provider name", "pattern": "^[a-z0-9][a-z0-9-]{0,31}$"})
def provider_name(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if not _PROVIDER_NAME.match(text):
        raise ValueError(f"{text!r}: lower-case letters, digits and hyphens, at most 32 (it is a path segment)")
    return text


@accepts({"type": "string", "title": "domain", "pattern": "^[A-Za-z0-9.-]+$"})
def email_domain(value: Any) -> str:
    text = yamlconf.non_empty_string(value).lower()
    if not _DOMAIN.match(text):
        raise ValueError(f"{text!r} is not a domain name (example.com, no @ or wildcard)")
    return text


def _provider_auth_method(values: Mapping[str, Any]) -> str:
    return "private_key_jwt" if values.get("private_key_file") is not None else "client_secret_basic"


@section
class ClaimMapping:
    """Which claims of an upstream provider's ID token (or its userinfo, for those the token
    lacks) fill a local user's fields when the first sign-in creates the user, and refresh
    them at each later sign-in (an email only once the provider verified it; the username
    only of a user without a password, when it is free); the local `sub` never follows them."""

    username: str = setting("Becomes the local username (suffixed when taken).", default="preferred_username")
    email: str = setting("Becomes the email (with email_verified as the provider says).", default="email")
    name: str = setting("Becomes the display name.", default="name")


@section
class IdentityProviderSettings:
    """An upstream OpenID Connect provider (a company directory) users may sign in with: the
    authorization server is its client (code, PKCE S256, state, nonce, iss checked, the ID
    token verified against its discovered keys)."""

    name: str = setting("Short name, in the callback path {issuer}/federation/NAME/callback.", parser=provider_name)
    issuer: str = setting("The provider's issuer identifier; its discovery document is {issuer}/.well-known/openid-configuration.", parser=issuer_url)
    client_id: str = setting("This server's client_id at the provider.")
    display_name: str = setting("The button's text on the sign-in page; the name when absent.", default="", derive=lambda v: v.get("name"))
    client_secret: str | None = setting("This server's secret at the provider (client_secret_basic or client_secret_post).", default=None, secret=True, from_file=True)
    private_key_file: str | None = setting("PEM private key (RSA, P-256 or Ed25519) signing private_key_jwt assertions; its public key is registered at the provider.", default=None)
    token_endpoint_auth_method: Literal["client_secret_basic", "client_secret_post", "private_key_jwt"] = setting(
        "How this server authenticates at the provider's token endpoint; client_secret_basic with a secret, private_key_jwt with a key file.", default="client_secret_basic", derive=_provider_auth_method)
    scopes: tuple[str, ...] = setting("Scopes asked of the provider; openid among them.", default=("openid", "email", "profile"), parser=scope_name)
    claims: ClaimMapping = setting("Claims that fill the local user.", default_factory=ClaimMapping)
    link_by_verified_email_domains: tuple[str, ...] = setting(
        "A first sign-in whose email the provider verified, of one of these domains, signs in the existing local user with that email; empty: never linked, a new user is created.", default=(), parser=email_domain)
    timeout: timedelta = setting("A request to the provider (discovery, keys, token), from connecting to the last byte.", default=timedelta(seconds=5), more_than=ZERO, maximum=timedelta(seconds=30))
    discovery_max_age: timedelta = setting("How long its discovery document and keys are kept before they are fetched again.", default=timedelta(hours=1), minimum=timedelta(seconds=1), maximum=timedelta(days=1))
    discovery_stale_if_error: timedelta = setting(
        "How long past discovery_max_age the last good discovery document and keys are still used while fetching them again fails (logged and counted); past it, sign-in through the provider is refused until a fetch succeeds. 0s: never used stale.",
        default=timedelta(hours=1), minimum=ZERO, maximum=timedelta(days=1))
    ca_file: str | None = setting("CA certificates the provider is verified against, instead of the system's.", default=None)
    line: int = section_line()

    def validate(self, check: Check) -> None:
        method = self.token_endpoint_auth_method
        if method == "private_key_jwt":
            if not check.has("private_key_file"):
                check.problem("private_key_jwt needs private_key_file")
            if check.has("client_secret"):
                check.problem_at(check.line_of("client_secret"), f"{check.where}: private_key_jwt uses a key, not client_secret")
            if check.secrets and self.private_key_file is not None:
                problem = private_key_problem(self.private_key_file)
                if problem:
                    check.problem(problem, key="private_key_file")
        else:
            if not check.has("client_secret"):
                check.problem(f"{method} needs client_secret (or client_secret_file)")
            if check.has("private_key_file"):
                check.problem_at(check.line_of("private_key_file"), f"{check.where}: {method} uses client_secret, not a key")
        if "openid" not in self.scopes:
            check.problem("must include openid", key="scopes")
        if check.secrets and self.ca_file is not None:
            tls.check_ca(check, "ca_file", self.ca_file)


def private_key_problem(path: str) -> str | None:
    """Why the PEM file at `path` cannot sign private_key_jwt assertions, if it cannot."""
    try:
        load_signing_key(path)
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    except ValueError as exc:
        return f"{path}: {exc}"
    return None


@section
class CorsSettings:
    """Browser pages that may read answers, beyond the origins of the browser clients'
    redirect URIs (protocol/cors.py has the policy)."""

    allow_origins: tuple[str, ...] = setting("Origins (scheme://host[:port]); plain http on loopback only.", default=(), parser=allowed_origin)


@section
class AccessLogSettings:
    """A line per request on the public listener (accesslog.py): never a query value, a
    secret or a token."""

    enabled: bool = setting("Whether lines are written.", default=True)
    output: str = setting("stderr, stdout or a file path (appended to).", default="stderr")
    flush_interval: timedelta = setting("How often lines are written out.", default=timedelta(milliseconds=200), more_than=ZERO, maximum=timedelta(seconds=10))


@section
class Settings:
    """Configuration of the Portcullis authorization server."""

    file: str = source_file()
    issuer: str = setting("The issuer identifier: https, no query, fragment or trailing slash.", parser=issuer_url)
    storage: str = setting("sqlite:///PATH, or postgresql://user@host/db to scale out.", parser=storage_url)
    keys: KeySettings = setting("Signing keys.")
    storage_pool: StoragePool = setting("postgresql:// only: the connections each server keeps.", default_factory=StoragePool)
    listen: Address = setting("Where clients connect.", default=Address("0.0.0.0", 9000), parser=address)
    default_audience: str | None = setting("`aud` of access tokens asked for without a resource.", default=None)
    lifetimes: Lifetimes = setting("Lifetimes.", default_factory=Lifetimes)
    refresh_grace: timedelta = setting("A retry of a lost refresh response is answered again this long (at most 10s).", default=REFRESH_GRACE, parser=grace)
    login_throttle: LoginThrottle = setting("Wrong passwords.", default_factory=LoginThrottle)
    second_factors: SecondFactorSettings = setting("Authenticator apps and recovery codes after the password, and who must sign in with a second factor.", default_factory=SecondFactorSettings)
    password_hashing: PasswordHashing = setting("Password checks off the event loop; restart to change.", default_factory=PasswordHashing)
    trusted_proxies: tuple[IPNetwork, ...] = setting("Peers whose X-Forwarded-For names the client (for the throttles).", default=(), parser=network)
    device: DeviceSettings = setting("The device grant.", default_factory=DeviceSettings)
    dpop: DpopSettings = setting("DPoP proofs (RFC 9449).", default_factory=DpopSettings)
    revocation_events: RevocationEventSettings = setting("The stream of revocation events.", default_factory=RevocationEventSettings)
    scopes: tuple[ScopeSettings, ...] = setting("Scopes beyond the OpenID Connect ones.", default=())
    client_id_metadata_documents: MetadataDocumentSettings = setting("Clients identified by the URL of their metadata document.", default_factory=MetadataDocumentSettings)
    registration: RegistrationSettings = setting("Dynamic client registration (RFC 7591, 7592).", default_factory=RegistrationSettings)
    resources: tuple[ResourceSettings, ...] = setting("Protected resources any client may ask tokens for (RFC 8707 `resource`).", default=(), label=named("resource", "uri"))
    users: tuple[DeclaredUser, ...] = setting("Users defined here (read-only in the admin API).", default=())
    clients: tuple[DeclaredClient, ...] = setting("Clients defined here (read-only in the admin API).", default=(), label=named("client", "client_id"))
    cors: CorsSettings = setting("CORS.", default_factory=CorsSettings)
    identity_providers: tuple[IdentityProviderSettings, ...] = setting("Upstream OpenID Connect providers users may sign in with, each a button on the sign-in page.", default=(), label=named("identity provider", "name"))
    password_sign_in: bool = setting("Users may sign in with their username and password, and change it on the account page; false: the sign-in pages show only the identity_providers' buttons (and a passkey, where the issuer allows them), and a password posted is refused unread. Needs an identity provider or passkeys. Client secrets and the admin API are not affected.", default=True)
    log_level: Literal["debug", "info", "warning", "error"] = setting("Least severity logged.", default="info")
    access_log: AccessLogSettings | Literal[True, False] = setting("A line per request: true, false, or a mapping; on when absent; restart to change.", default=True)
    admin_listen: Address = setting("/healthz, /readyz and /metrics.", default=Address("127.0.0.1", 9902), parser=address)
    client_assertion_max_lifetime: timedelta = setting("Longest private_key_jwt assertion; each jti is kept that long.", default=timedelta(hours=1), parser=assertion_lifetime)
    client_assertion_audience: Literal["strict", "compat"] = setting("private_key_jwt `aud`: strict, the issuer alone; compat, also the token endpoint URL alone (for clients that send it).", default="strict")
    tls: ServerTls | None = setting("HTTPS served by the server itself; TLS ends in front of it when absent.", default=None)

    @property
    def id_token_algs(self) -> list[str]:
        """Every algorithm ID tokens may be signed with. RS256 is always among them: OpenID
        Connect Discovery §3 requires it, and a client may register for it."""
        algs = {"RS256", self.keys.id_token_alg}
        algs.update(
            c.id_token_signed_response_alg for c in self.clients if c.id_token_signed_response_alg
        )
        return sorted(algs)

    @property
    def signing_algs(self) -> list[str]:
        """Every algorithm the server signs with: access tokens', then ID tokens'."""
        return list(dict.fromkeys([self.keys.access_token_alg, *self.id_token_algs]))

    @property
    def request_log(self) -> AccessLogSettings:
        """The access log's settings (`enabled` false when it is off)."""
        if isinstance(self.access_log, AccessLogSettings):
            return self.access_log
        return AccessLogSettings(enabled=self.access_log)

    @property
    def second_factor_key(self) -> str | None:
        """What seals authenticator secrets: second_factors.encryption_key, else
        keys.encryption_key; None when neither is set."""
        return self.second_factors.encryption_key or self.keys.encryption_key

    @property
    def secure_cookies(self) -> bool:
        return self.issuer.startswith("https://")

    # Lookups by key, built on first use. Records hold mappings (claims, jwks) and so are not
    # hashable: the indexes live on the instance rather than in a cache keyed by the records.
    @functools.cached_property
    def _clients_by_id(self) -> dict[str, DeclaredClient]:
        return {c.client_id: c for c in self.clients}

    @functools.cached_property
    def _users_by_name(self) -> dict[str, DeclaredUser]:
        return {u.username: u for u in self.users}

    @functools.cached_property
    def _users_by_subject(self) -> dict[str, DeclaredUser]:
        return {self.subject_of(u): u for u in self.users}

    @functools.cached_property
    def _scope_descriptions(self) -> dict[str, str]:
        return {**KNOWN_SCOPES, **{s.name: s.description for s in self.scopes}}

    def client(self, client_id: str) -> DeclaredClient | None:
        return self._clients_by_id.get(client_id)

    def user(self, username: str) -> DeclaredUser | None:
        return self._users_by_name.get(username)

    def user_by_subject(self, subject: str) -> DeclaredUser | None:
        return self._users_by_subject.get(subject)

    def scope_description(self, name: str) -> str:
        return self._scope_descriptions.get(name, name)

    def subject_of(self, user: DeclaredUser) -> str:
        """The user's `sub`: as configured, or derived from this issuer and the username."""
        return user.subject or default_subject(self.issuer, user.username)

    def validate(self, check: Check) -> None:
        if self.admin_listen == self.listen:
            check.problem_at(check.line_of("admin_listen"), "admin_listen must differ from listen")
        if self.tls is not None and urlsplit(self.issuer).scheme != "https":
            check.problem("must be https:// when the server itself serves TLS (tls:)", key="issuer")
        postgres = self.storage.startswith(("postgresql://", "postgres://"))
        if check.has("storage_pool") and not postgres:
            check.problem("only a postgresql:// storage has a pool", key="storage_pool")
        keys = check.within(self.keys)
        if postgres and self.keys.dir is not None:
            keys.problem(
                "replicas on PostgreSQL share their signing keys through the database, not a local directory: "
                "remove keys.dir and set keys.encryption_key",
                key="dir",
            )
        elif self.keys.in_storage and self.keys.encryption_key is None:
            where = "PostgreSQL storage keeps the signing keys in the database" if postgres else "without keys.dir the signing keys live in the storage"
            keys.problem(f"{where}: set keys.encryption_key to base64 of 32 random bytes (openssl rand -base64 32), e.g. ${{PORTCULLIS_KEY_SECRET}}")
        factors = self.second_factors
        # Passkeys need no key (a public key is no secret) but an issuer browsers run WebAuthn
        # for (protocol/webauthn.rp_id): a domain in a secure context.
        if factors.required and self.second_factor_key is None and webauthn.rp_id(self.issuer) is None:
            check.within(factors).problem(
                "a second factor cannot be required here: authenticator apps need an encryption key to seal their secrets "
                "(set second_factors.encryption_key, or keys.encryption_key), and passkeys need an https issuer "
                "(or http://localhost), which this issuer is not")
        if not self.password_sign_in and not self.identity_providers and webauthn.rp_id(self.issuer) is None:
            # Nobody could sign in: no password, no provider, and no passkey a browser would use.
            check.problem(
                "false leaves nobody a way to sign in: add an identity provider (identity_providers), "
                "or use an issuer passkeys work with (https, or http://localhost), which this issuer is not",
                key="password_sign_in",
            )
        _once(check, self.scopes, lambda s: s.name, "scope {!r} is listed twice")
        _once(check, self.users, lambda u: u.username, "username {!r} is listed twice")
        _once(check, self.clients, lambda c: c.client_id, "client_id is listed twice")
        known = self.known_scopes
        for client in self.clients:
            for token in unknown_scopes(client.scope, known):
                check.within(client).problem(f"{token!r} is not in the scopes list", key="scope")
        _once(check, self.resources, lambda r: r.uri, "resource {!r} is listed twice")
        _once(check, self.identity_providers, lambda p: p.name, "identity provider {!r} is listed twice")
        _once(check, self.identity_providers, lambda p: p.issuer, "issuer {!r} is listed twice")
        for resource in self.resources:
            within = check.within(resource)
            if resource.uri == self.issuer + ADMIN_API_PATH:
                within.problem("is the admin API's audience: only clients listing it in their own resources get tokens for it", key="uri")
            for token in resource.scopes:
                if token in ADMIN_SCOPES:
                    within.problem(f"{token!r} is the admin API's: no registered resource accepts it", key="scopes")
                elif token not in known:
                    within.problem(f"{token!r} is not in the scopes list", key="scopes")

    @property
    def known_scopes(self) -> frozenset[str]:
        """Every scope a client may be registered with."""
        return frozenset(KNOWN_SCOPES) | {s.name for s in self.scopes}


def protected_resources(settings: Settings) -> Audiences:
    """The default audience and the registered resources, as requests are checked against."""
    return Audiences(
        settings.default_audience or settings.issuer,
        [ProtectedResource(r.uri, r.name, frozenset(r.scopes)) for r in settings.resources],
    )


def registration_policy(settings: Settings) -> RegistrationPolicy:
    """What clients that register themselves are offered (`offered_scopes`), how long they
    have to obtain a token, and the initial access token."""
    reg = settings.registration
    token = reg.initial_access_token
    return RegistrationPolicy(
        offered_scopes=offered_scopes(settings),
        unused_lifetime=reg.unused_client_lifetime,
        initial_access_token_sha256=(
            hashlib.sha256(token.encode()).digest() if token and not isinstance(token, Withheld) else None
        ),
    )


def offered_scopes(settings: Settings) -> frozenset[str]:
    """What clients that register themselves, or are described by a metadata document, may
    ask for: the scopes of the registered resources and OpenID Connect's (never `roles` or
    the admin API's, nor a scope no registered resource accepts)."""
    return frozenset(STANDARD_SCOPES).union(*(r.scopes for r in settings.resources))


def document_rules(documents: MetadataDocumentSettings) -> FetchRules:
    """`client_id_metadata_documents`, as the fetcher takes it."""
    return FetchRules(
        timeout=documents.timeout,
        max_size=documents.max_size,
        hosts=tuple((h.pattern, h.policy == "allow") for h in documents.hosts),
        allow_origins=frozenset(documents.allow_origins),
        tls=tls.client_context(documents.ca_file),
    )


def document_policy(settings: Settings) -> DocumentPolicy:
    documents = settings.client_id_metadata_documents
    return DocumentPolicy(offered_scopes(settings), documents.cache_min, documents.cache_max)


def federation_providers(settings: Settings) -> list[Provider]:
    """`identity_providers`, as the federation routes take them (key files read here)."""
    return [
        Provider(
            name=p.name,
            display_name=p.display_name,
            issuer=p.issuer,
            client_id=p.client_id,
            auth_method=p.token_endpoint_auth_method,
            client_secret=None if isinstance(p.client_secret, Withheld) else p.client_secret,
            signing_key=load_signing_key(p.private_key_file) if p.private_key_file else None,
            scopes=p.scopes,
            claims=ClaimNames(p.claims.username, p.claims.email, p.claims.name),
            link_domains=frozenset(p.link_by_verified_email_domains),
            timeout=p.timeout.total_seconds(),
            max_age=p.discovery_max_age.total_seconds(),
            stale_if_error=p.discovery_stale_if_error.total_seconds(),
            tls=tls.client_context(p.ca_file),
        )
        for p in settings.identity_providers
    ]


def registration_cap(registration: RegistrationSettings) -> Cap:
    """`registration.rate` as the throttle takes it; the client address is appended to its key."""
    return Cap("register:", limit=int(registration.rate.count), window=registration.rate.per.total_seconds())


def _once(check: Check, items: tuple[T, ...], name: Callable[[T], str], problem: str) -> None:
    """Report an item whose name an earlier item has, on its own line."""
    seen: set[str] = set()
    for item in items:
        if name(item) in seen:
            within = check.within(item)
            within.problem_at(within.line, f"{within.where}: {problem.format(name(item))}")
        seen.add(name(item))



def rotation_policy(settings: Settings) -> RotationPolicy:
    """How the key ring rotates (`keys`): for the server and the `keys` commands alike.
    Any key may sign access tokens and ID tokens, so a retired one is kept for the longer
    lifetime."""
    keys, lifetimes = settings.keys, settings.lifetimes
    return RotationPolicy.of(
        publish_ahead=keys.publish_ahead,
        rotate_every=keys.rotate_every,
        check_every=keys.reload_every,
        token_lifetimes=(lifetimes.access_token, lifetimes.id_token),
    )

# ---------------------------------------------------------------------------- loading


def load(path: str, env: Mapping[str, str] | None = None, *, secrets: bool = True, storage: bool = False) -> Settings:
    """Read and validate a config file; raise ConfigError listing every problem.

    `secrets=False` is for commands that serve nothing and use no secret (`keys list`,
    `keys rotate`): secrets and TLS files are then neither read nor checked. `storage=True`
    also checks that the database can be opened where it is configured (for `run`).
    """
    data = yamlconf.load_file(path, env, keep_incomplete=True)
    found = _storage_problems(data, path) if storage else []
    try:
        settings = sections.load(Settings, data, path, secrets=secrets)
    except ConfigError as exc:
        raise ConfigError(exc.problems + found) from None
    if found:
        raise ConfigError(found)
    return settings


def load_text(text: str, file: str = "<text>", env: Mapping[str, str] | None = None, *, secrets: bool = True) -> Settings:
    return sections.load_text(Settings, text, file, env, secrets=secrets)


def check(path: str, env: Mapping[str, str] | None = None) -> list[str]:
    """Every problem `run` would meet, as `FILE:LINE: message`; empty when there is none."""
    return check_with_warnings(path, env)[0]


def check_with_warnings(
    path: str, env: Mapping[str, str] | None = None
) -> tuple[list[str], list[str]]:
    """The problems of `check`, and when there is none the file's `warnings`."""
    try:
        settings = load(path, env, storage=True)
    except ConfigError as exc:
        return [str(p) for p in exc.problems], []
    return [], warnings(settings)


def warnings(settings: Settings) -> list[str]:
    """What is valid but weaker than the default, as `FILE: warning: message`."""
    found = []
    if settings.client_assertion_audience == "compat":
        # draft-ietf-oauth-rfc7523bis: the issuer identifier is an assertion's one audience.
        # The token endpoint URL is what another server the client trusts can give as its own
        # endpoint, obtaining an assertion it can replay here.
        found.append(
            f"{settings.file}: warning: client_assertion_audience: compat takes the token "
            "endpoint URL as a private_key_jwt assertion's audience, which a malicious server "
            "the client also talks to can obtain and replay here; set strict (the issuer "
            "alone) once every client sends the issuer"
        )
    return found


def _storage_problems(data: LocatedMap, file: str) -> list[Problem]:
    storage = data.get("storage")
    problem = _database_problem(storage) if isinstance(storage, str) else None
    line = data.key_lines.get("storage", data.line)
    return [Problem(file, line, f"config.storage: {problem}")] if problem else []


def _database_problem(storage: str) -> str | None:
    """Why the database could not be opened here, if that can be told beforehand: for
    PostgreSQL its driver missing (an extra of the distribution); for SQLite its directory
    missing or not writable (SQLite writes its WAL beside it)."""
    if storage.startswith(("postgresql://", "postgres://")):
        problem = missing_driver("asyncpg", "postgres")
        return f"PostgreSQL storage {problem}" if problem else None
    if not storage.startswith("sqlite:///"):
        return None
    path = storage[len("sqlite://") :]
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        return f"the database's directory {directory} does not exist"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"the database's directory {directory} is not writable"
    if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
        return f"the database {path} is not readable and writable"
    return None


def default_subject(issuer: str, username: str) -> str:
    """A stable, opaque subject for a configured user who was given none (never the email)."""
    digest = hashlib.sha256(f"{issuer}\x00{username}".encode()).digest()
    return base64.urlsafe_b64encode(digest[:16]).rstrip(b"=").decode()


def _seconds(value: timedelta) -> str:
    return f"{value.total_seconds():g}s"
