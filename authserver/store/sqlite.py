"""The SQLite backend of the Store: the embedded default, one file and no server to run.

Threading. sqlite3 calls block, and the server is asyncio. Each store owns one connection
and one worker thread (a ThreadPoolExecutor with max_workers=1); every call is handed to
that thread and awaited. Calls are short, so running them on the event loop would mostly
work, but not always: a write waits up to `busy_timeout` for another process's write lock,
and a WAL checkpoint or a slow disk can stall on I/O. On the loop, either would freeze every
request in flight; on the worker, only the store's own callers wait. One thread rather than
a pool because a sqlite3 connection belongs to the thread that made it (check_same_thread
stays on) and because calls then run one at a time in submission order, so the process needs
no lock of its own; between processes, SQLite's file locks take over. Calls that queue up
while the thread is busy are run and answered together (serial.py), so under load the two
thread switches of a call are paid once per batch rather than once per call.

Transactions. The connection runs in autocommit mode (isolation_level=None) and every
change runs in `BEGIN IMMEDIATE`, which takes the database's write lock before the first
read. Every conditional change is a compare-and-set, `UPDATE ... WHERE state = ?` on the
state the domain read, and its row count says whether the condition still held: of two
connections (threads, processes) redeeming one code, the second waits for the first to
commit, then matches no row. An issuance (code consumed, grant created, tokens recorded) is
one such transaction. A waiting writer retries for up to `busy_timeout` before the call
raises.

Durability. WAL journal with synchronous=NORMAL. A commit is written to the WAL file before
the call returns, and fsync runs only at checkpoints. A killed process (kill -9, OOM killer)
loses nothing: the written pages are in the operating system's cache, and the next open
replays the WAL. Only an operating-system crash or a power cut can lose the last commits,
and even then the database is never corrupt. FULL would fsync every commit, a cost every
token request would pay to cover the machine dying, which replicated block storage or a
PostgreSQL backend covers better. foreign_keys=ON keeps refresh tokens tied to their family.

Cancellation. A call whose awaiting task is cancelled still runs to its end on the worker:
a transaction is never left half done, but the caller does not learn its result.

Revocation events. Written in the transaction of their revocation; the write lock orders
them, so ids are committed in increasing order. `events_signal` is set by this store after
each call that recorded one; events another process writes to the same file are found by
the readers' periodic look (authserver/events.py polls as a fallback).

Errors. An OperationalError (the disk full or failing, the file read-only, a lock not
obtained within busy_timeout) or a corrupt file becomes StoreUnavailable: the transaction
was rolled back and the connection stays usable, so the store recovers by itself when the
disk does.

Timing. Each Store method is one `_call`, which names it: the observer given at construction
(the server's metrics) is told the name and the time of every call, the wait for the worker
included, whether it returned or raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from functools import partial
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any, TypeVar

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
from authserver.store.serial import SerialWorker

T = TypeVar("T")

log = logging.getLogger("portcullis.authserver.store")

MIGRATIONS: Traversable = resources.files("authserver.store").joinpath("migrations", "sqlite")
BUSY_TIMEOUT = timedelta(seconds=5)
# Refresh tokens whose idle expiry passed this long ago are purged; until then a rotated
# one shown again is still recognised as reuse and revokes its family (RFC 9700 §4.14.2).
REFRESH_RETENTION = timedelta(days=1)


class SQLiteStore:
    """The Store protocol on one SQLite database file (or `:memory:`)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout: timedelta = BUSY_TIMEOUT,
        migrations: Traversable = MIGRATIONS,
        observe: StoreObserver = unobserved,
    ) -> None:
        self.path = os.fspath(path)
        self._busy_timeout = busy_timeout
        self._migrations = migrations
        self._observe = observe
        self._executor: ThreadPoolExecutor | None = None
        self._worker: SerialWorker | None = None
        self._conn: sqlite3.Connection | None = None
        self._signal = asyncio.Event()
        self._client_rows = ClientRows()  # used on the worker thread only

    async def open(self) -> None:
        if self._executor is not None:
            raise RuntimeError("the store is already open")
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-store")
        self._executor = executor  # a second open() while this one runs is refused
        try:
            self._conn = await asyncio.get_running_loop().run_in_executor(executor, self._connect)
            self._worker = SerialWorker(executor)
        except BaseException:
            self._executor = None
            executor.shutdown(wait=False)
            raise

    async def close(self) -> None:
        executor, conn, worker = self._executor, self._conn, self._worker
        self._executor = self._conn = self._worker = None
        if executor is None:
            return
        try:
            if conn is not None and worker is not None:
                # Queued behind the calls made before it, whose worker may not have been
                # started yet (serial.py): they run on the open connection, then it closes.
                await worker.call(conn.close)
            elif conn is not None:
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

    async def _call(self, operation: str, work: Callable[[sqlite3.Connection], T]) -> T:
        """Run `work` on the worker thread: the Store method `operation`, whose time (the
        wait for the worker included) goes to the observer under that name."""
        worker, conn = self._worker, self._conn
        if worker is None or conn is None:
            raise RuntimeError("the store is not open")
        started = time.perf_counter()
        try:
            return await worker.call(partial(work, conn))
        except sqlite3.OperationalError as exc:
            # The disk full or failing, the file gone read-only, a lock not obtained within
            # busy_timeout: the transaction was rolled back, and the next call may succeed.
            raise StoreUnavailable(f"SQLite: {exc}") from exc
        except sqlite3.DatabaseError as exc:
            if type(exc) is not sqlite3.DatabaseError:
                raise  # IntegrityError and the like: a bug, not the database's state
            raise StoreUnavailable(f"SQLite: {exc}") from exc
        finally:
            self._observe(operation, time.perf_counter() - started)

    # -- authorization codes

    async def save_code(self, record: CodeRecord) -> None:
        await self._call("save_code", lambda conn: _save_code(conn, record))

    async def get_code(self, code_hash: bytes) -> CodeRecord | None:
        return await self._call("get_code", lambda conn: _get_code(conn, code_hash))

    async def redeem_code(self, code_hash: bytes, move: Move, issuance: Issuance) -> bool:
        return await self._call(
            "redeem_code", lambda conn: _redeem_code(conn, code_hash, move, issuance)
        )

    # -- grants and access tokens

    async def get_grant(self, grant_id: str) -> GrantRecord | None:
        return await self._call("get_grant", lambda conn: _get_grant(conn, grant_id))

    async def revoke_grant(self, grant_id: str, now: float, reason: str = "revoked") -> bool:
        revoked = await self._call(
            "revoke_grant", lambda conn: _in_transaction(conn, _revoke_grant, grant_id, now, reason)
        )
        if revoked:
            self._wake()
        return revoked

    async def revoke_access_token(
        self, jti: str, expires_at: float, now: float, reason: str = "revoked"
    ) -> None:
        await self._call(
            "revoke_access_token",
            lambda conn: _revoke_access_token(conn, jti, expires_at, now, reason),
        )
        self._wake()

    async def cut_off(self, cut: CutOff) -> int:
        event_id = await self._call("cut_off", lambda conn: _in_transaction(conn, _cut_off, cut))
        self._wake()
        return event_id

    # -- revocation events

    async def revocation_events(self, after: int, now: float, limit: int) -> list[RevocationEvent]:
        return await self._call(
            "revocation_events", lambda conn: _revocation_events(conn, after, now, limit)
        )

    def events_signal(self) -> asyncio.Event:
        return self._signal

    def _wake(self) -> None:
        signal, self._signal = self._signal, asyncio.Event()
        signal.set()

    async def access_token_active(self, jti: str) -> bool:
        return await self._call("access_token_active", lambda conn: _access_token_active(conn, jti))

    # -- refresh tokens

    async def get_refresh(self, token_hash: bytes) -> RefreshRecord | None:
        return await self._call("get_refresh", lambda conn: _get_refresh(conn, token_hash))

    async def rotate_refresh(
        self, token_hash: bytes, move: Move, issuance: Issuance, successor_sealed: bytes
    ) -> bool:
        return await self._call(
            "rotate_refresh",
            lambda conn: _rotate_refresh(conn, token_hash, move, issuance, successor_sealed),
        )

    # -- consent

    async def granted_scopes(self, subject: str, client_id: str) -> frozenset[str]:
        return await self._call(
            "granted_scopes", lambda conn: _granted_scopes(conn, subject, client_id)
        )

    async def grant_scopes(
        self, subject: str, client_id: str, scopes: frozenset[str], now: float
    ) -> None:
        await self._call(
            "grant_scopes", lambda conn: _grant_scopes(conn, subject, client_id, scopes, now)
        )

    async def consents_of(self, subject: str) -> list[Consent]:
        return await self._call("consents_of", lambda conn: _consents_of(conn, subject))

    async def withdraw_consent(self, subject: str, client_id: str, now: float) -> list[str]:
        revoked = await self._call(
            "withdraw_consent",
            lambda conn: _in_transaction(conn, _withdraw_consent, subject, client_id, now),
        )
        if revoked:
            self._wake()
        return revoked

    # -- login sessions

    async def save_session(self, record: SessionRecord) -> None:
        await self._call("save_session", lambda conn: _save_session(conn, record))

    async def get_session(self, session_hash: bytes, now: float) -> SessionRecord | None:
        return await self._call("get_session", lambda conn: _get_session(conn, session_hash, now))

    async def delete_session(self, session_hash: bytes) -> None:
        await self._call("delete_session", lambda conn: _delete_session(conn, session_hash))

    async def record_sign_in(self, record: SignInRecord) -> None:
        await self._call("record_sign_in", lambda conn: _record_sign_in(conn, record))

    async def sign_ins_of(self, subject: str, now: float) -> list[SignInRecord]:
        return await self._call("sign_ins_of", lambda conn: _sign_ins_of(conn, subject, now))

    async def sessions_of(self, subject: str, now: float) -> list[SessionRecord]:
        return await self._call("sessions_of", lambda conn: _sessions_of(conn, subject, now))

    async def delete_other_sessions(self, subject: str, keep: bytes) -> int:
        return await self._call(
            "delete_other_sessions", lambda conn: _delete_other_sessions(conn, subject, keep)
        )

    # -- throttles on guessing

    async def reserve_attempt(self, rules: Sequence[Rule], now: float) -> Refuse | None:
        return await self._call("reserve_attempt", lambda conn: _reserve_attempt(conn, rules, now))

    async def release_attempt(self, keys: Sequence[str], reserved_at: float) -> None:
        await self._call("release_attempt", lambda conn: _release_attempt(conn, keys, reserved_at))

    async def clear_failures(self, key: str) -> None:
        await self._call("clear_failures", lambda conn: _clear_failures(conn, key))

    # -- second factors

    async def begin_totp(self, record: TotpRecord) -> bool:
        return await self._call("begin_totp", lambda conn: _begin_totp(conn, record))

    async def get_totp(self, subject: str) -> TotpRecord | None:
        return await self._call("get_totp", lambda conn: _get_totp(conn, subject))

    async def confirm_totp(
        self,
        subject: str,
        sealed_secret: bytes,
        step: int,
        recovery_codes: Sequence[bytes],
        now: float,
    ) -> bool:
        return await self._call(
            "confirm_totp",
            lambda conn: _confirm_totp(conn, subject, sealed_secret, step, recovery_codes, now),
        )

    async def use_totp_step(self, subject: str, step: int) -> bool:
        return await self._call("use_totp_step", lambda conn: _use_totp_step(conn, subject, step))

    async def use_recovery_code(self, subject: str, code_sha256: bytes, now: float) -> bool:
        return await self._call(
            "use_recovery_code", lambda conn: _use_recovery_code(conn, subject, code_sha256, now)
        )

    async def replace_recovery_codes(self, subject: str, recovery_codes: Sequence[bytes]) -> bool:
        return await self._call(
            "replace_recovery_codes",
            lambda conn: _replace_recovery_codes(conn, subject, recovery_codes),
        )

    async def delete_totp(self, subject: str) -> bool:
        return await self._call("delete_totp", lambda conn: _delete_totp(conn, subject))

    # -- passkeys

    async def add_passkey(self, record: PasskeyRecord) -> bool:
        return await self._call("add_passkey", lambda conn: _add_passkey(conn, record))

    async def passkeys_of(self, subject: str) -> list[PasskeyRecord]:
        return await self._call("passkeys_of", lambda conn: _passkeys_of(conn, subject))

    async def get_passkey(self, credential_id: bytes) -> PasskeyRecord | None:
        return await self._call("get_passkey", lambda conn: _get_passkey(conn, credential_id))

    async def use_passkey(
        self, credential_id: bytes, sign_count: int, backed_up: bool, now: float
    ) -> bool:
        return await self._call(
            "use_passkey",
            lambda conn: _use_passkey(conn, credential_id, sign_count, backed_up, now),
        )

    async def delete_passkey(self, subject: str, credential_id: bytes) -> bool:
        return await self._call(
            "delete_passkey", lambda conn: _delete_passkey(conn, subject, credential_id)
        )

    # -- client assertion replay cache

    async def use_jti(self, client_id: str, jti: str, expires_at: float, now: float) -> bool:
        return await self._call(
            "use_jti", lambda conn: _use_jti(conn, client_id, jti, expires_at, now)
        )

    # -- device authorization

    async def save_device(self, record: DeviceRecord) -> None:
        await self._call("save_device", lambda conn: _save_device(conn, record))

    async def device_by_user_code(self, user_code: str, now: float) -> DeviceRecord | None:
        return await self._call(
            "device_by_user_code", lambda conn: _device_by_user_code(conn, user_code, now)
        )

    async def get_device(self, device_code_hash: bytes) -> DeviceRecord | None:
        return await self._call("get_device", lambda conn: _get_device(conn, device_code_hash))

    async def decide_device(
        self,
        user_code: str,
        move: Move,
        subject: str,
        now: float,
        auth_time: float | None = None,
        amr: Sequence[str] = (),
    ) -> bool:
        return await self._call(
            "decide_device",
            lambda conn: _decide_device(conn, user_code, move, subject, now, auth_time, amr),
        )

    async def record_poll(self, device_code_hash: bytes, poll: Poll) -> bool:
        return await self._call(
            "record_poll", lambda conn: _in_transaction(conn, _record_poll, device_code_hash, poll)
        )

    async def redeem_device(self, device_code_hash: bytes, poll: Poll, issuance: Issuance) -> bool:
        return await self._call(
            "redeem_device", lambda conn: _redeem_device(conn, device_code_hash, poll, issuance)
        )

    # -- signing keys

    async def signing_keys(self) -> SigningKeys:
        return await self._call("signing_keys", _signing_keys)

    async def signing_keys_version(self) -> int:
        return await self._call("signing_keys_version", _signing_keys_version)

    async def replace_signing_keys(
        self, expected_version: int, keys: Sequence[SigningKeyRecord]
    ) -> bool:
        return await self._call(
            "replace_signing_keys", lambda conn: _replace_signing_keys(conn, expected_version, keys)
        )

    # -- clients and users

    async def get_client(self, client_id: str) -> ClientRecord | None:
        return await self._call("get_client", lambda conn: self._client_rows.read(conn, client_id))

    async def list_clients(self) -> list[ClientRecord]:
        return await self._call("list_clients", _list_clients)

    async def save_client(self, record: ClientRecord, expected_version: int | None) -> bool:
        return await self._call(
            "save_client",
            lambda conn: _in_transaction(conn, _save_client, record, expected_version),
        )

    async def delete_client(self, client_id: str) -> bool:
        return await self._call(
            "delete_client", lambda conn: _delete_row(conn, "clients", client_id)
        )

    async def client_used(self, client_id: str) -> bool:
        return await self._call("client_used", lambda conn: _client_used(conn, client_id))

    async def sync_clients(self, records: Sequence[ClientRecord], now: float) -> list[str]:
        return await self._call(
            "sync_clients", lambda conn: _in_transaction(conn, _sync_clients, records)
        )

    async def get_user(self, subject: str) -> UserRecord | None:
        return await self._call("get_user", lambda conn: _get_user(conn, "subject", subject))

    async def user_by_username(self, username: str) -> UserRecord | None:
        return await self._call(
            "user_by_username", lambda conn: _get_user(conn, "username", username)
        )

    async def list_users(self) -> list[UserRecord]:
        return await self._call("list_users", _list_users)

    async def users_with_email(self, email: str) -> list[UserRecord]:
        return await self._call("users_with_email", lambda conn: _users_with_email(conn, email))

    async def save_user(self, record: UserRecord, expected_version: int | None) -> bool:
        return await self._call(
            "save_user", lambda conn: _in_transaction(conn, _save_user, record, expected_version)
        )

    async def delete_user(self, subject: str) -> bool:
        return await self._call("delete_user", lambda conn: _delete_row(conn, "users", subject))

    async def sync_users(self, records: Sequence[UserRecord], now: float) -> list[str]:
        return await self._call(
            "sync_users", lambda conn: _in_transaction(conn, _sync_users, records)
        )

    async def identity_owner(self, issuer: str, provider_subject: str) -> str | None:
        return await self._call(
            "identity_owner", lambda conn: _identity_owner(conn, issuer, provider_subject)
        )

    async def link_identity(self, link: IdentityLink, new_user: UserRecord | None) -> None:
        await self._call(
            "link_identity", lambda conn: _in_transaction(conn, _link_identity, link, new_user)
        )

    async def identity_links(self, subject: str) -> list[IdentityLink]:
        return await self._call("identity_links", lambda conn: _identity_links(conn, subject))

    async def delete_sessions(self, subject: str) -> int:
        return await self._call(
            "delete_sessions", lambda conn: _delete_rows(conn, "sessions", subject)
        )

    async def list_grants(
        self, client_id: str | None = None, subject: str | None = None
    ) -> list[GrantSummary]:
        return await self._call("list_grants", lambda conn: _list_grants(conn, client_id, subject))

    # -- housekeeping

    async def purge_expired(self, now: float) -> int:
        return await self._call("purge_expired", lambda conn: _purge_expired(conn, now))

    async def ping(self) -> None:
        await self._call("ping", lambda conn: conn.execute("SELECT 1").fetchone())


