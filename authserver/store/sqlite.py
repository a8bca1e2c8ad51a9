"""The SQLite backend of the Store: the embedded default, one file and no server to run.

Threading. sqlite3 calls block, and the server is asyncio. Each store owns one connection
and one worker thread (a ThreadPoolExecutor with max_workers=1); every call is handed to
that thread and awaited. Calls are short, so running them on the event loop would mostly
work, but not always: a write waits up to `busy_timeout` for another process's write lock,
and a WAL checkpoint or a slow disk can stall on I/O. On the loop, either would freeze every
request in flight; on the worker, only the store's own callers wait. One thread rather than
a pool because a sqlite3 connection belongs to the thread that made it (check_same_thread
stays on) and because calls then run one at a time in submission order, so the process needs
no lock of its own; between processes, SQLite's file locks take over.

Transactions. The connection runs in autocommit mode (isolation_level=None) and every
change runs in `BEGIN IMMEDIATE`, which takes the database's write lock before the first
read. Two connections (threads, processes) can therefore never both read a code as issued
and both consume it: the second waits for the first to commit, then reads "consumed". A
waiting writer retries for up to `busy_timeout` before the call raises.

Durability. WAL journal with synchronous=NORMAL. A commit is written to the WAL file before
the call returns, and fsync runs only at checkpoints. A killed process (kill -9, OOM killer)
loses nothing: the written pages are in the operating system's cache, and the next open
replays the WAL. Only an operating-system crash or a power cut can lose the last commits,
and even then the database is never corrupt. FULL would fsync every commit, a cost every
token request would pay to cover the machine dying, which replicated block storage or a
PostgreSQL backend covers better. foreign_keys=ON keeps refresh tokens tied to their family.

Cancellation. A call whose awaiting task is cancelled still runs to its end on the worker:
a transaction is never left half done, but the caller does not learn its result.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from importlib import resources
from importlib.resources.abc import Traversable
from typing import TypeVar

from authserver.protocol.lifecycle import CODE, DEVICE, REFRESH, Code, Device, Effect, Refresh, step
from authserver.protocol.throttle import Admit, Counter, Refuse, Rule, released
from authserver.store.base import (
    AlreadyExists,
    CodeRecord,
    DeviceRecord,
    RefreshOutcome,
    RefreshRecord,
    RefreshUse,
    SessionRecord,
)

T = TypeVar("T")

MIGRATIONS: Traversable = resources.files("authserver.store").joinpath("migrations", "sqlite")
BUSY_TIMEOUT = timedelta(seconds=5)
# Refresh tokens whose idle expiry passed this long ago are purged; until then a rotated
# one shown again is still recognised as reuse and revokes its family (RFC 9700 §4.14.2).
REFRESH_RETENTION = timedelta(days=1)
# A grant revocation is kept while an access token or a family recorded under it remains,
# and at least this long, so a token recorded in a race with the revocation is still
# judged inactive.
REVOCATION_RETENTION = timedelta(days=1)


class SQLiteStore:
    """The Store protocol on one SQLite database file (or `:memory:`)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout: timedelta = BUSY_TIMEOUT,
        migrations: Traversable = MIGRATIONS,
    ) -> None:
        self.path = os.fspath(path)
        self._busy_timeout = busy_timeout
        self._migrations = migrations
        self._executor: ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None

    async def open(self) -> None:
        if self._executor is not None:
            raise RuntimeError("the store is already open")
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-store")
        self._executor = executor  # a second open() while this one runs is refused
        try:
            self._conn = await asyncio.get_running_loop().run_in_executor(executor, self._connect)
        except BaseException:
            self._executor = None
            executor.shutdown(wait=False)
            raise

    async def close(self) -> None:
        executor, conn = self._executor, self._conn
        self._executor = self._conn = None
        if executor is None:
            return
        try:
            if conn is not None:
                await asyncio.get_running_loop().run_in_executor(executor, conn.close)
        finally:
            executor.shutdown(wait=True)

    def _connect(self) -> sqlite3.Connection:
        timeout = self._busy_timeout.total_seconds()
        try:
            conn = sqlite3.connect(self.path, timeout=timeout, isolation_level=None)
        except sqlite3.OperationalError as exc:
            exc.add_note(f"while opening the SQLite database {self.path!r}")
            raise
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
            mode = _enter_wal(conn, timeout)
            if mode != "wal" and self.path != ":memory:":
                raise RuntimeError(
                    f"SQLite refused WAL mode for {self.path!r} (journal_mode is {mode}); "
                    "put the database on a local file system"
                )
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = ON")
            migrate(conn, load_migrations(self._migrations))
        except BaseException:
            conn.close()
            raise
        return conn

    async def _call(self, operation: Callable[[sqlite3.Connection], T]) -> T:
        executor, conn = self._executor, self._conn
        if executor is None or conn is None:
            raise RuntimeError("the store is not open")
        return await asyncio.get_running_loop().run_in_executor(executor, operation, conn)

    # -- authorization codes

    async def save_code(self, record: CodeRecord) -> None:
        await self._call(lambda conn: _save_code(conn, record))

    async def get_code(self, code_hash: bytes) -> CodeRecord | None:
        return await self._call(lambda conn: _get_code(conn, code_hash))

    async def consume_code(self, code_hash: bytes, now: float) -> tuple[CodeRecord | None, bool]:
        return await self._call(lambda conn: _consume_code(conn, code_hash, now))

    # -- grants and access tokens

    async def record_access_token(
        self, jti: str, grant_id: str | None, client_id: str, expires_at: float
    ) -> None:
        await self._call(
            lambda conn: _record_access_token(conn, jti, grant_id, client_id, expires_at)
        )

    async def revoke_grant(self, grant_id: str, now: float) -> None:
        await self._call(lambda conn: _in_transaction(conn, _revoke_grant, grant_id, now))

    async def revoke_access_token(self, jti: str, expires_at: float) -> None:
        await self._call(lambda conn: _revoke_access_token(conn, jti, expires_at))

    async def access_token_active(self, jti: str) -> bool:
        return await self._call(lambda conn: _access_token_active(conn, jti))

    # -- refresh tokens

    async def save_refresh(self, record: RefreshRecord) -> None:
        await self._call(lambda conn: _save_refresh(conn, record))

    async def use_refresh(
        self,
        token_hash: bytes,
        now: float,
        grace_seconds: float,
        successor: RefreshRecord,
        successor_sealed: bytes,
    ) -> RefreshUse:
        return await self._call(
            lambda conn: _use_refresh(
                conn, token_hash, now, grace_seconds, successor, successor_sealed
            )
        )

    async def get_refresh(self, token_hash: bytes) -> RefreshRecord | None:
        return await self._call(lambda conn: _get_refresh(conn, token_hash))

    async def family_revoked(self, family_id: str) -> bool:
        return await self._call(lambda conn: _family_revoked(conn, family_id))

    # -- consent

    async def granted_scopes(self, subject: str, client_id: str) -> frozenset[str]:
        return await self._call(lambda conn: _granted_scopes(conn, subject, client_id))

    async def grant_scopes(self, subject: str, client_id: str, scopes: frozenset[str]) -> None:
        await self._call(lambda conn: _grant_scopes(conn, subject, client_id, scopes))

    # -- login sessions

    async def save_session(self, record: SessionRecord) -> None:
        await self._call(lambda conn: _save_session(conn, record))

    async def get_session(self, session_hash: bytes, now: float) -> SessionRecord | None:
        return await self._call(lambda conn: _get_session(conn, session_hash, now))

    async def delete_session(self, session_hash: bytes) -> None:
        await self._call(lambda conn: _delete_session(conn, session_hash))

    # -- throttles on guessing

    async def reserve_attempt(self, rules: Sequence[Rule], now: float) -> Refuse | None:
        return await self._call(lambda conn: _reserve_attempt(conn, rules, now))

    async def release_attempt(self, keys: Sequence[str], reserved_at: float) -> None:
        await self._call(lambda conn: _release_attempt(conn, keys, reserved_at))

    async def clear_failures(self, key: str) -> None:
        await self._call(lambda conn: _clear_failures(conn, key))

    # -- client assertion replay cache

    async def use_jti(self, client_id: str, jti: str, expires_at: float, now: float) -> bool:
        return await self._call(lambda conn: _use_jti(conn, client_id, jti, expires_at, now))

    # -- device authorization

    async def save_device(self, record: DeviceRecord) -> None:
        await self._call(lambda conn: _save_device(conn, record))

    async def device_by_user_code(self, user_code: str, now: float) -> DeviceRecord | None:
        return await self._call(lambda conn: _device_by_user_code(conn, user_code, now))

    async def decide_device(
        self,
        user_code: str,
        subject: str,
        approve: bool,
        now: float,
        auth_time: float | None = None,
    ) -> bool:
        return await self._call(
            lambda conn: _decide_device(conn, user_code, subject, approve, now, auth_time)
        )

    async def poll_device(
        self, device_code_hash: bytes, client_id: str, now: float
    ) -> DeviceRecord | None:
        return await self._call(lambda conn: _poll_device(conn, device_code_hash, client_id, now))

    async def slow_down_device(self, device_code_hash: bytes, interval: float) -> None:
        await self._call(lambda conn: _slow_down_device(conn, device_code_hash, interval))

    # -- housekeeping

    async def purge_expired(self, now: float) -> int:
        return await self._call(lambda conn: _purge_expired(conn, now))

    async def ping(self) -> None:
        await self._call(lambda conn: conn.execute("SELECT 1").fetchone())


