"""The SQLite store: the conformance suite on a database file, then what only SQLite has
(migrations, WAL, its URL forms, real processes racing and being killed)."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

from authserver.protocol.lifecycle import Code
from authserver.store import open_store
from authserver.store.base import StoreUnavailable
from authserver.store.sqlite import MIGRATIONS, SQLiteStore, load_migrations
from tests.authserver.store_conformance import (
    DAY,
    HOUR,
    REDEEM,
    T0,
    ObservedStoreFactory,
    StoreConformance,
    StoreFactory,
    a_code,
    digest,
    redemption,
    rotate,
    start_family,
)

ROOT = Path(__file__).resolve().parents[2]


class TestSQLiteStore(StoreConformance):
    @pytest.fixture
    def make_store(self, tmp_path: Path) -> StoreFactory:
        path = tmp_path / "authserver.db"
        return lambda: SQLiteStore(path)

    @pytest.fixture
    def make_observed_store(self, tmp_path: Path) -> ObservedStoreFactory:
        return lambda observe: SQLiteStore(tmp_path / "authserver.db", observe=observe)


def applied_migrations(path: Path) -> list[tuple[int, str, float]]:
    with sqlite3.connect(path) as conn:
        return conn.execute(
            "SELECT version, name, applied_at FROM schema_migrations ORDER BY version"
        ).fetchall()


def tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {
            name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }


def write_migrations(directory: Path, files: dict[str, str]) -> Path:
    directory.mkdir(exist_ok=True)
    for old in directory.iterdir():
        old.unlink()
    for name, sql in files.items():
        (directory / name).write_text(sql)
    return directory


async def open_and_close(store: SQLiteStore) -> None:
    await store.open()
    await store.close()


# -- migrations ---------------------------------------------------------------------------


async def test_reopening_the_database_does_not_apply_migrations_again(tmp_path: Path) -> None:
    path = tmp_path / "authserver.db"
    await open_and_close(SQLiteStore(path))
    first = applied_migrations(path)
    shipped = [(m.version, m.name) for m in load_migrations(MIGRATIONS)]
    assert shipped[:2] == [(1, "001_initial.sql"), (2, "002_device_auth_time.sql")]
    assert [(version, name) for version, name, _ in first] == shipped

    await open_and_close(SQLiteStore(path))
    await open_and_close(SQLiteStore(path))
    assert applied_migrations(path) == first


async def test_a_failing_migration_keeps_earlier_ones_and_rolls_its_own_changes_back(
    tmp_path: Path,
) -> None:
    path = tmp_path / "db"
    migrations = write_migrations(
        tmp_path / "migrations",
        {
            "001_a.sql": "CREATE TABLE a (x INTEGER);\n",
            "002_b.sql": "CREATE TABLE b (x INTEGER);\nINSERT INTO nowhere VALUES (1);\n",
        },
    )
    store = SQLiteStore(path, migrations=migrations)
    with pytest.raises(sqlite3.OperationalError, match="nowhere"):
        await store.open()
    assert [version for version, _, _ in applied_migrations(path)] == [1]
    assert tables(path) == {"schema_migrations", "a"}

    # Fixed, it applies on the next open; 001 has no IF NOT EXISTS, so running it twice
    # would fail.
    write_migrations(
        migrations,
        {
            "001_a.sql": "CREATE TABLE a (x INTEGER);\n",
            "002_b.sql": "CREATE TABLE b (x INTEGER);\nINSERT INTO a VALUES (2);\n",
        },
    )
    await open_and_close(store)
    assert [version for version, _, _ in applied_migrations(path)] == [1, 2]
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT x FROM a").fetchall() == [(2,)]


async def test_migrations_apply_in_the_numeric_order_of_their_prefix(tmp_path: Path) -> None:
    path = tmp_path / "db"
    migrations = write_migrations(
        tmp_path / "migrations",
        {
            "10_fill.sql": "INSERT INTO t VALUES ('ten');\n",
            "9_make.sql": "-- the table; 10 fills it\nCREATE TABLE t (x TEXT);\n",
            "README": "not a migration",
        },
    )
    await open_and_close(SQLiteStore(path, migrations=migrations))
    assert [(v, n) for v, n, _ in applied_migrations(path)] == [
        (9, "9_make.sql"),
        (10, "10_fill.sql"),
    ]


async def test_statements_with_inner_semicolons_apply_whole(tmp_path: Path) -> None:
    path = tmp_path / "db"
    migrations = write_migrations(
        tmp_path / "migrations",
        {
            "001_trigger.sql": textwrap.dedent(
                """\
                CREATE TABLE t (x TEXT);  -- a comment; with a semicolon
                CREATE TABLE log (x TEXT);
                CREATE TRIGGER t_log AFTER INSERT ON t BEGIN
                    INSERT INTO log VALUES ('a;b');
                    INSERT INTO log VALUES (new.x);
                END;
                INSERT INTO t VALUES ('c');
                -- trailing comment
                """
            )
        },
    )
    await open_and_close(SQLiteStore(path, migrations=migrations))
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT x FROM log ORDER BY rowid").fetchall() == [("a;b",), ("c",)]


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"initial.sql": "SELECT 1;"}, "NNN_name.sql"),
        ({"1_a.sql": "SELECT 1;", "001_b.sql": "SELECT 2;"}, "share version 1"),
        ({"001_a.sql": "CREATE TABLE a (x INTEGER)\n"}, "unterminated"),
    ],
    ids=["unnumbered", "duplicate-version", "unterminated"],
)
async def test_malformed_migrations_are_refused_before_anything_applies(
    tmp_path: Path, files: dict[str, str], message: str
) -> None:
    path = tmp_path / "db"
    migrations = write_migrations(tmp_path / "migrations", files)
    with pytest.raises(ValueError, match=message):
        await SQLiteStore(path, migrations=migrations).open()
    assert tables(path) <= {"schema_migrations"}


async def test_database_written_by_a_newer_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "authserver.db"
    await open_and_close(SQLiteStore(path))
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO schema_migrations VALUES (999, '999_future.sql', 0)")
    with pytest.raises(RuntimeError, match=r"newer version"):
        await SQLiteStore(path).open()


async def test_stores_opening_a_new_database_at_once_apply_each_migration_once(
    tmp_path: Path,
) -> None:
    path = tmp_path / "authserver.db"
    stores = [SQLiteStore(path) for _ in range(4)]
    await asyncio.gather(*(store.open() for store in stores))
    await asyncio.gather(*(store.close() for store in stores))
    shipped = [m.version for m in load_migrations(MIGRATIONS)]
    assert [version for version, _, _ in applied_migrations(path)] == shipped


async def test_upgrading_to_grants_keeps_families_revocations_and_access_tokens(
    tmp_path: Path,
) -> None:
    # A database as the version before grants left it: families with their revocations
    # beside them, and access tokens recorded under grant ids that may have no family.
    path = tmp_path / "authserver.db"
    before = write_migrations(
        tmp_path / "before",
        {m.name: m.sql for m in load_migrations(MIGRATIONS) if m.version <= 3},
    )
    await open_and_close(SQLiteStore(path, migrations=before))
    with sqlite3.connect(path) as conn:
        conn.executemany(
            "INSERT INTO refresh_families VALUES (?, 'webapp', 'alice', ?, ?, ?)",
            [("fam-live", T0, T0 + 90 * DAY, None), ("fam-gone", T0, T0 + 90 * DAY, T0 + 5)],
        )
        conn.executemany(
            "INSERT INTO refresh_tokens VALUES (?, ?, 'webapp', 'alice', 'openid', 'api',"
            " ?, ?, ?, ?, NULL, NULL)",
            [
                (digest("rt-live"), "fam-live", T0, T0, T0 + 14 * DAY, "active"),
                (digest("rt-gone"), "fam-gone", T0, T0, T0 + 14 * DAY, "revoked"),
            ],
        )
        conn.execute("INSERT INTO grant_revocations VALUES ('c-replayed', ?)", (T0 + 1,))
        conn.executemany(
            "INSERT INTO access_tokens VALUES (?, ?, 'webapp', ?, 0)",
            [
                ("at-live", "fam-live", T0 + 300),
                ("at-replayed", "c-replayed", T0 + 300),
                ("at-code-only", "c-fine", T0 + 300),
            ],
        )

    store = SQLiteStore(path)
    await store.open()
    try:
        live = await store.get_refresh(digest("rt-live"))
        assert live is not None and live.family_expires_at == T0 + 90 * DAY
        gone = await store.get_grant("fam-gone")
        assert gone is not None and gone.revoked_at == T0 + 5
        assert await store.access_token_active("at-live")
        assert await store.access_token_active("at-code-only")
        assert not await store.access_token_active("at-replayed")
        assert await rotate(store, "rt-live", "rt-next", T0 + HOUR, family="fam-live")
        assert await store.revoke_grant("c-fine", T0 + 10)
        assert not await store.access_token_active("at-code-only")
    finally:
        await store.close()
    assert {"refresh_families", "grant_revocations"}.isdisjoint(tables(path))


# -- connection settings and lifecycle -----------------------------------------------------


async def test_database_file_is_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "authserver.db"
    await open_and_close(SQLiteStore(path))
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


async def test_store_refuses_calls_unless_open(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "authserver.db")
    with pytest.raises(RuntimeError, match="not open"):
        await store.save_code(a_code())
    await store.open()
    with pytest.raises(RuntimeError, match="already open"):
        await store.open()
    await store.close()
    await store.close()
    with pytest.raises(RuntimeError, match="not open"):
        await store.get_code(digest("code"))


async def test_missing_directory_fails_to_open_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "authserver.db"
    store = SQLiteStore(path)
    with pytest.raises(sqlite3.OperationalError) as failure:
        await store.open()
    assert any(str(path) in note for note in failure.value.__notes__)
    assert not path.parent.exists()


async def test_waiting_for_another_writers_lock_does_not_block_the_event_loop(
    tmp_path: Path,
) -> None:
    path = tmp_path / "authserver.db"
    store = SQLiteStore(path)
    await store.open()
    writer = sqlite3.connect(path, isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")
        save = asyncio.create_task(store.save_code(a_code()))
        # On the event loop, the save would hold the loop until the busy timeout ran out
        # and then fail; on the worker it waits while the loop carries on.
        await asyncio.sleep(0.05)
        assert not save.done()
        writer.execute("COMMIT")
        await save
        assert await store.get_code(digest("code")) == a_code()
    finally:
        writer.close()
        await store.close()


async def test_a_store_that_cannot_write_raises_unavailable_changes_nothing_and_recovers(
    tmp_path: Path,
) -> None:
    path = tmp_path / "authserver.db"
    store = SQLiteStore(path, busy_timeout=timedelta(milliseconds=50))
    await store.open()
    await store.save_code(a_code())
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        # Another process holds the database: every write times out waiting for it.
        blocker.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreUnavailable):
            await store.redeem_code(digest("code"), REDEEM, redemption())
        blocker.execute("ROLLBACK")
        assert await store.get_code(digest("code")) == a_code()
        assert await store.get_grant("fam-1") is None
        assert await store.redeem_code(digest("code"), REDEEM, redemption())
    finally:
        blocker.close()
        await store.close()


# -- storage URLs ----------------------------------------------------------------------------


async def test_sqlite_file_url_opens_that_file(tmp_path: Path) -> None:
    path = tmp_path / "authserver.db"
    store = open_store(f"sqlite://{path}")
    await store.open()
    await store.save_code(a_code())
    await store.close()
    assert path.is_file()
    again = SQLiteStore(path)
    await again.open()
    try:
        assert await again.get_code(digest("code")) == a_code()
    finally:
        await again.close()


async def test_sqlite_memory_url_keeps_data_only_in_that_store() -> None:
    store, stranger = open_store("sqlite://:memory:"), open_store("sqlite://:memory:")
    await store.open()
    await stranger.open()
    try:
        await store.save_code(a_code())
        assert await stranger.get_code(digest("code")) is None
        assert await store.get_code(digest("code")) == a_code()
    finally:
        await store.close()
        await stranger.close()
    assert not Path(":memory:").exists()


@pytest.mark.parametrize(
    "url", ["mysql://db/auth", "sqlite:///", "sqlite:/auth.db", "sqlite://:memory", "auth.db"]
)
def test_other_storage_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="storage URL"):
        open_store(url)


# -- real processes ----------------------------------------------------------------------------

RACER = """
import asyncio, sys
from authserver.store.sqlite import SQLiteStore
from tests.authserver.store_conformance import HOUR, REDEEM, T0, digest, redemption, rotate