# ---------------------------------------------------------------------------------------
# Migrations


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
    applied_before = {
        version for (version,) in conn.execute("SELECT version FROM schema_migrations")
    }
    newer = unknown_versions(applied_before, migrations)
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
        log.info("migration applied", extra={"version": migration.version, "file": migration.name})
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
    if conn.in_transaction:
        # A rollback that failed before (the disk it writes to gone) left this open: end it
        # now, or no transaction could start on the connection again.
        conn.execute("ROLLBACK")
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        # SQLite rolls back by itself after some errors (a full disk, for one).
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.OperationalError):  # retried at the next BEGIN
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
            " nonce, code_challenge, auth_time, expires_at, created_at, state, dpop_jkt, amr)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                r.dpop_jkt,
                _methods_text(r.amr),
            ),
        )


def _get_code(conn: sqlite3.Connection, code_hash: bytes) -> CodeRecord | None:
    row = conn.execute(
        "SELECT code_hash, client_id, subject, redirect_uri, scope, audience, nonce,"
        " code_challenge, auth_time, expires_at, created_at, state, dpop_jkt, amr"
        " FROM codes WHERE code_hash = ?",
        (code_hash,),
    ).fetchone()
    return None if row is None else replace(CodeRecord(*row[:-1]), amr=_methods(row[-1]))