# ---------------------------------------------------------------------------------------
# Migrations


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def load_migrations(directory: Traversable) -> list[Migration]:
    """The files NNN_name.sql of a directory, in the numeric order of NNN."""
    found: dict[int, Migration] = {}
    for entry in directory.iterdir():
        if not entry.name.endswith(".sql"):
            continue
        prefix, sep, _ = entry.name.partition("_")
        if not (sep and prefix.isdigit()):
            raise ValueError(f"migration {entry.name!r} is not named NNN_name.sql")
        version = int(prefix)
        if version in found:
            raise ValueError(
                f"migrations {found[version].name!r} and {entry.name!r} share version {version}"
            )
        found[version] = Migration(version, entry.name, entry.read_text(encoding="utf-8"))
    return [found[version] for version in sorted(found)]


def _enter_wal(conn: sqlite3.Connection, timeout: float) -> str:
    """Switch a connection to WAL, retrying while another process holds the database.

    Turning a new database to WAL needs an exclusive lock, and SQLite answers SQLITE_BUSY at
    once, without its busy handler, when another connection (a second replica, the CLI)
    opens the same new file at that moment. Retry with a short pause until `timeout`.
    """
    deadline = time.monotonic() + timeout
    pause = 0.005
    while True:
        try:
            (mode,) = conn.execute("PRAGMA journal_mode = WAL").fetchone()
            return str(mode)
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            if time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def migrate(conn: sqlite3.Connection, migrations: list[Migration]) -> list[int]:
    """Apply the migrations not applied yet, each in its own transaction; the versions applied.

    The check for "already applied" runs inside the migration's write transaction, so two
    processes opening a new database at once apply each migration exactly once.
    """
    conn.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations ("
        " version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL NOT NULL)"
    )
    known = {migration.version for migration in migrations}
    newer = sorted(
        version
        for (version,) in conn.execute("SELECT version FROM schema_migrations")
        if version not in known
    )
    if newer:
        raise RuntimeError(
            f"the database has migrations this program does not know ({newer}): "
            "it was written by a newer version"
        )
    applied: list[int] = []
    for migration in migrations:
        with _transaction(conn):
            done = conn.execute(
                "SELECT 1 FROM schema_migrations WHERE version = ?", (migration.version,)
            ).fetchone()
            if done:
                continue
            for statement in _statements(migration):
                conn.execute(statement)
            conn.execute(
                "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
                (migration.version, migration.name, time.time()),
            )
        applied.append(migration.version)
    return applied