async def main(path, name):
    store = SQLiteStore(path)
    await store.open()
    print("ready", flush=True)
    sys.stdin.readline()
    issuance = redemption("g-" + name, "at-" + name, "rt-code-" + name, T0 + 1)
    redeemed = await store.redeem_code(digest("code"), REDEEM, issuance)
    rotated = await rotate(store, "rt-0", "rt-" + name, T0 + HOUR)
    print(redeemed, rotated, flush=True)
    await store.close()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""

WRITER = """
import asyncio, itertools, sys
from authserver.store.sqlite import SQLiteStore
from tests.authserver.store_conformance import start_family

async def main(path):
    store = SQLiteStore(path)
    await store.open()
    for n in itertools.count():
        await start_family(store, f"rt-{n}", f"fam-{n}")
        print(n, flush=True)

asyncio.run(main(sys.argv[1]))
"""


async def python(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        *args,
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )


async def test_processes_racing_on_one_database_redeem_and_rotate_exactly_once(
    tmp_path: Path,
) -> None:
    path = tmp_path / "authserver.db"
    store = SQLiteStore(path)
    await store.open()
    await store.save_code(a_code())
    await start_family(store, "rt-0")
    await store.close()

    racers = [await python(RACER, str(path), f"p{i}") for i in range(4)]
    for racer in racers:
        assert racer.stdout is not None
        assert await asyncio.wait_for(racer.stdout.readline(), 10) == b"ready\n"
    for racer in racers:
        assert racer.stdin is not None
        racer.stdin.write(b"go\n")
        await racer.stdin.drain()
    outputs = [await asyncio.wait_for(racer.communicate(), 10) for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0, 0, 0]

    results = [stdout.decode().split() for stdout, _ in outputs]
    assert sorted(redeemed for redeemed, _ in results) == ["False", "False", "False", "True"]
    assert sorted(rotated for _, rotated in results) == ["False", "False", "False", "True"]


