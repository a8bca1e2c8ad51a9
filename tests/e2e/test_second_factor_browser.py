"""Authenticator apps in a real browser (Debian's Chromium driven by Playwright): setting
one up on the /factors pages, then signing in with the password and the app's code, into
the small client application of test_browser_flow.py, which shows the ID token's `amr` and
`acr`.

The server runs on a MovableClock that is never moved back: codes are made (by pyotp) for
the time the server sees. It is not moved ahead either, since the client checks the ID
token's `iat` against the real time; the sign-in uses the next step's code, which the
window of one step accepts.
"""

from __future__ import annotations

import base64
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pyotp
import pytest

from tests.authserver.conftest import (
    PASSWORD,
    MovableClock,
    RunningAuthServer,
    default_config,
    serve_authserver,
)
from tests.e2e import page_problems
from tests.e2e.test_browser_flow import ClientApp, browser, client_app, page, starting_with

__all__ = ["browser", "client_app", "page"]  # the fixtures, used here by name

pytestmark = pytest.mark.slow


@pytest.fixture
def clock() -> MovableClock:
    return MovableClock()


@pytest.fixture
async def authserver(tmp_path: Path, clock: MovableClock) -> AsyncIterator[RunningAuthServer]:
    config = default_config()
    config["second_factors"] = {"encryption_key": base64.b64encode(os.urandom(32)).decode()}
    server = await serve_authserver(config, tmp_path, clock)
    yield server
    await server.stop()


async def password_then(page: Any, client_app: ClientApp, authserver: RunningAuthServer) -> None:
    await page.goto(client_app.url + "/")
    await page.get_by_role("link", name="Sign in with Portcullis").click()
    await page.wait_for_url(starting_with(authserver.settings.issuer + "/authorize?"))
    await page.get_by_label("Username").fill("alice")
    await page.get_by_label("Password").fill(PASSWORD)
    await page.get_by_role("button", name="Sign in").click()
    await page.wait_for_url(authserver.settings.issuer + "/login")


