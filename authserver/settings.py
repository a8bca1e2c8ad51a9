"""The authorization server's configuration: frozen dataclasses from YAML, errors with FILE:LINE.

Clients use RFC 7591 metadata names. Users may carry a `password_hash` (scrypt, from
`portcullis-authserver hash-password`) or, for development only, a plain `password` that is
hashed at load with a warning. Secrets may come from files (`client_secret_file`,
`${file:PATH}`). Loading also checks that the TLS certificate and key load; `check` (and
`run`) besides that the SQLite database's directory is there and writable.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import ipaddress
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import jwt

from portcullis import tls, yamlconf
from portcullis.addresses import IPNetwork, network
from portcullis.tls import ServerTls
from portcullis.yamlconf import ConfigError, LocatedMap, Reader, Section, Withheld

from . import users as users_module
from .protocol.cors import origin

log = logging.getLogger("portcullis.authserver.settings")

SIGNING_ALGORITHMS = ("ES256", "RS256", "EdDSA")
AUTH_METHODS = ("client_secret_basic", "client_secret_post", "private_key_jwt", "none")
APPLICATION_TYPES = ("web", "native")  # OIDC Dynamic Client Registration §2; web by default
GRANT_TYPES = (
    "authorization_code",
    "client_credentials",
    "refresh_token",
    "urn:ietf:params:oauth:grant-type:device_code",
)
STANDARD_SCOPES = {
    "openid": "Sign you in",
    "profile": "Know your name",
    "email": "Know your email address",
    "address": "Know your postal address",
    "phone": "Know your phone number",
    "offline_access": "Stay connected when you are away",
}
_SCOPE_TOKEN = re.compile(r"^[\x21\x23-\x5B\x5D-\x7E]+$")
_CLIENT_ID = re.compile(r"^[\x21-\x7E]{1,128}$")
# OIDC Core §5.1 standard claims a user record may carry.
USER_CLAIMS = (
    "name",
    "given_name",
    "family_name",
    "middle_name",
    "nickname",
    "preferred_username",
    "profile",
    "picture",
    "website",
    "gender",
    "birthdate",
    "zoneinfo",
    "locale",
    "email",
    "email_verified",
    "phone_number",
    "phone_number_verified",
    "address",
)


@dataclass(frozen=True)
class Address:
    host: str
    port: int


@dataclass(frozen=True)
class KeySettings:
    dir: str
    access_token_alg: str = "ES256"  # noqa: S105 - an algorithm name, not a secret
    id_token_alg: str = "RS256"  # noqa: S105
    # How long the JWKS response may be cached (its Cache-Control max-age): whole seconds.
    jwks_max_age: timedelta = timedelta(minutes=5)
    # How long a new key is published before it signs. A verifier that fetched the key set
    # just before the key appeared keeps that copy for jwks_max_age, so this is never less.
    publish_ahead: timedelta = timedelta(minutes=5)
    rotate_every: timedelta | None = None  # automatic rotation; None: only by command


@dataclass(frozen=True)
class Lifetimes:
    authorization_code: timedelta = timedelta(seconds=60)
    device_code: timedelta = timedelta(minutes=10)  # RFC 8628 §3.2 expires_in
    access_token: timedelta = timedelta(minutes=5)
    id_token: timedelta = timedelta(minutes=5)
    refresh_token_idle: timedelta = timedelta(days=14)
    refresh_token_absolute: timedelta = timedelta(days=90)
    session: timedelta = timedelta(hours=12)


@dataclass(frozen=True)
class LoginThrottle:
    """Wrong passwords, counted when tried (endpoints/signin.py has the policy and its bounds)."""

    # Per username at one client address: a hard limit that only that address runs into.
    max_failures: int = 5
    # Per client address, any username: higher, since many people may share one address.
    max_failures_per_address: int = 20
    window: timedelta = timedelta(minutes=15)
    # Per username from every address: after this many, each attempt for the username waits
    # after the previous one a delay doubling from BACKOFF_FIRST_DELAY up to backoff_max.
    # Delays, not a lock: anyone can send wrong passwords for a username.
    backoff_after: int = 10
    backoff_max: timedelta = timedelta(minutes=1)


BACKOFF_FIRST_DELAY = timedelta(seconds=1)


@dataclass(frozen=True)
class DeviceSettings:
    """The device authorization grant (RFC 8628): polling and the user-code page's throttle."""

    interval: timedelta = timedelta(seconds=5)  # the least time between two polls
    # Wrong user codes per browser session, and per client address (higher: many people
    # may share one address), within `window`.
    max_failures: int = 5
    max_failures_per_address: int = 20
    window: timedelta = timedelta(minutes=15)


