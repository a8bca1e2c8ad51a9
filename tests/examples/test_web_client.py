"""examples/web_client as an OpenID Connect relying party.

Against the real stack (the authorization server's login and consent pages, the gateway, an
echo upstream), driven as a browser would be, without one: sign-in, the API call, refresh and
sign-out, and the answers it must refuse (a forged or replayed state, another issuer, another
browser's answer, forms without the CSRF token).

Against a provider under the test's control (`RogueProvider`, a real server too), whose token
endpoint hands out ID tokens shaped by the test: which ones the app must refuse, and proof that
it sends the PKCE verifier and authenticates with client_secret_basic.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote_plus, urlencode, urlsplit, urlunsplit

import aiohttp
import jwt
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec

from examples.web_client import Config, signin
from examples.web_client.app import DEFAULT_SCOPE
from examples.web_client.sessions import COOKIE
from tests.authserver.conftest import PASSWORD, SECRET, parse_form, verify_jwt
from tests.examples.conftest import EVIL_NAME, WEB_SECRET, RunningWebApp, Stack, run_web_app
from tests.support import bound_socket, compact, header_values, public_jwk, start_site

CLAIM_ROW = re.compile(r'<tr><th scope="row">(.*?)</th><td>(.*?)</td></tr>', re.S)
CSRF_FIELD = re.compile(r'name="csrf_token" value="([^"]*)"')
API_STATUS = re.compile(r'<strong class="status">(.*?)</strong>')
NOTICE = re.compile(r'<p class="notice" role="status">(.*?)</p>', re.S)
PRE = re.compile(r"<pre>(.*?)</pre>", re.S)


def query_of(url: str) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}


def with_param(url: str, name: str, value: str | None) -> str:
    """`url` with one query parameter replaced, or removed when `value` is None."""
    parts = urlsplit(url)
    params = {k: v for k, v in query_of(url).items() if k != name}
    if value is not None:
        params[name] = value
    return urlunsplit(parts._replace(query=urlencode(params)))


@dataclass
class Page:
    status: int
    headers: Any
    text: str
    url: str

    @property
    def location(self) -> str:
        return str(self.headers.get("Location", ""))

    @property
    def plain(self) -> str:
        """The text with entities decoded, for messages that contain quotes."""
        return html.unescape(self.text)

    def claims(self) -> dict[str, str]:
        return {html.unescape(k): html.unescape(v) for k, v in CLAIM_ROW.findall(self.text)}

    def csrf_token(self) -> str:
        tokens = set(CSRF_FIELD.findall(self.text))
        assert len(tokens) == 1, f"expected one CSRF token on the page, found {tokens}"
        return tokens.pop()

    def api_status(self) -> str | None:
        found = API_STATUS.search(self.text)
        return found.group(1) if found else None

    def api_body(self) -> str:
        found = PRE.search(self.text)
        assert found, "no API result on the page"
        return html.unescape(found.group(1))

    def notice(self) -> str | None:
        found = NOTICE.search(self.text)
        return html.unescape(found.group(1)).strip() if found else None

    @property
    def signed_in(self) -> bool:
        return "<h1>Hello, " in self.text

    @property
    def offers_sign_in(self) -> bool:
        return 'href="/login"' in self.text


class Visitor:
    """A browser as far as HTTP goes: one cookie jar for every host, redirects followed only
    when a test says so."""

    def __init__(self, http: aiohttp.ClientSession, web_url: str) -> None:
        self.http = http
        self.web = web_url
        self.last: Page | None = None

    def url(self, path_or_url: str) -> str:
        return path_or_url if "://" in path_or_url else self.web + path_or_url

    async def get(self, path_or_url: str) -> Page:
        url = self.url(path_or_url)
        async with self.http.get(url, allow_redirects=False) as response:
            return Page(response.status, response.headers, await response.text(), url)

    async def post(self, path_or_url: str, data: dict[str, str]) -> Page:
        url = self.url(path_or_url)
        async with self.http.post(url, data=data, allow_redirects=False) as response:
            return Page(response.status, response.headers, await response.text(), url)

    def cookie(self) -> str | None:
        for cookie in self.http.cookie_jar:
            if cookie.key == COOKIE:
                return cookie.value
        return None

    async def start_login(self) -> str:
        page = await self.get("/login")
        assert page.status == 302, page.text
        return page.location

    async def authorize(
        self,
        location: str,
        *,
        username: str = "alice",
        password: str = PASSWORD,
        decision: str = "approve",
    ) -> str:
        """Through the authorization server's login and consent pages; the URL it sends the
        browser back to."""
        page = await self.get(location)
        for _ in range(3):
            if page.status in (302, 303):
                return page.location
            assert page.status == 200, page.text
            action, fields = parse_form(page.text)
            if action.endswith("/login"):
                fields.update(username=username, password=password)
            else:
                fields["decision"] = decision
            page = await self.post(urlsplit(location)._replace(path=action).geturl(), fields)
        raise AssertionError("the authorization server never sent the browser back")

    async def follow_to_start(self, page: Page) -> Page:
        assert page.status == 303, page.text
        assert page.location == "/", page.location
        self.last = await self.get("/")
        assert self.last.status == 200
        return self.last

    async def sign_in(self, username: str = "alice") -> Page:
        callback = await self.authorize(await self.start_login(), username=username)
        return await self.follow_to_start(await self.get(callback))

    def csrf_token(self) -> str:
        """The CSRF token of the start page last seen."""
        assert self.last is not None, "no start page seen yet"
        return self.last.csrf_token()

    async def press(self, action: str) -> Page:
        """A button of the start page (a POST with the page's CSRF token), then the page."""
        pressed = await self.post(action, {"csrf_token": self.csrf_token()})
        return await self.follow_to_start(pressed)


@pytest.fixture
def visitor(http: aiohttp.ClientSession, web_app: RunningWebApp) -> Visitor:
    return Visitor(http, web_app.url)


@pytest.fixture
async def other_browser(web_app: RunningWebApp) -> AsyncIterator[Visitor]:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        yield Visitor(http, web_app.url)


# ---------------------------------------------------------------------------- pages


async def test_start_page_offers_sign_in_and_forbids_every_script(visitor: Visitor, stack):
    page = await visitor.get("/")
    assert page.status == 200
    assert page.offers_sign_in and not page.signed_in
    assert "Set-Cookie" not in page.headers  # nobody needs a session to read this
    csp = page.headers["Content-Security-Policy"]
    assert csp.startswith("default-src 'none';") and "script-src" not in csp
    assert f"form-action 'self' {stack.auth.settings.issuer};" in csp
    assert page.headers["X-Frame-Options"] == "DENY"
    assert page.headers["Cache-Control"] == "no-store"
    assert page.headers["Referrer-Policy"] == "no-referrer"
    assert "<script" not in page.text


async def test_login_sends_the_browser_to_the_authorization_endpoint_with_pkce_state_and_nonce(
    visitor: Visitor, stack: Stack
):
    first = await visitor.get("/login")
    assert first.status == 302
    assert first.location.startswith(stack.auth.endpoint("/authorize?"))
    asked = query_of(first.location)
    assert asked["response_type"] == "code"
    assert asked["client_id"] == "demo-web"
    assert asked["redirect_uri"] == stack.web_url + "/callback"
    assert asked["scope"] == DEFAULT_SCOPE
    assert asked["code_challenge_method"] == "S256"
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}", asked["code_challenge"])  # a SHA-256, base64url
    assert len(asked["state"]) >= 43 and len(asked["nonce"]) >= 43  # 256 random bits each
    cookie = first.headers["Set-Cookie"]
    assert cookie.startswith(f"{COOKIE}=")
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Path=/" in cookie
    assert "Domain" not in cookie  # host-only

    second = await visitor.get("/login")
    again = query_of(second.location)
    assert "Set-Cookie" not in second.headers  # the same session
    for name in ("state", "nonce", "code_challenge"):
        assert again[name] != asked[name], name