def _redeem_code(
    conn: sqlite3.Connection, code_hash: bytes, move: Move, issuance: Issuance
) -> bool:
    grant = _new_grant(issuance)
    with _transaction(conn):
        changed = conn.execute(
            "UPDATE codes SET state = ?, consumed_at = ? WHERE code_hash = ? AND state = ?",
            (Code(move.next).value, grant.created_at, code_hash, Code(move.expected).value),
        ).rowcount
        if changed != 1:
            return False
        _insert_grant(conn, grant)
        _record_tokens(conn, issuance)
        return True


# -- grants and access tokens


def _new_grant(issuance: Issuance) -> GrantRecord:
    grant = issuance.grant
    if grant is None or grant.grant_id != issuance.grant_id:
        raise ValueError("a redemption creates the grant its tokens are issued under")
    return grant


def _insert_grant(conn: sqlite3.Connection, g: GrantRecord) -> None:
    with _unique(f"grant {g.grant_id!r}"):
        conn.execute(
            "INSERT INTO grants (grant_id, client_id, subject, created_at, expires_at,"
            " revoked_at) VALUES (?, ?, ?, ?, ?, ?)",
            (g.grant_id, g.client_id, g.subject, g.created_at, g.expires_at, g.revoked_at),
        )


def _get_grant(conn: sqlite3.Connection, grant_id: str) -> GrantRecord | None:
    row = conn.execute(
        "SELECT grant_id, client_id, subject, created_at, expires_at, revoked_at"
        " FROM grants WHERE grant_id = ?",
        (grant_id,),
    ).fetchone()
    return None if row is None else GrantRecord(*row)


def _record_tokens(conn: sqlite3.Connection, issuance: Issuance) -> None:
    """Inside a transaction: the access token and the refresh token of an issuance."""
    a = issuance.access_token
    with _unique("this access token"):
        conn.execute(
            "INSERT INTO access_tokens (jti, grant_id, client_id, expires_at) VALUES (?, ?, ?, ?)",
            (a.jti, a.grant_id, a.client_id, a.expires_at),
        )
    if issuance.refresh_token is not None:
        if issuance.refresh_token.family_id != issuance.grant_id:
            raise ValueError("a refresh token is issued into the family of its grant")
        _insert_refresh_token(conn, issuance.refresh_token)


def _revoke_grant(conn: sqlite3.Connection, grant_id: str, now: float, reason: str) -> bool:
    """Inside a transaction: the grant, then every token of its family, then the event
    naming its access tokens. Whatever a rotation committed before this transaction began
    is in the family, and none can commit after it: rotations check the grant in their own
    write transaction."""
    if not _revoke_one_grant(conn, grant_id, now):
        return False
    tokens = [
        RevokedToken(jti, expires_at)
        for jti, expires_at in conn.execute(
            "SELECT jti, expires_at FROM access_tokens"
            " WHERE grant_id = ? AND expires_at > ? ORDER BY jti",
            (grant_id, now),
        )
    ]
    if tokens:
        _insert_event(
            conn, EventKind.TOKENS, reason, now, max(t.expires_at for t in tokens), tokens
        )
    return True


