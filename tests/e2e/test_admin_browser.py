"""A user made through the admin API signs in with a real browser (Chromium driven by
Playwright) through the server's own pages; once disabled through the API, the same browser
is sent back to the login page, and signing in again fails."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.authserver.admin_support import admin_config, admin_for
from tests.authserver.conftest import RunningAuthServer, load_settings, run_authserver
from tests.e2e.test_browser_flow import ClientApp, browser, client_app, page, starting_with
from tests.support import bound_socket

__all__ = ["browser", "client_app", "page"]  # fixtures

pytestmark = pytest.mark.slow

PASSWORD = "made-through-the-api"


@pytest.fixture
async def authserver(tmp_path: Path) -> AsyncIterator[RunningAuthServer]:
    sock = bound_socket()
    port = sock.getsockname()[1]
    server = await run_authserver(load_settings(admin_config(port), tmp_path, port), sock=sock)
    yield server
    await server.stop()


async def sign_in(page: Any, client_app: ClientApp, username: str) -> None:
    await page.goto(client_app.url + "/start")
    await page.get_by_label("Username").fill(username)
    await page.get_by_label("Password").fill(PASSWORD)
    await page.get_by_role("button", name="Sign in").click()


async def test_a_user_made_through_the_api_signs_in_and_once_disabled_cannot(
    page: Any, client_app: ClientApp, authserver: RunningAuthServer
) -> None:
    async with aiohttp.ClientSession() as http:
        admin = await admin_for(http, authserver)
        status, user, _ = await admin.post(
            "/users",
            {
                "username": "grace",
                "password": PASSWORD,
                "name": "Grace Hopper",
                "email": "grace@example.com",
            },
        )
        assert status == 201, user

        await sign_in(page, client_app, "grace")
        await page.get_by_role("button", name="Allow").click()
        await page.wait_for_url(starting_with(client_app.redirect_uri + "?"))
        assert await page.locator("h1").inner_text() == "Signed in"
        assert await page.locator("#subject").inner_text() == user["id"]
        assert await page.locator("#name").inner_text() == "Grace Hopper"

        status, _, _ = await admin.patch(f"/users/{user['id']}", {"disabled": True})
        assert status == 200

    # Her session ended: the next sign-in shows the login page, and her password fails.
    await sign_in(page, client_app, "grace")
    await page.wait_for_url(authserver.settings.issuer + "/login")
    alert = page.get_by_role("alert")
    assert await alert.inner_text() == "The username or password is not correct."
    assert client_app.pending  # the client never got an answer