async def test_sign_in_shows_the_claims_of_the_verified_id_token_under_a_new_session_id(
    visitor: Visitor, stack: Stack
):
    location = await visitor.start_login()
    asked = query_of(location)
    before = visitor.cookie()
    callback = await visitor.authorize(location)
    answer = query_of(callback)
    assert answer["state"] == asked["state"]
    assert answer["iss"] == stack.auth.settings.issuer

    page = await visitor.follow_to_start(await visitor.get(callback))
    assert page.signed_in
    assert page.notice() == "Signed in as Alice Liddell."
    claims = page.claims()
    assert claims["sub"] == stack.auth.subject("alice")
    assert claims["iss"] == stack.auth.settings.issuer
    assert claims["aud"] == "demo-web"
    assert claims["nonce"] == asked["nonce"]
    assert claims["name"] == "Alice Liddell"
    assert claims["email"] == "alice@example.com"
    assert "at_hash" in claims
    assert "Hello, Alice Liddell" in page.text

    # A session id known before sign-in (one an attacker could have planted) is worthless
    # after it.
    after = visitor.cookie()
    assert after and before and after != before
    async with aiohttp.ClientSession(
        cookies={COOKIE: before}, cookie_jar=aiohttp.CookieJar(unsafe=True)
    ) as planted:
        stale = await Visitor(planted, visitor.web).get("/")
    assert stale.status == 200 and not stale.signed_in and stale.offers_sign_in


