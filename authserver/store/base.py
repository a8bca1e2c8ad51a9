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

Revocation events. Every call that revokes something a resource server may hold (an access
token, a grant's access tokens, every token of a subject or a client issued before a time)
records a `RevocationEvent` in the same transaction: the revocation and its event commit
together or not at all, so no revocation is ever missing from the log. Event ids increase in
the order events are committed (a reader that has seen id N never finds a smaller one
later) and are never reused; an event is purged once every token it names has expired.

Errors. `AlreadyExists` when a call names a key (hash, grant id, user code) that is already
stored: nothing is changed, and a clash of random secrets means a bug. `StoreUnavailable`
when the backend cannot do its work (disk full, database unreachable, lock not obtained in
time): the call had no effect, and the server answers 503 until the backend recovers.

Signing keys. With keys kept in the store (several replicas), the key ring is one versioned
set of rows: readers take the set and its version in one read, and a change replaces the
whole set under a compare-and-set on the version it was decided from. Private keys reach
the store sealed (AES-GCM, authserver/stored_keys.py): the store never sees one in clear.

Concurrency. Every invariant below holds for many callers of one store and for several
stores (processes, replicas) on one database. tests/authserver/store_conformance.py has a
test for each: store/sqlite.py (embedded default) and store/postgres.py (several replicas
on one database) pass it, and so must any other backend.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any, Protocol

from authserver.protocol.errors import TemporarilyUnavailable
from authserver.protocol.lifecycle import Move
from authserver.protocol.throttle import Refuse, Rule


class AlreadyExists(Exception):
    """A call named a key (hash, grant id, user code) that is already stored."""


class StoreUnavailable(TemporarilyUnavailable):
    """The backend could not do the call's work; nothing was changed."""


@dataclass(frozen=True)
class PoolLimits:
    """The connections a backend with a pool (PostgreSQL) keeps open, and how long a call
    waits: for a connection to open, a statement to run, a busy pool to free one, and each
    migration (the wait for another process's migration lock included). A call past its
    limit fails with `StoreUnavailable`."""

    min_size: int = 1
    max_size: int = 10
    connect_timeout: timedelta = timedelta(seconds=5)
    command_timeout: timedelta = timedelta(seconds=5)
    acquire_timeout: timedelta = timedelta(seconds=5)
    migration_timeout: timedelta = timedelta(minutes=5)


# Told of every call a backend makes: the Store method's name and the seconds the call took,
# the wait for the backend's worker or a pooled connection included, whether it succeeded or
# raised. Given to a backend when it is built; the server counts the calls in its metrics.
StoreObserver = Callable[[str, float], None]


def unobserved(operation: str, seconds: float) -> None:
    """The observer of a store whose calls nobody counts."""


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
    # RFC 9449 §10: the thumbprint of the key the client bound the code to (`dpop_jkt` on
    # the authorization request); its redemption must prove possession of that key.
    dpop_jkt: str | None = None
    amr: tuple[str, ...] = ()  # RFC 8176: how the user signed in (the session's)


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
    # RFC 9449 §5: the thumbprint of the DPoP key the token is bound to (public clients'
    # tokens, for the life of the family); each use must prove possession of that key.
    dpop_jkt: str | None = None
    amr: tuple[str, ...] = ()  # RFC 8176: how the user signed in to start the family


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


class EventKind(StrEnum):
    TOKENS = "tokens"  # access tokens named by jti
    SUBJECT = "subject"  # every token of a subject issued before a time
    CLIENT = "client"  # every token of a client issued before a time


@dataclass(frozen=True)
class RevokedToken:
    jti: str
    expires_at: float


@dataclass(frozen=True)
class CutOff:
    """Every token of a subject (`kind` SUBJECT) or of a client (CLIENT) issued before
    `issued_before` is revoked; the last of them expires by `expires_at`."""

    kind: EventKind
    key: str  # the subject, or the client_id
    issued_before: float
    expires_at: float
    reason: str
    created_at: float


@dataclass(frozen=True)
class RevocationEvent:
    """One entry of the revocation log, as recorded."""

    event_id: int
    kind: EventKind
    reason: str
    created_at: float
    expires_at: float
    tokens: tuple[RevokedToken, ...] = ()  # kind TOKENS
    key: str | None = None  # kinds SUBJECT and CLIENT
    issued_before: float | None = None  # kinds SUBJECT and CLIENT


@dataclass(frozen=True)
class SessionRecord:
    session_hash: bytes
    subject: str
    auth_time: float
    expires_at: float
    csrf_secret: bytes
    address: str = ""  # the client address it signed in from; "" for an anonymous one
    # RFC 8176 values: the methods the sign-in used (`pwd`, `otp`, `mfa`); empty for an
    # anonymous session, and for one stored before sessions recorded them (a password).
    amr: tuple[str, ...] = ()


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
    amr: tuple[str, ...] = ()  # and how (RFC 8176)


@dataclass(frozen=True)
class SigningKeyRecord:
    """One key of the ring (keys.KeyInfo's fields) with its private half sealed."""

    kid: str
    alg: str
    state: str  # keys.KeyState value: next | active | retired
    created_at: float
    activate_at: float | None
    retired_at: float | None
    remove_after: float | None
    sealed_private_key: bytes  # never changes once stored


@dataclass(frozen=True)
class SigningKeys:
    """The key ring as stored: its version (0 before the first write) and its keys."""

    version: int
    keys: tuple[SigningKeyRecord, ...]


@dataclass(frozen=True)
class TotpRecord:
    """A user's authenticator app (protocol/totp.py): the secret sealed
    (authserver/factors.py), when enrolment began and when its confirming code came (None
    until then: not a factor yet), and the latest time step accepted."""

    subject: str
    sealed_secret: bytes
    created_at: float
    confirmed_at: float | None = None
    last_step: int | None = None
    recovery_codes_left: int = 0  # read only: the unused recovery codes

    @property
    def confirmed(self) -> bool:
        return self.confirmed_at is not None


@dataclass(frozen=True)
class PasskeyRecord:
    """A user's passkey (WebAuthn Level 3 §4 "public key credential source", as the relying
    party keeps it; authserver/passkeys.py): its credential id, the COSE_Key public key
    (RFC 9052 §7, CBOR as the authenticator sent it), the latest signature counter (§6.1.1),
    the transports the browser reported, the backup flags of its authenticator data (§6.1,
    BE and BS), the user handle it was created with (§5.4.3 `user.id`), the user's name for
    it, when it was created and when it last signed a sign-in, and the relying party id it
    was created for (§5.1.2; None when that was not recorded)."""

    credential_id: bytes
    subject: str
    user_handle: bytes
    public_key: bytes
    sign_count: int
    transports: tuple[str, ...]
    backup_eligible: bool
    backed_up: bool
    name: str
    created_at: float
    last_used_at: float | None = None
    rp_id: str | None = None


@dataclass(frozen=True)
class Poll:
    """A device's poll as the domain decided it: the code must still be in `move.expected`
    with the `last_poll` read before; it goes to `move.next`, polled at `at`, with
    `interval` from now on."""

    move: Move
    last_poll: float | None
    at: float
    interval: float


SIGN_INS_KEPT = 20  # the latest sign-ins kept per user; older ones are trimmed at insert


@dataclass(frozen=True)
class SignInRecord:
    """One sign-in of a known user: `succeeded` or `failed` (a wrong password)."""

    subject: str
    at: float
    outcome: str
    address: str  # the client address, as the throttles count it
    client_id: str | None  # the client signed in to; None for the account page
    expires_at: float


CONSENT_WITHDRAWN = "consent_withdrawn"  # the reason of the events withdraw_consent records


@dataclass(frozen=True)
class Consent:
    """What a user consented to for one client: the scopes, and when consent was first
    given (later consents add scopes to it)."""

    client_id: str
    scopes: tuple[str, ...]  # sorted
    granted_at: float


@dataclass(frozen=True)
class GrantSummary:
    """A grant as the admin API shows it: what the user granted the client, and when its
    refresh family was last used."""

    grant: GrantRecord
    # The family's scope; for a grant that issued no refresh token, what the user consented
    # to for the client (space-separated).
    scope: str
    last_used_at: float  # the latest token of its family, or its creation
    refresh_family: bool  # whether it issued refresh tokens


# Who manages a client or a user: the configuration file (seeded at start and on reload,
# read-only elsewhere) or the admin API; a client also itself, registered by RFC 7591
# dynamic registration (managed through RFC 7592 with its registration access token) or
# described by the Client ID Metadata Document its client_id names.
MANAGED_BY_CONFIG = "config"
MANAGED_BY_API = "api"
MANAGED_BY_DYNAMIC = "dynamic"
MANAGED_BY_METADATA_DOCUMENT = "metadata_document"


@dataclass(frozen=True)
class ClientRecord:
    """A client as stored. `metadata` holds its RFC 7591 metadata but the id and secret
    (JSON values); the secret is kept only as its SHA-256 digest. `version` counts changes:
    every update is a compare-and-set on it. Access tokens issued (`iat`, whole seconds) in
    the second of `tokens_valid_from` or before are inactive: it moves when the secret is
    rotated.

    A client that registered itself (MANAGED_BY_DYNAMIC) has the digest of its RFC 7592
    registration access token, and until it obtains a token an `unused_until`: past it,
    the client is gone (`purge_expired` removes it). `blocked` keeps a client that is
    refused wherever it is named."""

    client_id: str
    metadata: Mapping[str, Any]
    secret_sha256: bytes | None
    managed_by: str
    created_at: float
    updated_at: float
    tokens_valid_from: float
    version: int = 1
    registration_token_sha256: bytes | None = None
    unused_until: float | None = None
    blocked: bool = False


@dataclass(frozen=True)
class UserRecord:
    """A user as stored: `subject` is the `sub`, `username` unique, `claims` the OpenID
    Connect claims (JSON values), `version` as for clients."""

    subject: str
    username: str
    password_hash: str
    claims: Mapping[str, Any]
    roles: tuple[str, ...]
    disabled: bool
    managed_by: str
    created_at: float
    updated_at: float
    version: int = 1


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def email_key(email: object) -> str | None:
    """What a user is found by their `email` claim with (users_with_email): the address
    with its ASCII letters in lower case, the others as they are, so that every backend
    folds it alike; None for a claim that is no string."""
    return email.translate(_ASCII_LOWER) if isinstance(email, str) else None


@dataclass(frozen=True)
class IdentityLink:
    """An identity at an upstream OpenID Connect provider (its issuer and `sub`) and the
    local user it signs in as."""

    issuer: str
    provider_subject: str
    subject: str
    created_at: float


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

    async def revoke_grant(self, grant_id: str, now: float, reason: str = "revoked") -> bool:
        """Revoke the grant: every refresh token of its family becomes revoked and every
        access token recorded under it inactive. True if this call revoked it; False when
        it was revoked already or is unknown (then nothing changes).

        In the same transaction, when access tokens recorded under the grant expire after
        `now`, one TOKENS event naming them (jti and expiry) with `reason` is recorded.

        Invariant: once this returns, no token of the grant is active, including tokens a
        rotation of the family added concurrently, and no later rotation succeeds; the
        event names every access token the grant had when it was revoked."""

    async def revoke_access_token(
        self, jti: str, expires_at: float, now: float, reason: str = "revoked"
    ) -> None:
        """Make one access token inactive until `expires_at`, recorded or not (tokens of
        client_credentials are never recorded), and record a TOKENS event naming it, in one
        transaction. Revoking twice is not an error (each records its event)."""

    async def cut_off(self, cut: CutOff) -> int:
        """In one transaction: for a subject, first delete its codes still `issued` and
        deny its device codes still `approved`, created before `cut.issued_before`; then
        revoke every unrevoked grant of the subject (or client) that was created before
        `cut.issued_before`, with all their tokens, as revoke_grant does, and record the
        cut-off as one SUBJECT (or CLIENT) event; its id.

        Invariants: a rotation of a grant created before the cut-off either committed before
        (its tokens are covered by the event's time) or fails afterwards; a code or device
        code of the subject issued before it either was redeemed before (and its grant is
        revoked) or is never redeemed, whatever becomes of the subject."""

    # -- revocation events
    async def revocation_events(self, after: int, now: float, limit: int) -> list[RevocationEvent]:
        """Events with an id above `after` not expired at `now`, by increasing id, at most
        `limit`. Reading from the last id seen, a reader meets every event committed since,
        once, in order."""

    def events_signal(self) -> asyncio.Event:
        """An asyncio.Event set when an event may have been recorded after this call, by
        this store or (where the backend can tell) by another on the same database. Take it
        before reading, then wait on it: nothing recorded in between is missed."""

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

    async def consents_of(self, subject: str) -> list[Consent]:
        """Every client the subject consented to, ordered by client_id."""

    async def withdraw_consent(self, subject: str, client_id: str, now: float) -> list[str]:
        """In one transaction: forget the subject's consent to the client, and revoke every
        grant of theirs to it still in force, recording a revocation event for the access
        tokens of each (as revoke_grant does). The ids of the grants revoked, sorted."""

    # -- login sessions
    async def save_session(self, record: SessionRecord) -> None: ...

    async def get_session(self, session_hash: bytes, now: float) -> SessionRecord | None:
        """The session, unless it expired at `now`."""

    async def delete_session(self, session_hash: bytes) -> None: ...

    async def record_sign_in(self, record: SignInRecord) -> None:
        """Keep a sign-in; of the subject's, only the latest SIGN_INS_KEPT stay."""

    async def sign_ins_of(self, subject: str, now: float) -> list[SignInRecord]:
        """The subject's kept sign-ins not expired at `now`, the latest first."""

    async def sessions_of(self, subject: str, now: float) -> list[SessionRecord]:
        """The subject's sessions not expired at `now`, the most recent sign-in first."""

    async def delete_other_sessions(self, subject: str, keep: bytes) -> int:
        """End every session of the subject but the one hashed `keep`; how many."""

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

    # -- second factors: an authenticator app (TOTP) and recovery codes per user
    async def begin_totp(self, record: TotpRecord) -> bool:
        """Store an enrolment waiting for its confirming code (`record.confirmed_at` and
        `last_step` are ignored), replacing one that was waiting. False, with nothing
        changed, when the user has a confirmed factor already (it must be removed first)."""

    async def get_totp(self, subject: str) -> TotpRecord | None:
        """The user's factor, confirmed or waiting, with how many recovery codes are left."""

    async def confirm_totp(
        self,
        subject: str,
        sealed_secret: bytes,
        step: int,
        recovery_codes: Sequence[bytes],
        now: float,
    ) -> bool:
        """In one transaction: the waiting enrolment whose secret is `sealed_secret`
        becomes confirmed at `now` with `step` as its last accepted step, and its recovery
        codes are these digests (any before are deleted). False, with nothing changed,
        when no such enrolment waits (another began, or it was confirmed already).

        Invariant: of concurrent confirmations of one enrolment, at most one returns True."""

    async def use_totp_step(self, subject: str, step: int) -> bool:
        """Accept a code of time step `step`: True, recording it as the last, when the
        user's factor is confirmed and `step` is later than its last accepted step; False,
        with nothing changed, otherwise.

        Invariant: of concurrent calls with one step, at most one returns True; the last
        accepted step never goes back."""

    async def use_recovery_code(self, subject: str, code_sha256: bytes, now: float) -> bool:
        """Mark an unused recovery code of the user used at `now`. False, with nothing
        changed, when it is unknown or used.

        Invariant: of concurrent calls for one code, at most one returns True."""

    async def replace_recovery_codes(self, subject: str, recovery_codes: Sequence[bytes]) -> bool:
        """In one transaction: every recovery code of the user, used or not, deleted and
        these digests stored in their place, when the user's factor is confirmed. False,
        with nothing changed, otherwise.

        Invariant: no moment at which an old code and a new one are both usable."""

    async def delete_totp(self, subject: str) -> bool:
        """Remove the user's factor and recovery codes; False when there was none."""

    # -- passkeys (WebAuthn): any number per user, each under its credential id
    async def add_passkey(self, record: PasskeyRecord) -> bool:
        """Store a new passkey. False, with nothing changed, when a passkey with its
        credential id exists already, of this user or any other (WebAuthn §7.1 step 26:
        a credential id registered once is refused again), or the user is not in the store."""

    async def passkeys_of(self, subject: str) -> list[PasskeyRecord]:
        """The user's passkeys, oldest first."""

    async def get_passkey(self, credential_id: bytes) -> PasskeyRecord | None: ...

    async def use_passkey(
        self, credential_id: bytes, sign_count: int, backed_up: bool, now: float
    ) -> bool:
        """Record a sign-in by the passkey: its new signature counter, backup state and
        `last_used_at`. Only when the counter moved forward, or when both the stored and the
        new counter are 0 (an authenticator without a counter, WebAuthn §6.1.1); False, with
        nothing changed, otherwise: a counter that did not grow is a sign that the
        authenticator was cloned (§7.2 step 22), or the passkey is gone.

        Invariant: of concurrent calls with one new counter, at most one returns True
        (both counters 0 excepted: there is nothing to compare then)."""

    async def delete_passkey(self, subject: str, credential_id: bytes) -> bool:
        """Remove the user's passkey; False when the user has none by that id."""

    # -- replay cache for client assertions (RFC 7523 §3) and DPoP proofs (RFC 9449 §11.1)
    async def use_jti(self, client_id: str, jti: str, expires_at: float, now: float) -> bool:
        """True the first time this (client, jti) is seen; False on replay. An entry whose
        `expires_at` has passed is forgotten (the assertion itself has expired by then).
        DPoP proofs are kept under `dpop:` and their key's thumbprint in place of a client:
        a clash with a client so named could only refuse a proof, never accept one.

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
        amr: Sequence[str] = (),
    ) -> bool:
        """The person's decision: a code in `move.expected`, not expired at `now`, goes to
        `move.next`, recording who decided and when and how they signed in. False, with
        nothing changed, otherwise.

        Invariant: of concurrent decisions on one code, at most one returns True."""

    async def record_poll(self, device_code_hash: bytes, poll: Poll) -> bool:
        """A poll that issues nothing: compare-and-set on the code's state and last poll,
        then the state, last poll and interval `poll` gives. False, with nothing changed,
        when another poll came in between (or the code is unknown)."""

    async def redeem_device(self, device_code_hash: bytes, poll: Poll, issuance: Issuance) -> bool:
        """`record_poll` and, in the same transaction, the grant and its tokens recorded as
        `redeem_code` does. False, with nothing changed, when the condition fails.

        Invariant: of any number of concurrent calls for one code, at most one returns True."""

    # -- signing keys (one versioned set, shared by every replica)
    async def signing_keys(self) -> SigningKeys:
        """The ring's version and keys, read together (one consistent snapshot)."""

    async def signing_keys_version(self) -> int:
        """The ring's version alone: what a replica polls to learn of a change."""

    async def replace_signing_keys(
        self, expected_version: int, keys: Sequence[SigningKeyRecord]
    ) -> bool:
        """In one transaction, when the ring is still at `expected_version`: the ring becomes
        `keys` (keys not listed are deleted, listed ones inserted or their state and dates
        updated; a stored key's alg, created_at and sealed private key never change) and its
        version goes up by one. False, with nothing changed, when another change came first.
        AlreadyExists, with nothing changed, when `keys` hold two active keys of one
        algorithm.

        Invariant: of concurrent calls with one expected version, at most one returns True;
        the ring never has two active keys of one algorithm."""

    # -- clients and users (the registry: looked up on every request, never cached)
    async def get_client(self, client_id: str) -> ClientRecord | None: ...

    async def list_clients(self) -> list[ClientRecord]:
        """Every client, ordered by client_id."""

    async def save_client(self, record: ClientRecord, expected_version: int | None) -> bool:
        """`expected_version` None: create the client (AlreadyExists when its id is
        taken). Otherwise replace the stored client whose version is `expected_version`
        with `record`, stored with the next version; False, with nothing changed, when
        the client is gone or its version moved on.

        Invariant: of concurrent updates from one version, at most one returns True."""

    async def delete_client(self, client_id: str) -> bool:
        """Remove the client; False when it is unknown."""

    async def client_used(self, client_id: str) -> bool:
        """The client obtained a token: it is kept from now on (`unused_until` cleared, its
        version unchanged). False when it had no `unused_until` or is unknown.

        Invariant: of concurrent calls for one client, at most one returns True."""

    async def sync_clients(self, records: Sequence[ClientRecord], now: float) -> list[str]:
        """Make the clients managed by the configuration exactly `records`, in one
        transaction: each is created, or updated in place (keeping its `created_at` and
        `tokens_valid_from`; its version moves only when something changed; a client of
        the same id managed by the API is taken over); those managed by the configuration
        and absent from `records` are removed. The ids removed."""

    async def get_user(self, subject: str) -> UserRecord | None: ...

    async def user_by_username(self, username: str) -> UserRecord | None: ...

    async def list_users(self) -> list[UserRecord]:
        """Every user, ordered by subject."""

    async def users_with_email(self, email: str) -> list[UserRecord]:
        """The users whose `email` claim has the `email_key` of `email` (the same address,
        its ASCII letters in either case), ordered by subject: the candidates an address
        could link to, which the caller holds to its own rule."""

    async def save_user(self, record: UserRecord, expected_version: int | None) -> bool:
        """As save_client; AlreadyExists also when the username is another user's."""

    async def delete_user(self, subject: str) -> bool:
        """Remove the user; False when unknown."""

    async def sync_users(self, records: Sequence[UserRecord], now: float) -> list[str]:
        """As sync_clients, by subject; AlreadyExists, with nothing changed, when a seeded
        username belongs to a user managed by the API. The subjects removed."""

    # -- identities at upstream OpenID Connect providers
    async def identity_owner(self, issuer: str, provider_subject: str) -> str | None:
        """The local subject the provider's identity is linked to, if any."""

    async def link_identity(self, link: IdentityLink, new_user: UserRecord | None) -> None:
        """In one transaction: `new_user` created when given, then `link` stored. When the
        identity is linked already, or `new_user`'s subject or username is taken,
        AlreadyExists with nothing changed (the user is not created either). The link's
        local user must exist (or be `new_user`).

        Invariant: of concurrent links of one identity, exactly one succeeds."""

    async def identity_links(self, subject: str) -> list[IdentityLink]:
        """The identities linked to the local user, ordered by issuer then provider subject."""

    async def delete_sessions(self, subject: str) -> int:
        """End every login session of the subject; how many."""

    async def list_grants(
        self, client_id: str | None = None, subject: str | None = None
    ) -> list[GrantSummary]:
        """The grants, unrevoked and unexpired or not, ordered by grant_id; only those of
        the client and/or subject when given."""

    # -- housekeeping
    async def purge_expired(self, now: float) -> int:
        """Delete rows whose lifetime is over; the number deleted. Refresh tokens of a live
        family are kept a while past their idle expiry, so that a rotated one shown again
        is still caught as reuse; a grant is kept while an access token recorded under it
        may still be presented; a revocation event goes once every token it names has
        expired; a client goes once its `unused_until` is past."""

    async def ping(self) -> None:
        """Answer a trivial query, or raise: whether the store can serve (readiness)."""
