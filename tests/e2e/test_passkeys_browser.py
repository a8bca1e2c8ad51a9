"""Passkeys in a real browser (Debian's Chromium driven by Playwright), with Chromium's
virtual authenticator (the DevTools protocol's WebAuthn domain: CTAP2, internal transport,
resident keys, user verification): adding a passkey on the account page, signing out,
signing in with the passkey alone, then with the password and the passkey as the second
step, into the small client application of test_browser_flow.py, which shows the ID
token's `amr` and `acr`. A replayed assertion and a spoiled one are refused. Last, the
device page's sign-in with the passkey alone. And with `password_sign_in: false`, the
sign-in page of passkeys alone.

The issuer is http://localhost:PORT: WebAuthn needs a domain for its RP ID and a secure
context, which http is on localhost.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

import pytest

from tests.authserver.conftest import (
    PASSWORD,
    RunningAuthServer,
    serve_authserver,
)
from tests.authserver.device_support import device_config
from tests.authserver.passkey_support import b64, unb64
from tests.e2e import page_problems
from tests.e2e.test_browser_flow import ClientApp, browser, client_app, starting_with

__all__ = ["browser", "client_app"]  # the fixtures, used here by name

pytestmark = pytest.mark.slow


@pytest.fixture
async def authserver(tmp_path: Path) -> AsyncIterator[RunningAuthServer]:
    config = device_config()
    config["issuer"] = "http://localhost:{port}"
    server = await serve_authserver(config, tmp_path)
    yield server
    await server.stop()


async def virtual_authenticator(context: Any, tab: Any) -> tuple[Any, str]:
    """Chromium's virtual authenticator for `tab`, as a platform authenticator that holds
    resident keys and verifies its user."""
    cdp = await context.new_cdp_session(tab)
    await cdp.send("WebAuthn.enable", {"enableUI": False})
    added = await cdp.send(
        "WebAuthn.addVirtualAuthenticator",
        {
            "options": {
                "protocol": "ctap2",
                "transport": "internal",
                "hasResidentKey": True,
                "hasUserVerification": True,
                "isUserVerified": True,
                "automaticPresenceSimulation": True,
            }
        },
    )
    return cdp, added["authenticatorId"]


async def sign_out(tab: Any, authserver: RunningAuthServer) -> None:
    await tab.goto(authserver.settings.issuer + "/logout")
    await tab.get_by_role("button", name="Sign out").click()
    await tab.wait_for_load_state()


async def to_login_page(tab: Any, client_app: ClientApp, authserver: RunningAuthServer) -> None:
    await tab.goto(client_app.url + "/")
    await tab.get_by_role("link", name="Sign in with Portcullis").click()
    await tab.wait_for_url(starting_with(authserver.settings.issuer + "/authorize?"))


async def test_a_passkey_added_on_the_account_page_signs_in_alone_and_as_second_step(
    browser: Any, client_app: ClientApp, authserver: RunningAuthServer
) -> None:
    issuer = authserver.settings.issuer
    context = await browser.new_context()
    tab = await context.new_page()
    tab.set_default_timeout(15_000)
    problems: list[str] = []
    page_problems.watch(tab, problems)
    cdp, authenticator = await virtual_authenticator(context, tab)

    # The account page: the password, then a passkey named and added.
    await tab.goto(issuer + "/account")
    await tab.get_by_label("Username").fill("alice")
    await tab.get_by_label("Password").fill(PASSWORD)
    await tab.get_by_role("button", name="Sign in", exact=True).click()
    await tab.get_by_role("heading", name="Passkeys").wait_for()
    await tab.get_by_label("Name of the new passkey").fill("Test laptop")
    await tab.get_by_role("button", name="Add a passkey").click()
    await tab.wait_for_url(issuer + "/account?done=passkey-added")
    assert await tab.locator(".passkey-name").all_inner_texts() == ["Test laptop"]
    assert "not used yet" in await tab.locator(".passkey-item").inner_text()
    held = (await cdp.send("WebAuthn.getCredentials", {"authenticatorId": authenticator}))[
        "credentials"
    ]
    assert len(held) == 1 and held[0]["isResidentCredential"]
    assert held[0]["rpId"] == "localhost"

    # Signed out, the passkey alone signs in: two factors, the key bound to its device.
    await sign_out(tab, authserver)
    await to_login_page(tab, client_app, authserver)
    posted: list[str] = []

    async def keep(route: Any) -> None:
        posted.append(route.request.post_data or "")
        await route.continue_()

    await tab.route(issuer + "/login/passkey", keep)
    await tab.get_by_role("button", name="Sign in with a passkey").click()
    await tab.get_by_role("button", name="Allow").click()
    await tab.wait_for_url(starting_with(client_app.redirect_uri + "?"))
    assert await tab.locator("#amr").inner_text() == "hwk user mfa"
    assert await tab.locator("#acr").inner_text() == "urn:portcullis:acr:mfa"
    await tab.unroute(issuer + "/login/passkey")

    # The same assertion again, from this browser with its new session's CSRF token:
    # refused, as its challenge was used (and issued to the session signed in since).
    client_app.extra = {"prompt": "login"}
    await to_login_page(tab, client_app, authserver)
    client_app.extra = {}
    csrf = await tab.locator("input[name=csrf_token]").first.get_attribute("value")
    fields = dict(parse_qsl(posted[0]))
    assert fields["csrf_token"] != csrf
    fields["csrf_token"] = csrf
    replayed = await context.request.post(
        issuer + "/login/passkey",
        data=urlencode(fields),
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        max_redirects=0,
    )
    assert replayed.status == 400
    assert "expired or was already used" in await replayed.text()

    # Signed out again: the password, then the passkey as the second step.
    await sign_out(tab, authserver)
    await to_login_page(tab, client_app, authserver)
    await tab.get_by_label("Username").fill("alice")
    await tab.get_by_label("Password").fill(PASSWORD)
    await tab.get_by_role("button", name="Sign in", exact=True).click()
    await tab.wait_for_url(issuer + "/login")
    assert await tab.get_by_label("Code").count() == 0  # no authenticator app: the passkey

    # A spoiled assertion (its signature changed on the way) is refused with the reason
    # shown, and the page offers the passkey again.
    async def spoil(route: Any) -> None:
        fields = dict(parse_qsl(route.request.post_data or ""))
        credential = json.loads(fields["passkey_response"])
        signature = bytearray(unb64(credential["response"]["signature"]))
        signature[-1] ^= 0x01
        credential["response"]["signature"] = b64(bytes(signature))
        fields["passkey_response"] = json.dumps(credential)
        await route.continue_(post_data=urlencode(fields))

    await tab.route(issuer + "/login/passkey", spoil)
    await tab.get_by_role("button", name="Use a passkey").click()
    await tab.wait_for_url(issuer + "/login/passkey")
    assert "not valid for this server" in await tab.get_by_role("alert").inner_text()
    await tab.unroute(issuer + "/login/passkey")
    await tab.get_by_role("button", name="Use a passkey").click()
    await tab.wait_for_url(starting_with(client_app.redirect_uri + "?"))
    assert await tab.locator("#amr").inner_text() == "pwd hwk user mfa"
    assert await tab.locator("#acr").inner_text() == "urn:portcullis:acr:mfa"

    # The device page's sign-in: the passkey alone, then that device's consent page.
    await sign_out(tab, authserver)
    started = await context.request.post(
        issuer + "/device_authorization", form={"client_id": "tv", "scope": "openid"}
    )
    user_code = (await started.json())["user_code"]
    await tab.goto(issuer + "/device")
    await tab.get_by_label("Code").fill(user_code)
    await tab.get_by_role("button", name="Continue").click()
    await tab.get_by_role("button", name="Sign in with a passkey").click()
    await tab.wait_for_url(issuer + "/device/login/passkey")
    await tab.get_by_role("button", name="Allow").click()
    await tab.get_by_role("heading", name="Device connected").wait_for()

    # The account page lists its last use; every page ran its script within its policy.
    await tab.goto(issuer + "/account")
    assert "last used" in await tab.locator(".passkey-item").inner_text()
    assert [p for p in problems if "Failed to load resource" not in p] == []
    await context.close()


async def test_without_passwords_the_login_page_signs_in_with_a_passkey_alone(
    browser: Any, client_app: ClientApp, authserver: RunningAuthServer
) -> None:
    """`password_sign_in: false` and no identity provider, on an issuer where passkeys work:
    the login page has no password field, only the passkey, which signs in a user who
    added it before; their account page then has no Password section."""
    issuer = authserver.settings.issuer
    context = await browser.new_context()
    tab = await context.new_page()
    tab.set_default_timeout(15_000)
    await virtual_authenticator(context, tab)
    await tab.goto(issuer + "/account")
    await tab.get_by_label("Username").fill("alice")
    await tab.get_by_label("Password").fill(PASSWORD)
    await tab.get_by_role("button", name="Sign in", exact=True).click()
    await tab.get_by_label("Name of the new passkey").fill("Test laptop")
    await tab.get_by_role("button", name="Add a passkey").click()
    await tab.wait_for_url(issuer + "/account?done=passkey-added")
    await sign_out(tab, authserver)

    # The operator turns passwords off (the same files, the same store).
    authserver.settings = replace(authserver.settings, password_sign_in=False)
    await authserver.restart()
    await to_login_page(tab, client_app, authserver)
    assert await tab.get_by_label("Password").count() == 0
    assert "does not take passwords" in await tab.locator("#no-password").inner_text()
    await tab.get_by_role("button", name="Sign in with a passkey").click()
    await tab.get_by_role("button", name="Allow").click()
    await tab.wait_for_url(starting_with(client_app.redirect_uri + "?"))
    assert await tab.locator("#amr").inner_text() == "hwk user mfa"
    await tab.goto(issuer + "/account")
    await tab.get_by_role("heading", name="Passkeys").wait_for()
    assert await tab.get_by_role("heading", name="Password").count() == 0
    await context.close()
