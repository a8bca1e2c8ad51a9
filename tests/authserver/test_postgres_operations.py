"""Operating the PostgreSQL storage: `migrate` failing says why in one line and exits 1, a
migration waiting too long gives up within migration_timeout, and `storage_pool` is kept
until a restart when the file changes under a running server.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from authserver.app import AuthServer
from authserver.settings import load as load_settings
from authserver.store.postgres import lock_id
from tests.authserver.conftest import default_config
from tests.authserver.postgres_support import admin, fresh_schema, postgres_url_or_skip
from tests.authserver.process_support import ROOT, write_config
from tests.faults_support import PrivatePostgres


@pytest.fixture
async def postgres_url() -> str:
    return await postgres_url_or_skip()


@pytest.fixture
async def schema(postgres_url: str) -> AsyncIterator[str]:
    async with fresh_schema(postgres_url) as name:
        yield name


def migrate(tmp_path: Path, storage: str, **pool: str) -> subprocess.CompletedProcess[str]:
    config = default_config()
    config["storage"] = storage
    config["storage_pool"] = {"connect_timeout": "2s", **pool}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "authserver",
            "migrate",
            "--config",
            str(write_config(tmp_path, config)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def assert_one_line(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("cannot migrate the store postgresql://"), lines
    for word in words:
        assert word in lines[0], lines


async def test_migrate_with_an_unknown_role_or_database_says_so_in_one_line(
    tmp_path: Path, postgres_url: str
) -> None:
    host = postgres_url.split("@", 1)[1].split("/", 1)[0]
    role = await asyncio.to_thread(migrate, tmp_path, f"postgresql://no_such_role_here@{host}/test")
    assert_one_line(role, 'role "no_such_role_here" does not exist')
    database = await asyncio.to_thread(
        migrate, tmp_path, postgres_url.rsplit("/", 1)[0] + "/no_such_database_here"
    )
    assert_one_line(database, 'database "no_such_database_here" does not exist')


@pytest.mark.fault
async def test_migrate_with_a_wrong_password_says_so_without_showing_it(tmp_path: Path) -> None:
    with PrivatePostgres(password="the-right-one") as server:
        await asyncio.to_thread(server.start)
        good = f"postgresql://postgres:the-right-one@127.0.0.1:{server.port}/postgres"
        wrong = f"postgresql://postgres:not-the-one@127.0.0.1:{server.port}/postgres"
        result = await asyncio.to_thread(migrate, tmp_path, wrong)
        assert_one_line(result, "password authentication failed", "postgres:***@")
        assert "not-the-one" not in result.stderr + result.stdout
        ok = await asyncio.to_thread(migrate, tmp_path, good)
        assert ok.returncode == 0, ok.stderr


async def test_a_migration_waiting_for_another_replicas_lock_gives_up_within_its_timeout(
    tmp_path: Path, postgres_url: str, schema: str
) -> None:
    async with admin(postgres_url) as other, other.transaction():
        # Another replica in the middle of a migration of this schema.
        await other.execute("SELECT pg_advisory_xact_lock($1)", lock_id("migrations", schema))
        started = time.monotonic()
        result = await asyncio.to_thread(
            migrate, tmp_path, f"{postgres_url}?search_path={schema}", migration_timeout="1s"
        )
        took = time.monotonic() - started
    assert_one_line(result, "statement timeout")
    assert took < 10, took  # the process's start included; the wait itself is 1 s
    # Once the lock is free, the same command applies them.
    again = await asyncio.to_thread(migrate, tmp_path, f"{postgres_url}?search_path={schema}")
    assert again.returncode == 0, again.stderr


async def test_a_changed_storage_pool_waits_for_a_restart_with_a_warning(
    tmp_path: Path, postgres_url: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = default_config()
    config["storage"] = f"{postgres_url}?search_path={schema}"
    config["storage_pool"] = {"max_size": 3}
    path = write_config(tmp_path, config)
    server = AuthServer(load_settings(str(path)))
    await server.open()
    try:
        text = yaml.safe_load(path.read_text())
        text["storage_pool"] = {"max_size": 7, "command_timeout": "9s"}
        text["lifetimes"] = {"access_token": "2m"}  # a change that applies at once
        path.write_text(yaml.safe_dump(text))
        with caplog.at_level(logging.WARNING, logger="portcullis.authserver"):
            assert await server.reload()
        assert server.settings.lifetimes.access_token.total_seconds() == 120
        assert server.settings.storage_pool.max_size == 3
        assert server.settings.storage_pool.command_timeout.total_seconds() == 5
        warned = [
            r
            for r in caplog.records
            if r.getMessage() == "a changed setting takes effect only after a restart"
        ]
        assert [getattr(r, "setting", None) for r in warned] == ["storage_pool"]
    finally:
        await server.close()
