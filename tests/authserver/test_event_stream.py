"""GET /revocation_events as its subscribers meet it, on SQLite and on PostgreSQL: what the
Last-Event-ID header may be, and a stream that ends when its client may no longer read it
(deleted, its secret rotated, or `introspection` turned off through the admin API).
The events themselves, and the gateway reading them, are tested in
tests/e2e/test_revocation_events.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.authserver.admin_support import StartAdminServer, admin_for, start_admin_server
from tests.authserver.conftest import SECRET, RunningAuthServer, basic_auth, client_credentials

__all__ = ["start_admin_server"]  # the fixture

# Neither the poll of the log nor a heartbeat comes within a test: the stream wakes only
# when an event is recorded.
QUIET = {"poll_interval": "1h", "heartbeat": "1h"}
LARGEST_EVENT_ID = 2**63 - 1  # the events' ids are BIGINT / INTEGER: signed 64-bit


def quiet(config: dict[str, Any]) -> None:
    config["revocation_events"] = dict(QUIET)


class Subscription:
    """One open stream: its lines, read as they come."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response

    async def until_up_to_date(self) -> list[str]:
        """The lines up to the first comment, which follows everything committed so far."""
        lines = []
        async for raw in self.response.content:
            line = raw.decode().rstrip("\n")
            lines.append(line)
            if line.startswith(":"):
                return lines
        raise AssertionError(f"the stream ended before it was up to date: {lines}")

    async def rest(self) -> list[str]:
        """Every line until the stream ends, or until an event's id: an event delivered."""
        lines = []
        async for raw in self.response.content:
            line = raw.decode().rstrip("\n")
            lines.append(line)
            if line.startswith("id:"):
                break
        return lines


@contextlib.asynccontextmanager
async def subscribed(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    client_id: str,
    secret: str,
    last_event_id: str | None = None,
) -> AsyncIterator[Subscription]:
    headers = {"Authorization": basic_auth(client_id, secret)}
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    async with http.get(server.endpoint("/revocation_events"), headers=headers) as response:
        assert response.status == 200, await response.text()
        yield Subscription(response)


async def revoke_a_token(http: aiohttp.ClientSession, server: RunningAuthServer) -> None:
    """Record a new event: `machine` revokes an access token of its own."""
    status, body = await client_credentials(http, server, scope="orders:read")
    assert status == 200, body
    response = await http.post(
        server.endpoint("/revoke"),
        data={"token": body["access_token"]},
        headers={"Authorization": basic_auth("machine", SECRET)},
    )
    assert response.status == 200, await response.text()


# ---------------------------------------------------------------------------- Last-Event-ID


async def test_a_last_event_id_beyond_a_64_bit_integer_is_a_bad_request_before_the_stream(
    start_admin_server: StartAdminServer, http: aiohttp.ClientSession
) -> None:
    # 19 digits, but above the largest id either store can hold: refused with 400 while an
    # answer can still say so, not failed in the store after the 200 head went out.
    server = await start_admin_server(quiet)
    url = server.endpoint("/revocation_events")
    auth = {"Authorization": basic_auth("resource-server", SECRET)}
    for beyond in (LARGEST_EVENT_ID + 1, 10**19 - 1):
        async with http.get(url, headers={**auth, "Last-Event-ID": str(beyond)}) as response:
            assert response.status == 400, await response.text()
            assert (await response.json())["error"] == "invalid_request"
    # The largest id itself is one: the stream resumes after it (nothing is there yet).
    async with subscribed(http, server, "resource-server", SECRET, str(LARGEST_EVENT_ID)) as stream:
        assert await stream.until_up_to_date() == [": up to date"]


# ---------------------------------------------------------------------------- its client


async def _delete(admin: Any, client_id: str) -> None:
    status, body, _ = await admin.delete(f"/clients/{client_id}")
    assert status == 204, body


async def _rotate(admin: Any, client_id: str) -> None:
    status, body, _ = await admin.post(f"/clients/{client_id}/secret")
    assert status == 200, body


async def _no_introspection(admin: Any, client_id: str) -> None:
    status, body, _ = await admin.patch(f"/clients/{client_id}", {"introspection": False})
    assert status == 200 and body["introspection"] is False, body


@pytest.mark.parametrize(
    "change", [_delete, _rotate, _no_introspection], ids=["deleted", "rotated", "introspection_off"]
)
async def test_an_open_stream_ends_without_the_next_event_once_its_client_may_not_read(
    start_admin_server: StartAdminServer, http: aiohttp.ClientSession, change: Any
) -> None:
    server = await start_admin_server(quiet)
    admin = await admin_for(http, server)
    status, created, _ = await admin.post(
        "/clients",
        {
            "clientId": "edge-gateway",
            "grantTypes": ["client_credentials"],
            "scope": "",
            "introspection": True,
        },
    )
    assert status == 201, created
    async with subscribed(http, server, "edge-gateway", created["clientSecret"]) as stream:
        await stream.until_up_to_date()  # the (empty) snapshot: subscribed
        await change(admin, "edge-gateway")
        await revoke_a_token(http, server)
        # The event wakes the stream, which finds its client no longer allowed and ends:
        # neither this event nor the cut-off of the client itself goes out.
        rest = await asyncio.wait_for(stream.rest(), 10)
    assert not any(line.startswith(("id:", "data:")) for line in rest), rest
    # A subscriber that may read still gets the event.
    async with subscribed(http, server, "resource-server", SECRET) as stream:
        assert any(line.startswith("id:") for line in await stream.until_up_to_date())
