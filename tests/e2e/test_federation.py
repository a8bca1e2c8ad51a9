"""Signing in through an upstream OpenID Connect provider, end to end: the company directory
is panva's oidc-provider (tests/e2e/oidc_directory, installed with `npm ci` from its lock
file) on a loopback port, with a few accounts; the authorization server is its client. The
browser is an aiohttp session with a cookie jar, following each redirect by hand (the
directory finishes its own login and consent at once for the account the test names), so
that each response on the way can be looked at and tampered with.

Without node and npm these tests skip, saying so; under CI=true they fail instead.
"""

from __future__ import annotations

import asyncio
import html
import json
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import aiohttp
import jwt
import pytest

from authserver.protocol import pkce
from tests.authserver.conftest import (
    PASSWORD,
    REDIRECT,
    RunningAuthServer,
    StartAuthServer,
    default_config,
)
from tests.e2e.test_browser_flow import CHROMIUM, CHROMIUM_ARGS, browser_missing
from tests.support import reserve_port, service_missing

DIRECTORY = Path(__file__).parent / "oidc_directory"
DIRECTORY_SECRET = "directory-secret-for-the-authserver-0123456789"
ACCOUNTS = [
    # An employee whose email the directory verified, of the trusted domain.
    {
        "sub": "emp-1001",
        "email": "carol@corp.example",
        "email_verified": True,
        "name": "Carol Danvers",
        "preferred_username": "carol",
    },
    # The directory's account of alice, a local user already: verified, trusted domain.
    {
        "sub": "emp-1002",
        "email": "alice@example.com",
        "email_verified": True,
        "name": "Alice (directory)",
        "preferred_username": "alice",
    },
    # Claims alice's address but the directory never verified it.
    {
        "sub": "emp-1003",
        "email": "alice@example.com",
        "email_verified": False,
        "name": "Not Alice",
        "preferred_username": "mallory",
    },
    # bob's address, verified, but of a domain the operator does not trust for linking.
    {
        "sub": "emp-1004",
        "email": "bob@other.example",
        "email_verified": True,
        "name": "Bob Elsewhere",
        "preferred_username": "bob",
    },
]
VERIFIER = "v" * 43
SCOPE = "openid profile email"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def directory_script() -> Path:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        service_missing("node and npm are needed for the OIDC directory (Node.js 20 or later)")
    installed = DIRECTORY / "node_modules" / "oidc-provider" / "package.json"
    lock = json.loads((DIRECTORY / "package-lock.json").read_text())
    wanted = lock["packages"]["node_modules/oidc-provider"]["version"]
    if not installed.exists() or json.loads(installed.read_text())["version"] != wanted:
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=DIRECTORY,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            service_missing(f"npm ci of oidc-provider failed: {done.stderr.strip()[-500:]}")
    return DIRECTORY / "directory.mjs"


@dataclass
class Directory:
    url: str
    process: asyncio.subprocess.Process | None = None

    async def sign_in_as(self, http: aiohttp.ClientSession, sub: str) -> None:
        async with http.post(self.url + "/_test/account", json={"sub": sub}) as response:
            assert response.status == 204

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            await self.process.wait()


async def start_directory(script: Path, port: int, redirect_uri: str) -> Directory:
    process = await asyncio.create_subprocess_exec(
        "node",
        str(script),
        "--port",
        str(port),
        "--redirect-uri",
        redirect_uri,
        "--accounts",
        json.dumps(ACCOUNTS),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "DIRECTORY_CLIENT_SECRET": DIRECTORY_SECRET, "NODE_NO_WARNINGS": "1"},
    )
    assert process.stdout is not None
    try:
        line = await asyncio.wait_for(process.stdout.readline(), timeout=30)
    except TimeoutError:
        line = b""
    if b"listening" not in line:
        process.kill()
        _, err = await process.communicate()
        pytest.fail(f"the directory did not start: {err.decode()[-2000:]}")
    return Directory(f"http://127.0.0.1:{port}", process)


@dataclass
class Federated:
    server: RunningAuthServer
    directory: Directory
    directory_port: int


Setup = Callable[..., Awaitable[Federated]]


