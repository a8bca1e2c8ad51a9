"""Persistence of the authorization server: the Store protocol and its backends.

base.py holds the protocol and its records; each backend implements it in its own module
with its own hand-written SQL and migrations (migrations/<backend>/NNN_name.sql). The rest
of the server depends on base.py only; `open_store` turns the configured `storage` URL into
a backend, imported on demand so that importing the protocol never loads a driver.
"""

from __future__ import annotations

from authserver.store.base import PoolLimits, Store, StoreObserver, unobserved

SQLITE_MEMORY_URL = "sqlite://:memory:"
SQLITE_FILE_PREFIX = "sqlite:///"


def open_store(
    url: str, pool: PoolLimits | None = None, observe: StoreObserver = unobserved
) -> Store:
    """The backend a storage URL names, not opened yet: the caller awaits `open()`.

    `sqlite:///var/lib/portcullis/authserver.db` names a file by its absolute path (what
    follows `sqlite://`), `sqlite://:memory:` a private in-memory database that lives as
    long as the store is open. `postgresql://user:password@host:port/database` (or
    `postgres://`, with libpq's query parameters such as `sslmode`) names a PostgreSQL
    database, reached through a pool of connections bounded by `pool`; SQLite has none.
    `observe` is told the name and the duration of every call the store makes.
    """
    if url == SQLITE_MEMORY_URL:
        from authserver.store.sqlite import SQLiteStore

        return SQLiteStore(":memory:", observe=observe)
    if url.startswith(SQLITE_FILE_PREFIX):
        path = url[len("sqlite://") :]
        if path.rstrip("/") == "":
            raise ValueError(f"storage URL {url!r} names no file: use sqlite:///PATH")
        from authserver.store.sqlite import SQLiteStore

        return SQLiteStore(path, observe=observe)
    if url.startswith(("postgresql://", "postgres://")):
        try:
            from authserver.store.postgres import PostgresStore
        except ModuleNotFoundError as exc:
            if exc.name != "asyncpg":
                raise
            raise RuntimeError(
                "PostgreSQL storage needs asyncpg: install portcullis[postgres]"
            ) from exc
        return PostgresStore(url, pool, observe=observe)
    raise ValueError(
        f"storage URL {url!r} is neither sqlite:///PATH, sqlite://:memory:"
        " nor postgresql://USER@HOST/DATABASE"
    )
