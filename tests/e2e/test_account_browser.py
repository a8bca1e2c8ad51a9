"""The account page in a real browser (Chromium driven by Playwright): a user sees the app
they allowed and revokes it (its grant ends, gateways are told, the next sign-in asks
again), signs out their other sessions, and changes their password (the current one
required and throttled)."""

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

PASSWORD = "grace-first-password"
NEW_PASSWORD = "grace-second-password"


@pytest.fixture
async def authserver(tmp_path: Path) -> AsyncIterator[RunningAuthServer]:
    sock = bound_socket()
    port = sock.getsockname()[1]
    config = admin_config(port)
    config["login_throttle"] = {"max_failures": 3, "max_failures_per_address": 100}
    server = await run_authserver(load_settings(config, tmp_path, port), sock=sock)
    yield server
    await server.stop()


@pytest.fixture
async def grace(authserver: RunningAuthServer) -> dict[str, Any]:
    """A user kept in the store (made through the admin API), so her password can change."""
    async with aiohttp.ClientSession() as http:
        admin = await admin_for(http, authserver)
        status, user, _ = await admin.post(
            "/users", {"username": "grace", "password": PASSWORD, "name": "Grace Hopper"}
        )
        assert status == 201, user
        return dict(user)


def account(server: RunningAuthServer) -> str:
    return server.settings.issuer + "/account"


async def sign_in_to_account(
    page: Any, server: RunningAuthServer, password: str = PASSWORD, username: str = "grace"
) -> None:
    await page.goto(account(server))
    await page.get_by_label("Username").fill(username)
    await page.get_by_label("Password").fill(password)
    await page.get_by_role("button", name="Sign in").click()


async def test_revoking_an_app_ends_its_grant_tells_the_gateways_and_asks_consent_again(
    page: Any, client_app: ClientApp, authserver: RunningAuthServer, grace: dict[str, Any]
) -> None:
    await page.goto(client_app.url + "/start")
    await page.get_by_label("Username").fill("grace")
    await page.get_by_label("Password").fill(PASSWORD)
    await page.get_by_role("button", name="Sign in").click()
    await page.get_by_role("button", name="Allow").click()
    await page.wait_for_url(starting_with(client_app.redirect_uri + "?"))
    assert await page.locator("h1").inner_text() == "Signed in"

    await page.goto(account(authserver))
    assert await page.locator("h1").inner_text() == "Your account"
    app = page.locator("li.app")
    assert await app.count() == 1
    assert await app.locator(".app-name").inner_text() == "Desktop App"
    shown = await app.locator(".scopes code").all_inner_texts()
    assert shown == ["email", "openid", "orders:read", "profile"]
    assert "last used" in await app.locator(".dates").inner_text()
    (signed_in,) = await page.locator("li.sign-in").all_inner_texts()
    assert signed_in.endswith(": signed in from 127.0.0.1 to Desktop App")
    store = authserver.services.store
    (grant,) = await store.list_grants(subject=grace["id"])
    assert grant.grant.revoked_at is None
    events_before = await store.revocation_events(0, 0, 1000)

    await page.get_by_role("button", name="Revoke access of Desktop App").click()
    await page.wait_for_url(account(authserver) + "?done=revoked")
    assert "Access was revoked" in await page.get_by_role("status").inner_text()
    assert await page.locator("li.app").count() == 0
    assert "No application has access" in await page.content()

    (grant,) = await store.list_grants(subject=grace["id"])
    assert grant.grant.revoked_at is not None
    assert await store.granted_scopes(grace["id"], "desktop") == frozenset()
    events = await store.revocation_events(0, 0, 1000)
    (event,) = events[len(events_before) :]  # announced on the event stream, as an admin's
    assert event.reason == "consent_withdrawn" and len(event.tokens) == 1

    # Still signed in, the next authorization asks for consent again.
    await page.goto(client_app.url + "/start")
    assert await page.get_by_role("button", name="Allow").count() == 1
    assert not page.problems, page.problems


async def test_signing_out_the_other_sessions_leaves_this_one(
    browser: Any, page: Any, authserver: RunningAuthServer, grace: dict[str, Any]
) -> None:
    elsewhere = await browser.new_context()
    try:
        other = await elsewhere.new_page()
        third = await elsewhere.new_page()
        await sign_in_to_account(other, authserver)
        await sign_in_to_account(page, authserver)
        assert await page.locator("li.session").count() == 2
        assert await page.locator("li.session.current").count() == 1
        assert await page.locator("li.session .address").all_inner_texts() == ["127.0.0.1"] * 2

        # Every other session at once, then one by its own button.
        await page.get_by_role("button", name="Sign out all other sessions").click()
        await page.wait_for_url(account(authserver) + "?done=signed-out")
        assert await page.locator("li.session").count() == 1
        await other.reload()
        assert await other.get_by_role("button", name="Sign in").count() == 1

        await sign_in_to_account(third, authserver)
        await page.reload()
        assert await page.locator("li.session").count() == 2
        await page.locator("li.session:not(.current)").get_by_role("button").click()
        await page.wait_for_url(account(authserver) + "?done=signed-out")
        assert await page.locator("li.session").count() == 1
        await third.reload()
        assert await third.get_by_role("button", name="Sign in").count() == 1
        await page.reload()
        assert await page.locator("h1").inner_text() == "Your account"
    finally:
        await elsewhere.close()


