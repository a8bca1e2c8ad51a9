"""The machine's PostgreSQL for the store's tests: found once, and a fresh schema per test.

The server is looked for at 127.0.0.1:5432, database `test`, with trust authentication, as
the role `postgres` and then as the current user (PORTCULLIS_TEST_POSTGRESQL_URL names
another). When none answers, the tests that need it are skipped with the reason, or fail
under CI=true (tests/support.py `service_missing`).

Each test gets a schema of its own with a random name, created before and dropped with
everything in it after, so that runs in parallel never see each other's rows. A store
reaches it through its search_path (`PostgresStore(url, schema=...)`, or `?search_path=`
in a URL given to the command line).
"""

from __future__ import annotations

import getpass
import os
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from authserver.store.postgres import quote_identifier
from tests.support import service_missing

HOST = "127.0.0.1:5432"
DATABASE = "test"

_found: list[str] = []  # the URL that answered, once one has
_refusals: list[str] = []  # why none did, once every candidate was tried


def candidate_urls() -> list[str]:
    chosen = os.environ.get("PORTCULLIS_TEST_POSTGRESQL_URL")
    if chosen:
        return [chosen]
    roles = dict.fromkeys(["postgres", getpass.getuser()])
    return [f"postgresql://{role}@{HOST}/{DATABASE}" for role in roles]


async def postgres_url_or_skip() -> str:
    """The URL of a PostgreSQL that accepts a connection, or the test is skipped (failed
    under CI=true)."""
    if _found:
        return _found[0]
    if not _refusals:
        for url in candidate_urls():
            try:
                conn = await asyncpg.connect(url, timeout=2)
            except Exception as exc:
                _refusals.append(f"{url}: {type(exc).__name__}: {exc}")
                continue
            await conn.close()
            _found.append(url)
            return url
    service_missing("PostgreSQL is not reachable (" + "; ".join(_refusals) + ")")


@asynccontextmanager
async def fresh_schema(url: str) -> AsyncIterator[str]:
    """A new, empty schema, dropped with everything in it when the block ends."""
    name = "portcullis_test_" + secrets.token_hex(6)
    async with admin(url) as conn:
        await conn.execute(f"CREATE SCHEMA {quote_identifier(name)}")
    try:
        yield name
    finally:
        async with admin(url) as conn:
            await conn.execute(f"DROP SCHEMA {quote_identifier(name)} CASCADE")


@asynccontextmanager
async def admin(url: str, schema: str | None = None) -> AsyncIterator[Any]:
    """A connection of its own, outside any store: to look at or interfere with a schema."""
    settings = {"search_path": quote_identifier(schema)} if schema else None
    conn = await asyncpg.connect(url, timeout=5, server_settings=settings)
    try:
        yield conn
    finally:
        await conn.close()
