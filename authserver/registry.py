"""Clients and users as the running server knows them, and where it looks them up.

`Client` and `User` are domain records: what client authentication, the grants and the pages
work with, apart from how a client or user is declared (declarations.DeclaredClient and
DeclaredUser, read from the configuration file, with its line numbers, or from an admin API
body) and from the store's rows (store.base.ClientRecord and UserRecord). The adapters
between them are here, once.

Lookups are asynchronous (`ClientRegistry`, `UserDirectory`). The server's are backed by the
store (`StoredClients`, `StoredUsers`): every lookup reads it, with no copy kept in the
process, so a client deleted or a secret rotated through the admin API, by any replica, is
refused by every replica at the next request. The configuration file's clients and users
are seeds, written to the store at start and on every reload (`seed`), managed by the
configuration there and read-only in the admin API. A disabled user is not found: nobody
signs in as them, and their sessions and refresh tokens lead nowhere.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from .clock import Clock
from .declarations import DeclaredClient, DeclaredUser
from .store.base import (
    MANAGED_BY_CONFIG,
    MANAGED_BY_DYNAMIC,
    MANAGED_BY_METADATA_DOCUMENT,
    ClientRecord,
    Store,
    UserRecord,
)

# Clients nobody configured: registered by themselves (RFC 7591) or by a metadata document.
_SELF_REGISTERED = frozenset({MANAGED_BY_DYNAMIC, MANAGED_BY_METADATA_DOCUMENT})


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
    dpop_bound_access_tokens: bool = False  # RFC 9449 §5.2: token requests need a proof
    application_type: str = "web"  # OIDC Dynamic Client Registration §2: web | native
    # Sign-ins for this client need a second factor (protocol/assurance.py).
    require_mfa: bool = False
    default_acr_values: tuple[str, ...] = ()  # when a request has no acr_values
    # Access tokens issued (iat, whole seconds) in this time's second or before are
    # inactive: the secret was rotated since, or the client deleted and made again.
    tokens_valid_from: float = 0.0
    managed_by: str = MANAGED_BY_CONFIG
    # A client that registered itself and has obtained no token yet: gone after this time
    # (store.base.ClientRecord); its first token keeps it.
    unused_until: float | None = None

    @property
    def public(self) -> bool:
        return self.token_endpoint_auth_method == "none"  # noqa: S105 - a method name

    @property
    def loopback_any_port(self) -> bool:
        """Whether a loopback IP redirect URI matches on any port. RFC 8252 §7.3 gives that
        to native apps, which are public clients (§8.4): the port is picked when the app
        runs. A native app registered with a secret or keys is held to exact matching like
        every other client (RFC 9700 §2.1), and so is a client of a metadata document,
        whose redirect URIs are matched exactly against the document."""
        return (
            self.application_type == "native"
            and self.public
            and self.managed_by != MANAGED_BY_METADATA_DOCUMENT
        )


@dataclass(frozen=True)
class User:
    username: str
    password_hash: str
    subject: str
    claims: Mapping[str, Any]  # OIDC Core §5.1 standard claims, and `roles` when it has some
    roles: tuple[str, ...] = ()

    @property
    def display_name(self) -> str:
        return str(self.claims.get("name") or self.username)


class ClientRegistry(Protocol):
    async def client(self, client_id: str) -> Client | None: ...


class UserDirectory(Protocol):
    async def by_username(self, username: str) -> User | None: ...

    async def by_subject(self, subject: str) -> User | None: ...


class StoredClients:
    """The clients of the store: read at every lookup.

    What is derived from a record (its `Client`) is kept beside the record it came from, for
    the `keep` clients looked up last, and given again only while the store answers with a
    record equal to that one in every field: a rotated secret, changed metadata, a moved
    cut-off, a client deleted and made again are other records, in force at the next lookup.
    Nothing of the store's answer is kept in its place: a deleted client is not found, nor
    a blocked one, nor one that registered itself and let its time to obtain a token pass
    (the purge removes it later)."""

    def __init__(
        self,
        store: Store,
        clock: Clock = time.time,
        keep: int = 1024,
        self_registered_scopes: frozenset[str] = frozenset(),
    ) -> None:
        """`self_registered_scopes`: what a client that registered itself, or that a
        metadata document describes, may ask for, whatever scope its registration named."""
        self._store = store
        self._clock = clock
        self._keep = keep
        self._self_registered = self_registered_scopes
        self._derived: OrderedDict[str, tuple[ClientRecord, Client]] = OrderedDict()

    async def client(self, client_id: str) -> Client | None:
        record = await self._store.get_client(client_id)
        if record is None or not in_force(record, self._clock()):
            self._derived.pop(client_id, None)
            return None
        kept = self._derived.get(client_id)
        # The same record (the store gives an unchanged row's record again), else an equal one.
        if kept is not None and (kept[0] is record or kept[0] == record):
            self._derived.move_to_end(client_id)
            return kept[1]
        client = client_from_record(record)
        if record.managed_by in _SELF_REGISTERED and self._self_registered:
            # Its registration could not know the scopes a resource would challenge it for
            # later (MCP: a 403 insufficient_scope naming more); it keeps its registration
            # and asks again, and the user's consent decides what is granted.
            client = replace(client, scope=tuple(sorted(self._self_registered)))
        self._derived[client_id] = (record, client)
        self._derived.move_to_end(client_id)
        if len(self._derived) > self._keep:
            self._derived.popitem(last=False)
        return client


def in_force(record: ClientRecord, now: float) -> bool:
    """Whether a stored client may be used now: not blocked, and not past its time to
    obtain a first token."""
    return not record.blocked and (record.unused_until is None or record.unused_until > now)


class StoredUsers:
    """The users of the store, disabled ones left out: read at every lookup."""

    def __init__(self, store: Store) -> None:
        self._store = store

    async def by_username(self, username: str) -> User | None:
        return _enabled(await self._store.user_by_username(username))

    async def by_subject(self, subject: str) -> User | None:
        return _enabled(await self._store.get_user(subject))


def _enabled(record: UserRecord | None) -> User | None:
    return None if record is None or record.disabled else user_from_record(record)


# ---------------------------------------------------------------------------- the adapters

# What a client's metadata holds besides its id and secret: RFC 7591 names, as in the
# configuration file.
CLIENT_METADATA = (
    "client_name",
    "token_endpoint_auth_method",
    "redirect_uris",
    "post_logout_redirect_uris",
    "grant_types",
    "scope",
    "resources",
    "jwks",
    "require_pkce",
    "skip_consent",
    "id_token_signed_response_alg",
    "introspection",
    "dpop_bound_access_tokens",
    "application_type",
    "require_mfa",
    "default_acr_values",
)


def client_metadata(c: DeclaredClient) -> dict[str, Any]:
    """The metadata of a declared client, as JSON values (lists, strings)."""
    out: dict[str, Any] = {}
    for name in CLIENT_METADATA:
        value = getattr(c, name)
        if name == "scope":
            value = " ".join(value)
        elif isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, Mapping):
            value = plain(value)
        out[name] = value
    return out


def plain(value: Any) -> Any:
    """Mappings and sequences read from YAML as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def client_record(
    c: DeclaredClient, managed_by: str, now: float, secret_sha256: bytes | None = None
) -> ClientRecord:
    """A new client's row from its declaration; `secret_sha256` for a secret the
    declaration does not hold (one the admin API generated)."""
    return ClientRecord(
        client_id=c.client_id,
        metadata=client_metadata(c),
        secret_sha256=c.client_secret_sha256 if secret_sha256 is None else secret_sha256,
        managed_by=managed_by,
        created_at=now,
        updated_at=now,
        # A new client cuts off nothing of its own second: it gets tokens at once.
        tokens_valid_from=now - 1,
    )


