"""A server killed between committing a refresh rotation and answering it logs nobody out.

The client never gets the response, so it retries with the token it has: the one that was
just rotated. Within `refresh_grace` (5 s by default), by the same client, and while the
successor is unused, the retry gets the lost response; the family lives on. With a grace of
zero the same retry is taken for a replay and revokes the family: what every refresh in
flight at a crash did before the default changed.

The servers are real processes on one database and key directory, as two replicas are: the
first is `tests/authserver/die_after_commit.py`, which kills itself with SIGKILL the moment
a rotation has committed; the client retries at the second.
"""

from __future__ import annotations

import re
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.authserver.conftest import default_config, introspect, tokens_for
from tests.authserver.process_support import Process, write_config
from tests.support import free_port

DIES_AFTER_COMMIT = ("-m", "tests.authserver.die_after_commit")


async def replicas(
    tmp_path: Path, http: aiohttp.ClientSession, running: list[Process], config: dict[str, Any]
) -> tuple[Process, Process]:
    """Two servers on one database and key directory: the first dies after a rotation.
    Each is added to `running` as it starts, so that it is stopped whatever happens."""
    first_port, second_port = free_port(), free_port()
    dying = Process(
        write_config(tmp_path, config, first_port),
        f"http://127.0.0.1:{first_port}",
        tmp_path / "dying.log",
        DIES_AFTER_COMMIT,
    )
    running.append(dying)
    dying.start()
    await dying.wait_ready(http)
    # The same file but for the port: same issuer, database and keys.
    other = tmp_path / "replica"
    other.mkdir()
    text = dying.config.read_text().replace(f":{first_port}", f":{second_port}")
    issuer = f"http://127.0.0.1:{first_port}"
    text = text.replace(f"issuer: http://127.0.0.1:{second_port}", f"issuer: {issuer}")
    # An admin listener of its own.
    text = re.sub(r"(?m)^admin_listen: .*$", f"admin_listen: 127.0.0.1:{free_port()}", text)
    (other / "authserver.yaml").write_text(text)
    replica = Process(
        other / "authserver.yaml", f"http://127.0.0.1:{second_port}", tmp_path / "replica.log"
    )
    running.append(replica)
    replica.start()
    await replica.wait_ready(http)
    return dying, replica


@pytest.fixture
async def running() -> AsyncIterator[list[Process]]:
    started: list[Process] = []
    yield started
    for process in started:
        process.kill()


async def refresh(http: aiohttp.ClientSession, url: str, token: str) -> tuple[int, dict[str, Any]]:
    data = {"grant_type": "refresh_token", "refresh_token": token, "client_id": "spa"}
    async with http.post(url + "/token", data=data) as response:
        return response.status, await response.json()


async def kill_during_rotation(
    tmp_path: Path, http: aiohttp.ClientSession, running: list[Process], config: dict[str, Any]
) -> tuple[Process, dict[str, Any]]:
    """Tokens from the dying server, then a refresh it commits and never answers."""
    dying, replica = await replicas(tmp_path, http, running, config)
    tokens = await tokens_for(http, dying.server())
    with pytest.raises(aiohttp.ClientConnectionError):
        await refresh(http, dying.url, tokens["refresh_token"])
    assert dying.proc is not None
    assert dying.proc.wait(timeout=10) == -signal.SIGKILL
    return replica, tokens


@pytest.mark.slow
async def test_a_refresh_lost_to_a_kill_after_its_commit_is_answered_on_retry(
    tmp_path: Path, http: aiohttp.ClientSession, running: list[Process]
) -> None:
    replica, tokens = await kill_during_rotation(tmp_path, http, running, default_config())
    server = replica.server()

    status, retried = await refresh(http, replica.url, tokens["refresh_token"])
    assert status == 200, retried
    assert retried["refresh_token"] != tokens["refresh_token"]
    assert (await introspect(http, server, retried["access_token"]))["active"] is True

    # The family goes on from the successor the lost response carried.
    status, next_one = await refresh(http, replica.url, retried["refresh_token"])
    assert status == 200, next_one
    assert (await introspect(http, server, next_one["access_token"]))["active"] is True


@pytest.mark.slow
async def test_without_a_grace_window_the_retry_revokes_the_family(
    tmp_path: Path, http: aiohttp.ClientSession, running: list[Process]
) -> None:
    config = default_config()
    config["refresh_grace"] = "0s"
    replica, tokens = await kill_during_rotation(tmp_path, http, running, config)
    server = replica.server()

    status, body = await refresh(http, replica.url, tokens["refresh_token"])
    assert (status, body["error"]) == (400, "invalid_grant")
    # The user is logged out: every token of the family is revoked, the successor the lost
    # response carried included.
    assert await introspect(http, server, tokens["access_token"]) == {"active": False}
