"""The authorization code flow in a real browser (Chromium driven by Playwright), through the
authorization server's own login and consent pages, into a small real client application.

The client application is started here, a native app in the sense of RFC 8252: it sends the
browser to /authorize with state, nonce and a PKCE challenge, receives the redirect on a
loopback port of its own (the registered `http://127.0.0.1/cb` matches by the loopback rule
of RFC 8252 §7.3, which only public native clients get), checks `state` and `iss`,
redeems the code, verifies the ID token against the published keys, calls /userinfo and
shows the result. The browser is Debian's Chromium; Playwright never downloads one.
"""

from __future__ import annotations

import base64
import hashlib
import html
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp
import jwt
import pytest
from aiohttp import web

from tests.authserver.conftest import (
    PASSWORD,
    RunningAuthServer,
    default_config,
    serve_authserver,
)
from tests.e2e import page_problems
from tests.support import start_site

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCOPE = "openid profile email orders:read"

pytestmark = pytest.mark.slow


def browser_missing(reason: str) -> None:
    """Skip with the reason, except on CI where a missing browser is a failure."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: the browser tests must run)")
    pytest.skip(reason)


# ---------------------------------------------------------------------------- the client app


@dataclass
class ClientApp:
    """A public native client (`desktop`, `application_type: native`) with a flow store."""

    issuer: str
    client_id: str = "desktop"
    url: str = ""
    pending: dict[str, dict[str, str]] = field(default_factory=dict)
    extra: dict[str, str] = field(default_factory=dict)  # more authorization parameters
    runner: Any = None
    session: aiohttp.ClientSession | None = None

    @property
    def redirect_uri(self) -> str:
        return self.url + "/cb"

    async def start(self) -> ClientApp:
        app = web.Application()
        app.router.add_get("/", self.home)
        app.router.add_get("/start", self.begin)
        app.router.add_get("/cb", self.callback)
        app.router.add_get("/favicon.ico", self.no_icon)
        self.session = aiohttp.ClientSession()
        self.runner, self.url = await start_site(app)
        return self

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()
        if self.runner is not None:
            await self.runner.cleanup()

    @staticmethod
    def render(title: str, body: str, status: int = 200) -> web.Response:
        return web.Response(
            text=f"<!doctype html><title>{title}</title><h1>{title}</h1>{body}",
            content_type="text/html",
            status=status,
        )

    async def no_icon(self, _: web.Request) -> web.Response:
        return web.Response(status=204)

    async def home(self, _: web.Request) -> web.Response:
        return self.render("Orders app", '<a href="/start">Sign in with Portcullis</a>')

    async def begin(self, _: web.Request) -> web.Response:
        state, nonce = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
        verifier = secrets.token_urlsafe(48)
        digest = hashlib.sha256(verifier.encode()).digest()
        challenge = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        self.pending[state] = {"verifier": verifier, "nonce": nonce}
        query = urlencode(
            {
                "response_type": "code",
                "client_id": self.client_id,
                "redirect_uri": self.redirect_uri,
                "scope": SCOPE,
                "state": state,
                "nonce": nonce,
                "code_challenge": challenge,
                "code_challenge_method": "S256",
                **self.extra,
            }
        )
        raise web.HTTPFound(f"{self.issuer}/authorize?{query}")

    async def callback(self, request: web.Request) -> web.Response:
        query = request.query
        flow = self.pending.pop(query.get("state", ""), None)
        if flow is None:
            return self.render("Unknown state", "", status=400)
        if query.get("iss") != self.issuer:  # RFC 9207 §2.4
            return self.render("Wrong issuer", "", status=400)
        if "error" in query:
            error = html.escape(query["error"])
            return self.render("Sign-in failed", f'<p id="error">{error}</p>')
        assert self.session is not None
        async with self.session.post(
            self.issuer + "/token",
            data={
                "grant_type": "authorization_code",
                "code": query["code"],
                "redirect_uri": self.redirect_uri,
                "client_id": self.client_id,
                "code_verifier": flow["verifier"],
            },
        ) as response:
            tokens = await response.json()
            if response.status != 200:
                return self.render("Token request failed", html.escape(str(tokens)), status=502)
        claims = await self.verify_id_token(tokens["id_token"])
        if claims.get("nonce") != flow["nonce"]:
            return self.render("Wrong nonce", "", status=400)
        async with self.session.get(
            self.issuer + "/userinfo",
            headers={"Authorization": f"Bearer {tokens['access_token']}"},
        ) as response:
            userinfo = await response.json()
        rows = {
            "subject": claims["sub"],
            "name": userinfo.get("name", ""),
            "email": userinfo.get("email", ""),
            "scope": tokens["scope"],
            "amr": " ".join(claims.get("amr", [])),
            "acr": claims.get("acr", ""),
        }
        body = "".join(f'<p id="{k}">{html.escape(str(v))}</p>' for k, v in rows.items())
        return self.render("Signed in", body)

    async def verify_id_token(self, token: str) -> dict[str, Any]:
        assert self.session is not None
        async with self.session.get(self.issuer + "/jwks") as response:
            jwks = await response.json()
        kid = jwt.get_unverified_header(token)["kid"]
        [jwk] = [k for k in jwks["keys"] if k["kid"] == kid]
        claims: dict[str, Any] = jwt.decode(
            token,
            jwt.PyJWK(jwk).key,
            algorithms=[jwk["alg"]],
            audience=self.client_id,
            issuer=self.issuer,
        )
        return claims


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    if not Path(CHROMIUM).exists():
        browser_missing(f"{CHROMIUM} is missing (apt-get install chromium)")
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        browser_missing("the playwright package is not installed (pip install playwright)")
    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        await chromium.close()


@pytest.fixture
async def authserver(tmp_path: Path) -> AsyncIterator[RunningAuthServer]:
    server = await serve_authserver(default_config(), tmp_path)
    yield server
    await server.stop()


@pytest.fixture
async def client_app(authserver: RunningAuthServer) -> AsyncIterator[ClientApp]:
    app = await ClientApp(authserver.settings.issuer).start()
    yield app
    await app.stop()


@pytest.fixture
async def page(browser: Any) -> AsyncIterator[Any]:
    context = await browser.new_context()
    tab = await context.new_page()
    tab.set_default_timeout(15_000)
    # What went wrong in the page: console messages (CSP reports among them), script errors
    # and failed responses.
    problems: list[str] = []

    def failed(response: Any) -> None:
        if response.status >= 400:
            problems.append(f"{response.status} {response.url}")

    page_problems.watch(tab, problems)
    tab.on("response", failed)
    tab.problems = problems
    yield tab
    await context.close()


def starting_with(prefix: str) -> Any:
    return lambda url: url.startswith(prefix)


async def sign_in(page: Any, client_app: ClientApp, authserver: RunningAuthServer) -> None:
    """From the client's home page through the login page to the consent page."""
    await page.goto(client_app.url + "/")
    await page.get_by_role("link", name="Sign in with Portcullis").click()
    await page.wait_for_url(starting_with(authserver.settings.issuer + "/authorize?"))
    assert await page.title() == "Sign in · Portcullis"
    await page.get_by_label("Username").fill("alice")
    await page.get_by_label("Password").fill(PASSWORD)
    await page.get_by_role("button", name="Sign in").click()
    await page.wait_for_url(authserver.settings.issuer + "/login")
    assert await page.title() == "Allow access · Portcullis"