async def test_the_api_call_goes_through_the_gateway_with_the_users_access_token(
    visitor: Visitor, stack: Stack, http
):
    await visitor.sign_in()
    page = await visitor.press("/call-api")
    assert page.api_status() == "200"

    (seen,) = stack.upstream.requests
    assert seen["method"] == "GET" and seen["raw_path"] == "/orders?limit=5"
    alice = stack.auth.subject("alice")
    assert header_values(seen, "X-Auth-Subject") == [alice]
    assert header_values(seen, "X-Auth-Client-Id") == ["demo-web"]
    assert set(header_values(seen, "X-Auth-Scopes")[0].split()) >= {"orders:read", "openid"}
    (authorization,) = header_values(seen, "Authorization")
    assert authorization.startswith("Bearer ")
    token = authorization.removeprefix("Bearer ")
    claims = await verify_jwt(http, stack.auth, token, audience="orders-api", typ="at+jwt")
    assert (claims["sub"], claims["client_id"]) == (alice, "demo-web")
    # The page shows what the API answered: here the echo of the request it got.
    assert '"raw_path": "/orders?limit=5"' in page.api_body()


async def test_refresh_gets_new_tokens_that_the_api_accepts(visitor: Visitor, stack: Stack, http):
    await visitor.sign_in()
    await visitor.press("/call-api")
    page = await visitor.press("/refresh")
    assert page.notice() == "Tokens refreshed: a new access token and a new refresh token."
    assert page.signed_in and page.claims()["sub"] == stack.auth.subject("alice")
    page = await visitor.press("/call-api")
    assert page.api_status() == "200"

    first, second = (header_values(r, "Authorization")[0] for r in stack.upstream.requests)
    assert first != second
    for authorization in (first, second):
        token = authorization.removeprefix("Bearer ")
        await verify_jwt(http, stack.auth, token, audience="orders-api", typ="at+jwt")


async def test_refresh_after_the_grant_was_revoked_signs_the_user_out(
    visitor: Visitor, stack: Stack, web_app: RunningWebApp, http
):
    await visitor.sign_in()
    user = web_app.session(visitor.cookie()).user
    assert user is not None and user.refresh_token is not None
    raw = f"{quote_plus('demo-web')}:{quote_plus(WEB_SECRET)}".encode()
    revoked = await http.post(
        stack.auth.endpoint("/revoke"),
        data={"token": user.refresh_token},
        headers={"Authorization": "Basic " + base64.b64encode(raw).decode()},
    )
    assert revoked.status == 200

    page = await visitor.press("/refresh")
    assert page.notice() == "Your sign-in has ended at the authorization server: sign in again."
    assert not page.signed_in and page.offers_sign_in