@dataclass(frozen=True)
class PasswordHashing:
    """Password checks (scrypt, about 32 MiB and tens of milliseconds each): how many run at
    once, and how many may wait for them before a sign-in is answered 503."""

    workers: int = 2
    max_waiting: int = 16


@dataclass(frozen=True)
class ScopeSettings:
    name: str
    description: str


@dataclass(frozen=True)
class UserSettings:
    username: str
    password_hash: str
    subject: str
    claims: Mapping[str, Any]
    line: int = 0


@dataclass(frozen=True)
class ClientSettings:
    client_id: str
    client_name: str
    token_endpoint_auth_method: str
    client_secret_sha256: bytes | None  # secrets are high-entropy: a fast hash is enough
    redirect_uris: tuple[str, ...] = ()
    post_logout_redirect_uris: tuple[str, ...] = ()
    grant_types: tuple[str, ...] = ("authorization_code",)
    scope: tuple[str, ...] = ()
    resources: tuple[str, ...] = ()  # RFC 8707 audiences this client may ask for
    jwks: Mapping[str, Any] | None = None  # for private_key_jwt
    require_pkce: bool = True
    skip_consent: bool = False
    id_token_signed_response_alg: str | None = None  # None: keys.id_token_alg
    introspection: bool = False
    application_type: str = "web"  # OIDC Dynamic Client Registration §2: web | native
    line: int = 0

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


REFRESH_GRACE = timedelta(seconds=5)


@dataclass(frozen=True)
class CorsSettings:
    """Browser pages that may read answers, beyond the origins of the browser clients'
    redirect URIs (protocol/cors.py has the policy)."""

    allow_origins: tuple[str, ...] = ()


@dataclass(frozen=True)
class Settings:
    file: str
    issuer: str
    storage: str
    keys: KeySettings
    listen: Address = Address("0.0.0.0", 9000)
    default_audience: str | None = None
    lifetimes: Lifetimes = field(default_factory=Lifetimes)
    # A retry of a lost refresh response gets that response again for this long (README,
    # security notes: a server killed between the commit and the answer logs nobody out).
    refresh_grace: timedelta = REFRESH_GRACE
    login_throttle: LoginThrottle = field(default_factory=LoginThrottle)
    password_hashing: PasswordHashing = field(default_factory=PasswordHashing)
    # Peers whose X-Forwarded-For names the client (for the throttles' per-address counts).
    trusted_proxies: tuple[IPNetwork, ...] = ()
    device: DeviceSettings = field(default_factory=DeviceSettings)
    scopes: tuple[ScopeSettings, ...] = ()
    users: tuple[UserSettings, ...] = ()
    clients: tuple[ClientSettings, ...] = ()
    cors: CorsSettings = field(default_factory=CorsSettings)
    log_level: str = "info"
    # /healthz, /readyz and /metrics: for probes and scrapers, apart from the public listener.
    admin_listen: Address = Address("127.0.0.1", 9902)
    # The longest a private_key_jwt assertion may live (exp - now); each jti is kept that long.
    client_assertion_max_lifetime: timedelta = timedelta(hours=1)
    tls: ServerTls | None = None  # None: plain HTTP (TLS ends in front of the server)

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
    def secure_cookies(self) -> bool:
        return self.issuer.startswith("https://")

    # Lookups by key, built on first use. Records hold mappings (claims, jwks) and so are not
    # hashable: the indexes live on the instance rather than in a cache keyed by the records.
    @functools.cached_property
    def _clients_by_id(self) -> dict[str, ClientSettings]:
        return {c.client_id: c for c in self.clients}

    @functools.cached_property
    def _users_by_name(self) -> dict[str, UserSettings]:
        return {u.username: u for u in self.users}

    @functools.cached_property
    def _users_by_subject(self) -> dict[str, UserSettings]:
        return {u.subject: u for u in self.users}

    @functools.cached_property
    def _scope_descriptions(self) -> dict[str, str]:
        return {**STANDARD_SCOPES, **{s.name: s.description for s in self.scopes}}

    def client(self, client_id: str) -> ClientSettings | None:
        return self._clients_by_id.get(client_id)

    def user(self, username: str) -> UserSettings | None:
        return self._users_by_name.get(username)

    def user_by_subject(self, subject: str) -> UserSettings | None:
        return self._users_by_subject.get(subject)

    def scope_description(self, name: str) -> str:
        return self._scope_descriptions.get(name, name)


