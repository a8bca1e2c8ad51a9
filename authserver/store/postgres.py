"""The PostgreSQL backend of the Store: one database shared by every replica of the server.

Connections. asyncpg speaks to the server from the event loop itself: no thread. The store
owns one bounded pool (`storage_pool`: min_size to max_size connections). A call borrows a
connection for its one statement or transaction and gives it back. When every connection is
busy, a call waits up to acquire_timeout for one, then raises StoreUnavailable rather than
queueing without end. A new connection is made, login included, within connect_timeout.
Every statement, lock waits included, ends within command_timeout: asyncpg then cancels it
on the server and the call raises. The server ends a session left idle inside a transaction
for command_timeout (idle_in_transaction_session_timeout), so a replica cut off in the middle
of a transaction does not keep its row locks until TCP notices. Broken connections are
replaced by the pool on the next call.

Transactions. READ COMMITTED, PostgreSQL's default: each statement sees what was committed
when it began. That is enough because no decision rests on a read made earlier in the
transaction without a lock. Every conditional change is one statement whose WHERE clause
is the condition and whose RETURNING row says whether it held:
- Compare-and-set: `UPDATE ... WHERE key = $1 AND state = $expected RETURNING 1`. The update
  locks the row; a concurrent update of the row waits for the first to commit, then
  evaluates its WHERE clause again on the committed row and matches nothing: the state has
  moved on. Codes consumed, refresh tokens rotated, device codes decided and polled.
- Insert if absent: `INSERT ... ON CONFLICT`. The unique index makes a second inserter wait
  for the first and then take the conflict branch: a (client, jti) is used once, a counter
  is created once. An INSERT without ON CONFLICT that meets a taken key raises
  UniqueViolation, turned into AlreadyExists; the transaction is rolled back.
- Row locks where a change depends on another row: a rotation first takes its grant
  `FOR SHARE`, requiring it unrevoked; revoke_grant updates the grant (a conflicting lock)
  before it revokes the family with a second statement. So a rotation either commits before
  the revocation reaches the family, whose statement (a new snapshot) then sees the
  successor, or waits for the revocation and finds the grant revoked. Every transaction that
  locks a grant and its tokens takes the grant first, so they never deadlock.
- Throttle counters have no row to lock before a key's first attempt: reserve_attempt,
  release_attempt and clear_failures take a transaction-scoped advisory lock per key
  (pg_advisory_xact_lock), in ascending order of lock id, before they read. Reading the
  counters, deciding and writing them is then one step across every replica.
Nowhere is a row read in one statement and written in another without one of these locks.

Revocation events. A transaction that records one first takes the events' advisory lock
(pg_advisory_xact_lock, held until it commits) and then draws the id: ids are therefore
committed in increasing order across every replica, and a reader that has seen id N never
finds a smaller one committed after. Revocations are rare, so serialising them costs
nothing noticeable. The same transaction runs pg_notify, which PostgreSQL delivers at
commit to every session that LISTENs: each store keeps one connection of its own (outside
the pool) listening, and sets `events_signal` when a notification comes, whichever replica
recorded the event. While that connection is down (it is made again with backoff), readers
fall back to their periodic look.

Migrations (migrations/postgres/NNN_name.sql, hand-written for PostgreSQL) are applied at
open on a connection of their own, whose statements end within migration_timeout (the wait
for the lock included), each in one transaction that first takes an advisory lock named
after the schema: replicas starting together apply each one once; the others wait, then
find it recorded in schema_migrations. DDL is transactional
in PostgreSQL, so a failing migration leaves nothing of itself behind.

Durability. A call returns after COMMIT, which the server acknowledges once the commit is in
its write-ahead log on disk (synchronous_commit on, the default). Surviving the loss of the
server's machine is a matter for its replication and backups.

Cancellation. A call whose task is cancelled stops where it is. Its transaction commits
whole or not at all: asyncpg rolls it back, or the pool resets or closes the connection and
the server aborts a transaction whose session ends. A call cancelled while its COMMIT is in
flight may have committed; its caller does not learn which.

Errors. Connection refused, lost or timed out; no free connection within acquire_timeout; a
statement cancelled by command_timeout; a server shutting down, starting up or out of
resources; a deadlock or serialization failure; a read-only server (a standby after a
failover): StoreUnavailable. The transaction was rolled back, and the store recovers by
itself when the server does. Other errors (a violated foreign key, bad SQL) are bugs and
propagate as they are.

Timing. Each Store method borrows one connection, through `_connection` or `_transaction`,
which name it: the observer given at construction (the server's metrics) is told the name
and the time of every call, the wait for a free connection included, whether it returned or
raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace
from datetime import timedelta
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

import asyncpg
import orjson

from authserver.protocol.lifecycle import Code, Device, Move, Refresh
from authserver.protocol.throttle import Admit, Counter, Refuse, Rule, released
from authserver.store.base import (
    CONSENT_WITHDRAWN,
    MANAGED_BY_CONFIG,
    SIGN_INS_KEPT,
    AlreadyExists,
    ClientRecord,
    CodeRecord,
    Consent,
    CutOff,
    DeviceRecord,
    EventKind,
    GrantRecord,
    GrantSummary,
    IdentityLink,
    Issuance,
    PasskeyRecord,
    Poll,
    PoolLimits,
    RefreshRecord,
    RevocationEvent,
    RevokedToken,
    SessionRecord,
    SigningKeyRecord,
    SigningKeys,
    SignInRecord,
    StoreObserver,
    StoreUnavailable,
    TotpRecord,
    UserRecord,
    email_key,
    unobserved,
)
from authserver.store.migration_files import Migration, load_migrations, unknown_versions

log = logging.getLogger("portcullis.authserver.store")

MIGRATIONS: Traversable = resources.files("authserver.store").joinpath("migrations", "postgres")
APPLICATION_NAME = "portcullis-authserver"
# Refresh tokens whose idle expiry passed this long ago are purged; until then a rotated
# one shown again is still recognised as reuse and revokes its family (RFC 9700 §4.14.2).
REFRESH_RETENTION = timedelta(days=1)
EVENTS_CHANNEL = "portcullis_revocation_events"
EVENTS_LOCK = "revocation_events"
# The listening connection, when lost, is made again after this long at first, doubling.
LISTEN_RETRY = timedelta(seconds=1)
LISTEN_RETRY_MAX = timedelta(seconds=30)

# What says the server cannot do the work now, as opposed to a bug: the call had no effect.
UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,  # refused, reset, unreachable
    TimeoutError,  # connect_timeout, command_timeout, acquire_timeout
    asyncpg.PostgresConnectionError,  # class 08: the connection failed or was lost
    asyncpg.InsufficientResourcesError,  # class 53: disk full, too many connections
    asyncpg.OperatorInterventionError,  # class 57: shutting down, starting, cancelled
    asyncpg.TransactionRollbackError,  # class 40: deadlock, serialization failure
    asyncpg.ReadOnlySQLTransactionError,  # 25006: a standby after a failover
)


class _OneLine(logging.Filter):
    """asyncpg's pool logs each failed attempt to reopen its minimum of connections with a
    traceback, about once a second while the database is away: one line with the reason is
    what an operator needs, and what log collectors can take."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            record.msg = f"{record.getMessage()}: {type(error).__name__}: {error}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


logging.getLogger("asyncpg.pool").addFilter(_OneLine())