@pytest.fixture
async def federated(
    start_authserver: StartAuthServer, directory_script: Path
) -> AsyncIterator[Setup]:
    started: list[Directory] = []

    async def setup(*, directory_running: bool = True, **provider: Any) -> Federated:
        port = reserve_port()
        config = default_config()
        config["clients"].append(
            {
                "client_id": "portal",
                "client_name": "Staff Portal",
                "token_endpoint_auth_method": "none",
                "redirect_uris": [REDIRECT],
                "scope": SCOPE,
                "skip_consent": True,
            }
        )
        config["identity_providers"] = [
            {
                "name": "corp",
                "display_name": "Corp Directory",
                "issuer": f"http://127.0.0.1:{port}",
                "client_id": "portcullis",
                "client_secret": DIRECTORY_SECRET,
                "timeout": "2s",
                **provider,
            }
        ]
        server = await start_authserver(config)
        directory = Directory(f"http://127.0.0.1:{port}")
        if directory_running:
            directory = await start_directory(
                directory_script, port, server.endpoint("/federation/corp/callback")
            )
            started.append(directory)
        return Federated(server, directory, port)

    yield setup
    for directory in started:
        await directory.stop()


@pytest.fixture
async def browser() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        yield session


def authorize_url(server: RunningAuthServer) -> str:
    query = {
        "response_type": "code",
        "client_id": "portal",
        "redirect_uri": REDIRECT,
        "scope": SCOPE,
        "state": "client-state",
        "code_challenge": pkce.s256(VERIFIER),
        "code_challenge_method": "S256",
    }
    return server.endpoint("/authorize?" + urlencode(query))


async def provider_link(browser: aiohttp.ClientSession, server: RunningAuthServer) -> str:
    """The sign-in page's button for the directory, as the page gives it."""
    async with browser.get(authorize_url(server), allow_redirects=False) as response:
        assert response.status == 200
        page = await response.text()
    assert 'name="password"' in page
    start = page.index('class="button provider" href="') + len('class="button provider" href="')
    href = page[start : page.index('"', start)].replace("&amp;", "&")
    assert "Corp Directory" in page
    return server.url + href if href.startswith("/") else href


@dataclass
class Answer:
    status: int
    url: str
    location: str | None
    text: str


async def get(browser: aiohttp.ClientSession, url: str) -> Answer:
    async with browser.get(url, allow_redirects=False) as response:
        return Answer(response.status, url, response.headers.get("Location"), await response.text())


async def follow(
    browser: aiohttp.ClientSession, url: str, *, until: str
) -> tuple[Answer, list[Answer]]:
    """GET `url` and each redirect after it, until an answer that does not redirect or one
    redirecting to an address starting with `until` (not followed). The last answer, and
    every one on the way."""
    seen: list[Answer] = []
    for _ in range(12):
        answer = await get(browser, url)
        seen.append(answer)
        if answer.location is None:
            return answer, seen
        url = str(aiohttp.client.URL(url).join(aiohttp.client.URL(answer.location)))
        if url.startswith(until):
            return answer, seen
    raise AssertionError(f"too many redirects: {[a.url for a in seen]}")


async def to_callback(fed: Federated, browser: aiohttp.ClientSession, sub: str) -> str:
    """Sign in at the directory as `sub`; the callback URL it sends the browser back to."""
    await fed.directory.sign_in_as(browser, sub)
    link = await provider_link(browser, fed.server)
    callback = fed.server.endpoint("/federation/corp/callback")
    last, _ = await follow(browser, link, until=callback)
    assert last.location is not None and last.location.startswith(callback), last
    return last.location


async def finish(fed: Federated, browser: aiohttp.ClientSession, callback_url: str) -> Answer:
    last, _ = await follow(browser, callback_url, until=REDIRECT)
    return last


def code_of(answer: Answer) -> str:
    assert answer.location is not None and answer.location.startswith(REDIRECT), answer
    query = parse_qs(urlsplit(answer.location).query)
    assert query["state"] == ["client-state"]
    return query["code"][0]


async def id_token_claims(server: RunningAuthServer, code: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            server.endpoint("/token"),
            data={
                "grant_type": "authorization_code",
                "code": code,
                "redirect_uri": REDIRECT,
                "client_id": "portal",
                "code_verifier": VERIFIER,
            },
        ) as response,
    ):
        assert response.status == 200, await response.text()
        body = await response.json()
    claims: dict[str, Any] = jwt.decode(body["id_token"], options={"verify_signature": False})
    return claims


# ---------------------------------------------------------------------------- tests


