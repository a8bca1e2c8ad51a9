"""Signing in through an upstream provider that misbehaves: a small OpenID Connect provider
served here on a loopback port (real HTTP, real keys, real signatures) that answers as the
test tells it: an ID token for another audience, with another nonce or issuer, signed with
HMAC or not at all, a discovery document that is garbage, a token endpoint that hangs.
Each is refused with a page that says so, the password form still on it, and nothing stored.
It also checks what a well-behaved provider receives: client_secret_post and private_key_jwt
authentication, PKCE, the exact redirect URI.

tests/e2e/test_federation.py signs in through node-oidc-provider, the real thing.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp
import jwt
import pyotp
import pytest
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from prometheus_client.parser import text_string_to_metric_families

from authserver.federation_keys import load_signing_key, public_jwk
from authserver.protocol import pkce
from authserver.protocol.federation import ClaimNames, email_to_link
from authserver.protocol.throttle import Cap
from tests.authserver.conftest import (
    PASSWORD,
    REDIRECT,
    CodeResult,
    MovableClock,
    RunningAuthServer,
    StartAuthServer,
    client_credentials,
    default_config,
    exchange_code,
    parse_form,
    query_of,
    quick_password_hash,
    verify_jwt,
)
from tests.authserver.device_support import DEVICE_GRANT, poll
from tests.authserver.passkey_support import PasskeyForm, SoftAuthenticator, passkey_form
from tests.support import start_site

CLIENT_SECRET = "upstream-secret-of-the-authserver-0123456789"
VERIFIER = "w" * 43
PROVIDER_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
PROVIDER_JWK = {
    **json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(PROVIDER_KEY.public_key())),
    "kid": "p1",
    "use": "sig",
}


@dataclass
class Upstream:
    """The provider: `flaw` says how its next ID token is wrong; what it was sent is kept."""

    url: str = ""
    flaw: str = ""
    discovery: Any = None  # replaces the discovery document when set (bytes: sent as is)
    token_delay: float = 0.0
    client_keys: list[dict[str, Any]] = field(default_factory=list)
    codes: dict[str, dict[str, str]] = field(default_factory=dict)
    token_requests: list[dict[str, Any]] = field(default_factory=list)
    fetched: list[str] = field(default_factory=list)  # the paths of discovery and keys GETs
    asked: list[dict[str, str]] = field(default_factory=list)  # each authorization request
    signing: tuple[Any, str] = (PROVIDER_KEY, "p1")  # the key that signs, and its kid
    amr: list[str] | None = None  # the methods its ID tokens name, when set
    failing: set[str] = field(default_factory=set)  # paths answered with a 503
    clock: Callable[[], float] = time.time  # the time its ID tokens are issued at
    runner: Any = None
    issued_auth_times: list[int] = field(default_factory=list)
    profile: dict[str, Any] = field(default_factory=dict)  # claims its ID tokens say now

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/.well-known/openid-configuration", self.metadata)
        app.router.add_get("/authorize", self.authorize)
        app.router.add_post("/token", self.token)
        app.router.add_get("/jwks", self.jwks)
        app.router.add_get("/userinfo", self.userinfo)
        return app

    async def metadata(self, request: web.Request) -> web.Response:
        self.fetched.append(request.path)
        if request.path in self.failing:
            return web.json_response({"error": "maintenance"}, status=503)
        if isinstance(self.discovery, bytes):
            return web.Response(body=self.discovery, content_type="application/json")
        return web.json_response(
            self.discovery
            or {
                "issuer": self.url,
                "authorization_endpoint": self.url + "/authorize",
                "token_endpoint": self.url + "/token",
                "jwks_uri": self.url + "/jwks",
                "userinfo_endpoint": self.url + "/userinfo",
                "id_token_signing_alg_values_supported": ["RS256", "HS256", "none"],
                "authorization_response_iss_parameter_supported": True,
            }
        )

    async def jwks(self, request: web.Request) -> web.Response:
        self.fetched.append(request.path)
        if request.path in self.failing:
            return web.json_response({"error": "maintenance"}, status=503)
        key, kid = self.signing
        public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
        return web.json_response({"keys": [{**public, "kid": kid, "use": "sig"}]})

    async def userinfo(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer at":
            return web.json_response({"error": "invalid_token"}, status=401)
        sub = "someone-else" if self.flaw == "userinfo_subject" else "upstream-7"
        return web.json_response(
            {"sub": sub, "email": "dana@corp.example", "email_verified": True, "name": "Dana"}
        )

    async def authorize(self, request: web.Request) -> web.Response:
        query = request.query
        code = f"code-{len(self.codes)}"
        self.codes[code] = dict(query)
        self.asked.append(dict(query))
        back = {"code": code, "state": query["state"], "iss": self.url}
        if self.flaw == "denied":  # the person cancelled at the provider
            back = {"error": "access_denied", "state": query["state"], "iss": self.url}
        elif self.flaw == "no_iss":  # though the discovery document promises it
            del back["iss"]
        raise web.HTTPFound(query["redirect_uri"] + "?" + urlencode(back))

    async def token(self, request: web.Request) -> web.Response:
        form = dict(await request.post())
        self.token_requests.append(
            {"form": form, "authorization": request.headers.get("Authorization")}
        )
        await asyncio.sleep(self.token_delay)
        asked = self.codes.pop(str(form.get("code")), None)
        if asked is None or pkce.s256(str(form.get("code_verifier"))) != asked["code_challenge"]:
            return web.json_response({"error": "invalid_grant"}, status=400)
        if form.get("redirect_uri") != asked["redirect_uri"]:
            return web.json_response({"error": "invalid_grant"}, status=400)
        now = int(self.clock())
        claims: dict[str, Any] = {
            "iss": self.url,
            "sub": "upstream-7",
            "aud": asked["client_id"],
            "exp": now + 300,
            "iat": now,
            "nonce": asked["nonce"],
            "email": "dana@corp.example",
            "email_verified": True,
            "preferred_username": "dana",
        }
        claims.update(self.profile)
        if self.amr is not None:
            claims["amr"] = self.amr
        if "max_age" in asked or asked.get("prompt") == "login":
            claims["auth_time"] = now - 5  # asked for a fresh sign-in, it says when
            self.issued_auth_times.append(now - 5)
        flaw, alg = self.flaw, "RS256"
        if flaw == "stale_auth":  # its single sign-on left in place
            claims["auth_time"] = now - 3600
        elif flaw == "no_auth_time":
            claims.pop("auth_time", None)
        key, headers = self.signing[0], {"kid": self.signing[1]}
        # Other people at the provider (their names in the token: userinfo is dana's).
        if flaw == "unverified":  # an address the provider has not verified
            claims.update(sub="upstream-8", email_verified=False, name="Mallory")
        elif flaw == "newcomer":  # the address given to someone else since
            claims.update(sub="upstream-9", name="Newcomer")
        elif flaw == "audience":
            claims["aud"] = "another-client"
        elif flaw == "audiences_without_azp":
            claims["aud"] = [asked["client_id"], "another-client"]
        elif flaw == "nonce":
            claims["nonce"] = "a-nonce-of-another-sign-in"
        elif flaw == "issuer":
            claims["iss"] = "https://impostor.example"
        elif flaw == "expired":
            claims["exp"], claims["iat"] = now - 3600, now - 4000
        elif flaw in ("userinfo_subject", "userinfo"):
            del claims["email"], claims["email_verified"]  # left to userinfo
        elif flaw == "hmac":
            # Signed with the client secret: anyone holding it (the client) could forge it.
            key, alg, headers = CLIENT_SECRET.encode(), "HS256", {}  # type: ignore[assignment]
        elif flaw == "signature":
            key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        if flaw == "none":
            header = base64.urlsafe_b64encode(b'{"alg":"none"}').rstrip(b"=").decode()
            body = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
            token = f"{header}.{body}."
        else:
            token = jwt.encode(claims, key, algorithm=alg, headers=headers)
        return web.json_response({"access_token": "at", "token_type": "Bearer", "id_token": token})


Setup = Callable[..., Awaitable[tuple[RunningAuthServer, Upstream]]]


@pytest.fixture
async def federated(start_authserver: StartAuthServer) -> AsyncIterator[Setup]:
    runners: list[Any] = []

    async def setup(
        clock: Callable[[], float] = time.time,
        more: dict[str, Any] | None = None,
        clients: tuple[dict[str, Any], ...] = (),
        **provider: Any,
    ) -> tuple[RunningAuthServer, Upstream]:
        upstream = Upstream()
        runner, url = await start_site(upstream.app())
        runners.append(runner)
        upstream.url, upstream.runner = url, runner
        if isinstance(clock, MovableClock):
            upstream.clock = clock
        config = default_config()
        config["clients"].append(
            {
                "client_id": "portal",
                "token_endpoint_auth_method": "none",
                "redirect_uris": [REDIRECT],
                "scope": "openid email profile",
                "skip_consent": True,
            }
        )
        config["clients"].extend(clients)
        config["identity_providers"] = [
            {
                "name": "corp",
                "display_name": "Corp",
                "issuer": url,
                "client_id": "portcullis",
                "timeout": "1s",
                **({"client_secret": CLIENT_SECRET} if "private_key_file" not in provider else {}),
                **provider,
            }
        ]
        config.update(more or {})
        return await start_authserver(config, clock=clock), upstream

    yield setup
    for runner in runners:
        await runner.cleanup()


async def sign_in(
    server: RunningAuthServer, browser: aiohttp.ClientSession | None = None, **extra: str
) -> tuple[int, str, str | None]:
    """Through the sign-in page's button to the end: the last answer's status, page and
    Location (the client's redirect URI with a code, when it worked). In `browser` when
    given (a test goes on with it), else in a browser of its own."""
    if browser is not None:
        return await _sign_in(server, browser, **extra)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as own:
        return await _sign_in(server, own, **extra)


async def _sign_in(
    server: RunningAuthServer, browser: aiohttp.ClientSession, **extra: str
) -> tuple[int, str, str | None]:
    query = {
        **extra,
        "response_type": "code",
        "client_id": "portal",
        "redirect_uri": REDIRECT,
        "scope": "openid email profile",
        "state": "s",
        "code_challenge": pkce.s256(VERIFIER),
        "code_challenge_method": "S256",
    }
    async with browser.get(server.endpoint("/authorize?" + urlencode(query))) as response:
        page = await response.text()
    return await follow_provider_button(server, browser, page)


async def follow_provider_button(
    server: RunningAuthServer, browser: aiohttp.ClientSession, page: str
) -> tuple[int, str, str | None]:
    """The first provider button of `page`, followed through the provider and back."""
    marker = 'class="button provider" href="'
    start = page.index(marker) + len(marker)
    url = server.url + page[start : page.index('"', start)].replace("&amp;", "&")
    for _ in range(6):
        async with browser.get(url, allow_redirects=False) as response:
            location = response.headers.get("Location")
            if location is None or location.startswith(REDIRECT):
                return response.status, await response.text(), location
            url = location
    raise AssertionError("too many redirects")


async def users_of(server: RunningAuthServer) -> list[str]:
    return sorted(u.username for u in await server.services.store.list_users())


@pytest.mark.parametrize(
    ("flaw", "message"),
    [
        ("audience", "is meant for another client"),
        ("audiences_without_azp", "is meant for several clients"),
        ("nonce", "belongs to another sign-in"),
        ("issuer", "was issued by another issuer"),
        ("expired", "has expired"),
        ("hmac", "signed with an algorithm it does not advertise"),
        ("none", "signed with an algorithm it does not advertise"),
        ("signature", "has no valid signature"),
        ("userinfo_subject", "userinfo is about another user"),
    ],
)
async def test_an_id_token_that_is_not_for_this_sign_in_is_refused_and_nothing_stored(
    federated: Setup, flaw: str, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    server, upstream = await federated()
    upstream.flaw = flaw
    with caplog.at_level(logging.INFO, logger="portcullis.authserver.federation"):
        status, page, location = await sign_in(server)
    (line,) = [r for r in caplog.records if r.getMessage() == "federated sign-in refused"]
    assert line.provider == "corp" and line.reason
    assert (status, location) == (400, None)
    assert "Signing in with Corp failed." in page and message in page
    assert 'name="password"' in page  # the password form is still there
    assert await users_of(server) == ["alice", "bob"]


async def test_a_sound_id_token_signs_in_with_client_secret_post(
    federated: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    server, upstream = await federated(token_endpoint_auth_method="client_secret_post")
    with caplog.at_level(logging.INFO, logger="portcullis.authserver.federation"):
        status, _, location = await sign_in(server)
    (line,) = [r for r in caplog.records if r.getMessage() == "federated sign-in"]
    assert (line.provider, line.outcome) == ("corp", "created")
    logged = " ".join(str(vars(r)) for r in caplog.records)
    assert CLIENT_SECRET not in logged and "dana@corp.example" not in logged
    assert status == 302 and location is not None and "code=" in location
    (sent,) = upstream.token_requests
    assert sent["authorization"] is None
    assert sent["form"]["client_id"] == "portcullis"
    assert sent["form"]["client_secret"] == CLIENT_SECRET
    assert sent["form"]["redirect_uri"] == server.endpoint("/federation/corp/callback")
    assert await users_of(server) == ["alice", "bob", "dana"]


async def test_discovery_and_keys_are_kept_and_fetched_again_once_stale_or_unknown(
    federated: Setup,
) -> None:
    clock = MovableClock()
    server, upstream = await federated(clock=clock, discovery_max_age="1m")
    for _ in range(3):
        assert (await sign_in(server))[0] == 302
    assert upstream.fetched == ["/.well-known/openid-configuration", "/jwks"]
    # The provider rotates its key: a token under an unknown kid has the keys fetched again,
    # though not twice within KEYS_REFETCH (10s), however many such tokens come.
    upstream.signing = (rsa.generate_private_key(public_exponent=65537, key_size=2048), "p2")
    status, page, _ = await sign_in(server)
    assert status == 400 and "a key it does not publish" in page
    assert upstream.fetched[2:] == []
    clock.advance(11)
    assert (await sign_in(server))[0] == 302
    assert upstream.fetched[2:] == ["/jwks"]
    # Past discovery_max_age, the document (and then the keys) are read again.
    clock.advance(50)
    assert (await sign_in(server))[0] == 302
    assert upstream.fetched[3:] == ["/.well-known/openid-configuration", "/jwks"]


def stale_counts(server: RunningAuthServer) -> dict[str, float]:
    exposition = server.services.token.metrics.exposition().decode()
    return {
        sample.labels["document"]: sample.value
        for family in text_string_to_metric_families(exposition)
        if family.name == "portcullis_authserver_federation_stale_documents"
        for sample in family.samples
        if sample.labels["provider"] == "corp"
    }


async def test_a_failing_provider_s_documents_are_used_stale_within_a_bound_then_refused(
    federated: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """Fetching the discovery document or the keys again fails: the last good copies are
    used for discovery_stale_if_error past their age (logged, counted), then, with the
    provider gone, the sign-in page says it cannot be reached."""
    clock = MovableClock()
    server, upstream = await federated(
        clock=clock, discovery_max_age="1m", discovery_stale_if_error="5m"
    )
    assert (await sign_in(server))[0] == 302
    assert upstream.fetched == ["/.well-known/openid-configuration", "/jwks"]
    clock.advance(61)  # the document is fetched again (t=61), the keys fail
    upstream.failing = {"/jwks"}
    with caplog.at_level(logging.WARNING, logger="portcullis.authserver.federation"):
        assert (await sign_in(server))[0] == 302
    (line,) = [
        r for r in caplog.records if r.getMessage() == "identity provider document used stale"
    ]
    assert (line.provider, line.document, line.reason) == ("corp", "jwks", "http_503")
    assert stale_counts(server) == {"jwks": 1}
    clock.advance(61)  # both fail now (t=122); the keys of t=0 are within 1m + 5m
    upstream.failing = {"/.well-known/openid-configuration", "/jwks"}
    assert (await sign_in(server))[0] == 302
    assert stale_counts(server) == {"discovery": 1, "jwks": 2}
    # Within RETRY_AFTER_FAILURE of a failure nothing is asked of the provider again.
    before = len(upstream.fetched)
    assert (await sign_in(server))[0] == 302
    assert len(upstream.fetched) == before
    # The provider goes away: its documents of t=61 still send a sign-in there...
    for site in list(upstream.runner.sites):
        await site.stop()
    clock.advance(100)  # t=222
    status, location = await start_at_provider(server)
    assert status == 302 and location.startswith(upstream.url + "/authorize?")
    assert stale_counts(server) == {"discovery": 2, "jwks": 2}
    # ...until 1m + 5m after they were fetched: then the sign-in page says so.
    clock.advance(200)  # t=422
    status, page, location = await sign_in(server)
    assert (status, location) == (502, None)
    assert "Corp cannot be reached right now" in page and 'name="password"' in page


async def start_at_provider(server: RunningAuthServer) -> tuple[int, str]:
    """The sign-in page's provider button: the start's status and Location."""
    query = {
        "response_type": "code",
        "client_id": "portal",
        "redirect_uri": REDIRECT,
        "scope": "openid",
        "code_challenge": pkce.s256(VERIFIER),
        "code_challenge_method": "S256",
    }
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        async with browser.get(server.endpoint("/authorize?" + urlencode(query))) as response:
            page = await response.text()
        marker = 'class="button provider" href="'
        start = page.index(marker) + len(marker)
        url = server.url + page[start : page.index('"', start)].replace("&amp;", "&")
        async with browser.get(url, allow_redirects=False) as response:
            return response.status, response.headers.get("Location", "")


@pytest.mark.parametrize(
    ("flaw", "message"),
    [
        ("denied", "The provider did not sign you in."),
        ("no_iss", "The sign-in response did not name its issuer."),
    ],
)
async def test_a_response_without_a_code_or_without_its_promised_issuer_is_refused(
    federated: Setup, flaw: str, message: str
) -> None:
    server, upstream = await federated()
    upstream.flaw = flaw
    status, page, location = await sign_in(server)
    assert (status, location) == (400, None) and message in page
    assert upstream.token_requests == []  # no code was exchanged
    assert await users_of(server) == ["alice", "bob"]


async def test_a_callback_whose_query_is_not_utf_8_gets_a_page(
    federated: Setup, http: aiohttp.ClientSession
) -> None:
    server, _ = await federated()
    for path in ("/federation/corp/callback?state=%FF", "/federation/corp/start?client_id=%FF"):
        async with http.get(server.endpoint(path), allow_redirects=False) as response:
            assert response.status == 400, path
            assert "malformed" in await response.text()


async def test_a_disabled_user_cannot_sign_in_through_the_provider(federated: Setup) -> None:
    server, _ = await federated()
    assert (await sign_in(server))[0] == 302
    store = server.services.store
    dana = await store.user_by_username("dana")
    assert dana is not None
    assert await store.save_user(replace(dana, disabled=True), dana.version)
    status, page, location = await sign_in(server)
    assert (status, location) == (400, None) and "Your account here is disabled." in page


async def test_a_user_with_an_app_here_types_its_code_after_the_provider(
    federated: Setup, capfd: pytest.CaptureFixture[str]
) -> None:
    """The provider said nothing of a second factor: a user who set an app up here types its
    code next, as after a password; until then nothing is signed in."""
    key = base64.b64encode(os.urandom(32)).decode()
    server, _ = await federated(more={"second_factors": {"encryption_key": key}})
    assert (await sign_in(server))[0] == 302  # dana created
    created = [json.loads(line) for line in capfd.readouterr().err.splitlines() if "event" in line]
    dana = await server.services.store.user_by_username("dana")
    assert dana is not None
    events = {(e["event"], e.get("subject")) for e in created}
    assert ("user.created", dana.subject) in events
    assert ("signin.succeeded", dana.subject) in events
    factors = server.services.authorize.factors
    enrolment = await factors.begin(dana.subject, "dana")
    assert enrolment is not None
    secret = enrolment.grouped.replace(" ", "")
    assert await factors.confirm(dana.subject, pyotp.TOTP(secret).now()) is not None
    status, page, location = await sign_in(server)
    assert (status, location) == (200, None)
    assert "/login/code" in page and "Enter your code" in page


@pytest.mark.parametrize(
    ("named", "expected"),
    [(None, ["otp", "mfa"]), (["hwk", "pwd"], ["hwk", "pwd", "otp", "mfa"])],
)
async def test_the_id_token_after_the_provider_and_the_code_tells_of_both(
    federated: Setup, named: list[str] | None, expected: list[str]
) -> None:
    """After the provider and the code of the app here, the ID token names the provider's
    methods (none when it named none: no password was typed here) with `otp` and `mfa`,
    and says when the user signed in at the provider."""
    key = base64.b64encode(os.urandom(32)).decode()
    server, upstream = await federated(more={"second_factors": {"encryption_key": key}})
    assert (await sign_in(server))[0] == 302  # dana created
    dana = await server.services.store.user_by_username("dana")
    assert dana is not None
    factors = server.services.authorize.factors
    enrolment = await factors.begin(dana.subject, "dana")
    assert enrolment is not None
    app = pyotp.TOTP(enrolment.grouped.replace(" ", ""))
    assert await factors.confirm(dana.subject, app.now()) is not None
    upstream.amr = named  # no `mfa` among them: the code is asked here
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        status, page, _ = await sign_in(browser=browser, server=server, max_age="600")
        assert status == 200, page
        action, fields = parse_form(page)
        assert action.endswith("/login/code")
        # The first step's methods are under the pending sign-in's proof.
        forged = {**fields, "pending_methods": "pwd hwk", "code": app.at(time.time() + 30)}
        async with browser.post(server.url + action, data=forged, allow_redirects=False) as refused:
            assert refused.status == 403
        # The first code was used at enrolment: the next step's code.
        fields["code"] = app.at(time.time() + 30)
        async with browser.post(
            server.url + action, data=fields, allow_redirects=False
        ) as response:
            assert response.status in (302, 303), await response.text()
            code = query_of(response.headers["Location"])["code"]
        result = CodeResult(code, VERIFIER, REDIRECT, "s", None, "")
        status, body = await exchange_code(browser, server, result, client_id="portal")
        assert status == 200, body
        claims = await verify_jwt(browser, server, body["id_token"], audience="portal")
    assert claims["amr"] == expected
    assert claims["acr"] == "urn:portcullis:acr:mfa"
    asked_at = upstream.issued_auth_times[-1]
    assert claims["auth_time"] == asked_at  # the provider's, not the code's


TV = {
    "client_id": "tv",
    "client_name": "Living Room TV",
    "token_endpoint_auth_method": "none",
    "grant_types": [DEVICE_GRANT],
    "scope": "openid",
}


async def device_sign_in(
    server: RunningAuthServer, browser: aiohttp.ClientSession, *, password: bool = True
) -> tuple[str, tuple[int, str, str | None]]:
    """A device asks; the person types its code on the device page and presses the
    provider's button: the device code, and the last answer after the provider. The sign-in
    form has a password field unless `password` is false."""
    async with browser.post(
        server.endpoint("/device_authorization"), data={"client_id": "tv", "scope": "openid"}
    ) as started:
        body = await started.json()
    async with browser.get(server.endpoint("/device")) as page:
        action, fields = parse_form(await page.text())
    fields["user_code"] = body["user_code"]
    async with browser.post(server.url + action, data=fields) as checked:
        login = await checked.text()
    if password:
        assert 'name="password"' in login and "Or sign in with" in login
    else:
        assert 'name="password"' not in login and "company's sign-in" in login
    return body["device_code"], await follow_provider_button(server, browser, login)


async def approve_device(
    server: RunningAuthServer, browser: aiohttp.ClientSession, page: str, device_code: str
) -> dict[str, Any]:
    action, fields = parse_form(page)
    assert action.endswith("/device/consent"), action
    async with browser.post(server.url + action, data={**fields, "decision": "approve"}) as done:
        assert "Device connected" in await done.text()
    status, tokens = await poll(browser, server, device_code)
    assert status == 200, tokens
    return await verify_jwt(browser, server, tokens["id_token"], audience="tv")


async def test_the_device_page_offers_the_providers_and_comes_back_to_its_code(
    federated: Setup,
) -> None:
    """The device page's sign-in form has the providers' buttons; the user code goes through
    the provider and back to the consent page for that code, and after the app's code when
    the user has one here (the ID token then saying so)."""
    key = base64.b64encode(os.urandom(32)).decode()
    server, _ = await federated(more={"second_factors": {"encryption_key": key}}, clients=(TV,))
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        device_code, (status, page, _) = await device_sign_in(server, browser)
        assert status == 200 and "Allow a device" in page
        claims = await approve_device(server, browser, page, device_code)
    dana = await server.services.store.user_by_username("dana")
    assert dana is not None and claims["sub"] == dana.subject
    factors = server.services.authorize.factors
    enrolment = await factors.begin(dana.subject, "dana")
    assert enrolment is not None
    app = pyotp.TOTP(enrolment.grouped.replace(" ", ""))
    assert await factors.confirm(dana.subject, app.now()) is not None
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        device_code, (status, page, _) = await device_sign_in(server, browser)
        action, fields = parse_form(page)
        assert status == 200 and action.endswith("/device/login/code")
        fields["code"] = app.at(time.time() + 30)
        async with browser.post(server.url + action, data=fields) as answer:
            consent = await answer.text()
        claims = await approve_device(server, browser, consent, device_code)
    assert claims["amr"] == ["otp", "mfa"] and claims["acr"] == "urn:portcullis:acr:mfa"


async def test_a_user_without_a_password_signs_in_again_to_change_their_app(
    federated: Setup,
) -> None:
    """On the account page, renewing recovery codes or removing the app of a session older
    than a set-up allows asks for the password; a user who has none signs in again."""
    clock = MovableClock()
    key = base64.b64encode(os.urandom(32)).decode()
    server, _ = await federated(clock=clock, more={"second_factors": {"encryption_key": key}})
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        assert (await sign_in(server, browser))[0] == 302
        dana = await server.services.store.user_by_username("dana")
        assert dana is not None
        factors = server.services.authorize.factors
        enrolment = await factors.begin(dana.subject, "dana")
        assert enrolment is not None
        app = pyotp.TOTP(enrolment.grouped.replace(" ", ""))
        assert await factors.confirm(dana.subject, app.at(clock.now)) is not None
        clock.advance(16 * 60)
        async with browser.get(server.endpoint("/account")) as response:
            page = await response.text()
        assert "needs a recent sign-in" in page and 'id="renew-current"' not in page
        csrf = {"csrf_token": parse_form(page)[1]["csrf_token"]}
        for path in ("/account/factors/recovery-codes", "/account/factors/totp/remove"):
            async with browser.post(server.endpoint(path), data=csrf) as refused:
                assert refused.status == 403, path
                assert "sign out, sign in again" in await refused.text()
    assert await factors.enrolled(dana.subject)


async def test_the_account_pages_provider_sign_in_is_fresh_enough_to_change_factors(
    federated: Setup,
) -> None:
    """The account page's sign-in through a provider asks it for a sign-in of the last 15
    minutes (max_age, OIDC Core §3.1.2.1), so a user without a password can change their
    app there at once; a provider that answers with an older sign-in is refused."""
    clock = MovableClock()
    key = base64.b64encode(os.urandom(32)).decode()
    server, upstream = await federated(
        clock=clock, more={"second_factors": {"encryption_key": key}}
    )
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        assert (await sign_in(server, browser))[0] == 302
        dana = await server.services.store.user_by_username("dana")
        assert dana is not None and not dana.password_hash
        factors = server.services.authorize.factors
        enrolment = await factors.begin(dana.subject, "dana")
        assert enrolment is not None
        app = pyotp.TOTP(enrolment.grouped.replace(" ", ""))
        assert await factors.confirm(dana.subject, app.at(clock.now)) is not None
    clock.advance(16 * 60)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        async with browser.get(server.endpoint("/account")) as response:
            page = await response.text()
        status, page, location = await through_provider(server, browser, page)
        assert upstream.asked[-1]["max_age"] == "900"
        # The app's code, the second step after the provider; then the page.
        assert status == 200 and 'name="code"' in page, (status, location)
        form = parse_form(page)[1]
        async with browser.post(
            server.endpoint("/account/login/code"),
            data={**form, "code": app.at(clock.now + 30)},
            allow_redirects=False,
        ) as answer:
            assert (answer.status, answer.headers.get("Location")) == (303, "/account")
        async with browser.get(server.endpoint("/account")) as response:
            page = await response.text()
        assert "needs a recent sign-in" not in page
        csrf = {"csrf_token": parse_form(page)[1]["csrf_token"]}
        async with browser.post(
            server.endpoint("/account/factors/totp/remove"), data=csrf, allow_redirects=False
        ) as removed:
            assert removed.status == 303, await removed.text()
    assert not await factors.enrolled(dana.subject)
    # A provider whose single sign-on outlives the page's limit is not taken at its word.
    upstream.flaw = "stale_auth"
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        async with browser.get(server.endpoint("/account")) as response:
            page = await response.text()
        status, page, _ = await through_provider(server, browser, page)
        assert status == 400 and "Signed in as" not in page, status


async def test_a_device_sign_in_link_is_not_a_way_to_try_user_codes(
    federated: Setup, http: aiohttp.ClientSession
) -> None:
    server, upstream = await federated(clients=(TV,))
    async with http.post(
        server.endpoint("/device_authorization"), data={"client_id": "tv", "scope": "openid"}
    ) as started:
        user_code = (await started.json())["user_code"]
    # A link the device page did not give this session starts nothing and looks nothing up.
    for code in (user_code, "BCDF-GHJK"):
        start = server.endpoint("/federation/corp/start?" + urlencode({"user_code": code}))
        async with http.get(start, allow_redirects=False) as response:
            assert response.status == 403 and "Your session expired" in await response.text()
    assert upstream.asked == []


async def test_an_address_a_sign_in_brought_or_that_changed_hands_links_to_nobody(
    federated: Setup,
) -> None:
    """Linking by a verified email takes only a user whose own email is verified and who
    signs in through no provider: not one a first sign-in created with an unverified
    address (a pre-hijack), nor one whose address the provider gave to someone else."""
    server, upstream = await federated(link_by_verified_email_domains=["corp.example"])
    upstream.flaw = "unverified"
    assert (await sign_in(server))[0] == 302  # created, with the address unverified
    upstream.flaw = ""
    assert (await sign_in(server))[0] == 302  # verified now, another sub: not linked to it
    upstream.flaw = "newcomer"
    assert (await sign_in(server))[0] == 302  # the verified holder is linked already
    store = server.services.store
    danas = [u for u in await store.list_users() if u.username.startswith("dana")]
    assert len(danas) == 3
    for user in danas:
        assert len(await store.identity_links(user.subject)) == 1


def test_an_email_mapped_from_another_claim_is_never_verified() -> None:
    names = ClaimNames(username="preferred_username", email="upn", name="name")
    claims = {"upn": "ceo@corp.example", "email_verified": True}
    assert email_to_link(claims, names, {"corp.example"}) is None


async def test_a_forced_sign_in_is_asked_of_the_provider_and_must_have_happened_there(
    federated: Setup,
) -> None:
    """`prompt=login` and `max_age` go to the provider, and its ID token must say when the
    user signed in there (OIDC Core §3.1.2.1): a single sign-on left in place, or no word of
    when, is refused before any user is made."""
    server, upstream = await federated()
    status, _, location = await sign_in(server, prompt="login", max_age="0")
    assert status == 302 and location is not None and "code=" in location
    assert (upstream.asked[-1]["prompt"], upstream.asked[-1]["max_age"]) == ("login", "0")
    assert await users_of(server) == ["alice", "bob", "dana"]
    server, upstream = await federated()
    upstream.flaw = "stale_auth"
    status, page, location = await sign_in(server, max_age="60")
    assert (status, location) == (400, None) and "too long ago" in page
    upstream.flaw = "no_auth_time"
    status, page, _ = await sign_in(server, prompt="login")
    assert status == 400 and "did not say when you signed in" in page
    assert await users_of(server) == ["alice", "bob"]  # nothing made
    upstream.flaw = ""
    assert (await sign_in(server))[0] == 302  # neither asked: no auth_time needed
    assert "prompt" not in upstream.asked[-1] and "max_age" not in upstream.asked[-1]


async def test_claims_the_id_token_lacks_are_read_from_userinfo(federated: Setup) -> None:
    server, upstream = await federated()
    upstream.flaw = "userinfo"
    status, _, _ = await sign_in(server)
    assert status == 302
    user = await server.services.store.user_by_username("dana")
    assert user is not None
    assert user.claims == {"email": "dana@corp.example", "email_verified": True, "name": "Dana"}


def audit_events(err: str, name: str) -> list[dict[str, Any]]:
    lines = (json.loads(line) for line in err.splitlines() if '"event"' in line)
    return [e for e in lines if e["event"] == name]


async def signed_in_claims(server: RunningAuthServer) -> dict[str, Any]:
    """A sign-in through the provider, to the end: the claims of the ID token it gets."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        status, page, location = await sign_in(server, browser)
        assert status == 302 and location is not None, page
        result = CodeResult(query_of(location)["code"], VERIFIER, REDIRECT, "s", None, "")
        status, body = await exchange_code(browser, server, result, client_id="portal")
        assert status == 200, body
        return await verify_jwt(browser, server, body["id_token"], audience="portal")


async def test_a_returning_users_claims_follow_the_providers_at_each_sign_in(
    federated: Setup, capfd: pytest.CaptureFixture[str]
) -> None:
    """The name, the email (once verified there) and the username (when free) the provider
    gives now replace what the user was created with; never the `sub`. Each change is a
    `user.updated` event; a sign-in that changes nothing writes nothing."""
    server, upstream = await federated()
    store = server.services.store
    first = await signed_in_claims(server)
    dana = await store.user_by_username("dana")
    assert dana is not None and first["sub"] == dana.subject
    assert dana.claims == {"email": "dana@corp.example", "email_verified": True, "name": "Dana"}
    capfd.readouterr()

    # The same claims again: nothing written.
    await signed_in_claims(server)
    assert (await store.get_user(dana.subject)) == dana
    assert audit_events(capfd.readouterr().err, "user.updated") == []

    # A new name, a new verified address, a new username.
    upstream.profile = {
        "name": "Dana Quinn",
        "email": "dana.quinn@corp.example",
        "email_verified": True,
        "preferred_username": "dquinn",
    }
    claims = await signed_in_claims(server)
    assert claims["sub"] == dana.subject
    assert (claims["email"], claims["email_verified"]) == ("dana.quinn@corp.example", True)
    assert claims["name"] == "Dana Quinn"
    renamed = await store.get_user(dana.subject)
    assert renamed is not None and renamed.username == "dquinn"
    assert renamed.version == dana.version + 1
    (event,) = audit_events(capfd.readouterr().err, "user.updated")
    assert (event["actor"], event["subject"], event["reason"]) == (
        "server",
        dana.subject,
        "provider:corp",
    )
    assert "dana.quinn" not in json.dumps(event)  # ids and names only, no claim values

    # An address the provider has not verified changes nothing of the email; a username
    # another user has stays theirs; the name still follows.
    upstream.profile = {
        "name": "D. Quinn",
        "email": "mallory@elsewhere.example",
        "email_verified": False,
        "preferred_username": "alice",
    }
    claims = await signed_in_claims(server)
    assert claims["sub"] == dana.subject
    assert (claims["email"], claims["email_verified"]) == ("dana.quinn@corp.example", True)
    assert claims["name"] == "D. Quinn"
    kept = await store.get_user(dana.subject)
    assert kept is not None and kept.username == "dquinn"
    assert len(audit_events(capfd.readouterr().err, "user.updated")) == 1

    # Its own address, no longer verified there: not verified here either.
    upstream.profile = {
        "name": "D. Quinn",
        "email": "Dana.Quinn@corp.example",
        "email_verified": False,
        "preferred_username": "dquinn",
    }
    claims = await signed_in_claims(server)
    assert (claims["email"], claims["email_verified"]) == ("dana.quinn@corp.example", False)
    assert await users_of(server) == ["alice", "bob", "dquinn"]
    alice = await store.user_by_username("alice")
    assert alice is not None and "D. Quinn" not in json.dumps(alice.claims)


async def test_a_user_with_a_password_here_keeps_their_username(federated: Setup) -> None:
    """A user who types a password here signs in by their username: the provider's claims
    refresh the rest, not that."""
    server, upstream = await federated()
    store = server.services.store
    await signed_in_claims(server)
    dana = await store.user_by_username("dana")
    assert dana is not None
    assert await store.save_user(replace(dana, password_hash="scrypt$set-by-an-admin"), 1)
    upstream.profile = {"name": "Dana Quinn", "preferred_username": "dquinn"}
    claims = await signed_in_claims(server)
    assert claims["name"] == "Dana Quinn"
    assert await users_of(server) == ["alice", "bob", "dana"]


async def test_client_secret_basic_form_encodes_the_secret(federated: Setup) -> None:
    server, upstream = await federated()
    status, _, _ = await sign_in(server)
    assert status == 302
    (sent,) = upstream.token_requests
    scheme, _, encoded = sent["authorization"].partition(" ")
    assert scheme == "Basic"
    assert base64.b64decode(encoded).decode() == f"portcullis:{CLIENT_SECRET}"
    assert "client_secret" not in sent["form"]


async def test_private_key_jwt_signs_an_assertion_the_provider_can_verify(
    federated: Setup, tmp_path: Path
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    pem = tmp_path / "upstream.pem"
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    server, upstream = await federated(private_key_file=str(pem))
    status, _, _ = await sign_in(server)
    assert status == 302
    (sent,) = upstream.token_requests
    form = sent["form"]
    assert form["client_assertion_type"] == "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
    public = jwt.PyJWK(public_jwk(load_signing_key(str(pem))))
    claims = jwt.decode(
        form["client_assertion"], public.key, algorithms=["ES256"], audience=upstream.url
    )
    assert claims["iss"] == claims["sub"] == "portcullis"
    assert claims["exp"] - claims["iat"] <= 60 and claims["jti"]


@pytest.mark.parametrize(
    "discovery",
    [
        b"<html>maintenance</html>",
        {"issuer": "https://impostor.example"},
        {"issuer": "{url}"},  # no endpoints
        [1, 2, 3],
    ],
)
async def test_a_provider_answering_garbage_shows_the_sign_in_page_with_its_password_form(
    federated: Setup, discovery: Any
) -> None:
    server, upstream = await federated()
    if isinstance(discovery, dict) and discovery.get("issuer") == "{url}":
        discovery = {"issuer": upstream.url}
    upstream.discovery = discovery
    status, page, location = await sign_in(server)
    assert (status, location) == (502, None)
    assert "Corp cannot be reached right now" in page and 'name="password"' in page
    assert upstream.codes == {}  # nobody was sent there


async def test_a_provider_whose_token_endpoint_hangs_is_given_up_on_after_its_timeout(
    federated: Setup,
) -> None:
    server, upstream = await federated()
    upstream.token_delay = 5.0
    started = time.monotonic()
    status, page, _ = await sign_in(server)
    assert status == 502 and "cannot be reached right now" in page
    assert time.monotonic() - started < 4.0  # timeout: 1s
    assert await users_of(server) == ["alice", "bob"]


async def test_the_sign_in_page_without_providers_has_no_buttons(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    server = await start_authserver()
    query = {
        "response_type": "code",
        "client_id": "spa",
        "redirect_uri": REDIRECT,
        "scope": "openid",
        "code_challenge": pkce.s256(VERIFIER),
        "code_challenge_method": "S256",
    }
    async with http.get(server.endpoint("/authorize?" + urlencode(query))) as response:
        page = await response.text()
    assert 'name="password"' in page and "provider" not in page
    async with http.get(server.endpoint("/federation/corp/start")) as response:
        assert response.status == 404


# ---------------------------------------------------------------------------- passkeys


async def through_provider(
    server: RunningAuthServer, browser: aiohttp.ClientSession, page: str
) -> tuple[int, str, str | None]:
    """As follow_provider_button, on an issuer of its own name (http://localhost:PORT, where
    passkeys work), whose host the browser's cookies are kept for: the last answer's status,
    page and Location (the account page, or the client's redirect URI)."""
    origin = server.settings.issuer
    marker = 'class="button provider" href="'
    start = page.index(marker) + len(marker)
    url = origin + page[start : page.index('"', start)].replace("&amp;", "&")
    for _ in range(6):
        async with browser.get(url, allow_redirects=False) as response:
            location = response.headers.get("Location")
            if location is None or location.startswith(REDIRECT) or location == "/account":
                return response.status, await response.text(), location
            url = location
    raise AssertionError("too many redirects")


async def post_passkey(
    server: RunningAuthServer,
    browser: aiohttp.ClientSession,
    form: PasskeyForm,
    credential: dict[str, Any],
    **extra: str,
) -> aiohttp.ClientResponse:
    fields = {**form.fields, "passkey_response": json.dumps(credential), **extra}
    return await browser.post(
        server.settings.issuer + form.action, data=fields, allow_redirects=False
    )


async def test_a_user_with_a_passkey_only_uses_it_after_the_provider(federated: Setup) -> None:
    """The account page's sign-in offers the provider and comes back to the page, where the
    user (no password here) adds a passkey; from then on the provider is followed by the
    local second step, the passkey offered there (a wrong answer shown again keeps the
    provider's sign-in as the first step), and the ID token names the key after the
    provider's methods (none here: the provider named none)."""
    server, _ = await federated(more={"issuer": "http://localhost:{port}"}, clients=(TV,))
    origin = server.settings.issuer
    key = SoftAuthenticator(origin)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        async with browser.get(origin + "/account") as response:
            page = await response.text()
        assert 'name="password"' in page and "Or sign in with" in page
        status, _, location = await through_provider(server, browser, page)
        assert (status, location) == (303, "/account")
        async with browser.get(origin + "/account") as response:
            page = await response.text()
        assert "Signed in as" in page
        form = passkey_form(page)
        assert form is not None and form.mode == "create"
        added = await post_passkey(server, browser, form, key.create(form.options), name="Key")
        assert added.status == 303, await added.text()
    dana = await server.services.store.user_by_username("dana")
    assert dana is not None and not dana.password_hash
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        query = {
            "response_type": "code",
            "client_id": "portal",
            "redirect_uri": REDIRECT,
            "scope": "openid",
            "state": "s",
            "code_challenge": pkce.s256(VERIFIER),
            "code_challenge_method": "S256",
        }
        async with browser.get(origin + "/authorize?" + urlencode(query)) as response:
            page = await response.text()
        status, page, location = await through_provider(server, browser, page)
        assert (status, location) == (200, None), page
        assert 'name="code"' not in page  # no app: the passkey is the second step
        form = passkey_form(page)
        assert form is not None and form.action == "/login/passkey"
        assert form.fields["pending_methods"] == "fed"
        spoiled = await post_passkey(
            server, browser, form, key.get(form.options, bad_signature=True)
        )
        assert spoiled.status == 400
        key.counter -= 1
        form = passkey_form(await spoiled.text())
        assert form is not None and form.fields["pending_methods"] == "fed"
        done = await post_passkey(server, browser, form, key.get(form.options))
        assert done.status in (302, 303), await done.text()
        code = query_of(done.headers["Location"])["code"]
        result = CodeResult(code, VERIFIER, REDIRECT, "s", None, "")
        status, body = await exchange_code(browser, server, result, client_id="portal")
        assert status == 200, body
        claims = await verify_jwt(browser, server, body["id_token"], audience="portal")
    assert claims["sub"] == dana.subject
    assert claims["amr"] == ["hwk", "user", "mfa"]
    assert claims["acr"] == "urn:portcullis:acr:mfa"
    # So does the device page's, for the code the device shows.
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        async with browser.post(
            origin + "/device_authorization", data={"client_id": "tv", "scope": "openid"}
        ) as started:
            device = await started.json()
        async with browser.get(origin + "/device") as response:
            action, fields = parse_form(await response.text())
        fields["user_code"] = device["user_code"]
        async with browser.post(origin + action, data=fields) as checked:
            login = await checked.text()
        status, page, _ = await through_provider(server, browser, login)
        form = passkey_form(page)
        assert status == 200 and form is not None and form.action == "/device/login/passkey"
        async with await post_passkey(server, browser, form, key.get(form.options)) as answer:
            action, fields = parse_form(await answer.text())
        assert action == "/device/consent"
        fields["decision"] = "approve"
        async with browser.post(origin + action, data=fields) as done:
            assert "Device connected" in await done.text()
        status, tokens = await poll(browser, server, device["device_code"])
        assert status == 200, tokens
        claims = await verify_jwt(browser, server, tokens["id_token"], audience="tv")
    assert claims["amr"] == ["hwk", "user", "mfa"]
    # The account page's sign-in through the provider asks for the passkey too.
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        async with browser.get(origin + "/account") as response:
            page = await response.text()
        status, page, location = await through_provider(server, browser, page)
        assert (status, location) == (200, None), page
        form = passkey_form(page)
        assert form is not None and form.action == "/account/login/passkey"
        done = await post_passkey(server, browser, form, key.get(form.options))
        assert (done.status, done.headers["Location"]) == (303, "/account")
        async with browser.get(origin + "/account") as response:
            assert "Signed in as" in await response.text()


async def test_an_account_sign_in_link_must_be_the_pages_own(
    federated: Setup, http: aiohttp.ClientSession
) -> None:
    server, upstream = await federated()
    async with http.get(server.endpoint("/account")) as response:
        assert response.status == 200  # a session, with no proof for the links below
    for query in ("account=1&proof=forged", "account=2", "account=1&state=x&proof=x"):
        async with http.get(
            server.endpoint("/federation/corp/start?" + query), allow_redirects=False
        ) as response:
            assert response.status == 403, query
    assert upstream.asked == []


# ---------------------------------------------------------------------------- without passwords

NO_PASSWORDS = {"password_sign_in": False}
REFUSED = "Passwords are not accepted here"


async def test_without_password_sign_in_the_pages_offer_the_provider_and_refuse_a_password(
    federated: Setup, capfd: pytest.CaptureFixture[str]
) -> None:
    """`password_sign_in: false`: the login page, the device page's sign-in and the account
    page's have no password field, only the provider's button and a line saying so. A
    password posted to any of them anyway, right and with the session's CSRF token, is
    refused before it is read: no session, nothing charged to the throttle, no sign-in
    recorded. Clients still authenticate with their secrets; the provider signs in."""
    clock = MovableClock()
    server, upstream = await federated(clock=clock, more=NO_PASSWORDS, clients=(TV,))
    store = server.services.store
    # A provider that cannot be reached: the page does not send anyone to a password.
    upstream.discovery = b"not json"
    status, page, _ = await sign_in(server)
    assert status == 502 and "Corp cannot be reached right now. Try again" in page
    assert 'name="password"' not in page and "your password" not in page
    upstream.discovery = None
    clock.advance(60)
    capfd.readouterr()
    query = {
        "response_type": "code",
        "client_id": "portal",
        "redirect_uri": REDIRECT,
        "scope": "openid",
        "state": "s",
        "code_challenge": pkce.s256(VERIFIER),
        "code_challenge_method": "S256",
    }
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        for path in ("/authorize?" + urlencode(query), "/account"):
            async with browser.get(server.endpoint(path)) as response:
                page = await response.text()
            assert response.status == 200 and "<h1>Sign in</h1>" in page, path
            assert 'name="password"' not in page and 'name="username"' not in page, path
            assert "Use your company's sign-in below" in page, path
            assert 'class="button provider"' in page and "Or sign in with" not in page, path
        async with browser.get(server.endpoint("/device")) as response:
            csrf = parse_form(await response.text())[1]["csrf_token"]
        async with browser.post(
            server.endpoint("/device_authorization"), data={"client_id": "tv", "scope": "openid"}
        ) as started:
            user_code = (await started.json())["user_code"]
        async with browser.post(
            server.endpoint("/device"), data={"csrf_token": csrf, "user_code": user_code}
        ) as checked:
            page = await checked.text()
        assert 'name="password"' not in page and "company's sign-in" in page
        assert 'class="button provider"' in page
        # The right password, and a wrong one (which a check would have charged).
        for password in (PASSWORD, "not-the-password"):
            typed = {"csrf_token": csrf, "username": "alice", "password": password}
            for path, extra in (
                ("/login", query),
                ("/account/login", {}),
                ("/device/login", {"user_code": user_code}),
            ):
                async with browser.post(
                    server.endpoint(path), data={**typed, **extra}, allow_redirects=False
                ) as refused:
                    assert refused.status == 403, path
                    assert REFUSED in await refused.text(), path
        async with browser.get(server.endpoint("/account")) as response:
            assert "Signed in as" not in await response.text()
    alice = server.subject("alice")
    assert await store.sessions_of(alice, clock()) == []
    assert await store.sign_ins_of(alice, clock()) == []
    err = capfd.readouterr().err
    assert audit_events(err, "signin.failed") == audit_events(err, "signin.succeeded") == []
    # Nothing was charged: a cap of one attempt still has its one.
    for key in ("login:ip:127.0.0.1", "login:user-at-ip:127.0.0.1 alice"):
        assert await store.reserve_attempt([Cap(key, 1, 900)], clock()) is None, key
    async with aiohttp.ClientSession() as http:
        status, body = await client_credentials(http, server)
    assert status == 200, body
    # The provider signs in, at the authorization endpoint and on the device page.
    claims = await signed_in_claims(server)
    dana = await store.user_by_username("dana")
    assert dana is not None and claims["sub"] == dana.subject
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        device_code, (status, page, _) = await device_sign_in(server, browser, password=False)
        assert status == 200 and "Allow a device" in page
        assert (await approve_device(server, browser, page, device_code))["sub"] == dana.subject


async def test_without_password_sign_in_the_account_page_changes_no_password(
    federated: Setup,
) -> None:
    """Signed in through the provider, the account page has no Password section, and a
    password change posted anyway is refused; a change that needs a recent sign-in asks
    for a new sign-in, never a password."""
    clock = MovableClock()
    key = base64.b64encode(os.urandom(32)).decode()
    server, _ = await federated(
        clock=clock, more={**NO_PASSWORDS, "second_factors": {"encryption_key": key}}
    )
    store = server.services.store
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        assert (await sign_in(server, browser))[0] == 302
        dana = await store.user_by_username("dana")
        assert dana is not None
        # An administrator gave dana a password: it is not one to sign in or confirm with.
        given = quick_password_hash("pw")
        assert await store.save_user(replace(dana, password_hash=given), 1)
        factors = server.services.authorize.factors
        enrolment = await factors.begin(dana.subject, "dana")
        assert enrolment is not None
        app = pyotp.TOTP(enrolment.grouped.replace(" ", ""))
        assert await factors.confirm(dana.subject, app.at(clock.now)) is not None
        clock.advance(16 * 60)
        async with browser.get(server.endpoint("/account")) as response:
            page = await response.text()
        assert "Signed in as" in page
        assert 'id="password-heading"' not in page and "Change password" not in page
        assert "needs a recent sign-in" in page and 'name="current"' not in page
        async with browser.get(server.endpoint("/device")) as response:
            csrf = parse_form(await response.text())[1]["csrf_token"]  # the session's
        change = {
            "csrf_token": csrf,
            "current": "pw",
            "new": "a-new-password",
            "confirm": "a-new-password",
        }
        async with browser.post(
            server.endpoint("/account/password"), data=change, allow_redirects=False
        ) as refused:
            assert refused.status == 403
            assert "Passwords are not used here" in await refused.text()
        async with browser.post(
            server.endpoint("/account/factors/totp/remove"),
            data={"csrf_token": csrf, "current": "pw"},
        ) as refused:
            assert refused.status == 403 and "sign out, sign in again" in await refused.text()
    after = await store.user_by_username("dana")
    assert after is not None and after.password_hash == given
    assert await factors.enrolled(dana.subject)
