"""Clients and users as the running server knows them, and where it looks them up.

`Client` and `User` are domain records: what client authentication, the grants and the pages
work with, apart from the configuration file's shape (settings.ClientSettings and
UserSettings, which also carry the YAML's line numbers). `from_settings` is the one adapter
from the one to the other.

Lookups are asynchronous (`ClientRegistry`, `UserDirectory`), so that the YAML seeds behind
them today and the store behind them tomorrow look the same to every caller.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .settings import ClientSettings, Settings, UserSettings


@dataclass(frozen=True)
class Client:
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


@dataclass(frozen=True)
class User:
    username: str
    password_hash: str
    subject: str
    claims: Mapping[str, Any]  # OIDC Core §5.1 standard claims

    @property
    def display_name(self) -> str:
        return str(self.claims.get("name") or self.username)


class ClientRegistry(Protocol):
    async def client(self, client_id: str) -> Client | None: ...


class UserDirectory(Protocol):
    async def by_username(self, username: str) -> User | None: ...

    async def by_subject(self, subject: str) -> User | None: ...


class SeededClients:
    """The clients of the configuration file."""

    def __init__(self, clients: Iterable[Client]) -> None:
        self._by_id = {c.client_id: c for c in clients}

    async def client(self, client_id: str) -> Client | None:
        return self._by_id.get(client_id)


class SeededUsers:
    """The users of the configuration file."""

    def __init__(self, users: Iterable[User]) -> None:
        listed = list(users)
        self._by_name = {u.username: u for u in listed}
        self._by_subject = {u.subject: u for u in listed}

    async def by_username(self, username: str) -> User | None:
        return self._by_name.get(username)

    async def by_subject(self, subject: str) -> User | None:
        return self._by_subject.get(subject)


# ---------------------------------------------------------------------------- the adapter


def client_from_settings(c: ClientSettings) -> Client:
    return Client(
        client_id=c.client_id,
        client_name=c.client_name,
        token_endpoint_auth_method=c.token_endpoint_auth_method,
        client_secret_sha256=c.client_secret_sha256,
        redirect_uris=c.redirect_uris,
        post_logout_redirect_uris=c.post_logout_redirect_uris,
        grant_types=c.grant_types,
        scope=c.scope,
        resources=c.resources,
        jwks=c.jwks,
        require_pkce=c.require_pkce,
        skip_consent=c.skip_consent,
        id_token_signed_response_alg=c.id_token_signed_response_alg,
        introspection=c.introspection,
        application_type=c.application_type,
    )


def user_from_settings(u: UserSettings, settings: Settings) -> User:
    """The user's subject is the configured one, or the one the issuer derives."""
    return User(
        username=u.username,
        password_hash=u.password_hash,
        subject=settings.subject_of(u),
        claims=u.claims,
    )


def from_settings(settings: Settings) -> tuple[SeededClients, SeededUsers]:
    """The registry and directory the configuration file seeds."""
    return (
        SeededClients(client_from_settings(c) for c in settings.clients),
        SeededUsers(user_from_settings(u, settings) for u in settings.users),
    )