def _revoke_one_grant(conn: sqlite3.Connection, grant_id: str, now: float) -> bool:
    changed = conn.execute(
        "UPDATE grants SET revoked_at = ? WHERE grant_id = ? AND revoked_at IS NULL",
        (now, grant_id),
    ).rowcount
    if changed != 1:
        return False
    conn.execute(
        "UPDATE refresh_tokens SET state = ? WHERE family_id = ? AND state != ?",
        (Refresh.REVOKED.value, grant_id, Refresh.REVOKED.value),
    )
    return True


def _revoke_access_token(
    conn: sqlite3.Connection, jti: str, expires_at: float, now: float, reason: str
) -> None:
    with _transaction(conn):
        conn.execute(
            "INSERT INTO access_tokens (jti, expires_at, revoked) VALUES (?, ?, 1)"
            " ON CONFLICT (jti) DO UPDATE SET revoked = 1,"
            " expires_at = max(access_tokens.expires_at, excluded.expires_at)",
            (jti, expires_at),
        )
        _insert_event(
            conn, EventKind.TOKENS, reason, now, expires_at, [RevokedToken(jti, expires_at)]
        )


def _cut_off(conn: sqlite3.Connection, cut: CutOff) -> int:
    """Inside a transaction: a subject's codes not redeemed and device approvals not
    redeemed, issued before the cut, ended; the grants of the subject or client created
    before the cut, each revoked with its family; then the event."""
    column = "subject" if cut.kind is EventKind.SUBJECT else "client_id"
    if cut.kind is EventKind.SUBJECT:
        # Codes are few and short-lived (the purge deletes them), and cut-offs rare: a scan
        # rather than an index every code's insert would pay for.
        conn.execute(
            "DELETE FROM codes WHERE subject = ? AND state = ? AND created_at < ?",
            (cut.key, Code.ISSUED.value, cut.issued_before),
        )
        conn.execute(
            "UPDATE device_codes SET state = ? WHERE subject = ? AND state = ? AND created_at < ?",
            (Device.DENIED.value, cut.key, Device.APPROVED.value, cut.issued_before),
        )
    grant_ids = [
        grant_id
        for (grant_id,) in conn.execute(
            f"SELECT grant_id FROM grants WHERE {column} = ?"  # noqa: S608 - one of two names
            " AND created_at < ? AND revoked_at IS NULL",
            (cut.key, cut.issued_before),
        )
    ]
    for grant_id in grant_ids:
        _revoke_one_grant(conn, grant_id, cut.created_at)
    return _insert_event(
        conn,
        cut.kind,
        cut.reason,
        cut.created_at,
        cut.expires_at,
        key=cut.key,
        issued_before=cut.issued_before,
    )


def _insert_event(
    conn: sqlite3.Connection,
    kind: EventKind,
    reason: str,
    now: float,
    expires_at: float,
    tokens: Sequence[RevokedToken] = (),
    *,
    key: str | None = None,
    issued_before: float | None = None,
) -> int:
    cursor = conn.execute(
        "INSERT INTO revocation_events (kind, reason, tokens, key, issued_before, created_at,"
        " expires_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (
            kind.value,
            reason,
            json.dumps([[t.jti, t.expires_at] for t in tokens]),
            key,
            issued_before,
            now,
            expires_at,
        ),
    )
    assert cursor.lastrowid is not None
    return cursor.lastrowid


def _revocation_events(
    conn: sqlite3.Connection, after: int, now: float, limit: int
) -> list[RevocationEvent]:
    rows = conn.execute(
        "SELECT event_id, kind, reason, created_at, expires_at, tokens, key, issued_before"
        " FROM revocation_events WHERE event_id > ? AND expires_at > ?"
        " ORDER BY event_id LIMIT ?",
        (after, now, limit),
    ).fetchall()
    return [
        RevocationEvent(
            event_id=event_id,
            kind=EventKind(kind),
            reason=reason,
            created_at=created_at,
            expires_at=expires_at,
            tokens=tuple(RevokedToken(jti, exp) for jti, exp in json.loads(tokens)),
            key=key,
            issued_before=issued_before,
        )
        for event_id, kind, reason, created_at, expires_at, tokens, key, issued_before in rows
    ]


def _access_token_active(conn: sqlite3.Connection, jti: str) -> bool:
    row = conn.execute(
        "SELECT a.revoked OR EXISTS (SELECT 1 FROM grants g"
        "                            WHERE g.grant_id = a.grant_id AND g.revoked_at IS NOT NULL)"
        " FROM access_tokens a WHERE a.jti = ?",
        (jti,),
    ).fetchone()
    return row is None or not row[0]


# -- refresh tokens


def _get_refresh(conn: sqlite3.Connection, token_hash: bytes) -> RefreshRecord | None:
    row = conn.execute(
        "SELECT t.token_hash, t.family_id, t.client_id, t.subject, t.scope, t.audience,"
        " t.auth_time, t.created_at, t.expires_at, g.expires_at, t.state, t.rotated_at,"
        " t.successor_hash, t.successor_sealed, t.dpop_jkt, t.amr"
        " FROM refresh_tokens t JOIN grants g ON g.grant_id = t.family_id"
        " WHERE t.token_hash = ?",
        (token_hash,),
    ).fetchone()
    return None if row is None else replace(RefreshRecord(*row[:-1]), amr=_methods(row[-1]))


def _insert_refresh_token(conn: sqlite3.Connection, r: RefreshRecord) -> None:
    with _unique("this refresh token"):
        conn.execute(
            "INSERT INTO refresh_tokens (token_hash, family_id, client_id, subject, scope,"
            " audience, auth_time, created_at, expires_at, state, rotated_at, successor_hash,"
            " successor_sealed, dpop_jkt, amr)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                r.successor_hash,
                r.successor_sealed,
                r.dpop_jkt,
                _methods_text(r.amr),
            ),
        )


def _rotate_refresh(
    conn: sqlite3.Connection,
    token_hash: bytes,
    move: Move,
    issuance: Issuance,
    successor_sealed: bytes,
) -> bool:
    successor = issuance.refresh_token
    if successor is None:
        raise ValueError("a rotation issues a successor")
    with _transaction(conn):
        changed = conn.execute(
            "UPDATE refresh_tokens SET state = ?, rotated_at = ?, successor_hash = ?,"
            " successor_sealed = ?"
            " WHERE token_hash = ? AND state = ? AND family_id = ?"
            " AND EXISTS (SELECT 1 FROM grants g"
            "             WHERE g.grant_id = refresh_tokens.family_id AND g.revoked_at IS NULL)",
            (
                Refresh(move.next).value,
                successor.created_at,
                successor.token_hash,
                successor_sealed,
                token_hash,
                Refresh(move.expected).value,
                issuance.grant_id,
            ),
        ).rowcount
        if changed != 1:
            return False
        _record_tokens(conn, issuance)
        return True


# -- consent


def _granted_scopes(conn: sqlite3.Connection, subject: str, client_id: str) -> frozenset[str]:
    rows = conn.execute(
        "SELECT scope FROM consents WHERE subject = ? AND client_id = ?", (subject, client_id)
    )
    return frozenset(scope for (scope,) in rows)


def _grant_scopes(
    conn: sqlite3.Connection, subject: str, client_id: str, scopes: frozenset[str], now: float
) -> None:
    with _transaction(conn):
        conn.executemany(
            "INSERT INTO consents (subject, client_id, scope, granted_at) VALUES (?, ?, ?, ?)"
            " ON CONFLICT DO NOTHING",
            [(subject, client_id, scope, now) for scope in sorted(scopes) if scope],
        )


def _consents_of(conn: sqlite3.Connection, subject: str) -> list[Consent]:
    rows = conn.execute(
        "SELECT client_id, scope, granted_at FROM consents WHERE subject = ?"
        " ORDER BY client_id, scope",
        (subject,),
    )
    consents: dict[str, tuple[list[str], float]] = {}
    for client_id, scope, granted_at in rows:
        scopes, first = consents.setdefault(client_id, ([], granted_at))
        scopes.append(scope)
        consents[client_id] = (scopes, min(first, granted_at))
    return [Consent(c, tuple(scopes), at) for c, (scopes, at) in consents.items()]