def _statements(migration: Migration) -> Iterator[str]:
    """The statements of a script, one at a time: `executescript` would commit first."""
    buffer = ""
    for line in migration.sql.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            yield buffer
            buffer = ""
    leftover = [line for line in buffer.splitlines() if line.strip() and not _comment(line)]
    if leftover:
        raise ValueError(f"migration {migration.name!r} ends in an unterminated statement")


def _comment(line: str) -> bool:
    return line.lstrip().startswith("--")


# ---------------------------------------------------------------------------------------
# Operations: each runs on the worker thread with the store's connection.


@contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        # SQLite rolls back by itself after some errors (a full disk, for one).
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _in_transaction(conn: sqlite3.Connection, operation: Callable[..., T], *args: object) -> T:
    with _transaction(conn):
        return operation(conn, *args)


@contextmanager
def _unique(what: str) -> Iterator[None]:
    """Turn a primary-key or unique violation into AlreadyExists."""
    try:
        yield
    except sqlite3.IntegrityError as exc:
        if exc.sqlite_errorname in ("SQLITE_CONSTRAINT_PRIMARYKEY", "SQLITE_CONSTRAINT_UNIQUE"):
            raise AlreadyExists(f"{what} is already stored") from exc
        raise


# -- authorization codes


def _save_code(conn: sqlite3.Connection, r: CodeRecord) -> None:
    with _transaction(conn), _unique("this authorization code"):
        conn.execute(
            "INSERT INTO codes (code_hash, client_id, subject, redirect_uri, scope, audience,"
            " nonce, code_challenge, auth_time, expires_at, created_at, state)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
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
            ),
        )