async def test_sign_out_ends_both_sessions_and_revokes_the_refresh_token(
    visitor: Visitor, stack: Stack, web_app: RunningWebApp, http
):
    await visitor.sign_in()
    user = web_app.session(visitor.cookie()).user
    assert user is not None and user.refresh_token is not None

    out = await visitor.post("/logout", {"csrf_token": visitor.csrf_token()})
    assert out.status == 303
    assert out.location.startswith(stack.auth.endpoint("/logout?"))
    asked = query_of(out.location)
    assert asked["id_token_hint"] == user.id_token
    assert asked["post_logout_redirect_uri"] == stack.web_url + "/signed-out"
    assert asked["client_id"] == "demo-web"
    assert len(asked["state"]) >= 43

    back = await visitor.get(out.location)
    assert back.status == 302
    assert back.location == stack.web_url + "/signed-out?" + urlencode({"state": asked["state"]})
    done = await visitor.get(back.location)
    assert done.status == 200
    assert "You are signed out of this application and of the authorization server." in done.text
    start = await visitor.get("/")
    assert not start.signed_in and start.offers_sign_in

    # The refresh token is dead (RFC 7009)...
    response = await http.post(
        stack.auth.endpoint("/introspect"),
        data={"token": user.refresh_token},
        headers={
            "Authorization": "Basic "
            + base64.b64encode(f"resource-server:{SECRET}".encode()).decode()
        },
    )
    assert (await response.json()) == {"active": False}
    # ...and so is the session at the authorization server: a silent request needs a login.
    silent = await visitor.get(
        stack.auth.endpoint("/authorize?")
        + urlencode(
            {
                "response_type": "code",
                "client_id": "demo-web",
                "redirect_uri": stack.web_url + "/callback",
                "scope": "openid",
                "state": "s",
                "prompt": "none",
                "code_challenge": "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM",
                "code_challenge_method": "S256",
            }
        )
    )
    assert silent.status == 302
    assert query_of(silent.location)["error"] == "login_required"


async def test_signed_out_page_without_the_logout_state_does_not_claim_the_server_agreed(
    visitor: Visitor,
):
    await visitor.sign_in()
    await visitor.post("/logout", {"csrf_token": visitor.csrf_token()})
    page = await visitor.get("/signed-out?state=" + secrets.token_urlsafe(32))
    assert page.status == 200
    assert "You are signed out of this application." in page.text
    assert "authorization server" not in page.text


# ---------------------------------------------------------------------------- refusals


async def test_a_forged_state_is_refused_and_the_genuine_answer_still_signs_in(
    visitor: Visitor,
):
    callback = await visitor.authorize(await visitor.start_login())
    forged = await visitor.get(with_param(callback, "state", secrets.token_urlsafe(32)))
    assert forged.status == 400
    assert "state does not match" in forged.text
    assert not (await visitor.get("/")).signed_in
    # The forged answer spent neither the code nor the sign-in it imitated.
    page = await visitor.follow_to_start(await visitor.get(callback))
    assert page.signed_in


async def test_an_answer_meant_for_another_browser_is_refused(
    visitor: Visitor, other_browser: Visitor, web_app: RunningWebApp
):
    # Login CSRF: an attacker signs in and makes the victim's browser load the answer.
    attackers = await visitor.authorize(await visitor.start_login(), username="mallory")
    await other_browser.get("/login")  # the victim has a session of their own
    for browser in (other_browser, Visitor(other_browser.http, web_app.url)):
        page = await browser.get(attackers)
        assert page.status == 400
        assert "state does not match" in page.text
    assert not (await other_browser.get("/")).signed_in
    # With no session at all, the same.
    async with aiohttp.ClientSession() as fresh:
        page = await Visitor(fresh, web_app.url).get(attackers)
    assert page.status == 400