def _withdraw_consent(
    conn: sqlite3.Connection, subject: str, client_id: str, now: float
) -> list[str]:
    """Inside a transaction: the consent, then each grant in force, as _revoke_grant."""
    conn.execute("DELETE FROM consents WHERE subject = ? AND client_id = ?", (subject, client_id))
    grants = [
        grant_id
        for (grant_id,) in conn.execute(
            "SELECT grant_id FROM grants WHERE subject = ? AND client_id = ?"
            " AND revoked_at IS NULL AND expires_at > ? ORDER BY grant_id",
            (subject, client_id, now),
        )
    ]
    return [g for g in grants if _revoke_grant(conn, g, now, CONSENT_WITHDRAWN)]


# -- login sessions


def _save_session(conn: sqlite3.Connection, r: SessionRecord) -> None:
    with _transaction(conn), _unique("this session"):
        conn.execute(
            "INSERT INTO sessions (session_hash, subject, auth_time, expires_at, csrf_secret,"
            " address, amr) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                r.session_hash,
                r.subject,
                r.auth_time,
                r.expires_at,
                r.csrf_secret,
                r.address,
                _methods_text(r.amr),
            ),
        )


def _get_session(conn: sqlite3.Connection, session_hash: bytes, now: float) -> SessionRecord | None:
    row = conn.execute(
        "SELECT session_hash, subject, auth_time, expires_at, csrf_secret, address, amr"
        " FROM sessions"
        " WHERE session_hash = ? AND expires_at > ?",
        (session_hash, now),
    ).fetchone()
    return None if row is None else replace(SessionRecord(*row[:-1]), amr=_methods(row[-1]))


def _delete_session(conn: sqlite3.Connection, session_hash: bytes) -> None:
    with _transaction(conn):
        conn.execute("DELETE FROM sessions WHERE session_hash = ?", (session_hash,))


def _record_sign_in(conn: sqlite3.Connection, r: SignInRecord) -> None:
    with _transaction(conn):
        conn.execute(
            "INSERT INTO sign_ins (subject, at, outcome, address, client_id, expires_at)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (r.subject, r.at, r.outcome, r.address, r.client_id, r.expires_at),
        )
        conn.execute(
            "DELETE FROM sign_ins WHERE subject = ? AND rowid NOT IN"
            " (SELECT rowid FROM sign_ins WHERE subject = ? ORDER BY at DESC, rowid DESC"
            "  LIMIT ?)",
            (r.subject, r.subject, SIGN_INS_KEPT),
        )


def _sign_ins_of(conn: sqlite3.Connection, subject: str, now: float) -> list[SignInRecord]:
    rows = conn.execute(
        "SELECT subject, at, outcome, address, client_id, expires_at FROM sign_ins"
        " WHERE subject = ? AND expires_at > ? ORDER BY at DESC, rowid DESC",
        (subject, now),
    )
    return [SignInRecord(*row) for row in rows]


def _sessions_of(conn: sqlite3.Connection, subject: str, now: float) -> list[SessionRecord]:
    rows = conn.execute(
        "SELECT session_hash, subject, auth_time, expires_at, csrf_secret, address, amr"
        " FROM sessions WHERE subject = ? AND expires_at > ? ORDER BY auth_time DESC, session_hash",
        (subject, now),
    )
    return [replace(SessionRecord(*row[:-1]), amr=_methods(row[-1])) for row in rows]


def _delete_other_sessions(conn: sqlite3.Connection, subject: str, keep: bytes) -> int:
    with _transaction(conn):
        return conn.execute(
            "DELETE FROM sessions WHERE subject = ? AND session_hash <> ?", (subject, keep)
        ).rowcount


def _methods(text: str) -> tuple[str, ...]:
    """RFC 8176 values as stored: space-separated."""
    return tuple(text.split())


def _methods_text(amr: Sequence[str]) -> str:
    return " ".join(amr)


# -- second factors: each change one statement, or one transaction of a few


def _begin_totp(conn: sqlite3.Connection, r: TotpRecord) -> bool:
    with _transaction(conn):
        # A waiting enrolment is replaced; a confirmed factor is left alone.
        cursor = conn.execute(
            "INSERT INTO totp_factors (subject, sealed_secret, created_at, confirmed_at,"
            " last_step) VALUES (?, ?, ?, NULL, NULL)"
            " ON CONFLICT (subject) DO UPDATE SET sealed_secret = excluded.sealed_secret,"
            " created_at = excluded.created_at WHERE totp_factors.confirmed_at IS NULL",
            (r.subject, r.sealed_secret, r.created_at),
        )
        return cursor.rowcount == 1


def _get_totp(conn: sqlite3.Connection, subject: str) -> TotpRecord | None:
    row = conn.execute(
        "SELECT subject, sealed_secret, created_at, confirmed_at, last_step,"
        " (SELECT count(*) FROM recovery_codes c WHERE c.subject = f.subject"
        "  AND c.used_at IS NULL)"
        " FROM totp_factors f WHERE subject = ?",
        (subject,),
    ).fetchone()
    return None if row is None else TotpRecord(*row)


def _confirm_totp(
    conn: sqlite3.Connection,
    subject: str,
    sealed_secret: bytes,
    step: int,
    recovery_codes: Sequence[bytes],
    now: float,
) -> bool:
    with _transaction(conn):
        changed = conn.execute(
            "UPDATE totp_factors SET confirmed_at = ?, last_step = ?"
            " WHERE subject = ? AND sealed_secret = ? AND confirmed_at IS NULL",
            (now, step, subject, sealed_secret),
        ).rowcount
        if changed != 1:
            return False
        _set_recovery_codes(conn, subject, recovery_codes)
        return True


def _set_recovery_codes(
    conn: sqlite3.Connection, subject: str, recovery_codes: Sequence[bytes]
) -> None:
    """The user's recovery codes become these, all unused (within the caller's transaction)."""
    conn.execute("DELETE FROM recovery_codes WHERE subject = ?", (subject,))
    conn.executemany(
        "INSERT INTO recovery_codes (subject, code_sha256, used_at) VALUES (?, ?, NULL)",
        [(subject, digest) for digest in recovery_codes],
    )


def _use_totp_step(conn: sqlite3.Connection, subject: str, step: int) -> bool:
    with _transaction(conn):
        changed = conn.execute(
            "UPDATE totp_factors SET last_step = ? WHERE subject = ?"
            " AND confirmed_at IS NOT NULL AND (last_step IS NULL OR last_step < ?)",
            (step, subject, step),
        ).rowcount
        return changed == 1


def _use_recovery_code(
    conn: sqlite3.Connection, subject: str, code_sha256: bytes, now: float
) -> bool:
    with _transaction(conn):
        changed = conn.execute(
            "UPDATE recovery_codes SET used_at = ?"
            " WHERE subject = ? AND code_sha256 = ? AND used_at IS NULL",
            (now, subject, code_sha256),
        ).rowcount
        return changed == 1


def _replace_recovery_codes(
    conn: sqlite3.Connection, subject: str, recovery_codes: Sequence[bytes]
) -> bool:
    with _transaction(conn):
        confirmed = conn.execute(
            "SELECT 1 FROM totp_factors WHERE subject = ? AND confirmed_at IS NOT NULL",
            (subject,),
        ).fetchone()
        if confirmed is None:
            return False
        _set_recovery_codes(conn, subject, recovery_codes)
        return True