class PostgresStore:
    """The Store protocol on one PostgreSQL database (and schema), through a connection pool.

    `schema`, when given, is the only schema on the connections' search_path: the tables
    live there, and it must exist. Without it the server's search_path applies (`public`).
    """

    def __init__(
        self,
        url: str,
        pool: PoolLimits | None = None,
        *,
        schema: str | None = None,
        application_name: str = APPLICATION_NAME,
        migrations: Traversable = MIGRATIONS,
        observe: StoreObserver = unobserved,
    ) -> None:
        self.url = url
        self._limits = pool or PoolLimits()
        self._observe = observe
        self._schema = schema
        self._application_name = application_name
        self._migrations = migrations
        self._pool: Any = None
        self._opening = False
        self._signal = asyncio.Event()
        self._listener: asyncio.Task[None] | None = None

    # -- lifetime

    async def open(self) -> None:
        if self._pool is not None or self._opening:
            raise RuntimeError("the store is already open")
        self._opening = True
        try:
            with _unavailable():
                await self._migrate()
                self._pool = await asyncpg.create_pool(
                    self.url,
                    min_size=self._limits.min_size,
                    max_size=self._limits.max_size,
                    timeout=self._limits.connect_timeout.total_seconds(),
                    command_timeout=self._limits.command_timeout.total_seconds(),
                    server_settings=self._server_settings(),
                )
            self._listener = asyncio.create_task(self._listen(), name="revocation events listener")
        finally:
            self._opening = False

    async def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
        pool, self._pool = self._pool, None
        if pool is None:
            return
        try:
            # Calls in flight end within command_timeout; then their connections go.
            await asyncio.wait_for(pool.close(), 2 * self._limits.command_timeout.total_seconds())
        except TimeoutError:
            pool.terminate()

    def _server_settings(self) -> dict[str, str]:
        settings = {
            "application_name": self._application_name,
            "idle_in_transaction_session_timeout": _milliseconds(self._limits.command_timeout),
        }
        if self._schema is not None:
            settings["search_path"] = quote_identifier(self._schema)
        return settings

    async def _migrate(self) -> list[int]:
        """Apply the pending migrations on a connection of their own: with migration_timeout
        rather than the pool's command_timeout, since a migration may rewrite a large table.
        The server cancels a statement that runs longer (statement_timeout), the wait for
        another replica's migration lock included; the client gives up a little later, in
        case the server cannot even say so."""
        migrations = load_migrations(self._migrations)
        limit = self._limits.migration_timeout
        conn = await asyncpg.connect(
            self.url,
            timeout=self._limits.connect_timeout.total_seconds(),
            command_timeout=(limit + self._limits.connect_timeout).total_seconds(),
            server_settings={**self._server_settings(), "statement_timeout": _milliseconds(limit)},
        )
        try:
            schema = await conn.fetchval("SELECT current_schema()")
            if schema is None:
                raise RuntimeError(
                    f"no schema to create the tables in: {self._schema or 'the search_path'}"
                    " names none that exists"
                )
            return await migrate(conn, migrations, lock_id("migrations", schema))
        finally:
            await conn.close()

    @contextlib.asynccontextmanager
    async def _connection(self, operation: str) -> AsyncIterator[Any]:
        """A connection of the pool, for one statement (autocommit) or a transaction: the
        Store method `operation`, whose time (the wait for a connection included) goes to
        the observer under that name."""
        pool = self._pool
        if pool is None:
            raise RuntimeError("the store is not open")
        started = time.perf_counter()
        try:
            with _unavailable():
                timeout = self._limits.acquire_timeout.total_seconds()
                async with pool.acquire(timeout=timeout) as conn:
                    yield conn
        finally:
            self._observe(operation, time.perf_counter() - started)

    @contextlib.asynccontextmanager
    async def _transaction(self, operation: str) -> AsyncIterator[Any]:
        """A connection inside a READ COMMITTED transaction (`_in_transaction`), for the
        Store method `operation`."""
        async with self._connection(operation) as conn, _in_transaction(conn):
            yield conn

    # -- authorization codes

    async def save_code(self, record: CodeRecord) -> None:
        r = record
        async with self._connection("save_code") as conn:
            with _unique("this authorization code"):
                await conn.execute(
                    "INSERT INTO codes (code_hash, client_id, subject, redirect_uri, scope,"
                    " audience, nonce, code_challenge, auth_time, expires_at, created_at, state,"
                    " dpop_jkt, amr)"
                    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
                    r.code_hash,
                    r.client_id,
                    r.subject,
                    r.redirect_uri,
                    r.scope,
                    r.audience,
                    r.nonce,
                    r.code_challenge,
                    r.auth_time,
                    r.expires_at,
                    r.created_at,
                    Code.ISSUED.value,
                    r.dpop_jkt,
                    _methods_text(r.amr),
                )

    async def get_code(self, code_hash: bytes) -> CodeRecord | None:
        async with self._connection("get_code") as conn:
            row = await conn.fetchrow(
                "SELECT code_hash, client_id, subject, redirect_uri, scope, audience, nonce,"
                " code_challenge, auth_time, expires_at, created_at, state, dpop_jkt, amr"
                " FROM codes WHERE code_hash = $1",
                code_hash,
            )
        return None if row is None else replace(CodeRecord(*row[:-1]), amr=_methods(row[-1]))

    async def redeem_code(self, code_hash: bytes, move: Move, issuance: Issuance) -> bool:
        grant = _new_grant(issuance)
        async with self._transaction("redeem_code") as conn:
            consumed = await conn.fetchval(
                "UPDATE codes SET state = $1, consumed_at = $2"
                " WHERE code_hash = $3 AND state = $4 RETURNING 1",
                Code(move.next).value,
                grant.created_at,
                code_hash,
                Code(move.expected).value,
            )
            if consumed is None:
                return False
            await _insert_grant(conn, grant)
            await _record_tokens(conn, issuance)
            return True

    # -- grants and access tokens

    async def get_grant(self, grant_id: str) -> GrantRecord | None:
        async with self._connection("get_grant") as conn:
            row = await conn.fetchrow(
                "SELECT grant_id, client_id, subject, created_at, expires_at, revoked_at"
                " FROM grants WHERE grant_id = $1",
                grant_id,
            )
        return None if row is None else GrantRecord(*row)

    async def revoke_grant(self, grant_id: str, now: float, reason: str = "revoked") -> bool:
        async with self._transaction("revoke_grant") as conn:
            if not await _revoke_grant(conn, grant_id, now, reason):
                return False
        self._wake()
        return True

    async def revoke_access_token(
        self, jti: str, expires_at: float, now: float, reason: str = "revoked"
    ) -> None:
        async with self._transaction("revoke_access_token") as conn:
            await conn.execute(
                "INSERT INTO access_tokens (jti, expires_at, revoked) VALUES ($1, $2, true)"
                " ON CONFLICT (jti) DO UPDATE SET revoked = true,"
                " expires_at = greatest(access_tokens.expires_at, excluded.expires_at)",
                jti,
                expires_at,
            )
            await _insert_event(
                conn, EventKind.TOKENS, reason, now, expires_at, [RevokedToken(jti, expires_at)]
            )
        self._wake()

    async def cut_off(self, cut: CutOff) -> int:
        column = "subject" if cut.kind is EventKind.SUBJECT else "client_id"
        async with self._transaction("cut_off") as conn:
            if cut.kind is EventKind.SUBJECT:
                # A subject's codes and device approvals not redeemed end first, each row
                # locked in one order: a redemption holding one commits before (and its
                # grant, committed then, is revoked below), or finds it gone or denied.
                # Codes are few and short-lived, and cut-offs rare: a scan, not an index.
                await conn.execute(
                    "DELETE FROM codes WHERE code_hash IN (SELECT code_hash FROM codes"
                    " WHERE subject = $1 AND state = $2 AND created_at < $3"
                    " ORDER BY code_hash FOR UPDATE)",
                    cut.key,
                    Code.ISSUED.value,
                    cut.issued_before,
                )
                await conn.execute(
                    "UPDATE device_codes SET state = $1 WHERE device_code_hash IN"
                    " (SELECT device_code_hash FROM device_codes WHERE subject = $2"
                    " AND state = $3 AND created_at < $4 ORDER BY device_code_hash FOR UPDATE)",
                    Device.DENIED.value,
                    cut.key,
                    Device.APPROVED.value,
                    cut.issued_before,
                )
            # The grants, locked in one order (as every transaction taking a grant and its
            # tokens does), then their families.
            revoked = await conn.fetch(
                f"UPDATE grants SET revoked_at = $1 WHERE grant_id IN"  # noqa: S608 - fixed names
                f" (SELECT grant_id FROM grants WHERE {column} = $2 AND created_at < $3"
                "   AND revoked_at IS NULL ORDER BY grant_id FOR UPDATE)"
                " RETURNING grant_id",
                cut.created_at,
                cut.key,
                cut.issued_before,
            )
            if revoked:
                await conn.execute(
                    "UPDATE refresh_tokens SET state = $1"
                    " WHERE family_id = ANY($2::text[]) AND state <> $1",
                    Refresh.REVOKED.value,
                    [row[0] for row in revoked],
                )
            event_id = await _insert_event(
                conn,
                cut.kind,
                cut.reason,
                cut.created_at,
                cut.expires_at,
                key=cut.key,
                issued_before=cut.issued_before,
            )
        self._wake()
        return event_id

    # -- revocation events

    async def revocation_events(self, after: int, now: float, limit: int) -> list[RevocationEvent]:
        async with self._connection("revocation_events") as conn:
            rows = await conn.fetch(
                "SELECT event_id, kind, reason, created_at, expires_at, tokens::text, key,"
                " issued_before FROM revocation_events WHERE event_id > $1 AND expires_at > $2"
                " ORDER BY event_id LIMIT $3",
                after,
                now,
                limit,
            )
        return [
            RevocationEvent(
                event_id=row[0],
                kind=EventKind(row[1]),
                reason=row[2],
                created_at=row[3],
                expires_at=row[4],
                tokens=tuple(RevokedToken(jti, exp) for jti, exp in json.loads(row[5])),
                key=row[6],
                issued_before=row[7],
            )
            for row in rows
        ]

    def events_signal(self) -> asyncio.Event:
        return self._signal

    def _wake(self) -> None:
        signal, self._signal = self._signal, asyncio.Event()
        signal.set()

    async def _listen(self) -> None:
        """Keep one connection listening on the events channel; made again with backoff
        when it is lost. Each notification (and each new connection, which may have missed
        some) wakes the readers."""
        retry = LISTEN_RETRY.total_seconds()
        while True:
            conn = None
            try:
                conn = await asyncpg.connect(
                    self.url,
                    timeout=self._limits.connect_timeout.total_seconds(),
                    # Named apart from the pool's: it is one connection beside the pool.
                    server_settings={
                        **self._server_settings(),
                        "application_name": self._application_name + " (events)",
                    },
                )
                lost = asyncio.Event()
                conn.add_termination_listener(functools.partial(_set_on_loss, lost))
                await conn.add_listener(EVENTS_CHANNEL, lambda *_: self._wake())
                retry = LISTEN_RETRY.total_seconds()
                self._wake()
                await lost.wait()
                log.warning("the revocation events listener lost its connection")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(
                    "cannot listen for revocation events; readers poll meanwhile",
                    extra={"reason": f"{type(exc).__name__}: {exc}"},
                )
            finally:
                if conn is not None and not conn.is_closed():
                    with contextlib.suppress(Exception):
                        await asyncio.shield(conn.close(timeout=1))
            await asyncio.sleep(retry)
            retry = min(retry * 2, LISTEN_RETRY_MAX.total_seconds())

    async def access_token_active(self, jti: str) -> bool:
        async with self._connection("access_token_active") as conn:
            inactive = await conn.fetchval(
                "SELECT a.revoked OR EXISTS (SELECT 1 FROM grants g"
                "  WHERE g.grant_id = a.grant_id AND g.revoked_at IS NOT NULL)"
                " FROM access_tokens a WHERE a.jti = $1",
                jti,
            )
        return not inactive

    # -- refresh tokens

    async def get_refresh(self, token_hash: bytes) -> RefreshRecord | None:
        async with self._connection("get_refresh") as conn:
            row = await conn.fetchrow(
                "SELECT t.token_hash, t.family_id, t.client_id, t.subject, t.scope, t.audience,"
                " t.auth_time, t.created_at, t.expires_at, g.expires_at, t.state, t.rotated_at,"
                " t.successor_hash, t.successor_sealed, t.dpop_jkt, t.amr"
                " FROM refresh_tokens t JOIN grants g ON g.grant_id = t.family_id"
                " WHERE t.token_hash = $1",
                token_hash,
            )
        return None if row is None else replace(RefreshRecord(*row[:-1]), amr=_methods(row[-1]))

    async def rotate_refresh(
        self, token_hash: bytes, move: Move, issuance: Issuance, successor_sealed: bytes
    ) -> bool:
        successor = issuance.refresh_token
        if successor is None:
            raise ValueError("a rotation issues a successor")
        async with self._transaction("rotate_refresh") as conn:
            # FOR SHARE: concurrent rotations of the family go on together, while a
            # revocation (an UPDATE of the grant) waits for them, or they for it.
            live = await conn.fetchval(
                "SELECT 1 FROM grants WHERE grant_id = $1 AND revoked_at IS NULL FOR SHARE",
                issuance.grant_id,
            )
            if live is None:
                return False
            rotated = await conn.fetchval(
                "UPDATE refresh_tokens SET state = $1, rotated_at = $2, successor_hash = $3,"
                " successor_sealed = $4"
                " WHERE token_hash = $5 AND state = $6 AND family_id = $7 RETURNING 1",
                Refresh(move.next).value,
                successor.created_at,
                successor.token_hash,
                successor_sealed,
                token_hash,
                Refresh(move.expected).value,
                issuance.grant_id,
            )
            if rotated is None:
                return False
            await _record_tokens(conn, issuance)
            return True

    # -- consent

    async def granted_scopes(self, subject: str, client_id: str) -> frozenset[str]:
        async with self._connection("granted_scopes") as conn:
            rows = await conn.fetch(
                "SELECT scope FROM consents WHERE subject = $1 AND client_id = $2",
                subject,
                client_id,
            )
        return frozenset(row[0] for row in rows)

    async def grant_scopes(
        self, subject: str, client_id: str, scopes: frozenset[str], now: float
    ) -> None:
        async with self._connection("grant_scopes") as conn:
            await conn.execute(
                "INSERT INTO consents (subject, client_id, scope, granted_at)"
                " SELECT $1, $2, scope, $4 FROM unnest($3::text[]) AS scope"
                " ON CONFLICT DO NOTHING",
                subject,
                client_id,
                sorted(scope for scope in scopes if scope),
                now,
            )

    async def consents_of(self, subject: str) -> list[Consent]:
        async with self._connection("consents_of") as conn:
            rows = await conn.fetch(
                "SELECT client_id, array_agg(scope ORDER BY scope), min(granted_at)"
                " FROM consents WHERE subject = $1 GROUP BY client_id ORDER BY client_id",
                subject,
            )
        return [Consent(row[0], tuple(row[1]), row[2]) for row in rows]

    async def withdraw_consent(self, subject: str, client_id: str, now: float) -> list[str]:
        async with self._transaction("withdraw_consent") as conn:
            await conn.execute(
                "DELETE FROM consents WHERE subject = $1 AND client_id = $2", subject, client_id
            )
            rows = await conn.fetch(
                "SELECT grant_id FROM grants WHERE subject = $1 AND client_id = $2"
                " AND revoked_at IS NULL AND expires_at > $3 ORDER BY grant_id",
                subject,
                client_id,
                now,
            )
            revoked = [
                row[0] for row in rows if await _revoke_grant(conn, row[0], now, CONSENT_WITHDRAWN)
            ]
        if revoked:
            self._wake()
        return revoked

    # -- login sessions

    async def save_session(self, record: SessionRecord) -> None:
        r = record
        async with self._connection("save_session") as conn:
            with _unique("this session"):
                await conn.execute(
                    "INSERT INTO sessions (session_hash, subject, auth_time, expires_at,"
                    " csrf_secret, address, amr) VALUES ($1, $2, $3, $4, $5, $6, $7)",
                    r.session_hash,
                    r.subject,
                    r.auth_time,
                    r.expires_at,
                    r.csrf_secret,
                    r.address,
                    _methods_text(r.amr),
                )

    async def get_session(self, session_hash: bytes, now: float) -> SessionRecord | None:
        async with self._connection("get_session") as conn:
            row = await conn.fetchrow(
                "SELECT session_hash, subject, auth_time, expires_at, csrf_secret, address, amr"
                " FROM sessions WHERE session_hash = $1 AND expires_at > $2",
                session_hash,
                now,
            )
        return None if row is None else replace(SessionRecord(*row[:-1]), amr=_methods(row[-1]))

    async def delete_session(self, session_hash: bytes) -> None:
        async with self._connection("delete_session") as conn:
            await conn.execute("DELETE FROM sessions WHERE session_hash = $1", session_hash)

    async def record_sign_in(self, record: SignInRecord) -> None:
        r = record
        async with self._transaction("record_sign_in") as conn:
            await conn.execute(
                "INSERT INTO sign_ins (subject, at, outcome, address, client_id, expires_at)"
                " VALUES ($1, $2, $3, $4, $5, $6)",
                r.subject,
                r.at,
                r.outcome,
                r.address,
                r.client_id,
                r.expires_at,
            )
            await conn.execute(
                "DELETE FROM sign_ins WHERE subject = $1 AND id NOT IN"
                " (SELECT id FROM sign_ins WHERE subject = $1 ORDER BY at DESC, id DESC"
                "  LIMIT $2)",
                r.subject,
                SIGN_INS_KEPT,
            )

    async def sign_ins_of(self, subject: str, now: float) -> list[SignInRecord]:
        async with self._connection("sign_ins_of") as conn:
            rows = await conn.fetch(
                "SELECT subject, at, outcome, address, client_id, expires_at FROM sign_ins"
                " WHERE subject = $1 AND expires_at > $2 ORDER BY at DESC, id DESC",
                subject,
                now,
            )
        return [SignInRecord(*row) for row in rows]

    async def sessions_of(self, subject: str, now: float) -> list[SessionRecord]:
        async with self._connection("sessions_of") as conn:
            rows = await conn.fetch(
                "SELECT session_hash, subject, auth_time, expires_at, csrf_secret, address, amr"
                " FROM sessions"
                " WHERE subject = $1 AND expires_at > $2 ORDER BY auth_time DESC, session_hash",
                subject,
                now,
            )
        return [replace(SessionRecord(*row[:-1]), amr=_methods(row[-1])) for row in rows]

    async def delete_other_sessions(self, subject: str, keep: bytes) -> int:
        async with self._connection("delete_other_sessions") as conn:
            rows = await conn.fetch(
                "DELETE FROM sessions WHERE subject = $1 AND session_hash <> $2 RETURNING 1",
                subject,
                keep,
            )
        return len(rows)

    # -- throttles on guessing: the rules of protocol/throttle.py decide, under the keys'
    # advisory locks, so reading, deciding and charging is one step for every replica.

    async def reserve_attempt(self, rules: Sequence[Rule], now: float) -> Refuse | None:
        keys = [rule.key for rule in rules]
        if len(set(keys)) != len(keys):
            raise ValueError("the keys of one reservation must be distinct")
        async with self._transaction("reserve_attempt") as conn:
            await _lock_keys(conn, keys)
            counters = await _counters(conn, keys)
            decisions = [(rule.key, rule.admit(counters.get(rule.key), now)) for rule in rules]
            refusals = [d for _, d in decisions if isinstance(d, Refuse)]
            if refusals:
                return max(refusals, key=lambda refusal: refusal.retry_after)
            await conn.executemany(
                "INSERT INTO failures (key, window_start, count, last_attempt, expires_at)"
                " VALUES ($1, $2, $3, $4, $5)"
                " ON CONFLICT (key) DO UPDATE SET window_start = excluded.window_start,"
                " count = excluded.count, last_attempt = excluded.last_attempt,"
                " expires_at = excluded.expires_at",
                [
                    (
                        key,
                        d.counter.window_start,
                        d.counter.count,
                        d.counter.last_attempt,
                        d.expires_at,
                    )
                    for key, d in decisions
                    if isinstance(d, Admit)
                ],
            )
            return None

    async def release_attempt(self, keys: Sequence[str], reserved_at: float) -> None:
        async with self._transaction("release_attempt") as conn:
            await _lock_keys(conn, keys)
            counters = await _counters(conn, keys)
            for key, counter in sorted(counters.items()):
                after = released(counter, reserved_at)
                if after != counter:
                    await conn.execute(
                        "UPDATE failures SET count = $1 WHERE key = $2", after.count, key
                    )

    async def clear_failures(self, key: str) -> None:
        async with self._transaction("clear_failures") as conn:
            await _lock_keys(conn, [key])
            await conn.execute("DELETE FROM failures WHERE key = $1", key)

    # -- client assertion replay cache

    async def use_jti(self, client_id: str, jti: str, expires_at: float, now: float) -> bool:
        async with self._connection("use_jti") as conn:
            # A second caller waits on the first's index entry, then takes the conflict
            # branch, whose WHERE matches only an entry already expired.
            first = await conn.fetchval(
                "INSERT INTO assertion_jtis (client_id, jti, expires_at) VALUES ($1, $2, $3)"
                " ON CONFLICT (client_id, jti) DO UPDATE SET expires_at = excluded.expires_at"
                " WHERE assertion_jtis.expires_at <= $4 RETURNING 1",
                client_id,
                jti,
                expires_at,
                now,
            )
        return first is not None

    # -- second factors: each change one statement, or one transaction of a few

    async def begin_totp(self, record: TotpRecord) -> bool:
        r = record
        async with self._connection("begin_totp") as conn:
            # A waiting enrolment is replaced; a confirmed factor is left alone.
            stored = await conn.fetchval(
                "INSERT INTO totp_factors (subject, sealed_secret, created_at, confirmed_at,"
                " last_step) VALUES ($1, $2, $3, NULL, NULL)"
                " ON CONFLICT (subject) DO UPDATE SET sealed_secret = excluded.sealed_secret,"
                " created_at = excluded.created_at WHERE totp_factors.confirmed_at IS NULL"
                " RETURNING 1",
                r.subject,
                r.sealed_secret,
                r.created_at,
            )
        return stored is not None

    async def get_totp(self, subject: str) -> TotpRecord | None:
        async with self._connection("get_totp") as conn:
            row = await conn.fetchrow(
                "SELECT subject, sealed_secret, created_at, confirmed_at, last_step,"
                " (SELECT count(*) FROM recovery_codes c WHERE c.subject = f.subject"
                "  AND c.used_at IS NULL)"
                " FROM totp_factors f WHERE subject = $1",
                subject,
            )
        return None if row is None else TotpRecord(*row)

    async def confirm_totp(
        self,
        subject: str,
        sealed_secret: bytes,
        step: int,
        recovery_codes: Sequence[bytes],
        now: float,
    ) -> bool:
        async with self._transaction("confirm_totp") as conn:
            confirmed = await conn.fetchval(
                "UPDATE totp_factors SET confirmed_at = $1, last_step = $2"
                " WHERE subject = $3 AND sealed_secret = $4 AND confirmed_at IS NULL"
                " RETURNING 1",
                now,
                step,
                subject,
                sealed_secret,
            )
            if confirmed is None:
                return False
            await _set_recovery_codes(conn, subject, recovery_codes)
            return True

    async def use_totp_step(self, subject: str, step: int) -> bool:
        async with self._connection("use_totp_step") as conn:
            used = await conn.fetchval(
                "UPDATE totp_factors SET last_step = $1 WHERE subject = $2"
                " AND confirmed_at IS NOT NULL AND (last_step IS NULL OR last_step < $1)"
                " RETURNING 1",
                step,
                subject,
            )
        return used is not None

    async def use_recovery_code(self, subject: str, code_sha256: bytes, now: float) -> bool:
        async with self._connection("use_recovery_code") as conn:
            used = await conn.fetchval(
                "UPDATE recovery_codes SET used_at = $1"
                " WHERE subject = $2 AND code_sha256 = $3 AND used_at IS NULL RETURNING 1",
                now,
                subject,
                code_sha256,
            )
        return used is not None

    async def replace_recovery_codes(self, subject: str, recovery_codes: Sequence[bytes]) -> bool:
        async with self._transaction("replace_recovery_codes") as conn:
            # The factor's row locked: a removal or a confirmation at the same time waits.
            confirmed = await conn.fetchval(
                "SELECT 1 FROM totp_factors WHERE subject = $1 AND confirmed_at IS NOT NULL"
                " FOR UPDATE",
                subject,
            )
            if confirmed is None:
                return False
            await _set_recovery_codes(conn, subject, recovery_codes)
            return True

    async def delete_totp(self, subject: str) -> bool:
        async with self._connection("delete_totp") as conn:
            # Its recovery codes go with it (ON DELETE CASCADE).
            deleted = await conn.fetchval(
                "DELETE FROM totp_factors WHERE subject = $1 RETURNING 1", subject
            )
        return deleted is not None

    # -- passkeys: each change one statement

    async def add_passkey(self, record: PasskeyRecord) -> bool:
        r = record
        async with self._connection("add_passkey") as conn:
            added = await conn.fetchval(
                f"INSERT INTO passkeys ({_PASSKEY_COLUMNS})"  # noqa: S608 - fixed names
                " SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, NULL, $11"
                " WHERE EXISTS (SELECT 1 FROM users WHERE subject = $2)"
                " ON CONFLICT (credential_id) DO NOTHING RETURNING 1",
                r.credential_id,
                r.subject,
                r.user_handle,
                r.public_key,
                r.sign_count,
                " ".join(r.transports),
                r.backup_eligible,
                r.backed_up,
                r.name,
                r.created_at,
                r.rp_id,
            )
        return added is not None

    async def passkeys_of(self, subject: str) -> list[PasskeyRecord]:
        async with self._connection("passkeys_of") as conn:
            rows = await conn.fetch(
                f"SELECT {_PASSKEY_COLUMNS} FROM passkeys WHERE subject = $1"  # noqa: S608 - fixed names
                " ORDER BY created_at, credential_id",
                subject,
            )
        return [_passkey(row) for row in rows]

    async def get_passkey(self, credential_id: bytes) -> PasskeyRecord | None:
        async with self._connection("get_passkey") as conn:
            row = await conn.fetchrow(
                f"SELECT {_PASSKEY_COLUMNS} FROM passkeys WHERE credential_id = $1",  # noqa: S608 - fixed names
                credential_id,
            )
        return None if row is None else _passkey(row)

    async def use_passkey(
        self, credential_id: bytes, sign_count: int, backed_up: bool, now: float
    ) -> bool:
        async with self._connection("use_passkey") as conn:
            # WebAuthn §6.1.1: the counter must grow, unless the authenticator keeps none
            # (both 0). A second caller with one counter waits on the first's row lock,
            # then reads the grown counter and matches nothing.
            used = await conn.fetchval(
                "UPDATE passkeys SET sign_count = $2, backed_up = $3, last_used_at = $4"
                " WHERE credential_id = $1 AND (sign_count < $2 OR (sign_count = 0 AND $2 = 0))"
                " RETURNING 1",
                credential_id,
                sign_count,
                backed_up,
                now,
            )
        return used is not None

    async def delete_passkey(self, subject: str, credential_id: bytes) -> bool:
        async with self._connection("delete_passkey") as conn:
            deleted = await conn.fetchval(
                "DELETE FROM passkeys WHERE subject = $1 AND credential_id = $2 RETURNING 1",
                subject,
                credential_id,
            )
        return deleted is not None

    # -- device authorization

    async def save_device(self, record: DeviceRecord) -> None:
        r = record
        async with self._transaction("save_device") as conn:
            # An expired code no longer holds its user code.
            await conn.execute(
                "DELETE FROM device_codes WHERE user_code = $1 AND expires_at <= $2",
                r.user_code,
                r.created_at,
            )
            with _unique("this device code or user code"):
                await conn.execute(
                    "INSERT INTO device_codes (device_code_hash, user_code, client_id, scope,"
                    " audience, state, subject, poll_interval, last_poll, expires_at,"
                    " created_at, auth_time, amr)"
                    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
                    r.device_code_hash,
                    r.user_code,
                    r.client_id,
                    r.scope,
                    r.audience,
                    Device(r.state).value,
                    r.subject,
                    r.interval,
                    r.last_poll,
                    r.expires_at,
                    r.created_at,
                    r.auth_time,
                    _methods_text(r.amr),
                )

    async def device_by_user_code(self, user_code: str, now: float) -> DeviceRecord | None:
        async with self._connection("device_by_user_code") as conn:
            row = await conn.fetchrow(
                "SELECT device_code_hash, user_code, client_id, scope, audience, state,"
                " subject, poll_interval, last_poll, expires_at, created_at, auth_time, amr"
                " FROM device_codes"
                " WHERE user_code = $1 AND expires_at > $2",
                user_code,
                now,
            )
        return None if row is None else replace(DeviceRecord(*row[:-1]), amr=_methods(row[-1]))

    async def get_device(self, device_code_hash: bytes) -> DeviceRecord | None:
        async with self._connection("get_device") as conn:
            row = await conn.fetchrow(
                "SELECT device_code_hash, user_code, client_id, scope, audience, state,"
                " subject, poll_interval, last_poll, expires_at, created_at, auth_time, amr"
                " FROM device_codes"
                " WHERE device_code_hash = $1",
                device_code_hash,
            )
        return None if row is None else replace(DeviceRecord(*row[:-1]), amr=_methods(row[-1]))

    async def decide_device(
        self,
        user_code: str,
        move: Move,
        subject: str,
        now: float,
        auth_time: float | None = None,
        amr: Sequence[str] = (),
    ) -> bool:
        async with self._connection("decide_device") as conn:
            decided = await conn.fetchval(
                "UPDATE device_codes SET state = $1, subject = $2, auth_time = $3, amr = $7"
                " WHERE user_code = $4 AND state = $5 AND expires_at > $6 RETURNING 1",
                Device(move.next).value,
                subject,
                auth_time,
                user_code,
                Device(move.expected).value,
                now,
                _methods_text(amr),
            )
        return decided is not None

    async def record_poll(self, device_code_hash: bytes, poll: Poll) -> bool:
        async with self._connection("record_poll") as conn:
            return await _record_poll(conn, device_code_hash, poll)

    async def redeem_device(self, device_code_hash: bytes, poll: Poll, issuance: Issuance) -> bool:
        grant = _new_grant(issuance)
        async with self._transaction("redeem_device") as conn:
            if not await _record_poll(conn, device_code_hash, poll):
                return False
            await _insert_grant(conn, grant)
            await _record_tokens(conn, issuance)
            return True

    # -- signing keys

    async def signing_keys(self) -> SigningKeys:
        async with self._connection("signing_keys") as conn:
            # One statement, one snapshot: the version and the keys it names.
            rows = await conn.fetch(
                "SELECT r.version, k.kid, k.alg, k.state, k.created_at, k.activate_at,"
                " k.retired_at, k.remove_after, k.sealed_private_key"
                " FROM signing_key_ring r LEFT JOIN signing_keys k ON true"
                " WHERE r.id = 1 ORDER BY k.created_at, k.kid"
            )
        return SigningKeys(
            rows[0][0], tuple(SigningKeyRecord(*row[1:]) for row in rows if row[1] is not None)
        )

    async def signing_keys_version(self) -> int:
        async with self._connection("signing_keys_version") as conn:
            return int(await conn.fetchval("SELECT version FROM signing_key_ring WHERE id = 1"))

    async def replace_signing_keys(
        self, expected_version: int, keys: Sequence[SigningKeyRecord]
    ) -> bool:
        async with self._transaction("replace_signing_keys") as conn:
            # The ring's row lock: a concurrent change waits, then matches nothing.
            changed = await conn.fetchval(
                "UPDATE signing_key_ring SET version = version + 1"
                " WHERE id = 1 AND version = $1 RETURNING 1",
                expected_version,
            )
            if changed is None:
                return False
            await conn.execute(
                "DELETE FROM signing_keys WHERE NOT (kid = ANY($1::text[]))", [k.kid for k in keys]
            )
            # Keys leaving `active` first, so that the index allowing one active key per
            # algorithm sees a successor only after its predecessor is retired.
            for k in sorted(keys, key=lambda k: k.state == "active"):
                with _unique("a second active key of one algorithm"):
                    await conn.execute(
                        "INSERT INTO signing_keys (kid, alg, state, created_at, activate_at,"
                        " retired_at, remove_after, sealed_private_key)"
                        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
                        " ON CONFLICT (kid) DO UPDATE SET state = excluded.state,"
                        " activate_at = excluded.activate_at, retired_at = excluded.retired_at,"
                        " remove_after = excluded.remove_after",
                        k.kid,
                        k.alg,
                        k.state,
                        k.created_at,
                        k.activate_at,
                        k.retired_at,
                        k.remove_after,
                        k.sealed_private_key,
                    )
            return True

    # -- clients and users: JSON text for the values of mappings and lists

    async def get_client(self, client_id: str) -> ClientRecord | None:
        async with self._connection("get_client") as conn:
            return await _get_client(conn, client_id)

    async def list_clients(self) -> list[ClientRecord]:
        async with self._connection("list_clients") as conn:
            rows = await conn.fetch(
                f"SELECT {_CLIENT_COLUMNS} FROM clients ORDER BY client_id"  # noqa: S608
            )
        return [_client(row) for row in rows]

    async def save_client(self, record: ClientRecord, expected_version: int | None) -> bool:
        async with self._connection("save_client") as conn:
            return await _save_client(conn, record, expected_version)

    async def delete_client(self, client_id: str) -> bool:
        async with self._connection("delete_client") as conn:
            return bool(
                await conn.fetchval(
                    "DELETE FROM clients WHERE client_id = $1 RETURNING 1", client_id
                )
            )

    async def client_used(self, client_id: str) -> bool:
        async with self._connection("client_used") as conn:
            updated = await conn.fetchval(
                "UPDATE clients SET unused_until = NULL"
                " WHERE client_id = $1 AND unused_until IS NOT NULL RETURNING 1",
                client_id,
            )
        return updated is not None

    async def sync_clients(self, records: Sequence[ClientRecord], now: float) -> list[str]:
        async with self._transaction("sync_clients") as conn:
            # Replicas starting together sync one after the other.
            await conn.execute("SELECT pg_advisory_xact_lock($1)", lock_id("sync", "clients"))
            seeded = [r.client_id for r in records]
            removed = await conn.fetch(
                "DELETE FROM clients WHERE managed_by = $1 AND NOT (client_id = ANY($2::text[]))"
                " RETURNING client_id",
                MANAGED_BY_CONFIG,
                seeded,
            )
            for r in records:
                old = await _get_client(conn, r.client_id)
                if old is None:
                    await _save_client(conn, r, None)
                elif (old.metadata, old.secret_sha256, old.managed_by) != (
                    r.metadata,
                    r.secret_sha256,
                    MANAGED_BY_CONFIG,
                ):
                    kept = replace(
                        r, created_at=old.created_at, tokens_valid_from=old.tokens_valid_from
                    )
                    await _save_client(conn, kept, old.version)
        return sorted(row[0] for row in removed)

    async def get_user(self, subject: str) -> UserRecord | None:
        async with self._connection("get_user") as conn:
            return await _get_user(conn, "subject", subject)

    async def user_by_username(self, username: str) -> UserRecord | None:
        async with self._connection("user_by_username") as conn:
            return await _get_user(conn, "username", username)

    async def list_users(self) -> list[UserRecord]:
        async with self._connection("list_users") as conn:
            rows = await conn.fetch(
                "SELECT subject, username, password_hash, claims, roles, disabled, managed_by,"
                " created_at, updated_at, version FROM users ORDER BY subject"
            )
        return [_user(row) for row in rows]

    async def users_with_email(self, email: str) -> list[UserRecord]:
        async with self._connection("users_with_email") as conn:
            rows = await conn.fetch(
                "SELECT subject, username, password_hash, claims, roles, disabled, managed_by,"
                " created_at, updated_at, version FROM users WHERE email_key = $1"
                " ORDER BY subject",
                email_key(email),
            )
        return [_user(row) for row in rows]

    async def save_user(self, record: UserRecord, expected_version: int | None) -> bool:
        async with self._connection("save_user") as conn:
            return await _save_user(conn, record, expected_version)

    async def delete_user(self, subject: str) -> bool:
        async with self._connection("delete_user") as conn:
            return bool(
                await conn.fetchval("DELETE FROM users WHERE subject = $1 RETURNING 1", subject)
            )

    async def identity_owner(self, issuer: str, provider_subject: str) -> str | None:
        async with self._connection("identity_owner") as conn:
            subject = await conn.fetchval(
                "SELECT subject FROM identity_links WHERE issuer = $1 AND provider_subject = $2",
                issuer,
                provider_subject,
            )
        return None if subject is None else str(subject)

    async def link_identity(self, link: IdentityLink, new_user: UserRecord | None) -> None:
        async with self._transaction("link_identity") as conn:
            if new_user is not None:
                await _save_user(conn, new_user, None)
            with _unique(f"the identity {link.provider_subject!r} of {link.issuer!r}"):
                await conn.execute(
                    "INSERT INTO identity_links (issuer, provider_subject, subject, created_at)"
                    " VALUES ($1, $2, $3, $4)",
                    link.issuer,
                    link.provider_subject,
                    link.subject,
                    link.created_at,
                )

    async def identity_links(self, subject: str) -> list[IdentityLink]:
        async with self._connection("identity_links") as conn:
            rows = await conn.fetch(
                "SELECT issuer, provider_subject, subject, created_at FROM identity_links"
                " WHERE subject = $1 ORDER BY issuer, provider_subject",
                subject,
            )
        return [
            IdentityLink(r["issuer"], r["provider_subject"], r["subject"], r["created_at"])
            for r in rows
        ]

    async def sync_users(self, records: Sequence[UserRecord], now: float) -> list[str]:
        async with self._transaction("sync_users") as conn:
            await conn.execute("SELECT pg_advisory_xact_lock($1)", lock_id("sync", "users"))
            removed = await conn.fetch(
                "DELETE FROM users WHERE managed_by = $1 AND NOT (subject = ANY($2::text[]))"
                " RETURNING subject",
                MANAGED_BY_CONFIG,
                [r.subject for r in records],
            )
            for r in records:
                old = await _get_user(conn, "subject", r.subject)
                if old is None:
                    await _save_user(conn, r, None)
                elif _user_facts(old) != _user_facts(replace(r, managed_by=MANAGED_BY_CONFIG)):
                    await _save_user(conn, replace(r, created_at=old.created_at), old.version)
        return sorted(row[0] for row in removed)

    async def delete_sessions(self, subject: str) -> int:
        async with self._connection("delete_sessions") as conn:
            rows = await conn.fetch("DELETE FROM sessions WHERE subject = $1 RETURNING 1", subject)
        return len(rows)

    async def list_grants(
        self, client_id: str | None = None, subject: str | None = None
    ) -> list[GrantSummary]:
        async with self._connection("list_grants") as conn:
            rows = await conn.fetch(
                "SELECT g.grant_id, g.client_id, g.subject, g.created_at, g.expires_at,"
                " g.revoked_at,"
                " coalesce((SELECT t.scope FROM refresh_tokens t WHERE t.family_id = g.grant_id"
                "           ORDER BY t.created_at DESC LIMIT 1),"
                "(SELECT string_agg(c.scope, ' ' ORDER BY c.scope) FROM consents c"
                " WHERE c.subject = g.subject AND c.client_id = g.client_id)"
                ", ''),"
                " coalesce((SELECT max(t.created_at) FROM refresh_tokens t"
                "           WHERE t.family_id = g.grant_id), g.created_at),"
                " EXISTS (SELECT 1 FROM refresh_tokens t WHERE t.family_id = g.grant_id)"
                " FROM grants g WHERE ($1::text IS NULL OR g.client_id = $1)"
                " AND ($2::text IS NULL OR g.subject = $2) ORDER BY g.grant_id",
                client_id,
                subject,
            )
        return [GrantSummary(GrantRecord(*row[:6]), row[6], row[7], bool(row[8])) for row in rows]

    # -- housekeeping

    async def purge_expired(self, now: float) -> int:
        """On one connection, each step its own short transaction, so that writers wait for
        one table at most.

        The count is of records the protocol knows (codes, refresh tokens, sessions, jtis,
        device codes, throttle keys, access tokens, revocation events, clients that never
        obtained a token, sign-ins); grants are bookkeeping and not counted.
        """
        deleted = 0
        async with self._connection("purge_expired") as conn:
            for statement in _PURGE_BY_EXPIRY:
                deleted += await _count(conn, statement, now)
            async with _in_transaction(conn):
                # Whole families past their absolute lifetime. Their grants are locked
                # first, in one order, as every transaction touching a grant and its tokens
                # does.
                await conn.execute(
                    "SELECT 1 FROM grants WHERE expires_at <= $1 ORDER BY grant_id FOR UPDATE",
                    now,
                )
                deleted += await _count(
                    conn,
                    "WITH gone AS (DELETE FROM refresh_tokens WHERE family_id IN"
                    " (SELECT grant_id FROM grants WHERE expires_at <= $1) RETURNING 1)"
                    " SELECT count(*) FROM gone",
                    now,
                )
            # Tokens idle-expired long ago (a live family keeps its recent rotated tokens
            # for reuse detection).
            deleted += await _count(
                conn,
                "WITH gone AS (DELETE FROM refresh_tokens WHERE expires_at <= $1 RETURNING 1)"
                " SELECT count(*) FROM gone",
                now - REFRESH_RETENTION.total_seconds(),
            )
            # Grants left with nothing: no refresh token, or past their end, and no access
            # token that could still be presented (its revocation is read from the grant).
            await conn.execute(
                "DELETE FROM grants g WHERE NOT EXISTS"
                " (SELECT 1 FROM access_tokens a WHERE a.grant_id = g.grant_id)"
                " AND (g.expires_at <= $1 OR NOT EXISTS"
                "      (SELECT 1 FROM refresh_tokens t WHERE t.family_id = g.grant_id))",
                now,
            )
        return deleted

    async def ping(self) -> None:
        async with self._connection("ping") as conn:
            await conn.fetchval("SELECT 1")


