"""A user's cut-off (disabled or deleted through the admin API, or dropped from the
configuration file and reloaded) ends what was issued for them before it, over real HTTP on
SQLite and PostgreSQL: a code or an approved device code of theirs gives no token after it,
even once they are back, and no token issued afterwards falls under it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import jwt

from authserver import settings as authserver_settings
from authserver.app import AuthServer, build_app
from authserver.store.base import EventKind
from tests.authserver.admin_support import (
    Admin,
    StartAdminServer,
    admin_config,
    admin_for,
    start_admin_server,
)
from tests.authserver.conftest import (
    PASSWORD,
    MovableClock,
    RunningAuthServer,
    _key_template,
    authorize_code,
    exchange_code,
)
from tests.authserver.device_support import DEVICE_GRANT, approve_on_pages, poll, start_device
from tests.authserver.process_support import write_config
from tests.support import bound_socket, start_site

__all__ = ["start_admin_server"]  # fixtures

SCOPE = "openid offline_access orders:read"


def browser() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))


async def new_user(admin: Admin, username: str) -> str:
    """A user made through the API (the file's are read-only there); its path."""
    status, created, _ = await admin.post(
        "/users", {"username": username, "password": f"{username}-password"}
    )
    assert status == 201, created
    return f"/users/{quote(created['id'], safe='')}"


async def code_of(server: RunningAuthServer, username: str, password: str) -> Any:
    async with browser() as session:
        return await authorize_code(
            session, server, scope=SCOPE, username=username, password=password
        )


def assert_invalid_grant(status: int, body: dict[str, Any]) -> None:
    assert (status, body.get("error")) == (400, "invalid_grant"), body
    assert not {"access_token", "refresh_token", "id_token"} & set(body)


async def test_a_code_issued_before_its_user_is_disabled_gives_no_tokens(
    start_admin_server: StartAdminServer, http: aiohttp.ClientSession
) -> None:
    server = await start_admin_server()
    admin = await admin_for(http, server)
    path = await new_user(admin, "erin")
    result = await code_of(server, "erin", "erin-password")
    status, body, _ = await admin.patch(path, {"disabled": True})
    assert status == 200, body
    assert_invalid_grant(*await exchange_code(http, server, result))


async def test_a_code_issued_before_its_user_is_deleted_gives_no_tokens(
    start_admin_server: StartAdminServer, http: aiohttp.ClientSession
) -> None:
    server = await start_admin_server()
    admin = await admin_for(http, server)
    path = await new_user(admin, "erin")
    result = await code_of(server, "erin", "erin-password")
    assert (await admin.delete(path))[0] == 204
    assert_invalid_grant(*await exchange_code(http, server, result))


async def test_a_code_of_a_user_cut_off_stays_dead_once_they_are_back_and_new_tokens_follow_the_cut(
    start_admin_server: StartAdminServer, http: aiohttp.ClientSession
) -> None:
    clock = MovableClock()
    server = await start_admin_server(clock=clock)
    admin = await admin_for(http, server)
    path = await new_user(admin, "erin")
    result = await code_of(server, "erin", "erin-password")
    assert (await admin.patch(path, {"disabled": True}))[0] == 200
    assert (await admin.patch(path, {"disabled": False}))[0] == 200
    assert_invalid_grant(*await exchange_code(http, server, result))

    # Signed in again after the cut-off's second, the user gets tokens, none of which the
    # cut-off covers: resource servers following the events take them.
    clock.advance(1)
    fresh = await code_of(server, "erin", "erin-password")
    status, tokens = await exchange_code(http, server, fresh)
    assert status == 200, tokens
    claims = jwt.decode(tokens["access_token"], options={"verify_signature": False})
    events = await server.services.store.revocation_events(0, clock(), 100)
    cuts = [e for e in events if e.kind is EventKind.SUBJECT and e.key == claims["sub"]]
    assert len(cuts) == 1 and cuts[0].issued_before is not None
    assert claims["iat"] >= cuts[0].issued_before


async def test_an_approved_device_code_of_a_user_cut_off_gives_no_tokens_once_they_are_back(
    start_admin_server: StartAdminServer, http: aiohttp.ClientSession
) -> None:
    def with_a_device(config: dict[str, Any]) -> None:
        config["clients"].append(
            {
                "client_id": "tv",
                "token_endpoint_auth_method": "none",
                "grant_types": [DEVICE_GRANT, "refresh_token"],
                "scope": SCOPE,
            }
        )

    server = await start_admin_server(with_a_device)
    admin = await admin_for(http, server)
    path = await new_user(admin, "erin")
    status, device, _ = await start_device(http, server, scope=SCOPE)
    assert status == 200, device
    async with browser() as person:
        await approve_on_pages(
            person,
            server,
            device["verification_uri_complete"],
            username="erin",
            password="erin-password",
        )
    assert (await admin.patch(path, {"disabled": True}))[0] == 200
    assert (await admin.patch(path, {"disabled": False}))[0] == 200
    status, body = await poll(http, server, device["device_code"])
    # RFC 8628 §3.5: the approval was withdrawn.
    assert (status, body["error"]) == (400, "access_denied"), body
    assert "access_token" not in body


async def test_a_code_of_a_user_dropped_from_the_configuration_gives_no_tokens(
    tmp_path: Path, key_root: Path, http: aiohttp.ClientSession
) -> None:
    sock = bound_socket()
    port = sock.getsockname()[1]
    config = admin_config(port)
    shutil.copytree(_key_template(key_root), tmp_path / "keys")
    path = write_config(tmp_path, config, port)
    settings = authserver_settings.load(str(path))
    process = AuthServer(settings)
    runner, _ = await start_site(build_app(settings, process), sock=sock)
    try:
        server = RunningAuthServer(settings, f"http://127.0.0.1:{port}", process.live.current())
        result = await code_of(server, "bob", PASSWORD)
        bob = dict(next(u for u in config["users"] if u["username"] == "bob"))

        config["users"] = [u for u in config["users"] if u["username"] != "bob"]
        write_config(tmp_path, config, port)
        assert await process.reload()
        assert_invalid_grant(*await exchange_code(http, server, result))

        # Back in the file (the same subject again), the code issued before stays dead.
        again = await code_of(server, "alice", PASSWORD)
        config["users"].append(bob)
        write_config(tmp_path, config, port)
        assert await process.reload()
        assert_invalid_grant(*await exchange_code(http, server, result))
        # Nobody else's code is touched by it.
        status, tokens = await exchange_code(http, server, again)
        assert status == 200, tokens
    finally:
        await runner.cleanup()