def _get_code(conn: sqlite3.Connection, code_hash: bytes) -> CodeRecord | None:
    row = conn.execute(
        "SELECT code_hash, client_id, subject, redirect_uri, scope, audience, nonce,"
        " code_challenge, auth_time, expires_at, created_at"
        " FROM codes WHERE code_hash = ?",
        (code_hash,),
    ).fetchone()
    return None if row is None else CodeRecord(*row)


def _consume_code(
    conn: sqlite3.Connection, code_hash: bytes, now: float
) -> tuple[CodeRecord | None, bool]:
    with _transaction(conn):
        row = conn.execute(
            "SELECT code_hash, client_id, subject, redirect_uri, scope, audience, nonce,"
            " code_challenge, auth_time, expires_at, created_at, state"
            " FROM codes WHERE code_hash = ?",
            (code_hash,),
        ).fetchone()
        if row is None:
            return None, False
        record, state = CodeRecord(*row[:-1]), Code(row[-1])
        transition = step(CODE, state, "redeem")
        if transition.effect is not Effect.ISSUE_TOKENS:
            return record, False
        conn.execute(
            "UPDATE codes SET state = ?, consumed_at = ? WHERE code_hash = ?",
            (Code(transition.next_state).value, now, code_hash),
        )
        return record, True


# -- grants and access tokens


def _revoke_grant(conn: sqlite3.Connection, grant_id: str, now: float) -> None:
    """Inside a transaction: the grant, its refresh family if it is one, and every token."""
    conn.execute(
        "INSERT INTO grant_revocations (grant_id, revoked_at) VALUES (?, ?)"
        " ON CONFLICT (grant_id) DO NOTHING",
        (grant_id, now),
    )
    conn.execute(
        "UPDATE refresh_families SET revoked_at = ? WHERE family_id = ? AND revoked_at IS NULL",
        (now, grant_id),
    )
    conn.execute(
        "UPDATE refresh_tokens SET state = ? WHERE family_id = ? AND state != ?",
        (Refresh.REVOKED.value, grant_id, Refresh.REVOKED.value),
    )


