"""The authorization server on a PostgreSQL that goes away: under traffic, every OAuth
endpoint answers 503 `temporarily_unavailable` with Retry-After within the pool's timeouts
(pages: the 503 page), /readyz says why, and the server resumes by itself when the database
is back, with every refresh token a client received still good. And one of two replicas
killed under refresh traffic: the other keeps serving, and no family is left half-rotated.

The servers run as processes of their own, on a PostgreSQL of the test's own
(tests/faults_support.py): the machine's shared server is never stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from authserver import settings as authserver_settings
from tests.authserver.conftest import (
    SECRET,
    basic_auth,
    default_config,
    login_page_path,
    tokens_for,
)
from tests.authserver.process_support import Process, write_config
from tests.faults_support import PrivatePostgres
from tests.support import reserve_port, wait_for

pytestmark = [pytest.mark.fault, pytest.mark.slow]

# Short timeouts: a request meeting a stopped database gives up within about a second.
POOL = {
    "min_size": 1,
    "max_size": 4,
    "connect_timeout": "1s",
    "command_timeout": "1s",
    "acquire_timeout": "1s",
}
# The longest a request may take while the database is away: the connect timeout, the
# acquire timeout and a statement timeout could add up, and the machine is shared.
LONGEST_ANSWER = 4.0
AUTHORIZE = login_page_path()


@pytest.fixture
def database() -> Iterator[PrivatePostgres]:
    with PrivatePostgres() as server:
        server.start()
        yield server


def replica(directory: Path, database: PrivatePostgres, port: int | None = None) -> Process:
    """An authorization server process on `database`; replicas share the issuer's port
    number only in their configuration's issuer, each listening on a port of its own."""
    directory.mkdir(parents=True, exist_ok=True)
    config = default_config()
    config["storage"] = database.url
    config["storage_pool"] = POOL
    config["refresh_grace"] = "10s"
    listen = reserve_port()
    config["issuer"] = f"http://127.0.0.1:{port or listen}"
    path = write_config(directory, config, listen)
    return Process(path, f"http://127.0.0.1:{listen}", directory / "server.log")


def admin_url(process: Process) -> str:
    settings = authserver_settings.load(str(process.config))
    return f"http://{settings.admin_listen}"


@pytest.fixture
async def server(
    tmp_path: Path, database: PrivatePostgres, http: aiohttp.ClientSession
) -> AsyncIterator[Process]:
    process = replica(tmp_path / "a", database)
    process.start()
    await process.wait_ready(http)
    yield process
    process.kill()