# ---------------------------------------------------------------------------- loading


def load(
    path: str,
    env: Mapping[str, str] | None = None,
    *,
    secrets: bool = True,
    storage: bool = False,
) -> Settings:
    """Read and validate a config file; raise ConfigError listing every problem.

    `secrets=False` is for commands that serve nothing and use no secret (`keys list`,
    `keys rotate`): secrets and TLS files are then neither read nor checked. `storage=True`
    also checks that the database can be opened where it is configured (for `run`).
    """
    data = yamlconf.load_file(path, env, keep_incomplete=True)
    return parse(data, path, secrets=secrets, storage=storage)


def load_text(
    text: str, file: str = "<text>", env: Mapping[str, str] | None = None, *, secrets: bool = True
) -> Settings:
    return parse(yamlconf.load_text(text, file, env, keep_incomplete=True), file, secrets=secrets)


def check(path: str, env: Mapping[str, str] | None = None) -> list[str]:
    """Every problem `run` would meet, as `FILE:LINE: message`; empty when there is none."""
    try:
        load(path, env, storage=True)
    except ConfigError as exc:
        return [str(p) for p in exc.problems]
    return []


def parse(data: LocatedMap, file: str, *, secrets: bool = True, storage: bool = False) -> Settings:
    reader = Reader(file, data.incomplete, secrets=secrets)
    top = Section(reader, data, "config")
    issuer = top.get("issuer", _issuer)
    scopes = _scopes(reader, top)
    known_scopes = set(STANDARD_SCOPES) | {s.name for s in scopes}
    settings = Settings(
        file=file,
        issuer=issuer or "https://invalid",
        storage=top.get("storage", _storage),
        keys=_keys(reader, top),
        listen=top.get("listen", _address, Settings.listen),
        default_audience=top.get("default_audience", yamlconf.non_empty_string, None),
        lifetimes=_lifetimes(reader, top),
        refresh_grace=top.get("refresh_grace", _grace, REFRESH_GRACE),
        login_throttle=_throttle(reader, top),
        password_hashing=_password_hashing(top),
        trusted_proxies=top.list_of("trusted_proxies", network),
        device=_device(reader, top),
        scopes=scopes,
        users=_users(reader, top, issuer or ""),
        clients=_clients(reader, top, known_scopes),
        cors=_cors(top),
        log_level=top.get(
            "log_level", yamlconf.one_of("debug", "info", "warning", "error"), "info"
        ),
        admin_listen=top.get("admin_listen", _address, Settings.admin_listen),
        client_assertion_max_lifetime=top.get(
            "client_assertion_max_lifetime",
            _assertion_lifetime,
            Settings.client_assertion_max_lifetime,
        ),
        tls=(
            tls.parse_server(reader, top.raw("tls"), "tls", top.line_of("tls"), client_auth=False)
            if top.has("tls")
            else None
        ),
    )
    if settings.admin_listen == settings.listen:
        reader.problem(top.line_of("admin_listen"), "admin_listen must differ from listen")
    top.finish()
    if settings.tls is not None and issuer and urlsplit(issuer).scheme != "https":
        reader.problem(
            top.line_of("issuer"),
            "config.issuer: must be https:// when the server itself serves TLS (tls:)",
        )
    if storage and settings.storage:
        problem = _database_problem(settings.storage)
        if problem:
            reader.problem(top.line_of("storage"), f"config.storage: {problem}")
    reader.raise_if_any()
    return settings