async def test_refresh_token_saved_before_a_kill_9_is_there_after_reopening(
    tmp_path: Path,
) -> None:
    path = tmp_path / "authserver.db"
    writer = await python(WRITER, str(path))
    assert writer.stdout is not None
    saved: list[int] = []
    while len(saved) < 20:
        line = await asyncio.wait_for(writer.stdout.readline(), 10)
        assert line, "the writer died before it was killed"
        saved.append(int(line))
    # Killed while it writes on: no close, no checkpoint, the WAL is all there is.
    os.kill(writer.pid, signal.SIGKILL)
    await writer.wait()
    assert writer.returncode == -signal.SIGKILL
    saved += [int(line) for line in (await writer.stdout.read()).split()]
    assert Path(f"{path}-wal").stat().st_size > 0

    store = SQLiteStore(path)
    await store.open()
    try:
        for n in saved:
            record = await store.get_refresh(digest(f"rt-{n}"))
            assert record is not None and record.family_id == f"fam-{n}", n
            code = await store.get_code(digest(f"code-of-fam-{n}"))
            assert code is not None and code.state == Code.CONSUMED, n
    finally:
        await store.close()


OPENER = """
import asyncio, sqlite3, sys
from authserver.store.sqlite import SQLiteStore

async def main(path):
    sys.stdin.readline()
    store = SQLiteStore(path)
    await store.open()
    await store.close()
    with sqlite3.connect(path) as conn:
        print(conn.execute("PRAGMA journal_mode").fetchone()[0], flush=True)

asyncio.run(main(sys.argv[1]))
"""


