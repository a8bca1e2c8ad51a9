"""The Store protocol: everything the authorization server persists, and its records.

Secrets never reach the store in clear: authorization codes, refresh tokens, device codes and
login session ids are stored as SHA-256 digests (`bytes`, 32 long). Times are seconds since
the epoch (float).

Who decides. The domain reads, decides with `protocol/lifecycle.py` (which event this is,
which state comes next, every expiry) and hands the store a `Move` and records whose every
field is already set. A store never re-derives a decision: it applies what it is given, and
every conditional change is a compare-and-set on the state the domain read (`Move.expected`).
A call whose condition no longer holds changes nothing and says so (False); the domain then
reads again and decides again. States only move forward, so that loop ends.

Units of work. Each issuance of tokens is one call and one transaction: `redeem_code`,
`redeem_device` and `rotate_refresh` consume or rotate, create or extend the grant, and
record the tokens together, or do nothing at all. Token ids and hashes are drawn before the
call and tokens are signed after it returns True, so a response is sent only for an
issuance that was committed, and a failed call leaves nothing behind to be taken for reuse.

Grants. Every code or device code redeemed starts a grant (`GrantRecord`), named after the
code. The refresh tokens of a grant are its family; its access tokens are recorded under it.
Revoking the grant revokes all of them, including any a rotation added concurrently.

Errors. `AlreadyExists` when a call names a key (hash, grant id, user code) that is already
stored: nothing is changed, and a clash of random secrets means a bug. `StoreUnavailable`
when the backend cannot do its work (disk full, database unreachable, lock not obtained in
time): the call had no effect, and the server answers 503 until the backend recovers.

Concurrency. Every invariant below holds for many callers of one store and for several
stores (processes, replicas) on one database. tests/authserver/store_conformance.py has a
test for each: store/sqlite.py (embedded default) and store/postgres.py (several replicas
on one database) pass it, and so must any other backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from authserver.protocol.errors import TemporarilyUnavailable
from authserver.protocol.lifecycle import Move
from authserver.protocol.throttle import Refuse, Rule


class AlreadyExists(Exception):
    """A call named a key (hash, grant id, user code) that is already stored."""


class StoreUnavailable(TemporarilyUnavailable):
    """The backend could not do the call's work; nothing was changed."""


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
    state: str = "issued"  # lifecycle.Code value


@dataclass(frozen=True)
class GrantRecord:
    """What one redeemed code or device code granted: its refresh family and access tokens."""

    grant_id: str
    client_id: str
    subject: str
    created_at: float
    # Nothing issued under the grant outlives this: the refresh family's absolute end, or,
    # without refresh tokens, the access token's expiry.
    expires_at: float
    revoked_at: float | None = None


@dataclass(frozen=True)
class RefreshRecord:
    token_hash: bytes
    family_id: str  # the grant's id
    client_id: str
    subject: str
    scope: str
    audience: str
    auth_time: float
    created_at: float
    expires_at: float  # idle expiry; sliding: each successor gets a new one
    family_expires_at: float  # the grant's expires_at: read from it, never stored per token
    state: str  # lifecycle.Refresh value
    rotated_at: float | None = None
    successor_hash: bytes | None = None  # the token that replaced this one
    successor_sealed: bytes | None = None  # the successor response, encrypted with this token


@dataclass(frozen=True)
class AccessTokenRecord:
    """An access token issued under a grant, remembered so that revoking the grant makes
    it inactive on introspection."""

    jti: str
    grant_id: str
    client_id: str
    expires_at: float


@dataclass(frozen=True)
class Issuance:
    """Everything one token response records, decided and drawn before the store call.

    A redemption creates `grant`; a rotation has none and adds to the grant its tokens
    name. The access token (and refresh token) belong to `access_token.grant_id`."""

    access_token: AccessTokenRecord
    refresh_token: RefreshRecord | None = None
    grant: GrantRecord | None = None

    @property
    def grant_id(self) -> str:
        return self.access_token.grant_id


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


@dataclass(frozen=True)
class Poll:
    """A device's poll as the domain decided it: the code must still be in `move.expected`
    with the `last_poll` read before; it goes to `move.next`, polled at `at`, with
    `interval` from now on."""

    move: Move
    last_poll: float | None
    at: float
    interval: float