def _record_access_token(
    conn: sqlite3.Connection, jti: str, grant_id: str | None, client_id: str, expires_at: float
) -> None:
    # A jti revoked before it was recorded stays revoked.
    with _transaction(conn):
        conn.execute(
            "INSERT INTO access_tokens (jti, grant_id, client_id, expires_at) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (jti) DO UPDATE SET grant_id = excluded.grant_id,"
            " client_id = excluded.client_id,"
            " expires_at = max(access_tokens.expires_at, excluded.expires_at)",
            (jti, grant_id, client_id, expires_at),
        )


def _revoke_access_token(conn: sqlite3.Connection, jti: str, expires_at: float) -> None:
    with _transaction(conn):
        conn.execute(
            "INSERT INTO access_tokens (jti, expires_at, revoked) VALUES (?, ?, 1)"
            " ON CONFLICT (jti) DO UPDATE SET revoked = 1,"
            " expires_at = max(access_tokens.expires_at, excluded.expires_at)",
            (jti, expires_at),
        )


def _access_token_active(conn: sqlite3.Connection, jti: str) -> bool:
    row = conn.execute(
        "SELECT revoked OR EXISTS (SELECT 1 FROM grant_revocations g WHERE g.grant_id = a.grant_id)"
        " FROM access_tokens a WHERE a.jti = ?",
        (jti,),
    ).fetchone()
    return row is None or not row[0]


# -- refresh tokens


def _get_refresh(conn: sqlite3.Connection, token_hash: bytes) -> RefreshRecord | None:
    row = conn.execute(
        "SELECT t.token_hash, t.family_id, t.client_id, t.subject, t.scope, t.audience,"
        " t.auth_time, t.created_at, t.expires_at, f.expires_at, t.state, t.rotated_at,"
        " t.successor_sealed"
        " FROM refresh_tokens t JOIN refresh_families f ON f.family_id = t.family_id"
        " WHERE t.token_hash = ?",
        (token_hash,),
    ).fetchone()
    return None if row is None else RefreshRecord(*row)


def _insert_refresh_token(conn: sqlite3.Connection, r: RefreshRecord) -> None:
    with _unique("this refresh token"):
        conn.execute(
            "INSERT INTO refresh_tokens (token_hash, family_id, client_id, subject, scope,"
            " audience, auth_time, created_at, expires_at, state, rotated_at, successor_sealed)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
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
                r.successor_sealed,
            ),
        )


def _save_refresh(conn: sqlite3.Connection, r: RefreshRecord) -> None:
    with _transaction(conn):
        with _unique(f"refresh family {r.family_id!r}"):
            conn.execute(
                "INSERT INTO refresh_families (family_id, client_id, subject, created_at,"
                " expires_at, revoked_at) VALUES (?, ?, ?, ?, ?,"
                " (SELECT revoked_at FROM grant_revocations WHERE grant_id = ?))",
                (
                    r.family_id,
                    r.client_id,
                    r.subject,
                    r.created_at,
                    r.family_expires_at,
                    r.family_id,
                ),
            )
        _insert_refresh_token(conn, r)
        # The grant was revoked before its family existed (a code replayed while the first
        # redemption was still issuing): the family starts revoked.
        if _family_revoked(conn, r.family_id):
            _revoke_grant(conn, r.family_id, r.created_at)