async def test_processes_opening_one_new_database_at_once_all_succeed(tmp_path: Path) -> None:
    # Replicas (or the CLI beside a server) starting together: switching the new file to WAL
    # needs an exclusive lock, and SQLite does not wait for it by itself.
    for attempt in range(5):
        path = tmp_path / f"authserver-{attempt}.db"
        openers = [await python(OPENER, str(path)) for _ in range(6)]
        for opener in openers:
            assert opener.stdin is not None
            opener.stdin.write(b"go\n")
            await opener.stdin.drain()
        outputs = [await asyncio.wait_for(opener.communicate(), 20) for opener in openers]
        assert [opener.returncode for opener in openers] == [0] * 6
        assert [out for out, _ in outputs] == [b"wal\n"] * 6
        shipped = [m.version for m in load_migrations(MIGRATIONS)]
        assert [version for version, _, _ in applied_migrations(path)] == shipped


async def test_a_call_made_just_before_the_store_closes_is_answered(tmp_path: Path) -> None:
    # Made, then the store closed before the loop turned: the worker had not been started
    # for it yet, and the call still runs on the open connection before it is closed.
    store = SQLiteStore(tmp_path / "authserver.db")
    await store.open()
    pending = asyncio.ensure_future(store.get_client("nobody"))
    await asyncio.sleep(0)  # the call is queued; the worker's start is due
    await store.close()
    assert await pending is None


async def test_the_email_key_migration_fills_in_the_users_there_are(tmp_path: Path) -> None:
    """Migration 016 gives the users stored before it their email key, so a federated
    sign-in finds them by address; a claim that is no string gets none."""
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    for migration in load_migrations(MIGRATIONS):
        if migration.version < 16:
            (earlier / migration.name).write_text(migration.sql)
    path = tmp_path / "store.db"
    store = SQLiteStore(path, migrations=earlier)
    await store.open()
    await store.close()
    with sqlite3.connect(path) as conn:
        for subject, claims in (
            ("s1", '{"email": "Pat@Example.COM", "email_verified": true}'),
            ("s2", '{"email": "pat@example.com"}'),
            ("s3", '{"email": 7}'),
        ):
            conn.execute(
                "INSERT INTO users (subject, username, password_hash, claims, roles, disabled,"
                " managed_by, created_at, updated_at, version)"
                " VALUES (?, ?, '', ?, '[]', 0, 'api', 0, 0, 1)",
                (subject, subject, claims),
            )
    store = SQLiteStore(path)
    await store.open()
    try:
        found = await store.users_with_email("PAT@example.com")
        assert [u.subject for u in found] == ["s1", "s2"]
        assert await store.users_with_email("7") == []
    finally:
        await store.close()
