"""The Store protocol: everything the authorization server persists, and its records.

Secrets never reach the store in clear: authorization codes, refresh tokens, device codes and
login session ids are stored as SHA-256 digests (`bytes`, 32 long). Times are seconds since
the epoch (float). Every method that changes state is atomic: two concurrent callers of
`consume_code` or `use_refresh` with the same value see exactly one success, and callers of
`reserve_attempt` racing on one key are never admitted beyond its limit. The `save_*`
methods raise `AlreadyExists` rather than overwrite a stored key (a clash of random secrets
means a bug, and a clash of device user codes means the caller should draw another one).

Backends: store/sqlite.py (embedded default), store/postgres.py (scale-out). Both pass
tests/authserver/store_conformance.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from authserver.protocol.throttle import Refuse, Rule


class AlreadyExists(Exception):
    """A `save_*` call named a key (hash, family id, user code) that is already stored."""


@dataclass(frozen=True)
class CodeRecord:
    code_hash: bytes
    client_id: str
    subject: str
    redirect_uri: str
    scope: str  # space-separated, as granted
    audience: str
    nonce: str | None
    code_challenge: str | None
    auth_time: float
    expires_at: float
    created_at: float


class RefreshOutcome(Enum):
    ROTATED = "rotated"  # was active: now rotated, the successor given was stored
    GRACE = "grace"  # was rotated within the grace window: `successor_sealed` returned
    REUSED = "reused"  # was rotated or revoked: the family is now revoked
    EXPIRED = "expired"  # idle or absolute lifetime over (nothing changed)
    UNKNOWN = "unknown"  # no such token


@dataclass(frozen=True)
class RefreshRecord:
    token_hash: bytes
    family_id: str
    client_id: str
    subject: str
    scope: str
    audience: str
    auth_time: float
    created_at: float
    expires_at: float  # idle expiry; sliding: each successor gets a new one
    family_expires_at: float  # absolute lifetime of the family
    state: str  # lifecycle.Refresh value
    rotated_at: float | None = None
    successor_sealed: bytes | None = None  # the successor response, encrypted with this token


@dataclass(frozen=True)
class RefreshUse:
    outcome: RefreshOutcome
    record: RefreshRecord | None


@dataclass(frozen=True)
class SessionRecord:
    session_hash: bytes
    subject: str
    auth_time: float
    expires_at: float
    csrf_secret: bytes


@dataclass(frozen=True)
class DeviceRecord:
    device_code_hash: bytes
    user_code: str  # normalised: 8 characters, no hyphen
    client_id: str
    scope: str
    audience: str
    state: str  # lifecycle.Device value
    subject: str | None
    interval: float
    last_poll: float | None
    expires_at: float
    created_at: float
    auth_time: float | None = None  # when the deciding user signed in


class Store(Protocol):
    async def open(self) -> None:
        """Connect and apply pending migrations."""

    async def close(self) -> None: ...

    # -- authorization codes (single use)
    async def save_code(self, record: CodeRecord) -> None: ...

    async def get_code(self, code_hash: bytes) -> CodeRecord | None:
        """The code as issued, whether consumed or not (checks happen before consuming, so a
        wrong verifier leaves the code usable by its rightful holder)."""

    async def consume_code(self, code_hash: bytes, now: float) -> tuple[CodeRecord | None, bool]:
        """Mark the code consumed. (record, True) the first time; (record, False) on replay;
        (None, False) when unknown. Expiry is checked by the caller."""

    # -- grants: what was issued from a code or a refresh family, and its revocation
    async def record_access_token(
        self, jti: str, grant_id: str | None, client_id: str, expires_at: float
    ) -> None:
        """Remember an access token issued under a grant (code or family) so that revoking
        the grant makes it inactive on introspection."""

    async def revoke_grant(self, grant_id: str, now: float) -> None:
        """Revoke every token issued under the grant: its refresh family and access tokens."""

    async def revoke_access_token(self, jti: str, expires_at: float) -> None: ...

    async def access_token_active(self, jti: str) -> bool:
        """False when the token itself or its grant was revoked."""

    # -- refresh tokens (rotation with reuse detection)
    async def save_refresh(self, record: RefreshRecord) -> None:
        """A new family's first token (the family is created with it)."""

    async def use_refresh(
        self,
        token_hash: bytes,
        now: float,
        grace_seconds: float,
        successor: RefreshRecord,
        successor_sealed: bytes,
    ) -> RefreshUse:
        """Atomically rotate: an active token becomes rotated and `successor` is stored in
        the same family (its idle expiry extended). See RefreshOutcome for the other cases;
        a reuse outside the grace window revokes the whole family.

        The store decides the successor's family_id, client_id, subject, family_expires_at
        (the presented token's family), created_at (`now`) and state (active); the caller's
        token_hash, scope, audience, auth_time and expires_at are kept. The record returned
        is the presented token's as stored afterwards (rotated with `successor_sealed` for
        ROTATED and GRACE, revoked for REUSED, unchanged for EXPIRED); None for UNKNOWN."""

    async def get_refresh(self, token_hash: bytes) -> RefreshRecord | None: ...

    async def family_revoked(self, family_id: str) -> bool: ...

    # -- consent
    async def granted_scopes(self, subject: str, client_id: str) -> frozenset[str]: ...

    async def grant_scopes(self, subject: str, client_id: str, scopes: frozenset[str]) -> None: ...

    # -- login sessions
    async def save_session(self, record: SessionRecord) -> None: ...

    async def get_session(self, session_hash: bytes, now: float) -> SessionRecord | None: ...

    async def delete_session(self, session_hash: bytes) -> None: ...

    # -- throttles on guessing: passwords and device user codes (protocol/throttle.py)
    async def reserve_attempt(self, rules: Sequence[Rule], now: float) -> Refuse | None:
        """Charge one attempt at `now` to the key of every rule, or to none of them.

        In one atomic step the counters of the keys are read, every rule decides
        (`Rule.admit`) and, when all admit, every counter is written, before any other
        caller reads one of them; None then: the attempt may go ahead. When any rule
        refuses, nothing changes and the refusal asking the longest wait is returned.

        Invariant: for every key, the attempts charged and not released never exceed what
        its rule admits, under any concurrency: many callers of one store, and several
        stores (processes) on one database. Callers reserve before they check the guess,
        so guesses sent at once cannot all pass a check that saw none of them counted. A
        backend must serialise the callers of a key even while it has no counter yet
        (SQLite: BEGIN IMMEDIATE; PostgreSQL: insert the missing rows, then lock the rows
        in key order). The keys of one call are distinct."""

    async def release_attempt(self, keys: Sequence[str], reserved_at: float) -> None:
        """Give back, under each key, one attempt charged at `reserved_at` (the guess was
        right, so not a failure), as `protocol.throttle.released` says: never to a run of
        attempts that began after it."""

    async def clear_failures(self, key: str) -> None:
        """Forget the key's counter."""

    # -- replay cache for client assertions (RFC 7523 §3: jti single use)
    async def use_jti(self, client_id: str, jti: str, expires_at: float, now: float) -> bool:
        """True the first time this (client, jti) is seen; False on replay. An entry whose
        `expires_at` has passed is forgotten (the assertion itself has expired by then)."""

    # -- device authorization (RFC 8628)
    async def save_device(self, record: DeviceRecord) -> None:
        """AlreadyExists when the device code, or the user code of a code not expired at
        `record.created_at`, is taken; an expired code gives its user code up."""

    async def device_by_user_code(self, user_code: str, now: float) -> DeviceRecord | None: ...

    async def decide_device(
        self,
        user_code: str,
        subject: str,
        approve: bool,
        now: float,
        auth_time: float | None = None,
    ) -> bool:
        """Approve or deny a pending, unexpired code, recording who decided and when they
        signed in; False when it is not pending any more."""

    async def poll_device(
        self, device_code_hash: bytes, client_id: str, now: float
    ) -> DeviceRecord | None:
        """Record a poll by `client_id` and return the record as it was before; an approved
        code becomes redeemed atomically (one poll gets it). None, with nothing changed, when
        the code is unknown or was issued to another client. Expiry is checked by the caller."""

    async def slow_down_device(self, device_code_hash: bytes, interval: float) -> None: ...

    # -- housekeeping
    async def purge_expired(self, now: float) -> int:
        """Delete rows whose lifetime is over; the number deleted."""

    async def ping(self) -> None:
        """Answer a trivial query, or raise: whether the store can serve (readiness)."""