def _use_refresh(
    conn: sqlite3.Connection,
    token_hash: bytes,
    now: float,
    grace_seconds: float,
    successor: RefreshRecord,
    successor_sealed: bytes,
) -> RefreshUse:
    with _transaction(conn):
        current = _get_refresh(conn, token_hash)
        if current is None:
            return RefreshUse(RefreshOutcome.UNKNOWN, None)
        if current.family_expires_at <= now:
            return RefreshUse(RefreshOutcome.EXPIRED, current)
        state = Refresh(current.state)
        if state is Refresh.ACTIVE and current.expires_at <= now:
            return RefreshUse(RefreshOutcome.EXPIRED, current)
        within_grace = (
            state is Refresh.ROTATED
            and current.rotated_at is not None
            and now < current.rotated_at + grace_seconds
        )
        transition = step(REFRESH, state, "use_within_grace" if within_grace else "use")

        if transition.effect is Effect.ISSUE_TOKENS:
            conn.execute(
                "UPDATE refresh_tokens SET state = ?, rotated_at = ?, successor_sealed = ?"
                " WHERE token_hash = ?",
                (Refresh(transition.next_state).value, now, successor_sealed, token_hash),
            )
            _insert_refresh_token(
                conn,
                RefreshRecord(
                    token_hash=successor.token_hash,
                    family_id=current.family_id,
                    client_id=current.client_id,
                    subject=current.subject,
                    scope=successor.scope,
                    audience=successor.audience,
                    auth_time=successor.auth_time,
                    created_at=now,
                    expires_at=successor.expires_at,
                    family_expires_at=current.family_expires_at,
                    state=Refresh.ACTIVE.value,
                ),
            )
            return RefreshUse(RefreshOutcome.ROTATED, _get_refresh(conn, token_hash))
        if transition.effect is Effect.REPEAT_SUCCESSOR:
            return RefreshUse(RefreshOutcome.GRACE, current)
        # Rotated outside the grace window, or revoked already: someone holds a token that
        # was replaced, so every token of the family goes (RFC 9700 §4.14.2).
        _revoke_grant(conn, current.family_id, now)
        return RefreshUse(RefreshOutcome.REUSED, _get_refresh(conn, token_hash))


def _family_revoked(conn: sqlite3.Connection, family_id: str) -> bool:
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM grant_revocations WHERE grant_id = ?)"
        " OR EXISTS (SELECT 1 FROM refresh_families"
        "            WHERE family_id = ? AND revoked_at IS NOT NULL)",
        (family_id, family_id),
    ).fetchone()
    return bool(row[0])


# -- consent


def _granted_scopes(conn: sqlite3.Connection, subject: str, client_id: str) -> frozenset[str]:
    rows = conn.execute(
        "SELECT scope FROM consents WHERE subject = ? AND client_id = ?", (subject, client_id)
    )
    return frozenset(scope for (scope,) in rows)


def _grant_scopes(
    conn: sqlite3.Connection, subject: str, client_id: str, scopes: frozenset[str]
) -> None:
    now = time.time()
    with _transaction(conn):
        conn.executemany(
            "INSERT INTO consents (subject, client_id, scope, granted_at) VALUES (?, ?, ?, ?)"
            " ON CONFLICT DO NOTHING",
            [(subject, client_id, scope, now) for scope in sorted(scopes) if scope],
        )


# -- login sessions


def _save_session(conn: sqlite3.Connection, r: SessionRecord) -> None:
    with _transaction(conn), _unique("this session"):
        conn.execute(
            "INSERT INTO sessions (session_hash, subject, auth_time, expires_at, csrf_secret)"
            " VALUES (?, ?, ?, ?, ?)",
            (r.session_hash, r.subject, r.auth_time, r.expires_at, r.csrf_secret),
        )


def _get_session(conn: sqlite3.Connection, session_hash: bytes, now: float) -> SessionRecord | None:
    row = conn.execute(
        "SELECT session_hash, subject, auth_time, expires_at, csrf_secret FROM sessions"
        " WHERE session_hash = ? AND expires_at > ?",
        (session_hash, now),
    ).fetchone()
    return None if row is None else SessionRecord(*row)


def _delete_session(conn: sqlite3.Connection, session_hash: bytes) -> None:
    with _transaction(conn):
        conn.execute("DELETE FROM sessions WHERE session_hash = ?", (session_hash,))