def _delete_totp(conn: sqlite3.Connection, subject: str) -> bool:
    with _transaction(conn):
        # Its recovery codes go with it (ON DELETE CASCADE).
        return conn.execute("DELETE FROM totp_factors WHERE subject = ?", (subject,)).rowcount == 1


# -- passkeys: each change one statement

_PASSKEY_COLUMNS = (
    "credential_id, subject, user_handle, public_key, sign_count, transports,"
    " backup_eligible, backed_up, name, created_at, last_used_at, rp_id"
)


def _passkey(row: Any) -> PasskeyRecord:
    (cid, subject, handle, key, count, transports, eligible, backed_up, name, created, used, rp) = (
        row
    )
    return PasskeyRecord(
        credential_id=bytes(cid),
        subject=subject,
        user_handle=bytes(handle),
        public_key=bytes(key),
        sign_count=int(count),
        transports=tuple(transports.split()),
        backup_eligible=bool(eligible),
        backed_up=bool(backed_up),
        name=name,
        created_at=float(created),
        last_used_at=None if used is None else float(used),
        rp_id=rp,
    )


def _add_passkey(conn: sqlite3.Connection, r: PasskeyRecord) -> bool:
    with _transaction(conn):
        cursor = conn.execute(
            f"INSERT INTO passkeys ({_PASSKEY_COLUMNS})"  # noqa: S608 - fixed names
            " SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, ?"
            " WHERE EXISTS (SELECT 1 FROM users WHERE subject = ?)"
            " ON CONFLICT (credential_id) DO NOTHING",
            (
                r.credential_id,
                r.subject,
                r.user_handle,
                r.public_key,
                r.sign_count,
                " ".join(r.transports),
                int(r.backup_eligible),
                int(r.backed_up),
                r.name,
                r.created_at,
                r.rp_id,
                r.subject,
            ),
        )
        return cursor.rowcount == 1


def _passkeys_of(conn: sqlite3.Connection, subject: str) -> list[PasskeyRecord]:
    rows = conn.execute(
        f"SELECT {_PASSKEY_COLUMNS} FROM passkeys WHERE subject = ?"  # noqa: S608 - fixed names
        " ORDER BY created_at, credential_id",
        (subject,),
    ).fetchall()
    return [_passkey(row) for row in rows]


def _get_passkey(conn: sqlite3.Connection, credential_id: bytes) -> PasskeyRecord | None:
    row = conn.execute(
        f"SELECT {_PASSKEY_COLUMNS} FROM passkeys WHERE credential_id = ?",  # noqa: S608
        (credential_id,),
    ).fetchone()
    return None if row is None else _passkey(row)


def _use_passkey(
    conn: sqlite3.Connection, credential_id: bytes, sign_count: int, backed_up: bool, now: float
) -> bool:
    with _transaction(conn):
        # WebAuthn §6.1.1: the counter must grow, unless the authenticator keeps none (both 0).
        changed = conn.execute(
            "UPDATE passkeys SET sign_count = ?, backed_up = ?, last_used_at = ?"
            " WHERE credential_id = ? AND (sign_count < ? OR (sign_count = 0 AND ? = 0))",
            (sign_count, int(backed_up), now, credential_id, sign_count, sign_count),
        ).rowcount
        return changed == 1


def _delete_passkey(conn: sqlite3.Connection, subject: str, credential_id: bytes) -> bool:
    with _transaction(conn):
        return (
            conn.execute(
                "DELETE FROM passkeys WHERE subject = ? AND credential_id = ?",
                (subject, credential_id),
            ).rowcount
            == 1
        )


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
                " auth_time, amr) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                    _methods_text(r.amr),
                ),
            )


def _device_by_user_code(
    conn: sqlite3.Connection, user_code: str, now: float
) -> DeviceRecord | None:
    row = conn.execute(
        "SELECT device_code_hash, user_code, client_id, scope, audience, state, subject,"
        " interval, last_poll, expires_at, created_at, auth_time, amr"
        " FROM device_codes WHERE user_code = ? AND expires_at > ?",
        (user_code, now),
    ).fetchone()
    return None if row is None else replace(DeviceRecord(*row[:-1]), amr=_methods(row[-1]))


def _get_device(conn: sqlite3.Connection, device_code_hash: bytes) -> DeviceRecord | None:
    row = conn.execute(
        "SELECT device_code_hash, user_code, client_id, scope, audience, state, subject,"
        " interval, last_poll, expires_at, created_at, auth_time, amr"
        " FROM device_codes WHERE device_code_hash = ?",
        (device_code_hash,),
    ).fetchone()
    return None if row is None else replace(DeviceRecord(*row[:-1]), amr=_methods(row[-1]))


def _decide_device(
    conn: sqlite3.Connection,
    user_code: str,
    move: Move,
    subject: str,
    now: float,
    auth_time: float | None,
    amr: Sequence[str],
) -> bool:
    with _transaction(conn):
        changed = conn.execute(
            "UPDATE device_codes SET state = ?, subject = ?, auth_time = ?, amr = ?"
            " WHERE user_code = ? AND state = ? AND expires_at > ?",
            (
                Device(move.next).value,
                subject,
                auth_time,
                _methods_text(amr),
                user_code,
                Device(move.expected).value,
                now,
            ),
        ).rowcount
        return changed == 1


def _record_poll(conn: sqlite3.Connection, device_code_hash: bytes, poll: Poll) -> bool:
    """Inside a transaction. `IS` compares a last poll that may be NULL."""
    changed = conn.execute(
        "UPDATE device_codes SET state = ?, last_poll = ?, interval = ?"
        " WHERE device_code_hash = ? AND state = ? AND last_poll IS ?",
        (
            Device(poll.move.next).value,
            poll.at,
            poll.interval,
            device_code_hash,
            Device(poll.move.expected).value,
            poll.last_poll,
        ),
    ).rowcount
    return changed == 1


def _redeem_device(
    conn: sqlite3.Connection, device_code_hash: bytes, poll: Poll, issuance: Issuance
) -> bool:
    grant = _new_grant(issuance)
    with _transaction(conn):
        if not _record_poll(conn, device_code_hash, poll):
            return False
        _insert_grant(conn, grant)
        _record_tokens(conn, issuance)
        return True


# -- signing keys


def _signing_keys(conn: sqlite3.Connection) -> SigningKeys:
    # One statement, one snapshot: the version and the keys it names.
    rows = conn.execute(
        "SELECT r.version, k.kid, k.alg, k.state, k.created_at, k.activate_at, k.retired_at,"
        " k.remove_after, k.sealed_private_key"
        " FROM signing_key_ring r LEFT JOIN signing_keys k ON 1"
        " WHERE r.id = 1 ORDER BY k.created_at, k.kid"
    ).fetchall()
    return SigningKeys(
        int(rows[0][0]), tuple(SigningKeyRecord(*row[1:]) for row in rows if row[1] is not None)
    )


def _signing_keys_version(conn: sqlite3.Connection) -> int:
    (version,) = conn.execute("SELECT version FROM signing_key_ring WHERE id = 1").fetchone()
    return int(version)