class Store(Protocol):
    async def open(self) -> None:
        """Connect and apply pending migrations; several stores opening one new database
        at once apply each migration exactly once."""

    async def close(self) -> None: ...

    # -- authorization codes (single use)
    async def save_code(self, record: CodeRecord) -> None:
        """Store a new code in state `issued` (whatever `record.state` says)."""

    async def get_code(self, code_hash: bytes) -> CodeRecord | None:
        """The code with its current state, consumed or not (checks happen before
        consuming, so a wrong verifier leaves the code usable by its rightful holder)."""

    async def redeem_code(self, code_hash: bytes, move: Move, issuance: Issuance) -> bool:
        """In one transaction: the code goes from `move.expected` to `move.next` (consumed
        at the grant's `created_at`), the grant `issuance.grant` is created (it must be
        given), and the access token (and refresh token, if any) are recorded under it.
        False, with nothing changed, when the code is unknown or not in `move.expected` any
        more; AlreadyExists, with nothing changed, when the grant or a token is already
        stored.

        Invariant: of any number of concurrent calls for one code, at most one returns True."""

    # -- grants and access tokens
    async def get_grant(self, grant_id: str) -> GrantRecord | None: ...

    async def revoke_grant(self, grant_id: str, now: float) -> bool:
        """Revoke the grant: every refresh token of its family becomes revoked and every
        access token recorded under it inactive. True if this call revoked it; False when
        it was revoked already or is unknown (then nothing changes).

        Invariant: once this returns, no token of the grant is active, including tokens a
        rotation of the family added concurrently, and no later rotation succeeds."""

    async def revoke_access_token(self, jti: str, expires_at: float) -> None:
        """Make one access token inactive until `expires_at`, recorded or not (tokens of
        client_credentials are never recorded). Revoking twice is not an error."""

    async def access_token_active(self, jti: str) -> bool:
        """False when the token was revoked, or recorded under a grant that was revoked;
        True for a jti never recorded nor revoked."""

    # -- refresh tokens (rotation with reuse detection)
    async def get_refresh(self, token_hash: bytes) -> RefreshRecord | None:
        """The token as stored, with its family's absolute expiry."""

    async def rotate_refresh(
        self, token_hash: bytes, move: Move, issuance: Issuance, successor_sealed: bytes
    ) -> bool:
        """In one transaction: the token goes from `move.expected` to `move.next`, rotated
        at `issuance.refresh_token.created_at`, remembering its successor
        (`issuance.refresh_token`, stored as given, active) and `successor_sealed`; the
        access token is recorded under the grant. False, with nothing changed, when the
        token is unknown, not in `move.expected`, of another family than
        `issuance.grant_id`, or its grant is revoked. AlreadyExists, with nothing
        changed, when the successor's hash or the access token's jti is taken.

        Invariant: of any number of concurrent calls for one token, at most one returns
        True; a family never has two active tokens."""

    # -- consent
    async def granted_scopes(self, subject: str, client_id: str) -> frozenset[str]: ...

    async def grant_scopes(
        self, subject: str, client_id: str, scopes: frozenset[str], now: float
    ) -> None:
        """Add scopes to the consent (a union: concurrent grants lose none)."""

    # -- login sessions
    async def save_session(self, record: SessionRecord) -> None: ...

    async def get_session(self, session_hash: bytes, now: float) -> SessionRecord | None:
        """The session, unless it expired at `now`."""

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
        (SQLite: BEGIN IMMEDIATE; PostgreSQL: a transaction-scoped advisory lock per key,
        taken in one fixed order). The keys of one call are distinct."""

    async def release_attempt(self, keys: Sequence[str], reserved_at: float) -> None:
        """Give back, under each key, one attempt charged at `reserved_at` (the guess was
        right, or never checked), as `protocol.throttle.released` says: never to a run of
        attempts that began after it.

        Invariant: concurrent releases each give back their attempt; none is lost to
        another's write (a backend reads and writes a counter in one step, as
        reserve_attempt does)."""

    async def clear_failures(self, key: str) -> None:
        """Forget the key's counter."""

    # -- replay cache for client assertions (RFC 7523 §3: jti single use)
    async def use_jti(self, client_id: str, jti: str, expires_at: float, now: float) -> bool:
        """True the first time this (client, jti) is seen; False on replay. An entry whose
        `expires_at` has passed is forgotten (the assertion itself has expired by then).

        Invariant: of concurrent calls with one (client, jti), exactly one returns True."""

    # -- device authorization (RFC 8628)
    async def save_device(self, record: DeviceRecord) -> None:
        """AlreadyExists when the device code, or the user code of a code not expired at
        `record.created_at`, is taken; an expired code gives its user code up."""

    async def device_by_user_code(self, user_code: str, now: float) -> DeviceRecord | None:
        """The code a person typed, unless it expired at `now`."""

    async def get_device(self, device_code_hash: bytes) -> DeviceRecord | None:
        """The code a device polls with, whatever its state or expiry."""

    async def decide_device(
        self,
        user_code: str,
        move: Move,
        subject: str,
        now: float,
        auth_time: float | None = None,
    ) -> bool:
        """The person's decision: a code in `move.expected`, not expired at `now`, goes to
        `move.next`, recording who decided and when they signed in. False, with nothing
        changed, otherwise.

        Invariant: of concurrent decisions on one code, at most one returns True."""

    async def record_poll(self, device_code_hash: bytes, poll: Poll) -> bool:
        """A poll that issues nothing: compare-and-set on the code's state and last poll,
        then the state, last poll and interval `poll` gives. False, with nothing changed,
        when another poll came in between (or the code is unknown)."""

    async def redeem_device(self, device_code_hash: bytes, poll: Poll, issuance: Issuance) -> bool:
        """`record_poll` and, in the same transaction, the grant and its tokens recorded as
        `redeem_code` does. False, with nothing changed, when the condition fails.

        Invariant: of any number of concurrent calls for one code, at most one returns True."""

    # -- housekeeping
    async def purge_expired(self, now: float) -> int:
        """Delete rows whose lifetime is over; the number deleted. Refresh tokens of a live
        family are kept a while past their idle expiry, so that a rotated one shown again
        is still caught as reuse; a grant is kept while an access token recorded under it
        may still be presented."""

    async def ping(self) -> None:
        """Answer a trivial query, or raise: whether the store can serve (readiness)."""