# -- throttles on guessing: one row per key, whatever the number of attempts it counts.
# The rules of protocol/throttle.py decide; the write lock BEGIN IMMEDIATE takes before the
# first read makes reading, deciding and charging one step for every connection.


def _counter(conn: sqlite3.Connection, key: str) -> Counter | None:
    row = conn.execute(
        "SELECT window_start, count, last_attempt FROM failures WHERE key = ?", (key,)
    ).fetchone()
    return None if row is None else Counter(row[0], int(row[1]), row[2])


def _reserve_attempt(conn: sqlite3.Connection, rules: Sequence[Rule], now: float) -> Refuse | None:
    if len({rule.key for rule in rules}) != len(rules):
        raise ValueError("the keys of one reservation must be distinct")
    with _transaction(conn):
        decisions = [(rule.key, rule.admit(_counter(conn, rule.key), now)) for rule in rules]
        refusals = [d for _, d in decisions if isinstance(d, Refuse)]
        if refusals:
            return max(refusals, key=lambda refusal: refusal.retry_after)
        conn.executemany(
            "INSERT INTO failures (key, window_start, count, last_attempt, expires_at)"
            " VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (key) DO UPDATE SET window_start = excluded.window_start,"
            " count = excluded.count, last_attempt = excluded.last_attempt,"
            " expires_at = excluded.expires_at",
            [
                (key, d.counter.window_start, d.counter.count, d.counter.last_attempt, d.expires_at)
                for key, d in decisions
                if isinstance(d, Admit)
            ],
        )
        return None


def _release_attempt(conn: sqlite3.Connection, keys: Sequence[str], reserved_at: float) -> None:
    with _transaction(conn):
        for key in keys:
            counter = _counter(conn, key)
            if counter is None:
                continue
            after = released(counter, reserved_at)
            if after != counter:
                conn.execute("UPDATE failures SET count = ? WHERE key = ?", (after.count, key))


def _clear_failures(conn: sqlite3.Connection, key: str) -> None:
    with _transaction(conn):
        conn.execute("DELETE FROM failures WHERE key = ?", (key,))


# -- client assertion replay cache


def _use_jti(
    conn: sqlite3.Connection, client_id: str, jti: str, expires_at: float, now: float
) -> bool:
    with _transaction(conn):
        cursor = conn.execute(
            "INSERT INTO assertion_jtis (client_id, jti, expires_at) VALUES (?, ?, ?)"
            " ON CONFLICT (client_id, jti) DO UPDATE SET expires_at = excluded.expires_at"
            " WHERE assertion_jtis.expires_at <= ?",
            (client_id, jti, expires_at, now),
        )
        return cursor.rowcount == 1


# -- device authorization


def _save_device(conn: sqlite3.Connection, r: DeviceRecord) -> None:
    with _transaction(conn):
        # An expired code no longer holds its user code.
        conn.execute(
            "DELETE FROM device_codes WHERE user_code = ? AND expires_at <= ?",
            (r.user_code, r.created_at),
        )
        with _unique("this device code or user code"):
            conn.execute(
                "INSERT INTO device_codes (device_code_hash, user_code, client_id, scope,"
                " audience, state, subject, interval, last_poll, expires_at, created_at,"
                " auth_time) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
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
                ),
            )


def _device_by_user_code(
    conn: sqlite3.Connection, user_code: str, now: float
) -> DeviceRecord | None:
    row = conn.execute(
        "SELECT device_code_hash, user_code, client_id, scope, audience, state, subject,"
        " interval, last_poll, expires_at, created_at, auth_time"
        " FROM device_codes WHERE user_code = ? AND expires_at > ?",
        (user_code, now),
    ).fetchone()
    return None if row is None else DeviceRecord(*row)