_PURGE_BY_EXPIRY = (
    "WITH gone AS (DELETE FROM clients WHERE unused_until <= $1 RETURNING 1)"
    " SELECT count(*) FROM gone",
    "WITH gone AS (DELETE FROM codes WHERE expires_at <= $1 RETURNING 1) SELECT count(*) FROM gone",
    "WITH gone AS (DELETE FROM sessions WHERE expires_at <= $1 RETURNING 1)"
    " SELECT count(*) FROM gone",
    "WITH gone AS (DELETE FROM assertion_jtis WHERE expires_at <= $1 RETURNING 1)"
    " SELECT count(*) FROM gone",
    "WITH gone AS (DELETE FROM device_codes WHERE expires_at <= $1 RETURNING 1)"
    " SELECT count(*) FROM gone",
    "WITH gone AS (DELETE FROM failures WHERE expires_at <= $1 RETURNING 1)"
    " SELECT count(*) FROM gone",
    "WITH gone AS (DELETE FROM access_tokens WHERE expires_at <= $1 RETURNING 1)"
    " SELECT count(*) FROM gone",
    "WITH gone AS (DELETE FROM revocation_events WHERE expires_at <= $1 RETURNING 1)"
    " SELECT count(*) FROM gone",
    "WITH gone AS (DELETE FROM sign_ins WHERE expires_at <= $1 RETURNING 1)"
    " SELECT count(*) FROM gone",
)


