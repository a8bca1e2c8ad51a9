"""The example web app in a real browser (Debian's Chromium, driven by Playwright): what the
demo's walkthrough asks a person to do, click by click.

A browser enforces what a script does not: the pages' Content-Security-Policy (form-action
along the redirects from one server to the other), SameSite cookies on the way back to
/callback, and two session cookies on one host (browsers do not separate cookies by port).
Any CSP violation the browser reports fails the test. Playwright never downloads a browser.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.authserver.conftest import PASSWORD
from tests.examples.conftest import RunningWebApp, Stack
from tests.support import header_values

pytestmark = pytest.mark.slow


async def test_a_person_signs_in_calls_the_api_refreshes_and_signs_out_in_a_browser(
    page: tuple[Any, list[str]], stack: Stack, web_app: RunningWebApp
):
    tab, blocked = page
    await tab.goto(web_app.url + "/")
    await tab.click("text=Sign in")

    # The authorization server's pages.
    await tab.wait_for_url(stack.auth.endpoint("/authorize") + "*")
    await tab.fill("#username", "alice")
    await tab.fill("#password", PASSWORD)
    await tab.click("button[type=submit]")
    await tab.click("button[value=approve]")

    # Back in the app, signed in, with the ID token's claims on the page.
    await tab.wait_for_url(web_app.url + "/")
    assert await tab.text_content("h1") == "Hello, Alice Liddell"
    assert await tab.text_content("p.notice") == "Signed in as Alice Liddell."
    sub = await tab.text_content("xpath=//tr[th='sub']/td")
    assert sub == stack.auth.subject("alice")

    await tab.click("text=Call the orders API")
    await tab.wait_for_url(web_app.url + "/")
    assert await tab.text_content("strong.status") == "200"
    (seen,) = stack.upstream.requests
    assert header_values(seen, "X-Auth-Subject") == [stack.auth.subject("alice")]

    await tab.click("text=Refresh the tokens")
    await tab.wait_for_url(web_app.url + "/")
    notice = await tab.text_content("p.notice")
    assert notice == "Tokens refreshed: a new access token and a new refresh token."

    await tab.click("text=Sign out")
    await tab.wait_for_url(web_app.url + "/signed-out*")
    lead = await tab.text_content("p.lead")
    assert lead == "You are signed out of this application and of the authorization server."

    await tab.goto(web_app.url + "/")
    assert await tab.text_content("h1") == "Welcome"
    assert blocked == []
