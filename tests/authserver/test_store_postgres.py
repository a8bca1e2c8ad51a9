"""The PostgreSQL store: the conformance suite in a schema of its own, then what only
PostgreSQL has (migrations under an advisory lock, the pool and its timeouts, a server that
is unreachable, silent or drops connections, cancelled calls, its URL and settings, the
`migrate` command and a server answering 503 when the database stalls).

Needs the machine's PostgreSQL (tests/authserver/postgres_support.py): skipped with the
reason when it is not reachable, failed under CI=true.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from authserver import settings as authserver_settings
from authserver.app import pool_limits
from authserver.protocol.lifecycle import Code, Refresh
from authserver.protocol.throttle import Cap
from authserver.settings import StoragePool
from authserver.store import open_store
from authserver.store.base import PoolLimits, StoreUnavailable
from authserver.store.migration_files import load_migrations
from authserver.store.postgres import MIGRATIONS, PostgresStore
from portcullis.yamlconf import ConfigError
from tests.authserver.conftest import (
    KEY_SECRET,
    authorize_code,
    default_config,
    exchange_code,
    post_token,
)
from tests.authserver.postgres_support import admin, fresh_schema, postgres_url_or_skip
from tests.authserver.process_support import write_config
from tests.authserver.store_conformance import (
    HOUR,
    MINUTE,
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
# Small enough that many tests in parallel stay far below the server's max_connections.
POOL = PoolLimits(min_size=1, max_size=4)
QUICK = PoolLimits(
    min_size=1,
    max_size=1,
    connect_timeout=timedelta(milliseconds=500),
    command_timeout=timedelta(milliseconds=500),
    acquire_timeout=timedelta(milliseconds=200),
)


@pytest.fixture
async def postgres_url() -> str:
    return await postgres_url_or_skip()


@pytest.fixture
async def schema(postgres_url: str) -> AsyncIterator[str]:
    async with fresh_schema(postgres_url) as name:
        yield name


class TestPostgresStore(StoreConformance):
    @pytest.fixture
    def make_store(self, postgres_url: str, schema: str) -> StoreFactory:
        return lambda: PostgresStore(postgres_url, POOL, schema=schema)

    @pytest.fixture
    def make_observed_store(self, postgres_url: str, schema: str) -> ObservedStoreFactory:
        return lambda observe: PostgresStore(postgres_url, POOL, schema=schema, observe=observe)


async def applied_migrations(url: str, schema: str) -> list[tuple[int, str]]:
    async with admin(url, schema) as conn:
        rows = await conn.fetch("SELECT version, name FROM schema_migrations ORDER BY version")
    return [(row["version"], row["name"]) for row in rows]


async def tables(url: str, schema: str) -> set[str]:
    async with admin(url) as conn:
        rows = await conn.fetch(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = $1", schema
        )
    return {row["table_name"] for row in rows}


def write_migrations(directory: Path, files: dict[str, str]) -> Path:
    directory.mkdir(exist_ok=True)
    for old in directory.iterdir():
        old.unlink()
    for name, sql in files.items():
        (directory / name).write_text(sql)
    return directory


async def open_and_close(store: PostgresStore) -> None:
    await store.open()
    await store.close()


# -- migrations ---------------------------------------------------------------------------


async def test_opening_applies_the_shipped_migrations_once(postgres_url: str, schema: str) -> None:
    await open_and_close(PostgresStore(postgres_url, POOL, schema=schema))
    shipped = [(m.version, m.name) for m in load_migrations(MIGRATIONS)]
    assert shipped[0] == (1, "001_initial.sql")
    assert await applied_migrations(postgres_url, schema) == shipped
    await open_and_close(PostgresStore(postgres_url, POOL, schema=schema))
    assert await applied_migrations(postgres_url, schema) == shipped
    assert {"codes", "grants", "refresh_tokens", "failures"} <= await tables(postgres_url, schema)


async def test_stores_opening_a_fresh_schema_at_once_apply_each_migration_once(
    postgres_url: str, schema: str, tmp_path: Path
) -> None:
    # Neither migration can run twice unnoticed: the CREATE would fail, the INSERT would
    # leave two rows.
    migrations = write_migrations(
        tmp_path / "migrations",
        {
            "001_a.sql": "CREATE TABLE a (x integer);\nSELECT pg_sleep(0.05);\n"
            "INSERT INTO a VALUES (1);\n",
            "002_b.sql": "INSERT INTO a VALUES (2);\n",
        },
    )
    stores = [
        PostgresStore(postgres_url, POOL, schema=schema, migrations=migrations) for _ in range(6)
    ]
    await asyncio.gather(*(store.open() for store in stores))
    await asyncio.gather(*(store.close() for store in stores))
    assert await applied_migrations(postgres_url, schema) == [(1, "001_a.sql"), (2, "002_b.sql")]
    async with admin(postgres_url, schema) as conn:
        assert [row["x"] for row in await conn.fetch("SELECT x FROM a ORDER BY x")] == [1, 2]


async def test_stores_opening_a_fresh_schema_with_the_shipped_migrations_all_work(
    postgres_url: str, schema: str
) -> None:
    stores = [PostgresStore(postgres_url, POOL, schema=schema) for _ in range(4)]
    await asyncio.gather(*(store.open() for store in stores))
    try:
        shipped = [(m.version, m.name) for m in load_migrations(MIGRATIONS)]
        assert await applied_migrations(postgres_url, schema) == shipped
        await stores[1].save_code(a_code())
        assert await stores[3].get_code(digest("code")) == a_code()
    finally:
        await asyncio.gather(*(store.close() for store in stores))


async def test_a_failing_migration_keeps_earlier_ones_and_leaves_nothing_of_itself(
    postgres_url: str, schema: str, tmp_path: Path
) -> None:
    migrations = write_migrations(
        tmp_path / "migrations",
        {
            "001_a.sql": "CREATE TABLE a (x integer);\n",
            "002_b.sql": "CREATE TABLE b (x integer);\nINSERT INTO nowhere VALUES (1);\n",
        },
    )
    store = PostgresStore(postgres_url, POOL, schema=schema, migrations=migrations)
    with pytest.raises(asyncpg.UndefinedTableError, match="nowhere"):
        await store.open()
    assert await applied_migrations(postgres_url, schema) == [(1, "001_a.sql")]
    assert await tables(postgres_url, schema) == {"schema_migrations", "a"}

    write_migrations(
        migrations,
        {
            "001_a.sql": "CREATE TABLE a (x integer);\n",
            "002_b.sql": "CREATE TABLE b (x integer);\nINSERT INTO a VALUES (2);\n",
        },
    )
    await open_and_close(store)
    assert [v for v, _ in await applied_migrations(postgres_url, schema)] == [1, 2]


async def test_a_schema_written_by_a_newer_version_is_refused(
    postgres_url: str, schema: str
) -> None:
    await open_and_close(PostgresStore(postgres_url, POOL, schema=schema))
    async with admin(postgres_url, schema) as conn:
        await conn.execute("INSERT INTO schema_migrations VALUES (999, '999_future.sql', 0)")
    with pytest.raises(RuntimeError, match="newer version"):
        await PostgresStore(postgres_url, POOL, schema=schema).open()


async def test_a_schema_that_does_not_exist_is_named_in_the_error(postgres_url: str) -> None:
    store = PostgresStore(postgres_url, POOL, schema="portcullis_test_missing")
    with pytest.raises(RuntimeError, match="portcullis_test_missing"):
        await store.open()


# -- lifecycle ------------------------------------------------------------------------------


async def test_store_refuses_calls_unless_open(postgres_url: str, schema: str) -> None:
    store = PostgresStore(postgres_url, POOL, schema=schema)
    with pytest.raises(RuntimeError, match="not open"):
        await store.save_code(a_code())
    await store.open()
    with pytest.raises(RuntimeError, match="already open"):
        await store.open()
    await store.close()
    await store.close()
    with pytest.raises(RuntimeError, match="not open"):
        await store.get_code(digest("code"))


async def test_the_pool_never_holds_more_than_max_size_connections(
    postgres_url: str, schema: str
) -> None:
    name = "portcullis-test-" + schema
    store = PostgresStore(postgres_url, POOL, schema=schema, application_name=name)
    await store.open()
    try:
        await store.save_code(a_code())
        results = await asyncio.gather(
            *(
                store.redeem_code(digest("code"), REDEEM, redemption(f"g-{i}", f"at-{i}", None))
                for i in range(40)
            )
        )
        assert results.count(True) == 1
        async with admin(postgres_url) as conn:
            count = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name
            )
        assert 1 <= count <= POOL.max_size
    finally:
        await store.close()


# -- an unreachable, silent or failing server ------------------------------------------------


async def until_waiting_on_locks(conn: Any, application_name: str, count: int) -> None:
    """Poll until `count` sessions of the store wait for a lock another session holds."""
    async with asyncio.timeout(10):
        while True:
            waiting = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE application_name = $1 AND wait_event_type = 'Lock'",
                application_name,
            )
            if waiting >= count:
                return
            await asyncio.sleep(0.01)


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A port that accepts TCP connections and never says a word."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"postgresql://postgres@127.0.0.1:{listener.getsockname()[1]}/test"


async def test_a_refused_connection_raises_unavailable(refused_port: int) -> None:
    store = PostgresStore(f"postgresql://postgres@127.0.0.1:{refused_port}/test", QUICK)
    with pytest.raises(StoreUnavailable, match="PostgreSQL"):
        await asyncio.wait_for(store.open(), 10)
    with pytest.raises(RuntimeError, match="not open"):
        await store.get_code(digest("code"))


async def test_a_server_that_never_answers_raises_unavailable_after_the_connect_timeout(
    silent_server: str,
) -> None:
    store = PostgresStore(silent_server, QUICK)
    # Without the connect timeout the open would wait for ever; wait_for only bounds the
    # test, far above the 500 ms configured.
    with pytest.raises(StoreUnavailable, match="TimeoutError"):
        await asyncio.wait_for(store.open(), 10)


async def test_a_statement_stuck_on_a_lock_and_a_pool_with_no_free_connection_are_unavailable(
    postgres_url: str, schema: str
) -> None:
    name = "portcullis-test-" + schema
    store = PostgresStore(postgres_url, QUICK, schema=schema, application_name=name)
    await store.open()
    try:
        await store.save_code(a_code())
        async with (
            admin(postgres_url, schema) as blocker,
            admin(postgres_url) as observer,
            blocker.transaction(),
        ):
            # Another process holds the code's row: the redemption waits on it, holding the
            # pool's only connection.
            await blocker.execute("SELECT 1 FROM codes FOR UPDATE")
            redeem = asyncio.create_task(store.redeem_code(digest("code"), REDEEM, redemption()))
            await until_waiting_on_locks(observer, name, 1)
            with pytest.raises(StoreUnavailable, match="TimeoutError"):
                await store.get_code(digest("code"))  # no connection within acquire_timeout
            with pytest.raises(StoreUnavailable, match="TimeoutError"):
                await redeem  # its statement cancelled after command_timeout
        # Nothing changed, and the store works again.
        assert await store.get_code(digest("code")) == a_code()
        assert await store.get_grant("fam-1") is None
        assert await store.redeem_code(digest("code"), REDEEM, redemption())
    finally:
        await store.close()


async def test_connections_lost_mid_call_raise_unavailable_and_the_store_recovers(
    postgres_url: str, schema: str
) -> None:
    name = "portcullis-test-" + schema
    store = PostgresStore(postgres_url, POOL, schema=schema, application_name=name)
    await store.open()
    try:
        await store.save_code(a_code())
        async with (
            admin(postgres_url, schema) as blocker,
            admin(postgres_url) as observer,
            blocker.transaction(),
        ):
            await blocker.execute("SELECT 1 FROM codes FOR UPDATE")
            redeem = asyncio.create_task(store.redeem_code(digest("code"), REDEEM, redemption()))
            await until_waiting_on_locks(observer, name, 1)
            # An administrator (or a failover) ends the store's sessions.
            ended = await observer.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = $1",
                name,
            )
            assert ended >= 1
            with pytest.raises(StoreUnavailable):
                await redeem
        # The pool replaces what it lost; the interrupted redemption left nothing.
        for _ in range(POOL.max_size):
            # A call on a connection the server ended may fail, as StoreUnavailable only.
            with contextlib.suppress(StoreUnavailable):
                await store.get_code(digest("code"))
        assert await store.get_code(digest("code")) == a_code()
        assert await store.redeem_code(digest("code"), REDEEM, redemption())
    finally:
        await store.close()


async def test_cancelled_calls_commit_whole_or_not_at_all_and_return_their_connections(
    postgres_url: str, schema: str
) -> None:
    store = PostgresStore(postgres_url, POOL, schema=schema)
    await store.open()
    try:
        codes = [a_code(f"code-{i}") for i in range(30)]
        for code in codes:
            await store.save_code(code)
        tasks = [
            asyncio.create_task(
                store.redeem_code(
                    code.code_hash, REDEEM, redemption(f"g-{i}", f"at-{i}", f"rt-{i}")
                )
            )
            for i, code in enumerate(codes)
        ]
        # Cancelled at staggered moments: before, during and after their transactions.
        for i, task in enumerate(tasks):
            await asyncio.sleep(0.001 * (i % 5))
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for i, code in enumerate(codes):
            stored = await store.get_code(code.code_hash)
            grant = await store.get_grant(f"g-{i}")
            refresh = await store.get_refresh(digest(f"rt-{i}"))
            assert stored is not None
            if stored.state == Code.CONSUMED:
                assert grant is not None and refresh is not None
            else:
                assert grant is None and refresh is None
        # Every connection came back to the pool: more calls at once than it holds work.
        await asyncio.gather(*(store.get_code(code.code_hash) for code in codes))
    finally:
        await asyncio.wait_for(store.close(), 10)


async def test_throttle_reservations_from_two_stores_never_exceed_the_limit(
    postgres_url: str, schema: str
) -> None:
    # Keys with no counter yet: nothing to lock but the advisory lock on each key.
    stores = [PostgresStore(postgres_url, POOL, schema=schema) for _ in range(2)]
    await asyncio.gather(*(store.open() for store in stores))
    try:
        rules = [Cap("login:alice", 3, MINUTE), Cap("login:ip:192.0.2.1", 5, MINUTE)]
        results = await asyncio.gather(
            *(
                stores[i % 2].reserve_attempt(list(reversed(rules)) if i % 3 else rules, T0)
                for i in range(24)
            )
        )
        assert sum(result is None for result in results) == 3
    finally:
        await asyncio.gather(*(store.close() for store in stores))


async def test_a_revocation_arriving_while_a_rotation_commits_revokes_the_successor(
    postgres_url: str, schema: str
) -> None:
    # The interleaving the racing test of the suite only hits by chance, made certain: the
    # rotation has rotated rt-0 and waits, inside its transaction, to insert its access
    # token (another session holds that jti); the revocation comes in then.
    name = "portcullis-test-" + schema
    store = PostgresStore(postgres_url, POOL, schema=schema, application_name=name)
    await store.open()
    try:
        await start_family(store, "rt-0", "fam-1")
        # The observer reads pg_stat_activity outside the blocker's transaction, which
        # would see one snapshot of it.
        async with admin(postgres_url, schema) as blocker, admin(postgres_url) as observer:
            holding = blocker.transaction()
            await holding.start()
            await blocker.execute(
                "INSERT INTO access_tokens (jti, expires_at) VALUES ('at-rt-1', 0)"
            )
            rotation = asyncio.create_task(rotate(store, "rt-0", "rt-1", T0 + HOUR))
            await until_waiting_on_locks(observer, name, 1)
            revocation = asyncio.create_task(store.revoke_grant("fam-1", T0 + HOUR))
            await until_waiting_on_locks(observer, name, 2)
            await holding.rollback()
        assert await rotation
        assert await revocation
        successor = await store.get_refresh(digest("rt-1"))
        assert successor is not None and successor.state == Refresh.REVOKED
        assert not await store.access_token_active("at-rt-1")
    finally:
        await store.close()


# -- storage URL and settings ----------------------------------------------------------------


@pytest.mark.parametrize(
    "url", ["postgresql://portcullis@db/auth", "postgres://db:5433/auth?sslmode=require"]
)
def test_postgresql_urls_name_the_postgres_backend(url: str) -> None:
    store = open_store(url, PoolLimits(max_size=3))
    assert isinstance(store, PostgresStore)
    assert store.url == url


STORAGE = "storage: postgresql://portcullis@db/auth\n"


def settings_text(extra: str, storage: str = STORAGE) -> str:
    # On PostgreSQL the keys live in the database, sealed; on SQLite in a directory.
    keys = (
        f"keys: {{encryption_key: {KEY_SECRET}}}\n"
        if "postgresql://" in storage
        else "keys: {dir: /var/lib/portcullis/keys}\n"
    )
    return "issuer: https://auth.example.com\n" + storage + keys + extra


def test_storage_pool_settings_are_read_with_their_defaults() -> None:
    settings = authserver_settings.load_text(
        settings_text("storage_pool: {max_size: 20, command_timeout: 2s}\n")
    )
    assert settings.storage_pool == replace(
        StoragePool(), max_size=20, command_timeout=timedelta(seconds=2)
    )
    assert authserver_settings.load_text(settings_text("")).storage_pool == StoragePool()


def test_the_storage_pool_settings_are_the_stores_pool_limits() -> None:
    assert pool_limits(StoragePool()) == PoolLimits()  # the same defaults
    settings = authserver_settings.load_text(
        settings_text("storage_pool: {min_size: 2, max_size: 20, acquire_timeout: 1s}\n")
    )
    assert pool_limits(settings.storage_pool) == PoolLimits(
        min_size=2, max_size=20, acquire_timeout=timedelta(seconds=1)
    )


@pytest.mark.parametrize(
    ("extra", "storage", "message"),
    [
        ("storage_pool: {min_size: 5, max_size: 2}\n", STORAGE, "min_size: exceeds max_size"),
        ("storage_pool: {max_size: 0}\n", STORAGE, "max_size"),
        ("storage_pool: {connect_timeout: 0}\n", STORAGE, "connect_timeout: must be more than 0s"),
        ("storage_pool: {command_timeout: 5}\n", STORAGE, "not a duration"),
        ("storage_pool: {pool_size: 5}\n", STORAGE, "pool_size"),
        (
            "storage_pool: {max_size: 5}\n",
            "storage: sqlite:///var/lib/portcullis/authserver.db\n",
            "only a postgresql:// storage has a pool",
        ),
    ],
    ids=["min-above-max", "empty", "zero-timeout", "bare-number", "unknown-key", "sqlite"],
)
def test_bad_storage_pool_settings_are_reported_with_their_line(
    extra: str, storage: str, message: str
) -> None:
    with pytest.raises(ConfigError) as failure:
        authserver_settings.load_text(settings_text(extra, storage), "authserver.yaml")
    problems = [str(problem) for problem in failure.value.problems]
    assert any(p.startswith("authserver.yaml:4:") and message in p for p in problems), problems


# -- the command line and a running server ---------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "authserver", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_migrate_command_applies_the_migrations_once(
    postgres_url: str, schema: str, tmp_path: Path
) -> None:
    config = default_config()
    config["storage"] = f"{postgres_url}?search_path={schema}"
    path = write_config(tmp_path, config)

    first = await asyncio.to_thread(cli, "migrate", "--config", str(path))
    assert first.returncode == 0, first.stderr
    assert "every migration is applied" in first.stdout
    assert '"migration applied"' in first.stderr
    shipped = [(m.version, m.name) for m in load_migrations(MIGRATIONS)]
    assert await applied_migrations(postgres_url, schema) == shipped

    again = await asyncio.to_thread(cli, "migrate", "--config", str(path))
    assert again.returncode == 0, again.stderr
    assert '"migration applied"' not in again.stderr
    assert await applied_migrations(postgres_url, schema) == shipped


async def test_migrate_command_reports_an_unreachable_database(
    tmp_path: Path, refused_port: int
) -> None:
    config = default_config()
    config["storage"] = f"postgresql://postgres@127.0.0.1:{refused_port}/test"
    config["storage_pool"] = {"connect_timeout": "1s"}
    result = await asyncio.to_thread(
        cli, "migrate", "--config", str(write_config(tmp_path, config))
    )
    assert result.returncode == 1
    assert "cannot migrate the store" in result.stderr


async def test_migrate_command_on_sqlite_creates_the_database(tmp_path: Path) -> None:
    path = write_config(tmp_path, default_config())
    result = await asyncio.to_thread(cli, "migrate", "--config", str(path))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "authserver.db").exists()


async def test_a_server_on_postgresql_issues_tokens_and_answers_503_while_the_database_stalls(
    postgres_url: str, schema: str, start_authserver: Any, http: Any
) -> None:
    config = default_config()
    config["storage"] = f"{postgres_url}?search_path={schema}"
    config["storage_pool"] = {"max_size": 2, "command_timeout": "500ms"}
    server = await start_authserver(config)

    status, tokens = await exchange_code(http, server, await authorize_code(http, server))
    assert status == 200, tokens

    refresh = {
        "grant_type": "refresh_token",
        "refresh_token": tokens["refresh_token"],
        "client_id": "spa",
    }
    async with admin(postgres_url, schema) as blocker, blocker.transaction():
        # Every refresh token locked by another process: the rotation cannot finish.
        await blocker.execute("SELECT 1 FROM refresh_tokens FOR UPDATE")
        status, body, _ = await post_token(http, server, refresh)
    assert status == 503
    assert body["error"] == "temporarily_unavailable"
    # The database free again, the same refresh token rotates: the failed attempt left no
    # trace that would make it look reused.
    status, body, _ = await post_token(http, server, refresh)
    assert status == 200, body


async def test_the_email_key_migration_fills_in_the_users_there_are(
    postgres_url: str, schema: str, tmp_path: Path
) -> None:
    """Migration 013 gives the users stored before it their email key, so a federated
    sign-in finds them by address; claims jsonb cannot read (an escaped NUL) get none and
    do not stop the migration."""
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    for migration in load_migrations(MIGRATIONS):
        if migration.version < 13:
            (earlier / migration.name).write_text(migration.sql)
    await open_and_close(PostgresStore(postgres_url, POOL, schema=schema, migrations=earlier))
    async with admin(postgres_url, schema) as conn:
        for subject, claims in (
            ("s1", '{"email": "Pat@Example.COM", "email_verified": true}'),
            ("s2", '{"email": "pat@example.com", "name": "x\\u0000y"}'),
            ("s3", '{"email": 7}'),
        ):
            await conn.execute(
                "INSERT INTO users (subject, username, password_hash, claims, roles, disabled,"
                " managed_by, created_at, updated_at, version)"
                " VALUES ($1, $1, '', $2, '[]', false, 'api', 0, 0, 1)",
                subject,
                claims,
            )
    store = PostgresStore(postgres_url, POOL, schema=schema)
    await store.open()
    try:
        assert [u.subject for u in await store.users_with_email("PAT@example.com")] == ["s1"]
        assert await store.users_with_email("7") == []
    finally:
        await store.close()