# ---------------------------------------------------------------------------------------
# Migrations


async def migrate(conn: Any, migrations: list[Migration], lock: int) -> list[int]:
    """Apply the migrations not applied yet, each in its own transaction; the versions
    applied. Each transaction takes the advisory lock `lock` before it reads
    schema_migrations, so concurrent callers apply each migration exactly once."""
    async with conn.transaction():
        await _lock_schema(conn, lock)
        newer = unknown_versions(await _applied(conn), migrations)
        if newer:
            raise RuntimeError(
                f"the database has migrations this program does not know ({newer}): "
                "it was written by a newer version"
            )
    applied: list[int] = []
    for migration in migrations:
        async with conn.transaction():
            await _lock_schema(conn, lock)
            if migration.version in await _applied(conn):
                continue
            # No arguments: the simple query protocol, which runs a script's statements.
            await conn.execute(migration.sql)
            await conn.execute(
                "INSERT INTO schema_migrations (version, name, applied_at) VALUES ($1, $2, $3)",
                migration.version,
                migration.name,
                time.time(),
            )
        log.info("migration applied", extra={"version": migration.version, "file": migration.name})
        applied.append(migration.version)
    return applied


async def _lock_schema(conn: Any, lock: int) -> None:
    """Inside a transaction: wait for the schema's migration lock, then make sure the table
    of applied migrations exists (CREATE ... IF NOT EXISTS alone races with itself)."""
    await conn.execute("SELECT pg_advisory_xact_lock($1)", lock)
    await conn.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations ("
        " version integer PRIMARY KEY, name text NOT NULL, applied_at double precision NOT NULL)"
    )