async def test_a_first_sign_in_creates_a_user_whose_sub_stays_the_same_afterwards(
    federated: Setup, browser: aiohttp.ClientSession
) -> None:
    fed = await federated()
    start = await provider_link(browser, fed.server)
    # The redirect to the directory: code, PKCE S256, state, nonce, the exact callback.
    answer = await get(browser, start)
    assert answer.status == 302 and answer.location is not None
    sent = parse_qs(urlsplit(answer.location).query)
    assert sent["response_type"] == ["code"] and sent["client_id"] == ["portcullis"]
    assert sent["code_challenge_method"] == ["S256"] and len(sent["code_challenge"][0]) == 43
    assert sent["redirect_uri"] == [fed.server.endpoint("/federation/corp/callback")]
    assert sent["scope"] == ["openid email profile"]
    assert len(sent["state"][0]) >= 32 and len(sent["nonce"][0]) >= 32

    callback = await to_callback(fed, browser, "emp-1001")
    assert parse_qs(urlsplit(callback).query)["iss"] == [fed.directory.url]  # RFC 9207
    claims = await id_token_claims(fed.server, code_of(await finish(fed, browser, callback)))
    store = fed.server.services.store
    user = await store.get_user(claims["sub"])
    assert user is not None
    assert (user.username, user.claims) == (
        "carol",
        {"email": "carol@corp.example", "email_verified": True, "name": "Carol Danvers"},
    )
    assert claims["sub"] != "emp-1001"  # a local subject, not the directory's
    (link,) = await store.identity_links(claims["sub"])
    assert (link.issuer, link.provider_subject) == (fed.directory.url, "emp-1001")

    # Signing in again, in a new browser: the same local user.
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as other:
        again = await id_token_claims(
            fed.server, code_of(await finish(fed, other, await to_callback(fed, other, "emp-1001")))
        )
    assert again["sub"] == claims["sub"]
    assert len(await store.list_users()) == 3  # alice, bob and carol


async def test_a_verified_email_of_a_trusted_domain_signs_in_the_existing_user(
    federated: Setup, browser: aiohttp.ClientSession
) -> None:
    fed = await federated(link_by_verified_email_domains=["example.com"])
    code = code_of(await finish(fed, browser, await to_callback(fed, browser, "emp-1002")))
    claims = await id_token_claims(fed.server, code)
    assert claims["sub"] == fed.server.subject("alice")
    links = await fed.server.services.store.identity_links(fed.server.subject("alice"))
    assert [(link.provider_subject) for link in links] == ["emp-1002"]
    assert len(await fed.server.services.store.list_users()) == 2  # nobody created


async def test_an_unverified_email_never_links_to_the_existing_user(
    federated: Setup, browser: aiohttp.ClientSession
) -> None:
    fed = await federated(link_by_verified_email_domains=["example.com"])
    code = code_of(await finish(fed, browser, await to_callback(fed, browser, "emp-1003")))
    claims = await id_token_claims(fed.server, code)
    store = fed.server.services.store
    assert claims["sub"] != fed.server.subject("alice")
    assert await store.identity_links(fed.server.subject("alice")) == []
    user = await store.get_user(claims["sub"])
    assert user is not None and user.username == "mallory"
    assert user.claims["email_verified"] is False


async def test_without_the_rule_or_of_another_domain_a_user_with_that_email_is_not_taken_over(
    federated: Setup, browser: aiohttp.ClientSession
) -> None:
    fed = await federated()  # link_by_verified_email_domains empty: never linked
    code = code_of(await finish(fed, browser, await to_callback(fed, browser, "emp-1002")))
    first = await id_token_claims(fed.server, code)
    assert first["sub"] != fed.server.subject("alice")
    user = await fed.server.services.store.get_user(first["sub"])
    assert user is not None and user.username.startswith("alice-")  # alice is taken

    fed2 = await federated(link_by_verified_email_domains=["example.com"])
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as other:
        code = code_of(await finish(fed2, other, await to_callback(fed2, other, "emp-1004")))
    second = await id_token_claims(fed2.server, code)
    assert second["sub"] != fed2.server.subject("bob")
    assert await fed2.server.services.store.identity_links(fed2.server.subject("bob")) == []


async def test_a_provider_that_is_down_shows_the_sign_in_page_whose_password_form_still_works(
    federated: Setup, browser: aiohttp.ClientSession
) -> None:
    fed = await federated(directory_running=False)
    link = await provider_link(browser, fed.server)
    answer = await get(browser, link)
    assert answer.status == 502
    assert "Corp Directory cannot be reached right now" in answer.text
    assert 'name="password"' in answer.text
    # The password form on that page signs alice in.
    page = answer.text
    fields = dict((name, value) for name, value in _hidden_fields(page))
    fields.update(username="alice", password=PASSWORD)
    async with browser.post(
        fed.server.endpoint("/login"), data=fields, allow_redirects=False
    ) as response:
        assert response.status == 303
        assert response.headers["Location"].startswith(REDIRECT)


