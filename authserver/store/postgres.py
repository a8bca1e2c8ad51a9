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

Migrations (migrations/postgres/NNN_name.sql, hand-written for PostgreSQL) are applied at
open on a connection of their own, with no statement timeout, each in one transaction that
first takes an advisory lock named after the schema: replicas starting together apply each
one once; the others wait, then find it recorded in schema_migrations. DDL is transactional
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
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from datetime import timedelta
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

import asyncpg

from authserver.protocol.lifecycle import Code, Device, Move, Refresh
from authserver.protocol.throttle import Admit, Counter, Refuse, Rule, released
from authserver.settings import StoragePool
from authserver.store.base import (
    AlreadyExists,
    CodeRecord,
    DeviceRecord,
    GrantRecord,
    Issuance,
    Poll,
    RefreshRecord,
    SessionRecord,
    StoreUnavailable,
)
from authserver.store.migration_files import Migration, load_migrations, unknown_versions

log = logging.getLogger("portcullis.authserver.store")

MIGRATIONS: Traversable = resources.files("authserver.store").joinpath("migrations", "postgres")
APPLICATION_NAME = "portcullis-authserver"
# Refresh tokens whose idle expiry passed this long ago are purged; until then a rotated
# one shown again is still recognised as reuse and revokes its family (RFC 9700 §4.14.2).
REFRESH_RETENTION = timedelta(days=1)

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


