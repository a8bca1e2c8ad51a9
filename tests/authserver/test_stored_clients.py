"""Client lookups read the store every time; what is derived from a record is used again only
for an equal record: a rotated secret, changed metadata, a deleted client (even one made
again with the same version and dates) take effect at the next lookup, and what is kept is
bounded."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from authserver.clients import ClientAuthenticator, ClientAuthError
from authserver.registry import StoredClients, secret_digest
from authserver.store.base import ClientRecord
from authserver.store.sqlite import SQLiteStore

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