def _database_problem(storage: str) -> str | None:
    """Why a SQLite database could not be opened for writing here, if that can be told
    beforehand: its directory missing or not writable (SQLite writes its WAL beside it)."""
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


def _issuer(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    parts = urlsplit(text)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise ValueError(f"{text!r} is not an https URL")
    if parts.query or parts.fragment or text.endswith("/"):
        raise ValueError("an issuer has no query, fragment or trailing slash (RFC 8414 §2)")
    if parts.scheme == "http" and not _loopback(parts.hostname):
        raise ValueError("the issuer must be https (plain http only on loopback, for development)")
    return text


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _storage(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if text.startswith("sqlite:///") or text == "sqlite://:memory:":
        return text
    if text.startswith(("postgresql://", "postgres://")):
        return text
    raise ValueError("storage is sqlite:///PATH or postgresql://user@host/db")


def _address(value: Any) -> Address:
    text = yamlconf.string(value)
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise ValueError(f"{text!r} is not host:port")
    return Address(host.strip("[]"), int(port))


def _assertion_lifetime(value: Any) -> timedelta:
    lifetime = yamlconf.duration(value)
    if not timedelta(seconds=1) <= lifetime <= timedelta(days=1):
        raise ValueError("between 1s and 1d: each assertion's jti is kept that long")
    return lifetime


def _grace(value: Any) -> timedelta:
    grace = yamlconf.duration(value)
    if grace > timedelta(seconds=10):
        raise ValueError("at most 10s: the grace only covers an immediate retry")
    return grace


def _keys(reader: Reader, top: Section) -> KeySettings:
    sec = reader.section(top.raw("keys"), "keys", top.line_of("keys"))
    if sec is None:
        return KeySettings(dir="")
    alg = yamlconf.one_of(*SIGNING_ALGORITHMS)
    d = KeySettings(dir="")
    max_age = sec.get("jwks_max_age", _whole_seconds, d.jwks_max_age)
    publish_ahead = sec.get("publish_ahead", yamlconf.duration, max_age)
    rotate_every = sec.get("rotate_every", yamlconf.duration, None)
    result = KeySettings(
        dir=sec.get("dir", yamlconf.non_empty_string) or "",
        access_token_alg=sec.get("access_token_alg", alg, "ES256"),
        id_token_alg=sec.get("id_token_alg", alg, "RS256"),
        jwks_max_age=max_age,
        publish_ahead=publish_ahead,
        rotate_every=rotate_every,
    )
    sec.finish()
    if publish_ahead < max_age:
        reader.problem(
            sec.line_of("publish_ahead"),
            "keys.publish_ahead: must be at least keys.jwks_max_age "
            f"({_seconds_text(max_age)}): verifiers may keep the key set that long, and a key "
            "published for less could sign tokens they cannot verify yet",
        )
    if rotate_every is not None and rotate_every < max(publish_ahead, timedelta(seconds=1)):
        reader.problem(
            sec.line_of("rotate_every"),
            "keys.rotate_every: must be at least keys.publish_ahead "
            f"({_seconds_text(publish_ahead)}) and at least 1s",
        )
    return result


def _whole_seconds(value: Any) -> timedelta:
    """A duration of at least one second, in whole seconds (HTTP and RFC 8628 count so)."""
    result = yamlconf.duration(value)
    seconds = result.total_seconds()
    if seconds < 1 or seconds != int(seconds):
        raise ValueError(f"{value!r} must be a whole number of seconds, at least 1s")
    return result


def _seconds_text(value: timedelta) -> str:
    return f"{value.total_seconds():g}s"


def _device(reader: Reader, top: Section) -> DeviceSettings:
    sec = top.subsection("device")
    if sec is None:
        return DeviceSettings()
    d = DeviceSettings()
    result = DeviceSettings(
        interval=sec.get("interval", _whole_seconds, d.interval),
        max_failures=sec.get("max_failures", yamlconf.integer(1, 1000), d.max_failures),
        max_failures_per_address=sec.get(
            "max_failures_per_address", yamlconf.integer(1, 100_000), d.max_failures_per_address
        ),
        window=sec.get("window", yamlconf.duration, d.window),
    )
    if result.window <= timedelta(0):
        reader.problem(sec.line_of("window"), "device.window: must be longer than 0s")
    sec.finish()
    return result


def _lifetimes(reader: Reader, top: Section) -> Lifetimes:
    sec = top.subsection("lifetimes")
    if sec is None:
        return Lifetimes()
    d = Lifetimes()
    result = Lifetimes(
        **{
            name: sec.get(name, yamlconf.duration, getattr(d, name))
            for name in (
                "authorization_code",
                "device_code",
                "access_token",
                "id_token",
                "refresh_token_idle",
                "refresh_token_absolute",
                "session",
            )
        }
    )
    sec.finish()
    if result.device_code <= timedelta(0):
        reader.problem(sec.line_of("device_code"), "lifetimes.device_code: must be longer than 0s")
    if result.refresh_token_idle > result.refresh_token_absolute:
        reader.problem(sec.line, "lifetimes: refresh_token_idle exceeds refresh_token_absolute")
    return result


def _throttle(reader: Reader, top: Section) -> LoginThrottle:
    sec = top.subsection("login_throttle")
    if sec is None:
        return LoginThrottle()
    d = LoginThrottle()
    result = LoginThrottle(
        max_failures=sec.get("max_failures", yamlconf.integer(1, 1000), d.max_failures),
        max_failures_per_address=sec.get(
            "max_failures_per_address", yamlconf.integer(1, 100_000), d.max_failures_per_address
        ),
        window=sec.get("window", yamlconf.duration, d.window),
        backoff_after=sec.get("backoff_after", yamlconf.integer(1, 1000), d.backoff_after),
        backoff_max=sec.get("backoff_max", yamlconf.duration, d.backoff_max),
    )
    if result.window <= timedelta(0):
        reader.problem(sec.line_of("window"), "login_throttle.window: must be longer than 0s")
    if result.backoff_max < BACKOFF_FIRST_DELAY:
        reader.problem(
            sec.line_of("backoff_max"),
            f"login_throttle.backoff_max: must be at least {_seconds_text(BACKOFF_FIRST_DELAY)}",
        )
    sec.finish()
    return result


def _password_hashing(top: Section) -> PasswordHashing:
    sec = top.subsection("password_hashing")
    if sec is None:
        return PasswordHashing()
    d = PasswordHashing()
    result = PasswordHashing(
        workers=sec.get("workers", yamlconf.integer(1, 64), d.workers),
        max_waiting=sec.get("max_waiting", yamlconf.integer(0, 10_000), d.max_waiting),
    )
    sec.finish()
    return result


def _cors(top: Section) -> CorsSettings:
    sec = top.subsection("cors")
    if sec is None:
        return CorsSettings()
    result = CorsSettings(allow_origins=sec.list_of("allow_origins", _allowed_origin))
    sec.finish()
    return result


def _allowed_origin(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if text == "*":
        raise ValueError("'*' is not allowed: the token endpoint never answers every origin")
    parts = urlsplit(text)
    serialized = origin(text)
    if serialized is None or parts.path or parts.query or parts.fragment or "@" in text:
        raise ValueError(
            f"{text!r} is not an origin (scheme://host[:port], no path or trailing slash)"
        )
    if parts.scheme.lower() == "http" and not _loopback(parts.hostname or ""):
        # A page served over plain http can be rewritten on the way: it would read tokens.
        raise ValueError(f"{text!r}: plain http origins are for loopback only")
    # As browsers send it: lower case, no default port (RFC 6454 §6.2).
    return serialized


def _scope_name(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    if not _SCOPE_TOKEN.match(text):
        raise ValueError(f"{text!r} is not a scope token")
    return text


def _scopes(reader: Reader, top: Section) -> tuple[ScopeSettings, ...]:
    result: list[ScopeSettings] = []
    for index, line, item in reader.items(top.raw("scopes"), "scopes", top.line_of("scopes")):
        sec = reader.section(item, f"scopes[{index}]", line)
        if sec is None:
            continue
        name = sec.get("name", _scope_name)
        description = sec.get("description", yamlconf.non_empty_string, None)
        sec.finish()
        if name and any(s.name == name for s in result):
            reader.problem(line, f"scopes[{index}]: scope {name!r} is listed twice")
        elif name:
            result.append(ScopeSettings(name, description or STANDARD_SCOPES.get(name, name)))
    return tuple(result)


def default_subject(issuer: str, username: str) -> str:
    """A stable, opaque subject for a configured user who was given none (never the email)."""
    digest = hashlib.sha256(f"{issuer}\x00{username}".encode()).digest()
    return base64.urlsafe_b64encode(digest[:16]).rstrip(b"=").decode()


def _users(reader: Reader, top: Section, issuer: str) -> tuple[UserSettings, ...]:
    result = []
    seen: set[str] = set()
    for index, line, item in reader.items(top.raw("users"), "users", top.line_of("users")):
        sec = reader.section(item, f"users[{index}]", line)
        if sec is None:
            continue
        username = sec.get("username", yamlconf.non_empty_string)
        password_hash = sec.secret("password_hash")
        password = sec.secret("password")
        withheld = isinstance(password_hash, Withheld) or isinstance(password, Withheld)
        if withheld:
            password_hash, password = yamlconf.WITHHELD, None
        if password_hash and not withheld and not users_module.is_hash(password_hash):
            reader.problem(
                sec.line_of("password_hash"), f"users[{index}].password_hash: not a scrypt hash"
            )
        if password is not None and password_hash is not None:
            reader.problem(
                sec.line_of("password" if sec.has("password") else "password_file"),
                f"users[{index}]: give password_hash or password, not both",
            )
        elif password is not None:
            log.warning(
                "plain-text password in the config: use hash-password outside development",
                extra={"username": username},
            )
            password_hash = users_module.hash_password(password)
        given = ("password_hash", "password_hash_file", "password", "password_file")
        if password_hash is None and not any(sec.has(key) for key in given):
            reader.problem(
                line, f"users[{index}]: give password_hash (or password for development)"
            )
        subject = sec.get("sub", yamlconf.non_empty_string, None)
        claims = {name: sec.raw(name) for name in USER_CLAIMS if sec.has(name)}
        sec.finish()
        if username in seen:
            reader.problem(line, f"users[{index}]: username {username!r} is listed twice")
        if username:
            seen.add(username)
            result.append(
                UserSettings(
                    username=username,
                    password_hash=password_hash or "",
                    subject=subject or default_subject(issuer, username),
                    claims=claims,
                    line=line,
                )
            )
    return tuple(result)


def _redirect_uri(value: Any) -> str:
    text = yamlconf.non_empty_string(value)
    parts = urlsplit(text)
    if not parts.scheme:
        raise ValueError(f"{text!r} is not an absolute URI")
    if parts.fragment or "#" in text:
        raise ValueError(f"{text!r} must not contain a fragment (RFC 6749 §3.1.2)")
    if parts.scheme == "http" and not _loopback(parts.hostname or ""):
        raise ValueError(f"{text!r}: plain http redirects are for loopback only (RFC 9700 §2.1)")
    return text


def _jwks_problem(jwks: Any) -> str | None:
    """What makes `jwks` unusable as a client's public JWK Set (RFC 7517 §5), if anything."""
    keys = jwks.get("keys") if isinstance(jwks, dict) else None
    if not isinstance(keys, list) or not keys:
        return "must be a JWK Set: a mapping with a non-empty keys list"
    for index, key in enumerate(keys):
        if not isinstance(key, dict):
            return f"keys[{index}] must be a mapping"
        if any(member in key for member in ("d", "p", "q", "k")):
            return f"keys[{index}] holds private key material: give the public key only"
        try:
            jwt.PyJWK(dict(key))
        except (jwt.PyJWTError, ValueError, TypeError) as exc:
            return f"keys[{index}] is not a usable public key ({exc})"
    return None


def _clients(reader: Reader, top: Section, known_scopes: set[str]) -> tuple[ClientSettings, ...]:
    result = []
    seen: set[str] = set()
    for index, line, item in reader.items(top.raw("clients"), "clients", top.line_of("clients")):
        sec = reader.section(item, f"clients[{index}]", line)
        if sec is None:
            continue
        client_id = sec.get("client_id", yamlconf.non_empty_string)
        where = f"client {client_id!r}"
        sec.where = where
        if client_id and not _CLIENT_ID.match(client_id):
            reader.problem(sec.line_of("client_id"), f"{where}: client_id must be printable ASCII")
        # Given, whether or not its value could be read (that problem is reported once).
        has_secret = sec.has("client_secret") or sec.has("client_secret_file")
        secret = sec.secret("client_secret")
        secret_line = sec.line_of(
            "client_secret" if sec.has("client_secret") else "client_secret_file"
        )
        method = sec.get(
            "token_endpoint_auth_method",
            yamlconf.one_of(*AUTH_METHODS),
            "client_secret_basic" if has_secret else "none",
        )
        grant_types = sec.list_of(
            "grant_types", yamlconf.one_of(*GRANT_TYPES), ("authorization_code",)
        )
        scope = sec.get("scope", yamlconf.string, "")
        scope_tokens = tuple(scope.split())
        for token in scope_tokens:
            if token not in known_scopes:
                reader.problem(
                    sec.line_of("scope"), f"{where}.scope: {token!r} is not in the scopes list"
                )
        jwks = sec.raw("jwks")
        require_pkce = sec.get("require_pkce", yamlconf.boolean, True)
        redirect_uris = sec.list_of("redirect_uris", _redirect_uri)
        client = ClientSettings(
            client_id=client_id or "",
            client_name=sec.get("client_name", yamlconf.non_empty_string, client_id or ""),
            token_endpoint_auth_method=method,
            client_secret_sha256=(
                hashlib.sha256(secret.encode()).digest()
                if secret and not isinstance(secret, Withheld)
                else None  # a withheld secret authenticates nobody
            ),
            redirect_uris=redirect_uris,
            post_logout_redirect_uris=sec.list_of("post_logout_redirect_uris", _redirect_uri),
            grant_types=grant_types,
            scope=scope_tokens,
            resources=sec.list_of("resources", yamlconf.non_empty_string),
            jwks=jwks if isinstance(jwks, dict) else None,
            require_pkce=require_pkce,
            skip_consent=sec.get("skip_consent", yamlconf.boolean, False),
            id_token_signed_response_alg=sec.get(
                "id_token_signed_response_alg", yamlconf.one_of(*SIGNING_ALGORITHMS), None
            ),
            introspection=sec.get("introspection", yamlconf.boolean, False),
            application_type=sec.get(
                "application_type", yamlconf.one_of(*APPLICATION_TYPES), "web"
            ),
            line=line,
        )
        sec.finish()
        if method in ("client_secret_basic", "client_secret_post") and not has_secret:
            reader.problem(line, f"{where}: {method} needs client_secret")
        if method in ("none", "private_key_jwt") and has_secret:
            reader.problem(secret_line, f"{where}: {method} clients have no secret")
        if secret and not isinstance(secret, Withheld) and len(secret) < 32:
            reader.problem(
                secret_line,
                f"{where}.client_secret: use at least 32 random characters "
                "(secrets are stored with a fast hash, so they must not be guessable)",
            )
        if method == "private_key_jwt" and jwks is None:
            reader.problem(line, f"{where}: private_key_jwt needs jwks (the client's public keys)")
        elif jwks is not None:
            problem = _jwks_problem(jwks)
            if problem:
                reader.problem(sec.line_of("jwks"), f"{where}.jwks: {problem}")
        if client.public and not require_pkce:
            reader.problem(sec.line_of("require_pkce"), f"{where}: public clients always use PKCE")
        if client.public and "client_credentials" in grant_types:
            reader.problem(
                sec.line_of("grant_types"),
                f"{where}: client_credentials needs a confidential client",
            )
        # An invalid URI is reported on its own line; here only a missing or empty list.
        if "authorization_code" in grant_types and not sec.raw("redirect_uris"):
            reader.problem(line, f"{where}: authorization_code needs redirect_uris")
        if client_id in seen:
            reader.problem(line, f"{where}: client_id is listed twice")
        if client_id:
            seen.add(client_id)
            result.append(client)
    return tuple(result)