class PostgresStore:
    """The Store protocol on one PostgreSQL database (and schema), through a connection pool.

    `schema`, when given, is the only schema on the connections' search_path: the tables
    live there, and it must exist. Without it the server's search_path applies (`public`).
    """

    def __init__(
        self,
        url: str,
        pool: StoragePool | None = None,
        *,
        schema: str | None = None,
        application_name: str = APPLICATION_NAME,
        migrations: Traversable = MIGRATIONS,
    ) -> None:
        self.url = url
        self._limits = pool or StoragePool()
        self._schema = schema
        self._application_name = application_name
        self._migrations = migrations
        self._pool: Any = None
        self._opening = False

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
        finally:
            self._opening = False

    async def close(self) -> None:
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
        """Apply the pending migrations on a connection of their own: without the pool's
        command_timeout, since a migration may rewrite a large table."""
        migrations = load_migrations(self._migrations)
        conn = await asyncpg.connect(
            self.url,
            timeout=self._limits.connect_timeout.total_seconds(),
            server_settings=self._server_settings(),
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
    async def _connection(self) -> AsyncIterator[Any]:
        """A connection of the pool, for one statement (autocommit) or a transaction."""
        pool = self._pool
        if pool is None:
            raise RuntimeError("the store is not open")
        with _unavailable():
            async with pool.acquire(timeout=self._limits.acquire_timeout.total_seconds()) as conn:
                yield conn

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[Any]:
        """A connection inside a READ COMMITTED transaction: committed when the block ends,
        rolled back when it raises (AlreadyExists included)."""
        async with self._connection() as conn:
            transaction = conn.transaction()
            await transaction.start()
            try:
                yield conn
            except BaseException:
                # The error that ended the block is the one to raise, a cancellation
                # included. A rollback that fails means the connection broke (or the pool
                # took it back already): the server aborts the transaction of a session
                # that ends, and the pool resets a connection it gets back, which rolls
                # back too, or discards it.
                with contextlib.suppress(Exception):
                    await transaction.rollback()
                raise
            await transaction.commit()

    # -- authorization codes

    async def save_code(self, record: CodeRecord) -> None:
        r = record
        async with self._connection() as conn:
            with _unique("this authorization code"):
                await conn.execute(
                    "INSERT INTO codes (code_hash, client_id, subject, redirect_uri, scope,"
                    " audience, nonce, code_challenge, auth_time, expires_at, created_at, state)"
                    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
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
                )

    async def get_code(self, code_hash: bytes) -> CodeRecord | None:
        async with self._connection() as conn:
            row = await conn.fetchrow(
                "SELECT code_hash, client_id, subject, redirect_uri, scope, audience, nonce,"
                " code_challenge, auth_time, expires_at, created_at, state"
                " FROM codes WHERE code_hash = $1",
                code_hash,
            )
        return None if row is None else CodeRecord(*row)

    async def redeem_code(self, code_hash: bytes, move: Move, issuance: Issuance) -> bool:
        grant = _new_grant(issuance)
        async with self._transaction() as conn:
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
        async with self._connection() as conn:
            row = await conn.fetchrow(
                "SELECT grant_id, client_id, subject, created_at, expires_at, revoked_at"
                " FROM grants WHERE grant_id = $1",
                grant_id,
            )
        return None if row is None else GrantRecord(*row)

    async def revoke_grant(self, grant_id: str, now: float) -> bool:
        async with self._transaction() as conn:
            # The grant's row lock first: a rotation holding it FOR SHARE commits before
            # this goes on, and one that comes later finds the grant revoked.
            revoked = await conn.fetchval(
                "UPDATE grants SET revoked_at = $1"
                " WHERE grant_id = $2 AND revoked_at IS NULL RETURNING 1",
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
            return True

    async def revoke_access_token(self, jti: str, expires_at: float) -> None:
        async with self._connection() as conn:
            await conn.execute(
                "INSERT INTO access_tokens (jti, expires_at, revoked) VALUES ($1, $2, true)"
                " ON CONFLICT (jti) DO UPDATE SET revoked = true,"
                " expires_at = greatest(access_tokens.expires_at, excluded.expires_at)",
                jti,
                expires_at,
            )

    async def access_token_active(self, jti: str) -> bool:
        async with self._connection() as conn:
            inactive = await conn.fetchval(
                "SELECT a.revoked OR EXISTS (SELECT 1 FROM grants g"
                "  WHERE g.grant_id = a.grant_id AND g.revoked_at IS NOT NULL)"
                " FROM access_tokens a WHERE a.jti = $1",
                jti,
            )
        return not inactive

    # -- refresh tokens

    async def get_refresh(self, token_hash: bytes) -> RefreshRecord | None:
        async with self._connection() as conn:
            row = await conn.fetchrow(
                "SELECT t.token_hash, t.family_id, t.client_id, t.subject, t.scope, t.audience,"
                " t.auth_time, t.created_at, t.expires_at, g.expires_at, t.state, t.rotated_at,"
                " t.successor_hash, t.successor_sealed"
                " FROM refresh_tokens t JOIN grants g ON g.grant_id = t.family_id"
                " WHERE t.token_hash = $1",
                token_hash,
            )
        return None if row is None else RefreshRecord(*row)

    async def rotate_refresh(
        self, token_hash: bytes, move: Move, issuance: Issuance, successor_sealed: bytes
    ) -> bool:
        successor = issuance.refresh_token
        if successor is None:
            raise ValueError("a rotation issues a successor")
        async with self._transaction() as conn:
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
        async with self._connection() as conn:
            rows = await conn.fetch(
                "SELECT scope FROM consents WHERE subject = $1 AND client_id = $2",
                subject,
                client_id,
            )
        return frozenset(row[0] for row in rows)

    async def grant_scopes(
        self, subject: str, client_id: str, scopes: frozenset[str], now: float
    ) -> None:
        async with self._connection() as conn:
            await conn.execute(
                "INSERT INTO consents (subject, client_id, scope, granted_at)"
                " SELECT $1, $2, scope, $4 FROM unnest($3::text[]) AS scope"
                " ON CONFLICT DO NOTHING",
                subject,
                client_id,
                sorted(scope for scope in scopes if scope),
                now,
            )

    # -- login sessions

    async def save_session(self, record: SessionRecord) -> None:
        r = record
        async with self._connection() as conn:
            with _unique("this session"):
                await conn.execute(
                    "INSERT INTO sessions (session_hash, subject, auth_time, expires_at,"
                    " csrf_secret) VALUES ($1, $2, $3, $4, $5)",
                    r.session_hash,
                    r.subject,
                    r.auth_time,
                    r.expires_at,
                    r.csrf_secret,
                )

    async def get_session(self, session_hash: bytes, now: float) -> SessionRecord | None:
        async with self._connection() as conn:
            row = await conn.fetchrow(
                "SELECT session_hash, subject, auth_time, expires_at, csrf_secret FROM sessions"
                " WHERE session_hash = $1 AND expires_at > $2",
                session_hash,
                now,
            )
        return None if row is None else SessionRecord(*row)

    async def delete_session(self, session_hash: bytes) -> None:
        async with self._connection() as conn:
            await conn.execute("DELETE FROM sessions WHERE session_hash = $1", session_hash)

    # -- throttles on guessing: the rules of protocol/throttle.py decide, under the keys'
    # advisory locks, so reading, deciding and charging is one step for every replica.

    async def reserve_attempt(self, rules: Sequence[Rule], now: float) -> Refuse | None:
        keys = [rule.key for rule in rules]
        if len(set(keys)) != len(keys):
            raise ValueError("the keys of one reservation must be distinct")
        async with self._transaction() as conn:
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
        async with self._transaction() as conn:
            await _lock_keys(conn, keys)
            counters = await _counters(conn, keys)
            for key, counter in sorted(counters.items()):
                after = released(counter, reserved_at)
                if after != counter:
                    await conn.execute(
                        "UPDATE failures SET count = $1 WHERE key = $2", after.count, key
                    )

    async def clear_failures(self, key: str) -> None:
        async with self._transaction() as conn:
            await _lock_keys(conn, [key])
            await conn.execute("DELETE FROM failures WHERE key = $1", key)

    # -- client assertion replay cache

    async def use_jti(self, client_id: str, jti: str, expires_at: float, now: float) -> bool:
        async with self._connection() as conn:
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

    # -- device authorization

    async def save_device(self, record: DeviceRecord) -> None:
        r = record
        async with self._transaction() as conn:
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
                    " created_at, auth_time)"
                    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
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
                )

    async def device_by_user_code(self, user_code: str, now: float) -> DeviceRecord | None:
        async with self._connection() as conn:
            row = await conn.fetchrow(
                "SELECT device_code_hash, user_code, client_id, scope, audience, state,"
                " subject, poll_interval, last_poll, expires_at, created_at, auth_time"
                " FROM device_codes"
                " WHERE user_code = $1 AND expires_at > $2",
                user_code,
                now,
            )
        return None if row is None else DeviceRecord(*row)

    async def get_device(self, device_code_hash: bytes) -> DeviceRecord | None:
        async with self._connection() as conn:
            row = await conn.fetchrow(
                "SELECT device_code_hash, user_code, client_id, scope, audience, state,"
                " subject, poll_interval, last_poll, expires_at, created_at, auth_time"
                " FROM device_codes"
                " WHERE device_code_hash = $1",
                device_code_hash,
            )
        return None if row is None else DeviceRecord(*row)

    async def decide_device(
        self,
        user_code: str,
        move: Move,
        subject: str,
        now: float,
        auth_time: float | None = None,
    ) -> bool:
        async with self._connection() as conn:
            decided = await conn.fetchval(
                "UPDATE device_codes SET state = $1, subject = $2, auth_time = $3"
                " WHERE user_code = $4 AND state = $5 AND expires_at > $6 RETURNING 1",
                Device(move.next).value,
                subject,
                auth_time,
                user_code,
                Device(move.expected).value,
                now,
            )
        return decided is not None

    async def record_poll(self, device_code_hash: bytes, poll: Poll) -> bool:
        async with self._connection() as conn:
            return await _record_poll(conn, device_code_hash, poll)

    async def redeem_device(self, device_code_hash: bytes, poll: Poll, issuance: Issuance) -> bool:
        grant = _new_grant(issuance)
        async with self._transaction() as conn:
            if not await _record_poll(conn, device_code_hash, poll):
                return False
            await _insert_grant(conn, grant)
            await _record_tokens(conn, issuance)
            return True

    # -- housekeeping

    async def purge_expired(self, now: float) -> int:
        """Each step its own short transaction, so that writers wait for one table at most.

        The count is of records the protocol knows (codes, refresh tokens, sessions, jtis,
        device codes, throttle keys, access tokens); grants are bookkeeping and not counted.
        """
        deleted = 0
        for statement in _PURGE_BY_EXPIRY:
            async with self._connection() as conn:
                deleted += await _count(conn, statement, now)
        async with self._transaction() as conn:
            # Whole families past their absolute lifetime. Their grants are locked first,
            # in one order, as every transaction touching a grant and its tokens does.
            await conn.execute(
                "SELECT 1 FROM grants WHERE expires_at <= $1 ORDER BY grant_id FOR UPDATE", now
            )
            deleted += await _count(
                conn,
                "WITH gone AS (DELETE FROM refresh_tokens WHERE family_id IN"
                " (SELECT grant_id FROM grants WHERE expires_at <= $1) RETURNING 1)"
                " SELECT count(*) FROM gone",
                now,
            )
        async with self._connection() as conn:
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
        async with self._connection() as conn:
            await conn.fetchval("SELECT 1")


_PURGE_BY_EXPIRY = (
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
            " successor_sealed) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
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