async def _applied(conn: Any) -> set[int]:
    return {row[0] for row in await conn.fetch("SELECT version FROM schema_migrations")}


def lock_id(purpose: str, name: str) -> int:
    """A 64-bit advisory lock id for a named thing. Ids of different things may collide
    (one in 2^64): the two then merely wait for each other."""
    digest = hashlib.sha256(f"portcullis-authserver\x00{purpose}\x00{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def quote_identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


# ---------------------------------------------------------------------------------------
# Statements shared by several operations; each runs inside the caller's transaction.


@contextlib.contextmanager
def _unavailable() -> Iterator[None]:
    try:
        yield
    except UNAVAILABLE as exc:
        raise StoreUnavailable(f"PostgreSQL: {type(exc).__name__}: {exc}") from exc


@contextlib.asynccontextmanager
async def _in_transaction(conn: Any) -> AsyncIterator[None]:
    """A READ COMMITTED transaction on `conn`: committed when the block ends, rolled back
    when it raises (AlreadyExists included)."""
    transaction = conn.transaction()
    await transaction.start()
    try:
        yield
    except BaseException:
        # The error that ended the block is the one to raise, a cancellation included. A
        # rollback that fails means the connection broke (or the pool took it back
        # already): the server aborts the transaction of a session that ends, and the pool
        # resets a connection it gets back, which rolls back too, or discards it.
        with contextlib.suppress(Exception):
            await transaction.rollback()
        raise
    await transaction.commit()


_USER_BY = {
    "subject": (
        "SELECT subject, username, password_hash, claims, roles, disabled, managed_by,"
        " created_at, updated_at, version FROM users WHERE subject = $1"
    ),
    "username": (
        "SELECT subject, username, password_hash, claims, roles, disabled, managed_by,"
        " created_at, updated_at, version FROM users WHERE username = $1"
    ),
}


def _client(row: Any) -> ClientRecord:
    return ClientRecord(
        client_id=row[0],
        metadata=orjson.loads(row[1]),
        secret_sha256=row[2],
        managed_by=row[3],
        created_at=row[4],
        updated_at=row[5],
        tokens_valid_from=row[6],
        version=row[7],
        registration_token_sha256=row[8],
        unused_until=row[9],
        blocked=row[10],
    )


def _user(row: Any) -> UserRecord:
    return UserRecord(
        subject=row[0],
        username=row[1],
        password_hash=row[2],
        claims=orjson.loads(row[3]),
        roles=tuple(orjson.loads(row[4])),
        disabled=row[5],
        managed_by=row[6],
        created_at=row[7],
        updated_at=row[8],
        version=row[9],
    )


def _user_facts(r: UserRecord) -> tuple[Any, ...]:
    """What a seed sets of a user: a sync changes the stored one only when these differ."""
    return (r.username, r.password_hash, dict(r.claims), r.roles, r.disabled, r.managed_by)


_CLIENT_COLUMNS = (
    "client_id, metadata, secret_sha256, managed_by, created_at, updated_at,"
    " tokens_valid_from, version, registration_token_sha256, unused_until, blocked"
)


async def _get_client(conn: Any, client_id: str) -> ClientRecord | None:
    row = await conn.fetchrow(
        f"SELECT {_CLIENT_COLUMNS} FROM clients WHERE client_id = $1",  # noqa: S608
        client_id,
    )
    return None if row is None else _client(row)


async def _save_client(conn: Any, r: ClientRecord, expected: int | None) -> bool:
    values = (
        orjson.dumps(r.metadata).decode(),
        r.secret_sha256,
        r.managed_by,
        r.created_at,
        r.updated_at,
        r.tokens_valid_from,
        r.registration_token_sha256,
        r.unused_until,
        r.blocked,
    )
    if expected is None:
        with _unique(f"client {r.client_id!r}"):
            await conn.execute(
                "INSERT INTO clients (client_id, metadata, secret_sha256, managed_by,"
                " created_at, updated_at, tokens_valid_from, registration_token_sha256,"
                " unused_until, blocked, version)"
                " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 1)",
                r.client_id,
                *values,
            )
        return True
    changed = await conn.fetchval(
        "UPDATE clients SET metadata = $2, secret_sha256 = $3, managed_by = $4,"
        " created_at = $5, updated_at = $6, tokens_valid_from = $7,"
        " registration_token_sha256 = $8, unused_until = $9, blocked = $10,"
        " version = version + 1"
        " WHERE client_id = $1 AND version = $11 RETURNING 1",
        r.client_id,
        *values,
        expected,
    )
    return changed is not None


async def _get_user(conn: Any, column: str, value: str) -> UserRecord | None:
    row = await conn.fetchrow(_USER_BY[column], value)
    return None if row is None else _user(row)


async def _save_user(conn: Any, r: UserRecord, expected: int | None) -> bool:
    values = (
        r.username,
        r.password_hash,
        orjson.dumps(r.claims).decode(),
        orjson.dumps(list(r.roles)).decode(),
        r.disabled,
        r.managed_by,
        r.created_at,
        r.updated_at,
        email_key(r.claims.get("email")),
    )
    with _unique(f"user {r.subject!r} or username {r.username!r}"):
        if expected is None:
            await conn.execute(
                "INSERT INTO users (subject, username, password_hash, claims, roles, disabled,"
                " managed_by, created_at, updated_at, email_key, version)"
                " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 1)",
                r.subject,
                *values,
            )
            return True
        changed = await conn.fetchval(
            "UPDATE users SET username = $2, password_hash = $3, claims = $4, roles = $5,"
            " disabled = $6, managed_by = $7, created_at = $8, updated_at = $9,"
            " email_key = $10, version = version + 1 WHERE subject = $1 AND version = $11"
            " RETURNING 1",
            r.subject,
            *values,
            expected,
        )
        return changed is not None


async def _set_recovery_codes(conn: Any, subject: str, recovery_codes: Sequence[bytes]) -> None:
    """The user's recovery codes become these, all unused (within the caller's transaction)."""
    await conn.execute("DELETE FROM recovery_codes WHERE subject = $1", subject)
    await conn.executemany(
        "INSERT INTO recovery_codes (subject, code_sha256, used_at) VALUES ($1, $2, NULL)",
        [(subject, digest) for digest in recovery_codes],
    )


@contextlib.contextmanager
def _unique(what: str) -> Iterator[None]:
    """Turn a primary-key or unique violation into AlreadyExists."""
    try:
        yield
    except asyncpg.UniqueViolationError as exc:
        raise AlreadyExists(f"{what} is already stored") from exc


def _new_grant(issuance: Issuance) -> GrantRecord:
    grant = issuance.grant
    if grant is None or grant.grant_id != issuance.grant_id:
        raise ValueError("a redemption creates the grant its tokens are issued under")
    return grant


async def _insert_grant(conn: Any, g: GrantRecord) -> None:
    with _unique(f"grant {g.grant_id!r}"):
        await conn.execute(
            "INSERT INTO grants (grant_id, client_id, subject, created_at, expires_at,"
            " revoked_at) VALUES ($1, $2, $3, $4, $5, $6)",
            g.grant_id,
            g.client_id,
            g.subject,
            g.created_at,
            g.expires_at,
            g.revoked_at,
        )


def _set_on_loss(lost: asyncio.Event, _conn: Any) -> None:
    lost.set()


async def _insert_event(
    conn: Any,
    kind: EventKind,
    reason: str,
    now: float,
    expires_at: float,
    tokens: Sequence[RevokedToken] = (),
    *,
    key: str | None = None,
    issued_before: float | None = None,
) -> int:
    """Inside a transaction: the events' lock (ids committed in order), the row, and the
    notification every replica's listener gets when the transaction commits."""
    await conn.execute("SELECT pg_advisory_xact_lock($1)", lock_id("events", EVENTS_LOCK))
    event_id: int = await conn.fetchval(
        "INSERT INTO revocation_events (kind, reason, tokens, key, issued_before, created_at,"
        " expires_at) VALUES ($1, $2, $3::jsonb, $4, $5, $6, $7) RETURNING event_id",
        kind.value,
        reason,
        json.dumps([[t.jti, t.expires_at] for t in tokens]),
        key,
        issued_before,
        now,
        expires_at,
    )
    await conn.execute("SELECT pg_notify($1, $2)", EVENTS_CHANNEL, str(event_id))
    return event_id


async def _revoke_grant(conn: Any, grant_id: str, now: float, reason: str) -> bool:
    """Inside a transaction: the grant, every token of its family, then the event naming
    its access tokens; False when it was revoked already."""
    # The grant's row lock first: a rotation holding it FOR SHARE commits before this goes
    # on, and one that comes later finds the grant revoked.
    revoked = await conn.fetchval(
        "UPDATE grants SET revoked_at = $1 WHERE grant_id = $2 AND revoked_at IS NULL RETURNING 1",
        now,
        grant_id,
    )
    if revoked is None:
        return False
    # A new statement, a new snapshot: it sees every successor committed so far.
    await conn.execute(
        "UPDATE refresh_tokens SET state = $1 WHERE family_id = $2 AND state <> $1",
        Refresh.REVOKED.value,
        grant_id,
    )
    # Access tokens are recorded in the transaction that adds them to the grant, which
    # holds the grant FOR SHARE: all of them are committed by now.
    rows = await conn.fetch(
        "SELECT jti, expires_at FROM access_tokens"
        " WHERE grant_id = $1 AND expires_at > $2 ORDER BY jti",
        grant_id,
        now,
    )
    tokens = [RevokedToken(row[0], row[1]) for row in rows]
    if tokens:
        await _insert_event(
            conn, EventKind.TOKENS, reason, now, max(t.expires_at for t in tokens), tokens
        )
    return True


async def _record_tokens(conn: Any, issuance: Issuance) -> None:
    """The access token and the refresh token of an issuance."""
    a = issuance.access_token
    with _unique("this access token"):
        await conn.execute(
            "INSERT INTO access_tokens (jti, grant_id, client_id, expires_at)"
            " VALUES ($1, $2, $3, $4)",
            a.jti,
            a.grant_id,
            a.client_id,
            a.expires_at,
        )
    r = issuance.refresh_token
    if r is None:
        return
    if r.family_id != issuance.grant_id:
        raise ValueError("a refresh token is issued into the family of its grant")
    with _unique("this refresh token"):
        await conn.execute(
            "INSERT INTO refresh_tokens (token_hash, family_id, client_id, subject, scope,"
            " audience, auth_time, created_at, expires_at, state, rotated_at, successor_hash,"
            " successor_sealed, dpop_jkt, amr)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)",
            r.token_hash,
            r.family_id,
            r.client_id,
            r.subject,
            r.scope,
            r.audience,
            r.auth_time,
            r.created_at,
            r.expires_at,
            Refresh(r.state).value,
            r.rotated_at,
            r.successor_hash,
            r.successor_sealed,
            r.dpop_jkt,
            _methods_text(r.amr),
        )


async def _record_poll(conn: Any, device_code_hash: bytes, poll: Poll) -> bool:
    """Compare-and-set on the state and the last poll, which may be NULL."""
    polled = await conn.fetchval(
        "UPDATE device_codes SET state = $1, last_poll = $2, poll_interval = $3"
        " WHERE device_code_hash = $4 AND state = $5"
        " AND last_poll IS NOT DISTINCT FROM $6 RETURNING 1",
        Device(poll.move.next).value,
        poll.at,
        poll.interval,
        device_code_hash,
        Device(poll.move.expected).value,
        poll.last_poll,
    )
    return polled is not None


async def _lock_keys(conn: Any, keys: Sequence[str]) -> None:
    """Inside a transaction: the throttle keys' advisory locks, held until it ends. Taken in
    ascending order of id, so that two callers sharing keys never wait for each other in a
    circle."""
    ids = sorted({lock_id("throttle", key) for key in keys})
    for each in ids:
        await conn.execute("SELECT pg_advisory_xact_lock($1)", each)


async def _counters(conn: Any, keys: Sequence[str]) -> dict[str, Counter]:
    rows = await conn.fetch(
        "SELECT key, window_start, count, last_attempt FROM failures WHERE key = ANY($1::text[])",
        list(keys),
    )
    return {row[0]: Counter(row[1], row[2], row[3]) for row in rows}


async def _count(conn: Any, statement: str, *args: object) -> int:
    """The number a `WITH gone AS (DELETE ... RETURNING 1) SELECT count(*)` statement gives."""
    return int(await conn.fetchval(statement, *args))


def _milliseconds(duration: timedelta) -> str:
    return str(max(1, round(duration.total_seconds() * 1000)))


def _methods(text: str) -> tuple[str, ...]:
    """RFC 8176 values as stored: space-separated."""
    return tuple(text.split())


def _methods_text(amr: Sequence[str]) -> str:
    return " ".join(amr)


_PASSKEY_COLUMNS = (
    "credential_id, subject, user_handle, public_key, sign_count, transports,"
    " backup_eligible, backed_up, name, created_at, last_used_at, rp_id"
)


def _passkey(row: Any) -> PasskeyRecord:
    return PasskeyRecord(
        credential_id=bytes(row["credential_id"]),
        subject=row["subject"],
        user_handle=bytes(row["user_handle"]),
        public_key=bytes(row["public_key"]),
        sign_count=int(row["sign_count"]),
        transports=tuple(row["transports"].split()),
        backup_eligible=bool(row["backup_eligible"]),
        backed_up=bool(row["backed_up"]),
        name=row["name"],
        created_at=float(row["created_at"]),
        last_used_at=None if row["last_used_at"] is None else float(row["last_used_at"]),
        rp_id=row["rp_id"],
    )