def client_from_record(r: ClientRecord) -> Client:
    m = r.metadata
    jwks = m.get("jwks")
    return Client(
        client_id=r.client_id,
        client_name=str(m.get("client_name") or r.client_id),
        token_endpoint_auth_method=str(m.get("token_endpoint_auth_method", "none")),
        client_secret_sha256=r.secret_sha256,
        redirect_uris=tuple(m.get("redirect_uris", ())),
        post_logout_redirect_uris=tuple(m.get("post_logout_redirect_uris", ())),
        grant_types=tuple(m.get("grant_types", ("authorization_code",))),
        scope=tuple(str(m.get("scope", "")).split()),
        resources=tuple(m.get("resources", ())),
        jwks=jwks if isinstance(jwks, Mapping) else None,
        require_pkce=bool(m.get("require_pkce", True)),
        skip_consent=bool(m.get("skip_consent", False)),
        id_token_signed_response_alg=m.get("id_token_signed_response_alg"),
        introspection=bool(m.get("introspection", False)),
        dpop_bound_access_tokens=bool(m.get("dpop_bound_access_tokens", False)),
        application_type=str(m.get("application_type", "web")),
        require_mfa=bool(m.get("require_mfa", False)),
        default_acr_values=tuple(m.get("default_acr_values", ())),
        tokens_valid_from=r.tokens_valid_from,
        managed_by=r.managed_by,
        unused_until=r.unused_until,
    )


def user_record(u: DeclaredUser, subject: str, managed_by: str, now: float) -> UserRecord:
    return UserRecord(
        subject=subject,
        username=u.username,
        password_hash=u.password_hash,
        claims=plain(u.claims),
        roles=tuple(u.roles),
        disabled=False,
        managed_by=managed_by,
        created_at=now,
        updated_at=now,
    )


def user_from_record(r: UserRecord) -> User:
    claims = dict(r.claims)
    if r.roles:
        claims["roles"] = list(r.roles)  # RFC 9068 §2.2.3.1, released by the `roles` scope
    return User(
        username=r.username,
        password_hash=r.password_hash,
        subject=r.subject,
        claims=claims,
        roles=r.roles,
    )


async def seed(
    store: Store,
    clients: Iterable[DeclaredClient],
    users: Iterable[tuple[DeclaredUser, str]],
    now: float,
) -> tuple[list[str], list[str]]:
    """Write the configuration file's clients and users (each with its subject) to the
    store, as the ones the configuration manages; those it no longer lists are removed. The
    client ids and subjects removed (their tokens are for the caller to revoke)."""
    removed_clients = await store.sync_clients(
        [client_record(c, MANAGED_BY_CONFIG, now) for c in clients], now
    )
    removed_users = await store.sync_users(
        [user_record(u, subject, MANAGED_BY_CONFIG, now) for u, subject in users], now
    )
    return removed_clients, removed_users


def secret_digest(secret: str) -> bytes:
    """What is kept of a client secret: secrets are high-entropy, a fast hash is enough."""
    return hashlib.sha256(secret.encode()).digest()
