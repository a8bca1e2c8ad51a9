"""The store failing under the server: answers are 503 with Retry-After, never a plain-text
500, and the server recovers by itself when the store does.

The fault is real: the server runs as its own process, and the test lowers that process's
file-size limit (RLIMIT_FSIZE) to one byte, so that every write to its database fails as on
a full disk (`disk I/O error`); root is held to the limit like anyone. Raising the limit is
the disk getting space again. The server's output goes through a pipe, so only its database
suffers (tests/authserver/process_support.py).
"""

from __future__ import annotations

import resource
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.authserver.conftest import (
    JWT_BEARER,
    client_assertion,
    client_public_jwks,
    login_page_path,
    tokens_for,
)
from tests.authserver.device_support import device_config
from tests.authserver.process_support import Process, write_config
from tests.support import reserve_port

# A valid request from a browser without a session: the login page needs a new session.
AUTHORIZE = login_page_path()
RESOURCE_SERVER = {
    # Introspects with a client assertion, whose jti the store records: a write.
    "client_id": "rs-jwt",
    "token_endpoint_auth_method": "private_key_jwt",
    "jwks": client_public_jwks(),
    "grant_types": ["client_credentials"],
    "scope": "",
    "introspection": True,
}


@pytest.fixture
async def process(tmp_path: Path, http: aiohttp.ClientSession) -> AsyncIterator[Process]:
    config = device_config()
    config["clients"].append(RESOURCE_SERVER)
    port = reserve_port()
    running = Process(
        write_config(tmp_path, config, port), f"http://127.0.0.1:{port}", tmp_path / "server.log"
    )
    running.start()
    await running.wait_ready(http)
    yield running
    running.kill()


def limit_file_size(process: Process, size: int) -> None:
    assert process.proc is not None
    _, hard = resource.prlimit(process.proc.pid, resource.RLIMIT_FSIZE)
    resource.prlimit(process.proc.pid, resource.RLIMIT_FSIZE, (size, hard))


def disk_full(process: Process) -> None:
    limit_file_size(process, 1)


def disk_freed(process: Process) -> None:
    limit_file_size(process, resource.RLIM_INFINITY)


async def post(
    http: aiohttp.ClientSession,
    url: str,
    data: dict[str, str],
    headers: dict[str, str] | None = None,
) -> tuple[int, Any, Any]:
    async with http.post(url, data=data, headers=headers) as response:
        body = await response.json() if response.content_type == "application/json" else None
        return response.status, body, response.headers


def calls(process: Process, refresh_token: str) -> dict[str, tuple[str, dict[str, str]]]:
    """A call to each JSON endpoint that writes to the store."""
    url = process.url
    return {
        "token": (
            url + "/token",
            {"grant_type": "refresh_token", "refresh_token": refresh_token, "client_id": "spa"},
        ),
        "device_authorization": (
            url + "/device_authorization",
            {"client_id": "tv", "scope": "openid orders:read"},
        ),
        "revoke": (url + "/revoke", {"token": refresh_token, "client_id": "spa"}),
        "introspect": (
            url + "/introspect",
            {
                "token": refresh_token,
                "client_id": "rs-jwt",
                "client_assertion_type": JWT_BEARER,
                "client_assertion": client_assertion(url, client_id="rs-jwt"),
            },
        ),
    }


@pytest.mark.slow
async def test_a_full_disk_gets_503_and_the_server_recovers_when_space_returns(
    process: Process, http: aiohttp.ClientSession
) -> None:
    tokens = await tokens_for(http, process.server())

    disk_full(process)
    for name, (url, data) in calls(process, tokens["refresh_token"]).items():
        status, body, headers = await post(http, url, data)
        assert status == 503, (name, status, body)
        assert body == {
            "error": "temporarily_unavailable",
            "error_description": "try again in a moment",
        }, name
        assert int(headers["Retry-After"]) >= 1, name
        assert headers["Cache-Control"] == "no-store", name
    # From the single-page app's origin: the CORS middleware reads the form after the
    # endpoint failed, and the app can read the 503.
    spa_origin = "http://127.0.0.1"
    url, data = calls(process, tokens["refresh_token"])["token"]
    status, body, headers = await post(http, url, data, {"Origin": spa_origin})
    assert (status, body["error"]) == (503, "temporarily_unavailable")
    assert headers["Access-Control-Allow-Origin"] == spa_origin
    async with aiohttp.ClientSession() as browser:  # no session yet: the page makes one
        for path in ("/device", AUTHORIZE):
            async with browser.get(process.url + path) as response:
                text = await response.text()
                assert response.status == 503, (path, text)
                assert response.content_type == "text/html", path
                assert int(response.headers["Retry-After"]) >= 1, path
                assert "try again in a moment" in text, path

    disk_freed(process)
    # The refresh that failed committed nothing: its token is as good as before, not reuse.
    status, refreshed, _ = await post(http, *calls(process, tokens["refresh_token"])["token"])
    assert status == 200, refreshed
    for name, (url, data) in calls(process, refreshed["refresh_token"]).items():
        if name == "token":
            continue
        status, body, _ = await post(http, url, data)
        assert status == 200, (name, status, body)
    async with aiohttp.ClientSession() as browser:
        for path in ("/device", AUTHORIZE):
            async with browser.get(process.url + path) as response:
                assert response.status == 200, path


@pytest.mark.slow
async def test_a_device_code_typed_while_the_disk_is_full_gets_the_503_page(
    process: Process, http: aiohttp.ClientSession
) -> None:
    # The code form is fetched while the disk has space, and posted when it is full.
    async with http.get(process.url + "/device") as response:
        assert response.status == 200
        text = await response.text()
    csrf = text.split('name="csrf_token" value="', 1)[1].split('"', 1)[0]
    disk_full(process)
    async with http.post(
        process.url + "/device", data={"csrf_token": csrf, "user_code": "BCDF-GHJK"}
    ) as response:
        # Checking a code charges the guess first: a write, refused.
        assert response.status == 503
        assert int(response.headers["Retry-After"]) >= 1
    disk_freed(process)
    async with http.post(
        process.url + "/device",
        data={"csrf_token": csrf, "user_code": "BCDF-GHJK"},
    ) as response:
        assert response.status == 400  # a well-formed code that is not known: no 503