async def test_an_answer_is_accepted_only_once(visitor: Visitor):
    callback = await visitor.authorize(await visitor.start_login())
    assert (await visitor.get(callback)).status == 303
    replayed = await visitor.get(callback)
    assert replayed.status == 400
    assert "state does not match" in replayed.text


@pytest.mark.parametrize(
    ("iss", "message"),
    [
        ("https://auth.example.com", "The answer comes from another server (iss)."),
        (None, "The answer does not say which server sent it (iss)."),
    ],
)
async def test_an_answer_without_the_expected_iss_is_refused_and_spends_its_state(
    visitor: Visitor, iss: str | None, message: str
):
    # RFC 9207: the server says it sends iss, so an answer lacking it or naming another
    # server may be a mix-up attack.
    callback = await visitor.authorize(await visitor.start_login())
    page = await visitor.get(with_param(callback, "iss", iss))
    assert page.status == 400
    assert message in page.text
    assert not (await visitor.get("/")).signed_in
    assert (await visitor.get(callback)).status == 400


async def test_denied_consent_signs_nobody_in_and_shows_the_error(visitor: Visitor):
    callback = await visitor.authorize(await visitor.start_login(), decision="deny")
    assert query_of(callback)["error"] == "access_denied"
    page = await visitor.get(callback)
    assert page.status == 400
    assert "access_denied: the user denied the request" in page.text
    assert not (await visitor.get("/")).signed_in


@pytest.mark.parametrize("action", ["/call-api", "/refresh", "/logout"])
async def test_a_form_without_the_sessions_csrf_token_is_refused(
    visitor: Visitor, stack: Stack, action: str
):
    page = await visitor.sign_in()
    for data in ({}, {"csrf_token": ""}, {"csrf_token": secrets.token_urlsafe(32)}):
        refused = await visitor.post(action, data)
        assert refused.status == 403, data
        assert "This form has expired" in refused.text
    async with aiohttp.ClientSession() as fresh:
        page_token = page.csrf_token()
        refused = await Visitor(fresh, visitor.web).post(action, {"csrf_token": page_token})
    assert refused.status == 403  # the right token, but not this browser's session
    assert stack.upstream.requests == []
    still = await visitor.get("/")
    assert still.signed_in


async def test_claims_are_shown_as_text_never_as_markup(visitor: Visitor):
    page = await visitor.sign_in("mallory")
    assert page.claims()["name"] == EVIL_NAME
    assert "<script" not in page.text and "<b>friends" not in page.text
    assert "&lt;script&gt;" in page.text


# ---------------------------------------------------------------------------- signin.py


async def test_the_signin_script_runs_the_whole_round_trip(stack: Stack, web_app: RunningWebApp):
    out = io.StringIO()
    claims = await signin.sign_in(
        web_app.url, "alice", PASSWORD, expect_sub=stack.auth.subject("alice"), out=out
    )
    assert claims["sub"] == stack.auth.subject("alice")
    assert claims["email"] == "alice@example.com"
    # Two API calls (before and after the refresh), each through the gateway.
    assert [r["raw_path"] for r in stack.upstream.requests] == ["/orders?limit=5"] * 2
    assert "consent: approve" in out.getvalue()


async def test_the_signin_script_reports_a_refused_password(stack: Stack, web_app: RunningWebApp):
    with pytest.raises(signin.Mismatch, match=r"expected \(200, 302, 303\), got 400"):
        await signin.sign_in(web_app.url, "alice", "not-" + PASSWORD, out=io.StringIO())
    assert stack.upstream.requests == []


# ---------------------------------------------------------------------------- ID token checks

Shape = Callable[[dict[str, Any], dict[str, Any]], str | None]