async def test_setting_up_an_app_then_signing_in_with_its_code(
    browser: Any, client_app: ClientApp, authserver: RunningAuthServer, clock: MovableClock
) -> None:
    context = await browser.new_context()
    tab = await context.new_page()
    tab.set_default_timeout(15_000)
    problems: list[str] = []
    page_problems.watch(tab, problems)

    # Signed in with the password alone: the client is told so.
    await password_then(tab, client_app, authserver)
    await tab.get_by_role("button", name="Allow").click()
    await tab.wait_for_url(starting_with(client_app.redirect_uri + "?"))
    assert await tab.locator("#amr").inner_text() == "pwd"
    assert await tab.locator("#acr").inner_text() == "urn:portcullis:acr:pwd"

    # Setting up the app: a QR code and the key, then a wrong code, then the right one.
    await tab.goto(authserver.settings.issuer + "/factors")
    await tab.get_by_role("button", name="Set up an authenticator app").click()
    await tab.locator(".qr svg").wait_for()
    secret = (await tab.locator("#secret").inner_text()).replace(" ", "")
    uri = await tab.locator("#otpauth-uri").text_content()
    assert pyotp.parse_uri(uri).secret == secret
    valid = {pyotp.TOTP(secret).at(clock.now + 30 * k) for k in (-1, 0, 1)}
    await tab.get_by_label("Code from the app").fill(
        "000000" if "000000" not in valid else "999999"
    )
    await tab.get_by_role("button", name="Confirm").click()
    assert "not correct" in await tab.get_by_role("alert").inner_text()
    assert (await tab.locator("#secret").inner_text()).replace(" ", "") == secret
    await tab.get_by_label("Code from the app").fill(pyotp.TOTP(secret).at(clock.now))
    await tab.get_by_role("button", name="Confirm").click()
    await tab.get_by_role("heading", name="Your recovery codes").wait_for()
    codes = await tab.locator(".recovery-codes code").all_inner_texts()
    assert len(codes) == 10
    # The inline QR code breaks no Content-Security-Policy, and no script runs (the 400 of
    # the wrong code is the one resource that failed).
    assert [p for p in problems if "Failed to load resource" not in p] == []
    await context.close()

    # Another browser: the password, then the code.
    context = await browser.new_context()
    tab = await context.new_page()
    tab.set_default_timeout(15_000)
    await password_then(tab, client_app, authserver)
    assert await tab.title() == "Enter your code · Portcullis"
    valid = {pyotp.TOTP(secret).at(clock.now + 30 * k) for k in (-1, 0, 1, 2)}
    wrong = next(
        code for code in ("000000", "111111", "222222", "333333", "444444") if code not in valid
    )
    await tab.get_by_label("Code").fill(wrong)
    await tab.get_by_role("button", name="Verify").click()
    assert "not correct" in await tab.get_by_role("alert").inner_text()
    await tab.get_by_label("Code").fill(pyotp.TOTP(secret).at(clock.now + 30))
    await tab.get_by_role("button", name="Verify").click()
    # Consent was given at the first sign-in: straight back to the client.
    await tab.wait_for_url(starting_with(client_app.redirect_uri + "?"))
    assert await tab.locator("h1").inner_text() == "Signed in"
    assert await tab.locator("#amr").inner_text() == "pwd otp mfa"
    assert await tab.locator("#acr").inner_text() == "urn:portcullis:acr:mfa"
    await context.close()

    # A third browser: a recovery code in place of the app.
    context = await browser.new_context()
    tab = await context.new_page()
    tab.set_default_timeout(15_000)
    await password_then(tab, client_app, authserver)
    await tab.get_by_label("Code").fill(codes[3])
    await tab.get_by_role("button", name="Verify").click()
    # Consent was given at the first sign-in: straight back to the client.
    await tab.wait_for_url(starting_with(client_app.redirect_uri + "?"))
    assert await tab.locator("#acr").inner_text() == "urn:portcullis:acr:mfa"

    # The account page, signed in by that sign-in: new recovery codes, then the app removed.
    await tab.goto(authserver.settings.issuer + "/account")
    assert await tab.locator("#recovery-left").inner_text() == "9"
    await tab.get_by_role("button", name="Get new recovery codes").click()
    await tab.locator("#renewed").wait_for()
    renewed = await tab.locator(".recovery-codes code").all_inner_texts()
    assert len(renewed) == 10 and not set(renewed) & set(codes)
    await tab.get_by_role("link", name="Back to your account").click()
    assert await tab.locator("#recovery-left").inner_text() == "10"
    await tab.get_by_role("button", name="Remove authenticator app").click()
    assert "was removed" in await tab.get_by_role("status").inner_text()
    await tab.get_by_role("link", name="Set one up").wait_for()
    await context.close()


async def test_a_client_asking_for_a_second_factor_leads_to_setting_one_up_and_back(
    browser: Any, client_app: ClientApp, authserver: RunningAuthServer, clock: MovableClock
) -> None:
    context = await browser.new_context()
    tab = await context.new_page()
    tab.set_default_timeout(15_000)
    problems: list[str] = []
    page_problems.watch(tab, problems)
    await password_then(tab, client_app, authserver)
    await tab.get_by_role("button", name="Allow").click()
    await tab.wait_for_url(starting_with(client_app.redirect_uri + "?"))

    # Now the client asks for the second level: the signed-in user has no app yet.
    client_app.extra = {"acr_values": "urn:portcullis:acr:mfa"}
    await tab.goto(client_app.url + "/")
    await tab.get_by_role("link", name="Sign in with Portcullis").click()
    await tab.locator("#reason").wait_for()
    await tab.get_by_role("button", name="Set up an authenticator app").click()
    secret = (await tab.locator("#secret").inner_text()).replace(" ", "")
    await tab.get_by_label("Code from the app").fill(pyotp.TOTP(secret).at(clock.now))
    await tab.get_by_role("button", name="Confirm").click()
    await tab.get_by_role("heading", name="Your recovery codes").wait_for()
    # Going on redirects to the client: the page's form-action lets the browser follow.
    await tab.get_by_role("button", name="I have saved them: continue").click()
    await tab.wait_for_url(starting_with(client_app.redirect_uri + "?"))
    assert await tab.locator("h1").inner_text() == "Signed in"
    assert await tab.locator("#acr").inner_text() == "urn:portcullis:acr:mfa"
    assert await tab.locator("#amr").inner_text() == "pwd otp mfa"
    assert [p for p in problems if "Content Security Policy" in p] == []
    await context.close()