async def test_the_password_changes_only_with_the_current_one_and_guesses_are_throttled(
    browser: Any, page: Any, authserver: RunningAuthServer, grace: dict[str, Any]
) -> None:
    elsewhere = await browser.new_context()
    try:
        other = await elsewhere.new_page()
        await sign_in_to_account(other, authserver)
        await sign_in_to_account(page, authserver)

        async def change(current: str, new: str, confirm: str | None = None) -> str:
            await page.get_by_label("Current password").fill(current)
            await page.get_by_label("New password", exact=True).fill(new)
            await page.get_by_label("New password again").fill(confirm or new)
            await page.get_by_role("button", name="Change password").click()
            await page.wait_for_load_state()
            alert = page.get_by_role("alert")
            return await alert.inner_text() if await alert.count() else ""

        assert await change(PASSWORD, NEW_PASSWORD, "something-else") == (
            "The confirmation does not match the new password."
        )
        assert await change("a-wrong-guess", NEW_PASSWORD) == "The current password is not correct."
        assert await change("another-guess", NEW_PASSWORD) == "The current password is not correct."
        assert await change("a-third-guess", NEW_PASSWORD) == "The current password is not correct."
        # The sign-in throttle counts these guesses too: even the right one waits now.
        assert "Too many failed attempts" in await change(PASSWORD, NEW_PASSWORD)
        # Each wrong guess shows among the recent sign-ins, the latest first.
        await page.goto(account(authserver))
        shown = await page.locator("li.sign-in").all_inner_texts()
        assert [line.split(": ", 1)[1] for line in shown] == [
            *["wrong password from 127.0.0.1 to this account page"] * 3,
            *["signed in from 127.0.0.1 to this account page"] * 2,
        ]
    finally:
        await elsewhere.close()


async def test_a_changed_password_signs_in_and_the_old_one_no_longer_does(
    browser: Any, page: Any, authserver: RunningAuthServer, grace: dict[str, Any]
) -> None:
    elsewhere = await browser.new_context()
    try:
        other = await elsewhere.new_page()
        await sign_in_to_account(other, authserver)
        await sign_in_to_account(page, authserver)
        await page.get_by_label("Current password").fill(PASSWORD)
        await page.get_by_label("New password", exact=True).fill(NEW_PASSWORD)
        await page.get_by_label("New password again").fill(NEW_PASSWORD)
        await page.get_by_role("button", name="Change password").click()
        await page.wait_for_url(account(authserver) + "?done=password")
        assert "Your password was changed" in await page.get_by_role("status").inner_text()
        await other.reload()  # the other session ended with the change
        assert await other.get_by_role("button", name="Sign in").count() == 1
        await sign_in_to_account(other, authserver)
        assert await other.get_by_role("alert").inner_text() == (
            "The username or password is not correct."
        )
        await sign_in_to_account(other, authserver, NEW_PASSWORD)
        assert await other.locator("h1").inner_text() == "Your account"
    finally:
        await elsewhere.close()


async def test_a_user_of_the_configuration_file_is_told_where_the_password_changes(
    browser: Any, page: Any, authserver: RunningAuthServer
) -> None:
    elsewhere = await browser.new_context()  # a second session: its form carries the token
    await sign_in_to_account(await elsewhere.new_page(), authserver, "wonderland", "alice")
    await elsewhere.close()
    await sign_in_to_account(page, authserver, "wonderland", "alice")
    assert await page.locator("h1").inner_text() == "Your account"
    assert await page.get_by_label("Current password").count() == 0
    assert "defined in the server's configuration" in await page.content()
    # A form made by hand changes nothing either.
    token = await page.locator("input[name=csrf_token]").first.get_attribute("value")
    assert token
    response = await page.request.post(
        account(authserver) + "/password",
        form={
            "csrf_token": token,
            "current": "wonderland",
            "new": NEW_PASSWORD,
            "confirm": NEW_PASSWORD,
        },
        max_redirects=0,
    )
    assert response.status == 400
    assert "defined in the server's configuration" in await response.text()
    later = await browser.new_context()
    again = await later.new_page()
    await sign_in_to_account(again, authserver, "wonderland", "alice")  # unchanged
    assert await again.locator("h1").inner_text() == "Your account"
    await later.close()


async def test_forms_without_the_session_s_csrf_token_change_nothing(
    page: Any, client_app: ClientApp, authserver: RunningAuthServer, grace: dict[str, Any]
) -> None:
    await sign_in_to_account(page, authserver)
    token = await page.locator("input[name=csrf_token]").first.get_attribute("value")
    assert token
    for path, form in (
        ("/sessions/end", {}),
        ("/apps/revoke", {"client_id": "desktop"}),
        ("/password", {"current": PASSWORD, "new": NEW_PASSWORD, "confirm": NEW_PASSWORD}),
    ):
        for sent in ({}, {"csrf_token": "forged-" + token}):
            response = await page.request.post(
                account(authserver) + path, form={**form, **sent}, max_redirects=0
            )
            assert response.status == 403, (path, sent)
    # With the token, revoking an app the user never allowed is refused with a page.
    response = await page.request.post(
        account(authserver) + "/apps/revoke",
        form={"client_id": "desktop", "csrf_token": token},
        max_redirects=0,
    )
    assert response.status == 400
    assert "has no access to your account" in await response.text()