def _decide_device(
    conn: sqlite3.Connection,
    user_code: str,
    subject: str,
    approve: bool,
    now: float,
    auth_time: float | None,
) -> bool:
    transition = step(DEVICE, Device.PENDING, "approve" if approve else "deny")
    with _transaction(conn):
        cursor = conn.execute(
            "UPDATE device_codes SET state = ?, subject = ?, auth_time = ?"
            " WHERE user_code = ? AND state = ? AND expires_at > ?",
            (
                Device(transition.next_state).value,
                subject,
                auth_time,
                user_code,
                Device.PENDING.value,
                now,
            ),
        )
        return cursor.rowcount == 1


def _poll_device(
    conn: sqlite3.Connection, device_code_hash: bytes, client_id: str, now: float
) -> DeviceRecord | None:
    with _transaction(conn):
        # Another client's poll must not redeem the code or move its last poll (RFC 8628
        # §3.4: the code is bound to the client it was issued to), so it matches no row.
        row = conn.execute(
            "SELECT device_code_hash, user_code, client_id, scope, audience, state, subject,"
            " interval, last_poll, expires_at, created_at, auth_time"
            " FROM device_codes WHERE device_code_hash = ? AND client_id = ?",
            (device_code_hash, client_id),
        ).fetchone()
        if row is None:
            return None
        before = DeviceRecord(*row)
        transition = step(DEVICE, Device(before.state), "poll")
        conn.execute(
            "UPDATE device_codes SET state = ?, last_poll = ? WHERE device_code_hash = ?",
            (Device(transition.next_state).value, now, device_code_hash),
        )
        return before


def _slow_down_device(conn: sqlite3.Connection, device_code_hash: bytes, interval: float) -> None:
    with _transaction(conn):
        conn.execute(
            "UPDATE device_codes SET interval = ? WHERE device_code_hash = ?",
            (interval, device_code_hash),
        )


# -- housekeeping


def _purge_expired(conn: sqlite3.Connection, now: float) -> int:
    """Each table in its own short transaction, so writers wait for one table at most.

    The count is of records the protocol knows (codes, refresh tokens, sessions, jtis,
    device codes, throttle keys, access tokens); families and grant revocations are
    bookkeeping and not counted.
    """
    deleted = 0
    for statement in (
        "DELETE FROM codes WHERE expires_at <= :now",
        "DELETE FROM sessions WHERE expires_at <= :now",
        "DELETE FROM assertion_jtis WHERE expires_at <= :now",
        "DELETE FROM device_codes WHERE expires_at <= :now",
        "DELETE FROM failures WHERE expires_at <= :now",
        "DELETE FROM access_tokens WHERE expires_at <= :now",
    ):
        with _transaction(conn):
            deleted += conn.execute(statement, {"now": now}).rowcount
    with _transaction(conn):
        # Whole families past their absolute lifetime, then tokens idle-expired long ago
        # (a live family keeps its recent rotated tokens for reuse detection), then the
        # families left without a token.
        deleted += conn.execute(
            "DELETE FROM refresh_tokens WHERE family_id IN"
            " (SELECT family_id FROM refresh_families WHERE expires_at <= :now)",
            {"now": now},
        ).rowcount
        deleted += conn.execute(
            "DELETE FROM refresh_tokens WHERE expires_at <= :cutoff",
            {"cutoff": now - REFRESH_RETENTION.total_seconds()},
        ).rowcount
        conn.execute(
            "DELETE FROM refresh_families WHERE expires_at <= :now OR NOT EXISTS"
            " (SELECT 1 FROM refresh_tokens t WHERE t.family_id = refresh_families.family_id)",
            {"now": now},
        )
    with _transaction(conn):
        conn.execute(
            "DELETE FROM grant_revocations WHERE revoked_at <= :cutoff"
            " AND NOT EXISTS (SELECT 1 FROM access_tokens a"
            "                 WHERE a.grant_id = grant_revocations.grant_id)"
            " AND NOT EXISTS (SELECT 1 FROM refresh_families f"
            "                 WHERE f.family_id = grant_revocations.grant_id)",
            {"cutoff": now - REVOCATION_RETENTION.total_seconds()},
        )
    return deleted