@dataclass
class RogueProvider:
    """An OpenID provider whose ID tokens the test shapes: it signs in whoever comes, checks
    the client's PKCE verifier and Basic credentials as a real one would, and lets `shape`
    change the ID token's header and claims (or return a whole token of its own)."""

    __test__ = False

    client_id: str = "demo-web"
    client_secret: str = WEB_SECRET
    url: str = ""
    key: Any = field(default_factory=lambda: ec.generate_private_key(ec.SECP256R1()))
    kid: str = "rogue-1"
    metadata_overrides: dict[str, Any] = field(default_factory=dict)
    shape: Shape | None = None
    shape_refreshed: Shape | None = None
    authorizations: dict[str, dict[str, str]] = field(default_factory=dict)  # code -> query
    token_requests: list[tuple[dict[str, str], str | None]] = field(default_factory=list)
    issued: list[dict[str, Any]] = field(default_factory=list)  # ID token claims handed out
    runner: Any = None

    async def start(self) -> RogueProvider:
        app = web.Application()
        app.router.add_get("/.well-known/openid-configuration", self._metadata)
        app.router.add_get("/jwks", self._jwks)
        app.router.add_get("/authorize", self._authorize)
        app.router.add_post("/token", self._token)
        self.runner, self.url = await start_site(app)
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()

    def expected_basic(self) -> str:
        raw = f"{quote_plus(self.client_id)}:{quote_plus(self.client_secret)}".encode()
        return "Basic " + base64.b64encode(raw).decode()

    def sign(self, header: dict[str, Any], claims: dict[str, Any], key: Any = None) -> str:
        return jwt.encode(claims, key or self.key, algorithm="ES256", headers=header)

    async def _metadata(self, _: web.Request) -> web.Response:
        document = {
            "issuer": self.url,
            "authorization_endpoint": self.url + "/authorize",
            "token_endpoint": self.url + "/token",
            "jwks_uri": self.url + "/jwks",
            # Advertised, and still never to be accepted by the client.
            "id_token_signing_alg_values_supported": ["ES256", "HS256", "none"],
            "authorization_response_iss_parameter_supported": True,
        }
        document.update(self.metadata_overrides)
        return web.json_response(document)

    async def _jwks(self, _: web.Request) -> web.Response:
        return web.json_response({"keys": [public_jwk(self.key, self.kid, "ES256")]})

    async def _authorize(self, request: web.Request) -> web.Response:
        query = dict(request.query)
        code = secrets.token_urlsafe(16)
        self.authorizations[code] = query
        answer = {"code": code, "state": query["state"], "iss": self.url}
        raise web.HTTPFound(query["redirect_uri"] + "?" + urlencode(answer))

    def _id_token(self, claims: dict[str, Any], access_token: str, shape: Shape | None) -> str:
        digest = hashlib.sha256(access_token.encode()).digest()
        claims["at_hash"] = base64.urlsafe_b64encode(digest[:16]).rstrip(b"=").decode()
        header = {"alg": "ES256", "kid": self.kid, "typ": "JWT"}
        made = shape(header, claims) if shape is not None else None
        self.issued.append(dict(claims))
        return made if made is not None else self.sign(header, claims)

    async def _token(self, request: web.Request) -> web.Response:
        form = {k: str(v) for k, v in (await request.post()).items()}
        authorization = request.headers.get("Authorization")
        self.token_requests.append((form, authorization))
        if authorization != self.expected_basic():
            return web.json_response({"error": "invalid_client"}, status=401)
        access_token = secrets.token_urlsafe(24)
        now = int(time.time())
        if form.get("grant_type") == "refresh_token":
            first = self.issued[0]
            claims = {**first, "iat": now, "exp": now + 300}
            claims.pop("nonce", None)
            id_token = self._id_token(claims, access_token, self.shape_refreshed)
        else:
            asked = self.authorizations.pop(form.get("code", ""), None)
            verifier = form.get("code_verifier", "")
            challenge = (
                base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest())
                .rstrip(b"=")
                .decode()
            )
            if (
                asked is None
                or asked.get("code_challenge") != challenge
                or asked.get("redirect_uri") != form.get("redirect_uri")
            ):
                return web.json_response({"error": "invalid_grant"}, status=400)
            claims = {
                "iss": self.url,
                "sub": "rogue-user",
                "aud": self.client_id,
                "exp": now + 300,
                "iat": now,
                "auth_time": now,
                "nonce": asked["nonce"],
                "name": "Rogue User",
            }
            id_token = self._id_token(claims, access_token, self.shape)
        return web.json_response(
            {
                "access_token": access_token,
                "token_type": "Bearer",
                "expires_in": 300,
                "refresh_token": secrets.token_urlsafe(24),
                "id_token": id_token,
                "scope": DEFAULT_SCOPE,
            }
        )