def _replace_signing_keys(
    conn: sqlite3.Connection, expected_version: int, keys: Sequence[SigningKeyRecord]
) -> bool:
    with _transaction(conn):
        changed = conn.execute(
            "UPDATE signing_key_ring SET version = version + 1 WHERE id = 1 AND version = ?",
            (expected_version,),
        ).rowcount
        if changed != 1:
            return False
        conn.execute(
            "DELETE FROM signing_keys WHERE kid NOT IN (SELECT value FROM json_each(?))",
            (json.dumps([k.kid for k in keys]),),
        )
        # Keys leaving `active` first, so that the index allowing one active key per
        # algorithm sees a successor only after its predecessor is retired.
        for k in sorted(keys, key=lambda k: k.state == "active"):
            with _unique("a second active key of one algorithm"):
                conn.execute(
                    "INSERT INTO signing_keys (kid, alg, state, created_at, activate_at,"
                    " retired_at, remove_after, sealed_private_key)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT (kid) DO UPDATE SET state = excluded.state,"
                    " activate_at = excluded.activate_at, retired_at = excluded.retired_at,"
                    " remove_after = excluded.remove_after",
                    (
                        k.kid,
                        k.alg,
                        k.state,
                        k.created_at,
                        k.activate_at,
                        k.retired_at,
                        k.remove_after,
                        k.sealed_private_key,
                    ),
                )
        return True


# -- clients and users: JSON text for the values of mappings and lists

_USER_BY = {
    "subject": (
        "SELECT subject, username, password_hash, claims, roles, disabled, managed_by,"
        " created_at, updated_at, version FROM users WHERE subject = ?"
    ),
    "username": (
        "SELECT subject, username, password_hash, claims, roles, disabled, managed_by,"
        " created_at, updated_at, version FROM users WHERE username = ?"
    ),
}
_DELETE = {
    "clients": "DELETE FROM clients WHERE client_id = ?",
    "users": "DELETE FROM users WHERE subject = ?",
    "sessions": "DELETE FROM sessions WHERE subject = ?",
}


def _client(row: Sequence[object]) -> ClientRecord:
    client_id, metadata, secret, managed_by, created, updated, valid_from, version = row[:8]
    registration_token, unused_until, blocked = row[8:]
    return ClientRecord(
        client_id=str(client_id),
        metadata=orjson.loads(metadata),  # type: ignore[arg-type]
        secret_sha256=secret,  # type: ignore[arg-type]
        managed_by=str(managed_by),
        created_at=float(created),  # type: ignore[arg-type]
        updated_at=float(updated),  # type: ignore[arg-type]
        tokens_valid_from=float(valid_from),  # type: ignore[arg-type]
        version=int(version),  # type: ignore[call-overload]
        registration_token_sha256=registration_token,  # type: ignore[arg-type]
        unused_until=None if unused_until is None else float(unused_until),  # type: ignore[arg-type]
        blocked=bool(blocked),
    )


def _user(row: Sequence[object]) -> UserRecord:
    subject, username, password_hash, claims, roles, disabled, managed_by = row[:7]
    created, updated, version = row[7:]
    return UserRecord(
        subject=str(subject),
        username=str(username),
        password_hash=str(password_hash),
        claims=orjson.loads(claims),  # type: ignore[arg-type]
        roles=tuple(orjson.loads(roles)),  # type: ignore[arg-type]
        disabled=bool(disabled),
        managed_by=str(managed_by),
        created_at=float(created),  # type: ignore[arg-type]
        updated_at=float(updated),  # type: ignore[arg-type]
        version=int(version),  # type: ignore[call-overload]
    )


def _client_values(r: ClientRecord, version: int) -> tuple[object, ...]:
    return (
        r.client_id,
        orjson.dumps(r.metadata).decode(),
        r.secret_sha256,
        r.managed_by,
        r.created_at,
        r.updated_at,
        r.tokens_valid_from,
        version,
        r.registration_token_sha256,
        r.unused_until,
        int(r.blocked),
    )


def _user_values(r: UserRecord, version: int) -> tuple[object, ...]:
    return (
        r.subject,
        r.username,
        r.password_hash,
        orjson.dumps(r.claims).decode(),
        orjson.dumps(list(r.roles)).decode(),
        int(r.disabled),
        r.managed_by,
        r.created_at,
        r.updated_at,
        version,
    )


_CLIENT_COLUMNS = (
    "client_id, metadata, secret_sha256, managed_by, created_at, updated_at,"
    " tokens_valid_from, version, registration_token_sha256, unused_until, blocked"
)
_CLIENT_BY_ID = f"SELECT {_CLIENT_COLUMNS} FROM clients WHERE client_id = ?"  # noqa: S608


def _get_client(conn: sqlite3.Connection, client_id: str) -> ClientRecord | None:
    row = conn.execute(_CLIENT_BY_ID, (client_id,)).fetchone()
    return None if row is None else _client(row)


class ClientRows:
    """Client lookups that give the record made from a row again while the row read is equal
    to it in every column: the token endpoint looks its client up on every request, and the
    row is read every time, but parsing the metadata and building the record again from an
    unchanged row would only cost. A changed or deleted row is read as it now is. Records
    are immutable (their metadata is never changed in place), so one may be given to many
    callers. At most `keep` rows are remembered, the oldest forgotten first; only the
    store's worker thread uses it."""

    def __init__(self, keep: int = 1024) -> None:
        self._keep = keep
        self._rows: dict[str, tuple[tuple[object, ...], ClientRecord]] = {}

    def read(self, conn: sqlite3.Connection, client_id: str) -> ClientRecord | None:
        row = conn.execute(_CLIENT_BY_ID, (client_id,)).fetchone()
        if row is None:
            self._rows.pop(client_id, None)
            return None
        kept = self._rows.get(client_id)
        if kept is not None and kept[0] == row:
            return kept[1]
        record = _client(row)
        self._rows.pop(client_id, None)
        self._rows[client_id] = (row, record)
        if len(self._rows) > self._keep:
            del self._rows[next(iter(self._rows))]
        return record


def _list_clients(conn: sqlite3.Connection) -> list[ClientRecord]:
    rows = conn.execute(f"SELECT {_CLIENT_COLUMNS} FROM clients ORDER BY client_id")  # noqa: S608
    return [_client(row) for row in rows]


def _save_client(conn: sqlite3.Connection, r: ClientRecord, expected: int | None) -> bool:
    if expected is None:
        with _unique(f"client {r.client_id!r}"):
            conn.execute(
                f"INSERT INTO clients ({_CLIENT_COLUMNS})"  # noqa: S608
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                _client_values(r, 1),
            )
        return True
    values = _client_values(r, expected + 1)
    return (
        conn.execute(
            "UPDATE clients SET metadata = ?, secret_sha256 = ?, managed_by = ?,"
            " created_at = ?, updated_at = ?, tokens_valid_from = ?, version = ?,"
            " registration_token_sha256 = ?, unused_until = ?, blocked = ?"
            " WHERE client_id = ? AND version = ?",
            (*values[1:], r.client_id, expected),
        ).rowcount
        == 1
    )


def _client_used(conn: sqlite3.Connection, client_id: str) -> bool:
    updated = conn.execute(
        "UPDATE clients SET unused_until = NULL WHERE client_id = ? AND unused_until IS NOT NULL",
        (client_id,),
    )
    return updated.rowcount == 1


def _sync_clients(conn: sqlite3.Connection, records: Sequence[ClientRecord]) -> list[str]:
    seeded = {r.client_id for r in records}
    removed = [
        client_id
        for (client_id,) in conn.execute(
            "SELECT client_id FROM clients WHERE managed_by = ? ORDER BY client_id",
            (MANAGED_BY_CONFIG,),
        )
        if client_id not in seeded
    ]
    conn.executemany("DELETE FROM clients WHERE client_id = ?", [(c,) for c in removed])
    for r in records:
        old = _get_client(conn, r.client_id)
        if old is None:
            _save_client(conn, r, None)
        elif (old.metadata, old.secret_sha256, old.managed_by) != (
            r.metadata,
            r.secret_sha256,
            MANAGED_BY_CONFIG,
        ):
            kept = replace(r, created_at=old.created_at, tokens_valid_from=old.tokens_valid_from)
            _save_client(conn, kept, old.version)
    return removed