# ---------------------------------------------------------------------------- tests


async def test_code_flow_through_the_login_and_consent_pages_signs_the_user_in(
    page, client_app, authserver
):
    await sign_in(page, client_app, authserver)
    consent = page.locator("main")
    await consent.get_by_text("Desktop App").wait_for()
    for description in (
        "Sign you in",
        "Know your name",
        "Know your email address",
        "Read your orders",
    ):
        await consent.get_by_text(description).wait_for()

    await page.get_by_role("button", name="Allow").click()
    await page.wait_for_url(starting_with(client_app.redirect_uri + "?"))
    assert await page.locator("h1").inner_text() == "Signed in"
    assert await page.locator("#name").inner_text() == "Alice Liddell"
    assert await page.locator("#email").inner_text() == "alice@example.com"
    assert await page.locator("#scope").inner_text() == SCOPE
    subject = await page.locator("#subject").inner_text()
    assert subject == authserver.settings.subject_of(authserver.settings.user("alice"))  # type: ignore[arg-type]
    assert page.problems == []  # no Content-Security-Policy report, no script error

    # A second sign-in needs neither the login nor the consent page.
    await page.goto(client_app.url + "/")
    await page.get_by_role("link", name="Sign in with Portcullis").click()
    await page.wait_for_url(starting_with(client_app.redirect_uri + "?"))
    assert await page.locator("h1").inner_text() == "Signed in"
    assert await page.locator("#subject").inner_text() == subject


async def test_denying_consent_returns_access_denied_to_the_client(page, client_app, authserver):
    await sign_in(page, client_app, authserver)
    await page.get_by_role("button", name="Deny").click()
    await page.wait_for_url(starting_with(client_app.redirect_uri + "?"))
    assert await page.locator("h1").inner_text() == "Sign-in failed"
    assert await page.locator("#error").inner_text() == "access_denied"
    assert client_app.pending == {}
    assert page.problems == []


async def test_a_wrong_password_keeps_the_browser_on_the_login_page(page, client_app, authserver):
    await page.goto(client_app.url + "/start")
    await page.get_by_label("Username").fill("alice")
    await page.get_by_label("Password").fill("not the password")
    await page.get_by_role("button", name="Sign in").click()
    await page.wait_for_url(authserver.settings.issuer + "/login")
    alert = page.get_by_role("alert")
    assert await alert.inner_text() == "The username or password is not correct."
    assert await page.get_by_label("Username").input_value() == "alice"
    assert await page.get_by_label("Password").input_value() == ""
    assert client_app.pending  # the client never got an answer


async def test_the_page_watch_reports_a_policy_violation_and_not_chromiums_notes(browser: Any):
    """page_problems.watch, which every browser test's verdict on a page rests on: a script
    the page's Content-Security-Policy refuses is reported; Chromium's note that autofocus
    was skipped (a field was focused first) is not."""
    context = await browser.new_context()
    try:
        tab = await context.new_page()
        problems: list[str] = []
        page_problems.watch(tab, problems)
        await tab.set_content(
            "<html><head><meta http-equiv='Content-Security-Policy' content=\"script-src "
            "'sha256-" + _FOCUS_SCRIPT_HASH + "'\"></head><body><input id=a>"
            "<input id=b autofocus><script>" + _FOCUS_SCRIPT + "</script>"
            "<script>document.title = 'refused';</script></body></html>"
        )
        await tab.wait_for_timeout(200)
        assert await tab.evaluate("document.activeElement.id") == "a"  # the allowed script ran
        assert await tab.title() != "refused"
    finally:
        await context.close()
    assert len(problems) == 1 and "Content Security Policy" in problems[0], problems


_FOCUS_SCRIPT = "document.getElementById('a').focus()"
_FOCUS_SCRIPT_HASH = base64.b64encode(hashlib.sha256(_FOCUS_SCRIPT.encode()).digest()).decode()