@pytest.fixture
async def rogue() -> AsyncIterator[RogueProvider]:
    provider = await RogueProvider().start()
    yield provider
    await provider.stop()


@pytest.fixture
async def rogue_visitor(
    rogue: RogueProvider, http: aiohttp.ClientSession
) -> AsyncIterator[Visitor]:
    sock = bound_socket()
    port = sock.getsockname()[1]
    config = Config(
        issuer=rogue.url,
        client_id=rogue.client_id,
        client_secret=rogue.client_secret,
        api="http://127.0.0.1:9",  # never called here
        base_url=f"http://127.0.0.1:{port}",
    )
    running, runner = await run_web_app(config, sock)
    yield Visitor(http, running.url)
    await runner.cleanup()


async def rogue_callback(visitor: Visitor) -> Page:
    location = await visitor.start_login()
    back = await visitor.get(location)
    assert back.status == 302, back.text
    return await visitor.get(back.location)


async def test_a_well_formed_id_token_signs_in_after_pkce_and_basic_client_authentication(
    rogue: RogueProvider, rogue_visitor: Visitor
):
    page = await rogue_visitor.follow_to_start(await rogue_callback(rogue_visitor))
    assert page.signed_in and page.claims()["sub"] == "rogue-user"
    ((form, authorization),) = rogue.token_requests
    # client_secret_basic, with id and secret form-encoded (the secret has ":" "+" "/" "%").
    assert authorization == rogue.expected_basic()
    assert "client_secret" not in form and "client_id" not in form
    assert form["grant_type"] == "authorization_code"
    assert 43 <= len(form["code_verifier"]) <= 128  # RFC 7636 §4.1; its hash was checked


def _set(**changes: Any) -> Shape:
    def shape(_: dict[str, Any], claims: dict[str, Any]) -> None:
        for name, value in changes.items():
            if value is None:
                claims.pop(name, None)
            else:
                claims[name] = value(claims) if callable(value) else value

    return shape


def _header(**changes: Any) -> Shape:
    def shape(header: dict[str, Any], _: dict[str, Any]) -> None:
        header.update(changes)

    return shape


def _signed_by_another_key(header: dict[str, Any], claims: dict[str, Any]) -> str:
    return jwt.encode(claims, ec.generate_private_key(ec.SECP256R1()), "ES256", headers=header)


def _unsigned(header: dict[str, Any], claims: dict[str, Any]) -> str:
    return compact({**header, "alg": "none"}, claims)


def _hmac_with_the_client_secret(header: dict[str, Any], claims: dict[str, Any]) -> str:
    # The classic confusion: a symmetric token "signed" with a secret the client knows.
    return jwt.encode(claims, WEB_SECRET, "HS256", headers={"kid": header["kid"]})


_NOW = time.time