@dataclass
class RefreshingClient:
    """A client that refreshes its token over and over, as an app would: it keeps the last
    refresh token it received and retries it after a 503 (or a dropped connection)."""

    urls: list[str]
    token: str
    seen: list[int] = field(default_factory=list)
    slowest: float = 0.0
    turn: int = 0

    async def refresh_once(self, http: aiohttp.ClientSession) -> None:
        url = self.urls[self.turn % len(self.urls)]
        self.turn += 1
        data = {"grant_type": "refresh_token", "refresh_token": self.token, "client_id": "spa"}
        started = time.monotonic()
        try:
            async with http.post(url + "/token", data=data) as response:
                body = await response.json(content_type=None)
                status = response.status
        except aiohttp.ClientConnectionError:
            status, body = 0, None  # a replica killed: the answer is lost
        self.slowest = max(self.slowest, time.monotonic() - started)
        self.seen.append(status)
        if status == 200:
            self.token = body["refresh_token"]
        elif status == 503:
            assert body == {
                "error": "temporarily_unavailable",
                "error_description": "try again in a moment",
            }, body

    async def run(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.refresh_once(http)
            await asyncio.sleep(0.02)


async def families(http: aiohttp.ClientSession, process: Process, count: int) -> list[str]:
    """`count` refresh tokens, each of a family of its own."""
    server = process.server()
    return [(await tokens_for(http, server))["refresh_token"] for _ in range(count)]


async def timed_post(
    http: aiohttp.ClientSession, url: str, data: dict[str, str], headers: dict[str, str]
) -> tuple[int, Any, Any, float]:
    started = time.monotonic()
    async with http.post(url, data=data, headers=headers) as response:
        text = await response.text()
        return response.status, text, response.headers, time.monotonic() - started


async def test_a_stopped_database_gets_503_and_the_server_resumes_with_every_token_good(
    server: Process, database: PrivatePostgres, http: aiohttp.ClientSession
) -> None:
    untouched = await families(http, server, 3)  # kept aside during the outage
    clients = [RefreshingClient([server.url], token) for token in await families(http, server, 3)]
    admin = admin_url(server)
    stop = asyncio.Event()
    traffic = [asyncio.create_task(c.run(http, stop)) for c in clients]
    try:
        await wait_for(
            lambda: all(c.seen.count(200) >= 2 for c in clients), 10, "every client refreshing"
        )
        database.stop("immediate")  # as in a crash: sessions cut, nothing flushed cleanly

        calls = {
            "token": (
                "/token",
                {"grant_type": "refresh_token", "refresh_token": untouched[0], "client_id": "spa"},
                {},
            ),
            "introspect": (
                "/introspect",
                {"token": untouched[0]},
                {"Authorization": basic_auth("resource-server", SECRET)},
            ),
            "revoke": ("/revoke", {"token": untouched[0], "client_id": "spa"}, {}),
        }
        for name, (path, data, headers) in calls.items():
            status, text, answer_headers, took = await timed_post(
                http, server.url + path, data, headers
            )
            assert status == 503, (name, status, text)
            assert text.startswith("{") and "Traceback" not in text, (name, text)
            assert '"error":"temporarily_unavailable"' in text.replace(" ", ""), (name, text)
            assert int(answer_headers["Retry-After"]) >= 1, name
            assert took < LONGEST_ANSWER, (name, took)
        async with aiohttp.ClientSession() as browser:  # no session: the page needs one
            started = time.monotonic()
            async with browser.get(server.url + AUTHORIZE) as response:
                page = await response.text()
                assert response.status == 503, page
                assert response.content_type == "text/html"
                assert int(response.headers["Retry-After"]) >= 1
                assert "try again in a moment" in page and "Traceback" not in page
            assert time.monotonic() - started < LONGEST_ANSWER
            async with browser.get(admin + "/readyz") as response:
                assert response.status == 503
                assert "store" in (await response.json())["reasons"]

        # The clients keep trying meanwhile: the outage lasts until each was refused (and a
        # dozen requests in all), however slowly a loaded machine lets them run.
        await wait_for(
            lambda: (
                all(503 in c.seen for c in clients)
                and sum(c.seen.count(503) for c in clients) >= 10
            ),
            20,
            "every client refused during the outage",
        )
        database.start()

        # Back by itself: no restart of the authorization server.
        deadline = time.monotonic() + 20
        while True:
            async with http.get(admin + "/readyz") as response:
                if response.status == 200:
                    break
            assert time.monotonic() < deadline, server.log.read_text()[-3000:]
            await asyncio.sleep(0.1)
        await wait_for(
            lambda: all(c.seen[-1] == 200 for c in clients), 20, "every client served again"
        )
    finally:
        stop.set()
        await asyncio.gather(*traffic)

    for client in clients:
        assert set(client.seen) <= {200, 503}, client.seen
        assert 503 in client.seen and client.seen[-1] == 200, client.seen
        assert client.slowest < LONGEST_ANSWER, client.slowest
        # The last token it received is as good as it was.
        await client.refresh_once(http)
        assert client.seen[-1] == 200
    for token in untouched:
        refresh = RefreshingClient([server.url], token)
        await refresh.refresh_once(http)
        assert refresh.seen == [200]
    log = server.log.read_text()
    assert "Traceback" not in log
    # Dozens of requests failed alike within seconds: a line or two say so, not one each.
    failed = sum(client.seen.count(503) for client in clients)
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    unavailable = [line for line in lines if line["message"] == "temporarily unavailable"]
    assert failed >= 10 and 1 <= len(unavailable) <= 2, (failed, unavailable)


async def test_a_replica_killed_under_refresh_traffic_leaves_no_family_half_rotated(
    tmp_path: Path, database: PrivatePostgres, http: aiohttp.ClientSession
) -> None:
    a = replica(tmp_path / "a", database)
    a.start()
    await a.wait_ready(http)
    b = replica(tmp_path / "b", database, port=int(a.url.rsplit(":", 1)[1]))
    b.start()
    try:
        await b.wait_ready(http)
        clients = [RefreshingClient([a.url, b.url], token) for token in await families(http, a, 6)]
        stop = asyncio.Event()
        traffic = [asyncio.create_task(c.run(http, stop)) for c in clients]
        try:
            # Each client served by both replicas twice: refreshes are going through A.
            await wait_for(
                lambda: all(c.seen.count(200) >= 4 for c in clients), 20, "refreshes at both"
            )
            a.kill()  # SIGKILL, in the middle of whatever it was doing
            killed_at = [len(c.seen) for c in clients]
            # Until each client has tried both replicas twice since: B's answers are then in.
            await wait_for(
                lambda: all(len(c.seen) >= k + 4 for c, k in zip(clients, killed_at, strict=True)),
                20,
                "requests to both replicas after the kill",
            )
        finally:
            stop.set()
            await asyncio.gather(*traffic)
        for client, before in zip(clients, killed_at, strict=True):
            # B answered every request it got, before and after A was gone.
            answers_from_b = client.seen[before + (before % 2 == 0) :: 2]
            assert answers_from_b and set(answers_from_b) == {200}, client.seen
            assert set(client.seen) <= {0, 200}, client.seen
            # The last token the client holds works at B: a rotation A committed without
            # answering is repeated within the grace; one A never committed was not made.
            client.urls = [b.url]
            await client.refresh_once(http)
            assert client.seen[-1] == 200, client.seen
            await client.refresh_once(http)
            assert client.seen[-1] == 200, client.seen
        assert "Traceback" not in b.log.read_text()
    finally:
        a.kill()
        with contextlib.suppress(Exception):
            b.kill()