def _get_user(conn: sqlite3.Connection, column: str, value: str) -> UserRecord | None:
    row = conn.execute(_USER_BY[column], (value,)).fetchone()
    return None if row is None else _user(row)


def _users_with_email(conn: sqlite3.Connection, email: str) -> list[UserRecord]:
    return [
        _user(row)
        for row in conn.execute(
            "SELECT subject, username, password_hash, claims, roles, disabled, managed_by,"
            " created_at, updated_at, version FROM users WHERE email_key = ? ORDER BY subject",
            (email_key(email),),
        )
    ]


def _list_users(conn: sqlite3.Connection) -> list[UserRecord]:
    return [
        _user(row)
        for row in conn.execute(
            "SELECT subject, username, password_hash, claims, roles, disabled, managed_by,"
            " created_at, updated_at, version FROM users ORDER BY subject"
        )
    ]


def _save_user(conn: sqlite3.Connection, r: UserRecord, expected: int | None) -> bool:
    with _unique(f"user {r.subject!r} or username {r.username!r}"):
        if expected is None:
            conn.execute(
                "INSERT INTO users (subject, username, password_hash, claims, roles, disabled,"
                " managed_by, created_at, updated_at, version, email_key) VALUES (?, ?, ?, ?,"
                " ?, ?, ?, ?, ?, ?, ?)",
                (*_user_values(r, 1), email_key(r.claims.get("email"))),
            )
            return True
        values = _user_values(r, expected + 1)
        return (
            conn.execute(
                "UPDATE users SET username = ?, password_hash = ?, claims = ?, roles = ?,"
                " disabled = ?, managed_by = ?, created_at = ?, updated_at = ?, version = ?,"
                " email_key = ? WHERE subject = ? AND version = ?",
                (*values[1:], email_key(r.claims.get("email")), r.subject, expected),
            ).rowcount
            == 1
        )


def _sync_users(conn: sqlite3.Connection, records: Sequence[UserRecord]) -> list[str]:
    seeded = {r.subject for r in records}
    removed = [
        subject
        for (subject,) in conn.execute(
            "SELECT subject FROM users WHERE managed_by = ? ORDER BY subject",
            (MANAGED_BY_CONFIG,),
        )
        if subject not in seeded
    ]
    conn.executemany("DELETE FROM users WHERE subject = ?", [(s,) for s in removed])
    for r in records:
        old = _get_user(conn, "subject", r.subject)
        if old is None:
            _save_user(conn, r, None)
        elif _user_values(old, 0)[1:7] != (*_user_values(r, 0)[1:6], MANAGED_BY_CONFIG):
            _save_user(conn, replace(r, created_at=old.created_at), old.version)
    return removed


def _identity_owner(conn: sqlite3.Connection, issuer: str, provider_subject: str) -> str | None:
    row = conn.execute(
        "SELECT subject FROM identity_links WHERE issuer = ? AND provider_subject = ?",
        (issuer, provider_subject),
    ).fetchone()
    return None if row is None else str(row[0])


def _link_identity(
    conn: sqlite3.Connection, link: IdentityLink, new_user: UserRecord | None
) -> None:
    if new_user is not None:
        _save_user(conn, new_user, None)
    with _unique(f"the identity {link.provider_subject!r} of {link.issuer!r}"):
        conn.execute(
            "INSERT INTO identity_links (issuer, provider_subject, subject, created_at)"
            " VALUES (?, ?, ?, ?)",
            (link.issuer, link.provider_subject, link.subject, link.created_at),
        )


def _identity_links(conn: sqlite3.Connection, subject: str) -> list[IdentityLink]:
    rows = conn.execute(
        "SELECT issuer, provider_subject, subject, created_at FROM identity_links"
        " WHERE subject = ? ORDER BY issuer, provider_subject",
        (subject,),
    )
    return [IdentityLink(*row) for row in rows]


def _delete_row(conn: sqlite3.Connection, table: str, value: str) -> bool:
    return _delete_rows(conn, table, value) == 1


def _delete_rows(conn: sqlite3.Connection, table: str, value: str) -> int:
    with _transaction(conn):
        return conn.execute(_DELETE[table], (value,)).rowcount


def _list_grants(
    conn: sqlite3.Connection, client_id: str | None, subject: str | None
) -> list[GrantSummary]:
    rows = conn.execute(
        "SELECT g.grant_id, g.client_id, g.subject, g.created_at, g.expires_at, g.revoked_at,"
        " coalesce((SELECT t.scope FROM refresh_tokens t WHERE t.family_id = g.grant_id"
        "           ORDER BY t.created_at DESC LIMIT 1),"
        "(SELECT group_concat(c.scope, ' ') FROM (SELECT scope FROM consents c2"
        " WHERE c2.subject = g.subject AND c2.client_id = g.client_id ORDER BY"
        " scope) c)"
        ", ''),"
        " coalesce((SELECT max(t.created_at) FROM refresh_tokens t"
        "           WHERE t.family_id = g.grant_id), g.created_at),"
        " EXISTS (SELECT 1 FROM refresh_tokens t WHERE t.family_id = g.grant_id)"
        " FROM grants g WHERE (:client IS NULL OR g.client_id = :client)"
        " AND (:subject IS NULL OR g.subject = :subject) ORDER BY g.grant_id",
        {"client": client_id, "subject": subject},
    )
    return [GrantSummary(GrantRecord(*row[:6]), row[6], row[7], bool(row[8])) for row in rows]


# -- housekeeping


def _purge_expired(conn: sqlite3.Connection, now: float) -> int:
    """Each table in its own short transaction, so writers wait for one table at most.

    The count is of records the protocol knows (codes, refresh tokens, sessions, jtis,
    device codes, throttle keys, access tokens, revocation events, clients that never
    obtained a token, sign-ins); grants are bookkeeping and not counted.
    """
    deleted = 0
    for statement in (
        "DELETE FROM clients WHERE unused_until <= :now",
        "DELETE FROM codes WHERE expires_at <= :now",
        "DELETE FROM sessions WHERE expires_at <= :now",
        "DELETE FROM assertion_jtis WHERE expires_at <= :now",
        "DELETE FROM device_codes WHERE expires_at <= :now",
        "DELETE FROM failures WHERE expires_at <= :now",
        "DELETE FROM access_tokens WHERE expires_at <= :now",
        "DELETE FROM revocation_events WHERE expires_at <= :now",
        "DELETE FROM sign_ins WHERE expires_at <= :now",
    ):
        with _transaction(conn):
            deleted += conn.execute(statement, {"now": now}).rowcount
    with _transaction(conn):
        # Whole families past their absolute lifetime, then tokens idle-expired long ago
        # (a live family keeps its recent rotated tokens for reuse detection), then the
        # grants left with nothing: no refresh token, or past their end, and no access
        # token that could still be presented (its revocation is read from the grant).
        deleted += conn.execute(
            "DELETE FROM refresh_tokens WHERE family_id IN"
            " (SELECT grant_id FROM grants WHERE expires_at <= :now)",
            {"now": now},
        ).rowcount
        deleted += conn.execute(
            "DELETE FROM refresh_tokens WHERE expires_at <= :cutoff",
            {"cutoff": now - REFRESH_RETENTION.total_seconds()},
        ).rowcount
        conn.execute(
            "DELETE FROM grants WHERE NOT EXISTS"
            " (SELECT 1 FROM access_tokens a WHERE a.grant_id = grants.grant_id)"
            " AND (expires_at <= :now OR NOT EXISTS"
            "      (SELECT 1 FROM refresh_tokens t WHERE t.family_id = grants.grant_id))",
            {"now": now},
        )
    return deleted