@pytest.mark.parametrize(
    ("shape", "reason"),
    [
        (_set(nonce="not-the-nonce-sent"), "its nonce is not the one this client sent"),
        (_set(nonce=None), "its nonce is not the one this client sent"),
        (_set(aud="another-client"), "it is meant for another client (aud)"),
        (
            _set(aud=lambda c: [c["aud"], "another-client"]),
            "it also names audiences this client does not trust",
        ),
        (_set(azp="another-client"), "it was issued to another party (azp)"),
        (_set(iss="https://auth.example.com"), "it was issued by someone else (iss)"),
        (_set(exp=lambda _: int(_NOW()) - 120), "it has expired"),
        (_set(iat=lambda _: int(_NOW()) + 3600, exp=lambda _: int(_NOW()) + 7200), "iat"),
        (_set(sub=None), 'the "sub" claim'),
        (_set(at_hash="bm90IHRoZSBhY2Nlc3MgdG9rZW4"), "its at_hash does not match"),
        (_header(kid="unpublished"), "it is signed with a key the provider does not publish"),
        (_header(typ="at+jwt"), "typ 'at+jwt' is not an ID token's"),
        (_signed_by_another_key, "its signature does not verify"),
        (_unsigned, "alg 'none' is not one this client accepts"),
        (_hmac_with_the_client_secret, "alg 'HS256' is not one this client accepts"),
    ],
    ids=[
        "wrong-nonce",
        "no-nonce",
        "wrong-aud",
        "extra-aud",
        "wrong-azp",
        "wrong-iss",
        "expired",
        "iat-in-future",
        "no-sub",
        "wrong-at-hash",
        "unknown-kid",
        "access-token-typ",
        "wrong-key",
        "alg-none",
        "hs256",
    ],
)
async def test_an_unacceptable_id_token_signs_nobody_in(
    rogue: RogueProvider, rogue_visitor: Visitor, shape: Shape, reason: str
):
    rogue.shape = shape
    page = await rogue_callback(rogue_visitor)
    assert page.status == 502
    assert "the ID token is not acceptable: " in page.plain
    assert reason in page.plain
    assert len(rogue.token_requests) == 1  # the code was redeemed; its ID token refused
    start = await rogue_visitor.get("/")
    assert not start.signed_in and start.offers_sign_in


async def test_a_refreshed_id_token_about_someone_else_ends_the_sign_in(
    rogue: RogueProvider, rogue_visitor: Visitor
):
    await rogue_visitor.follow_to_start(await rogue_callback(rogue_visitor))
    rogue.shape_refreshed = _set(sub="someone-else")
    refused = await rogue_visitor.post(
        "/refresh",
        {"csrf_token": rogue_visitor.csrf_token()},
    )
    assert refused.status == 502
    assert "its sub differs from the first ID token's" in refused.plain
    assert not (await rogue_visitor.get("/")).signed_in


async def test_a_refreshed_id_token_about_the_same_sign_in_is_accepted(
    rogue: RogueProvider, rogue_visitor: Visitor
):
    await rogue_visitor.follow_to_start(await rogue_callback(rogue_visitor))
    page = await rogue_visitor.press("/refresh")
    assert page.notice() == "Tokens refreshed: a new access token and a new refresh token."
    assert page.claims()["sub"] == "rogue-user"
    (_, (form, authorization)) = rogue.token_requests
    assert form["grant_type"] == "refresh_token"
    assert authorization == rogue.expected_basic()


async def test_a_discovery_document_for_another_issuer_is_not_used(
    rogue: RogueProvider, rogue_visitor: Visitor
):
    rogue.metadata_overrides = {"issuer": "https://auth.example.com"}
    page = await rogue_visitor.get("/login")
    assert page.status == 502
    assert "names issuer 'https://auth.example.com'" in page.plain
    assert rogue.authorizations == {}


async def test_without_iss_support_an_answer_without_iss_is_accepted(
    rogue: RogueProvider, rogue_visitor: Visitor
):
    # RFC 9207 §2.4: iss is required only from servers that say they send it.
    rogue.metadata_overrides = {"authorization_response_iss_parameter_supported": False}
    location = await rogue_visitor.start_login()
    back = await rogue_visitor.get(location)
    page = await rogue_visitor.get(with_param(back.location, "iss", None))
    assert (await rogue_visitor.follow_to_start(page)).signed_in
