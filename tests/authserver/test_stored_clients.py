"""Client lookups read the store every time; what is derived from a record is used again only
for an equal record: a rotated secret, changed metadata, a deleted client (even one made
again with the same version and dates) take effect at the next lookup, and what is kept is
bounded."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from authserver.clients import ClientAuthenticator, ClientAuthError
from authserver.registry import StoredClients, secret_digest
from authserver.store.base import ClientRecord
from authserver.store.sqlite import ClientRows, SQLiteStore

T0 = 1_700_000_000.0


def a_client(client_id: str = "app", secret: str = "s" * 40, scope: str = "read") -> ClientRecord:
    return ClientRecord(
        client_id=client_id,
        metadata={
            "client_name": client_id,
            "token_endpoint_auth_method": "client_secret_post",
            "grant_types": ["client_credentials"],
            "scope": scope,
        },
        secret_sha256=secret_digest(secret),
        managed_by="api",
        created_at=T0,
        updated_at=T0,
        tokens_valid_from=T0 - 1,
    )


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    store = SQLiteStore(tmp_path / "authserver.db")
    await store.open()
    yield store
    await store.close()


async def test_an_unchanged_client_is_derived_once_and_read_every_time(
    store: SQLiteStore,
) -> None:
    await store.save_client(a_client(), None)
    clients = StoredClients(store)
    first = await clients.client("app")
    again = await clients.client("app")
    assert first is not None and again is first
    assert first.scope == ("read",)

    await store.delete_client("app")
    assert await clients.client("app") is None  # read from the store, not kept


async def test_a_rotated_secret_is_refused_at_the_next_request(store: SQLiteStore) -> None:
    await store.save_client(a_client(secret="old" * 14), None)
    clients = StoredClients(store)
    authenticator = ClientAuthenticator(clients, store, "https://as.example", timedelta(hours=1))
    form = {"client_id": "app", "client_secret": "old" * 14}
    assert (await authenticator.authenticate(form, None, "https://as.example/token")).client_id

    record = await store.get_client("app")
    assert record is not None
    rotated = replace(record, secret_sha256=secret_digest("new" * 14))
    assert await store.save_client(rotated, record.version)

    with pytest.raises(ClientAuthError):
        await authenticator.authenticate(form, None, "https://as.example/token")
    new_form = {"client_id": "app", "client_secret": "new" * 14}
    assert await authenticator.authenticate(new_form, None, "https://as.example/token")


async def test_a_client_made_again_with_the_same_version_and_dates_is_read_anew(
    store: SQLiteStore,
) -> None:
    # Deleted and made again in the same instant: id, version and dates are those of the
    # first, only the metadata differs. What was derived from the first must not serve.
    await store.save_client(a_client(scope="read"), None)
    clients = StoredClients(store)
    before = await clients.client("app")
    assert before is not None and before.scope == ("read",)

    await store.delete_client("app")
    await store.save_client(a_client(scope="read write"), None)
    after = await clients.client("app")
    assert after is not None and after.scope == ("read", "write")


async def test_what_is_kept_is_bounded_by_the_clients_looked_up_last(store: SQLiteStore) -> None:
    clients = StoredClients(store, keep=3)
    for i in range(10):
        await store.save_client(a_client(f"c{i}"), None)
        assert await clients.client(f"c{i}") is not None
    assert list(clients._derived) == ["c7", "c8", "c9"]
    # The one looked up again stays; the oldest of the others goes.
    await clients.client("c7")
    await store.save_client(a_client("c10"), None)
    await clients.client("c10")
    assert list(clients._derived) == ["c9", "c7", "c10"]


async def test_the_store_gives_an_unchanged_rows_record_again_and_a_changed_one_anew(
    store: SQLiteStore,
) -> None:
    await store.save_client(a_client(), None)
    first = await store.get_client("app")
    assert first is not None and await store.get_client("app") is first

    # Any column changed is another record: here the secret, then only tokens_valid_from.
    rotated = replace(first, secret_sha256=secret_digest("new" * 14))
    assert await store.save_client(rotated, first.version)
    second = await store.get_client("app")
    assert second is not None and second is not first
    assert second.secret_sha256 == secret_digest("new" * 14)
    moved = replace(second, tokens_valid_from=second.tokens_valid_from + 60)
    assert await store.save_client(moved, second.version)
    third = await store.get_client("app")
    assert third is not None and third is not second
    assert third.tokens_valid_from == second.tokens_valid_from + 60

    await store.delete_client("app")
    assert await store.get_client("app") is None
    await store.save_client(a_client(scope="read write"), None)
    again = await store.get_client("app")
    assert again is not None and again.metadata["scope"] == "read write"


async def test_a_change_another_connection_makes_is_read_at_the_next_lookup(
    tmp_path: Path,
) -> None:
    # Two stores on one file stand for two processes: what one writes, the other's next
    # lookup reads, though it gave the row's record before.
    first, second = SQLiteStore(tmp_path / "shared.db"), SQLiteStore(tmp_path / "shared.db")
    await first.open()
    await second.open()
    try:
        await first.save_client(a_client(), None)
        before = await second.get_client("app")
        assert before is not None and await second.get_client("app") is before
        assert await first.save_client(
            replace(before, secret_sha256=secret_digest("new" * 14)), before.version
        )
        after = await second.get_client("app")
        assert after is not None and after.secret_sha256 == secret_digest("new" * 14)
        await first.delete_client("app")
        assert await second.get_client("app") is None
    finally:
        await first.close()
        await second.close()


def test_the_rows_remembered_are_bounded_the_oldest_forgotten_first(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "rows.db")
    conn.execute(
        "CREATE TABLE clients (client_id TEXT PRIMARY KEY, metadata TEXT, secret_sha256 BLOB,"
        " managed_by TEXT, created_at REAL, updated_at REAL, tokens_valid_from REAL,"
        " version INTEGER, registration_token_sha256 BLOB, unused_until REAL, blocked INTEGER)"
    )
    for i in range(5):
        conn.execute(
            "INSERT INTO clients VALUES (?, '{}', NULL, 'api', 0, 0, 0, 1, NULL, NULL, 0)",
            (f"c{i}",),
        )
    rows = ClientRows(keep=3)
    records = {f"c{i}": rows.read(conn, f"c{i}") for i in range(5)}
    assert list(rows._rows) == ["c2", "c3", "c4"]
    assert rows.read(conn, "c4") is records["c4"]
    forgotten = rows.read(conn, "c0")
    assert forgotten == records["c0"] and forgotten is not records["c0"]
    assert list(rows._rows) == ["c3", "c4", "c0"]
    assert rows.read(conn, "nobody") is None
    conn.close()


async def test_a_blocked_client_or_one_past_its_time_to_obtain_a_token_is_not_found(
    store: SQLiteStore,
) -> None:
    now = 1_700_000_000.0
    clients = StoredClients(store, lambda: now)
    await store.save_client(replace(a_client("blocked"), blocked=True), None)
    await store.save_client(replace(a_client("late"), unused_until=now), None)
    await store.save_client(replace(a_client("early"), unused_until=now + 1), None)
    assert await clients.client("blocked") is None
    assert await clients.client("late") is None
    early = await clients.client("early")
    assert early is not None and early.unused_until == now + 1