def _hidden_fields(page: str) -> list[tuple[str, str]]:
    return [
        (html.unescape(name), html.unescape(value))
        for name, value in re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', page)
    ]


async def test_a_forged_state_is_refused_and_nothing_is_stored(
    federated: Setup, browser: aiohttp.ClientSession
) -> None:
    fed = await federated()
    callback = await to_callback(fed, browser, "emp-1001")
    answer = await finish(fed, browser, _with(callback, state="forged-by-someone"))
    assert answer.status == 400
    assert "does not belong to this sign-in" in answer.text
    assert len(await fed.server.services.store.list_users()) == 2


async def test_a_callback_answers_once_however_often_it_is_sent(
    federated: Setup, browser: aiohttp.ClientSession
) -> None:
    fed = await federated()
    callback = await to_callback(fed, browser, "emp-1001")
    cookies = {morsel.key: morsel.value for morsel in browser.cookie_jar}

    async def send() -> Answer:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as copy:
            copy.cookie_jar.update_cookies(cookies, aiohttp.client.URL(fed.server.url))
            return await get(copy, callback)

    # The same response, sent at once from copies of the browser: `state` is used once.
    answers = await asyncio.gather(*(send() for _ in range(5)))
    signed_in = [a for a in answers if a.location and a.location.startswith(REDIRECT)]
    assert len(signed_in) == 1, [a.status for a in answers]
    assert sorted(a.status for a in answers if a not in signed_in) == [400] * 4
    # And later again, once the sign-in is done.
    late = await send()
    assert late.status == 400 and late.location is None
    assert len(await fed.server.services.store.list_users()) == 3  # carol, once


async def test_a_callback_in_another_browser_is_refused(
    federated: Setup, browser: aiohttp.ClientSession
) -> None:
    fed = await federated()
    callback = await to_callback(fed, browser, "emp-1001")
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as other:
        answer = await finish(fed, other, callback)
    assert answer.status == 400
    assert "not started in this browser" in answer.text
    assert len(await fed.server.services.store.list_users()) == 2


async def test_a_response_naming_another_issuer_is_refused(
    federated: Setup, browser: aiohttp.ClientSession
) -> None:
    fed = await federated()
    callback = await to_callback(fed, browser, "emp-1001")
    answer = await finish(fed, browser, _with(callback, iss="https://attacker.example"))
    assert answer.status == 400
    assert "another issuer" in answer.text
    assert len(await fed.server.services.store.list_users()) == 2


async def test_a_start_link_not_made_for_this_session_starts_nothing(
    federated: Setup, browser: aiohttp.ClientSession
) -> None:
    fed = await federated()
    link = await provider_link(browser, fed.server)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as other:
        answer = await get(other, link)
    assert answer.status == 403 and answer.location is None


def _with(url: str, **changes: str) -> str:
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    query.update(changes)
    return urlunsplit(parts._replace(query=urlencode(query)))


# ---------------------------------------------------------------------------- in a browser


@pytest.fixture
async def chromium() -> AsyncIterator[Any]:
    if not Path(CHROMIUM).exists():
        browser_missing(f"{CHROMIUM} is missing (apt-get install chromium)")
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        browser_missing("the playwright package is not installed (pip install playwright)")
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        await launched.close()


async def test_a_person_signs_in_with_the_directory_button_in_a_browser(
    federated: Setup, chromium: Any, http: aiohttp.ClientSession
) -> None:
    fed = await federated()
    await fed.directory.sign_in_as(http, "emp-1001")
    page = await (await chromium.new_context()).new_page()
    arrived: list[str] = []

    async def client(route: Any) -> None:
        arrived.append(route.request.url)
        await route.fulfill(status=200, content_type="text/plain", body="back at the client")

    await page.route(REDIRECT + "*", client)
    await page.goto(authorize_url(fed.server))
    # The password form and the directory's button, side by side.
    assert await page.locator('input[name="password"]').count() == 1
    await page.get_by_role("link", name="Corp Directory").click()
    await page.wait_for_url(REDIRECT + "*")
    (url,) = arrived
    query = parse_qs(urlsplit(url).query)
    assert query["state"] == ["client-state"] and query["iss"] == [fed.server.settings.issuer]
    claims = await id_token_claims(fed.server, query["code"][0])
    user = await fed.server.services.store.get_user(claims["sub"])
    assert user is not None and user.username == "carol"
