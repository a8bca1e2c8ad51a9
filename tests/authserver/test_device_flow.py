"""The device authorization grant (RFC 8628) over real HTTP: the device's requests, the device
pages a person goes through, polling, denial, expiry, single redemption, and the throttle on
wrong user codes."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
import jwt
import pytest

from tests.authserver.conftest import (
    SECRET,
    MovableClock,
    RunningAuthServer,
    StartAuthServer,
    introspect,
    post_token,
    verify_jwt,
)
from tests.authserver.device_support import (
    DEVICE_GRANT,
    TV_SCOPE,
    Form,
    approve_on_pages,
    device_config,
    get_page,
    only_form,
    poll,
    start_device,
    submit,
)

USER_CODE = re.compile(r"^[BCDFGHJKLMNPQRSTVWXZ]{4}-[BCDFGHJKLMNPQRSTVWXZ]{4}$")


@pytest.fixture
async def server(start_authserver: StartAuthServer) -> RunningAuthServer:
    return await start_authserver(device_config())


@pytest.fixture
def clock() -> MovableClock:
    """The time of `clocked_server`, which tests move instead of waiting."""
    return MovableClock()


@pytest.fixture
async def clocked_server(
    start_authserver: StartAuthServer, clock: MovableClock
) -> RunningAuthServer:
    return await start_authserver(device_config(), clock=clock)


@pytest.fixture
async def browser() -> AsyncIterator[aiohttp.ClientSession]:
    """The person's browser: its own cookies, apart from the device's client."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        yield session


async def started(http: aiohttp.ClientSession, server: RunningAuthServer, **kw: Any) -> dict:
    status, body, _ = await start_device(http, server, **kw)
    assert status == 200, body
    return body


def assert_oauth_error(status: int, body: dict[str, Any], expected: int, error: str) -> None:
    assert (status, body.get("error")) == (expected, error), body
    assert isinstance(body.get("error_description"), str)


async def code_form(browser: aiohttp.ClientSession, server: RunningAuthServer) -> Form:
    page = await get_page(browser, server.endpoint("/device"))
    assert page.status == 200
    return page.form


async def enter_code(
    browser: aiohttp.ClientSession, server: RunningAuthServer, typed: str
) -> tuple[int, str, aiohttp.ClientResponse]:
    """A fresh look at the code page, then the code as the person typed it."""
    step = await submit(browser, server, await code_form(browser, server), {"user_code": typed})
    return step.status, step.text, step.response


# ---------------------------------------------------------------------------- starting


async def test_device_authorization_answers_codes_links_lifetime_and_interval_uncached(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    config = device_config()
    del config["device"]  # the defaults: 10 minutes, 5 seconds
    server = await start_authserver(config)
    status, body, response = await start_device(http, server)
    assert status == 200, body
    assert response.headers["Cache-Control"] == "no-store"
    assert set(body) == {
        "device_code",
        "user_code",
        "verification_uri",
        "verification_uri_complete",
        "expires_in",
        "interval",
    }
    assert USER_CODE.match(body["user_code"]), body["user_code"]
    assert body["verification_uri"] == server.endpoint("/device")
    complete = urlsplit(body["verification_uri_complete"])
    assert complete._replace(query="").geturl() == server.endpoint("/device")
    assert parse_qs(complete.query) == {"user_code": [body["user_code"]]}
    assert (body["expires_in"], body["interval"]) == (600, 5)
    assert len(body["device_code"]) >= 43  # 32 random bytes

    # Stored under its digest, never in clear.
    record = await server.services.store.device_by_user_code(
        body["user_code"].replace("-", ""), time.time()
    )
    assert record is not None
    assert record.device_code_hash == hashlib.sha256(body["device_code"].encode()).digest()
    assert (record.client_id, record.scope, record.audience) == ("tv", TV_SCOPE, "orders-api")
    database = urlsplit(server.settings.storage).path
    files = [Path(database), Path(database + "-wal")]
    assert files[0].exists()
    for file in files:
        if file.exists():
            assert body["device_code"].encode() not in file.read_bytes()


async def test_two_devices_get_different_codes(server, http) -> None:
    first, second = await started(http, server), await started(http, server)
    assert first["device_code"] != second["device_code"]
    assert first["user_code"] != second["user_code"]


@pytest.mark.parametrize(
    ("kwargs", "status", "error"),
    [
        ({"client_id": "nobody"}, 401, "invalid_client"),
        # A confidential client cannot fall back to identifying by client_id alone.
        ({"client_id": "tv-secret", "scope": "orders:read"}, 401, "invalid_client"),
        ({"auth": ("tv-secret", "wrong" * 8), "scope": "orders:read"}, 401, "invalid_client"),
        ({"client_id": "spa"}, 400, "unauthorized_client"),
        ({"scope": "orders:read admin"}, 400, "invalid_scope"),
        ({"auth": ("tv-secret", SECRET), "scope": "orders:write"}, 400, "invalid_scope"),
        ({"scope": None}, 400, "invalid_scope"),
        ({"extra": {"resource": "billing-api"}}, 400, "invalid_target"),
    ],
)
async def test_device_authorization_refuses_what_the_token_endpoint_would(
    server, http, kwargs, status, error
) -> None:
    got, body, response = await start_device(http, server, **kwargs)
    assert_oauth_error(got, body, status, error)
    assert response.headers["Cache-Control"] == "no-store"


async def test_device_authorization_refuses_a_repeated_parameter(server, http) -> None:
    response = await http.post(
        server.endpoint("/device_authorization"),
        data=[("client_id", "tv"), ("scope", "openid"), ("scope", "orders:read")],
    )
    assert_oauth_error(response.status, await response.json(), 400, "invalid_request")


async def test_a_confidential_client_starts_with_its_secret(server, http) -> None:
    body = await started(http, server, auth=("tv-secret", SECRET), scope="orders:read")
    status, polled = await poll(http, server, body["device_code"], auth=("tv-secret", SECRET))
    assert_oauth_error(status, polled, 400, "authorization_pending")


# ---------------------------------------------------------------------------- the pages


async def test_full_flow_through_the_pages_gives_tokens_exactly_once(
    clocked_server: RunningAuthServer,
    http: aiohttp.ClientSession,
    browser: aiohttp.ClientSession,
    clock: MovableClock,
) -> None:
    server = clocked_server
    before = clock.now
    body = await started(http, server)
    status, polled = await poll(http, server, body["device_code"])
    assert_oauth_error(status, polled, 400, "authorization_pending")

    # The link the device shows opens the code page with the code filled in.
    page = await get_page(browser, body["verification_uri_complete"])
    assert page.status == 200
    assert "form-action 'self'" in page.response.headers["Content-Security-Policy"]
    form = page.form
    assert urlsplit(form.action).path == "/device"
    assert form.inputs["user_code"] == body["user_code"]
    assert form.labels.get("user_code")
    assert "<button" in page.text and 'type="submit"' in page.text

    login = await submit(browser, server, form)
    assert login.status == 200
    assert urlsplit(login.form.action).path == "/device/login"
    assert {"username", "password"} <= set(login.form.inputs)
    assert "Living Room TV" in login.text

    consent = await submit(
        browser, server, login.form, {"username": "alice", "password": "wonderland"}
    )
    assert consent.status == 200
    signed_in = clock.now
    assert urlsplit(consent.form.action).path == "/device/consent"
    assert sorted(consent.form.buttons) == [("decision", "approve"), ("decision", "deny")]
    assert "Living Room TV" in consent.text
    for description in ("Read your orders", "Stay connected when you are away"):
        assert description in consent.text
    assert "Signed in as Alice Liddell" in consent.text
    warning = re.search(r'<p class="warning" role="note">(.*?)</p>', consent.text, re.S)
    assert warning is not None
    assert "holding" in warning.group(1) and body["user_code"] in warning.group(1)

    done = await submit(browser, server, consent.form, {"decision": "approve"})
    assert done.status == 200
    assert "Device connected" in done.text

    clock.advance(1.0)  # the interval
    status, tokens = await poll(http, server, body["device_code"])
    assert status == 200, tokens
    assert tokens["token_type"] == "Bearer"
    assert tokens["scope"] == TV_SCOPE
    assert tokens["refresh_token"]
    access = await verify_jwt(http, server, tokens["access_token"], audience="orders-api")
    assert access["sub"] == server.subject("alice")
    assert access["client_id"] == "tv"
    assert access["scope"] == TV_SCOPE
    assert before - 1 <= access["auth_time"] <= signed_in + 1
    id_claims = await verify_jwt(http, server, tokens["id_token"], audience="tv")
    assert id_claims["sub"] == server.subject("alice")
    assert id_claims["name"] == "Alice Liddell"
    assert id_claims["auth_time"] == access["auth_time"]
    assert (await introspect(http, server, tokens["access_token"]))["active"] is True

    # Exactly once: the second redemption is refused and ends what the first got.
    status, again = await poll(http, server, body["device_code"])
    assert_oauth_error(status, again, 400, "invalid_grant")
    assert (await introspect(http, server, tokens["access_token"]))["active"] is False
    status, refreshed, _ = await post_token(
        http,
        server,
        {
            "grant_type": "refresh_token",
            "refresh_token": tokens["refresh_token"],
            "client_id": "tv",
        },
    )
    assert_oauth_error(status, refreshed, 400, "invalid_grant")


async def test_refresh_tokens_from_the_device_flow_rotate_like_the_code_flows(
    start_authserver, http, browser
) -> None:
    # Without a grace window, a second use right after the rotation is reuse.
    server = await start_authserver(device_config(refresh_grace="0s"))
    body = await started(http, server)
    await approve_on_pages(browser, server, body["verification_uri_complete"])
    status, tokens = await poll(http, server, body["device_code"])
    assert status == 200, tokens

    refresh = {"grant_type": "refresh_token", "client_id": "tv"}
    status, first, _ = await post_token(
        http, server, {**refresh, "refresh_token": tokens["refresh_token"]}
    )
    assert status == 200, first
    assert first["refresh_token"] != tokens["refresh_token"]
    claims = await verify_jwt(http, server, first["access_token"], audience="orders-api")
    assert claims["sub"] == server.subject("alice")
    # The rotated token shown again is reuse: the family is revoked.
    status, reused, _ = await post_token(
        http, server, {**refresh, "refresh_token": tokens["refresh_token"]}
    )
    assert_oauth_error(status, reused, 400, "invalid_grant")
    status, after, _ = await post_token(
        http, server, {**refresh, "refresh_token": first["refresh_token"]}
    )
    assert_oauth_error(status, after, 400, "invalid_grant")


async def test_an_openid_request_without_offline_access_gets_no_refresh_token(
    server, http, browser
) -> None:
    body = await started(http, server, scope="openid orders:read")
    await approve_on_pages(browser, server, body["verification_uri_complete"])
    status, tokens = await poll(http, server, body["device_code"])
    assert status == 200, tokens
    assert "refresh_token" not in tokens
    assert tokens["id_token"]


@pytest.mark.parametrize("typed", ["{lower}", "{lower_plain}", " {plain} ", "{first} {second}"])
async def test_the_code_is_accepted_in_any_case_with_or_without_the_hyphen(
    server, http, browser, typed: str
) -> None:
    code = (await started(http, server))["user_code"]
    first, second = code.split("-")
    text = typed.format(
        lower=code.lower(),
        lower_plain=(first + second).lower(),
        plain=first + second,
        first=first,
        second=second,
    )
    status, page, _ = await enter_code(browser, server, text)
    assert status == 200, page[:500]
    assert urlsplit(only_form(page).action).path == "/device/login"


async def test_a_signed_in_person_goes_straight_to_consent_and_tokens_keep_their_sign_in_time(
    clocked_server, http, browser, clock
) -> None:
    server = clocked_server
    first = await started(http, server)
    await approve_on_pages(browser, server, first["verification_uri_complete"])
    status, tokens = await poll(http, server, first["device_code"])
    assert status == 200
    signed_in_at = jwt.decode(tokens["access_token"], options={"verify_signature": False})[
        "auth_time"
    ]

    clock.advance(1.1)  # auth_time has one-second resolution
    second = await started(http, server)
    status, page, _ = await enter_code(browser, server, second["user_code"])
    assert status == 200
    consent = only_form(page)
    assert urlsplit(consent.action).path == "/device/consent"
    done = await submit(browser, server, consent, {"decision": "approve"})
    assert "Device connected" in done.text
    status, tokens = await poll(http, server, second["device_code"])
    assert status == 200
    claims = await verify_jwt(http, server, tokens["access_token"], audience="orders-api")
    assert claims["auth_time"] == signed_in_at


async def test_consent_is_asked_even_of_a_client_that_skips_it_in_the_code_flow(
    server, http, browser
) -> None:
    body = await started(http, server, auth=("tv-secret", SECRET), scope="orders:read")
    page = await get_page(browser, body["verification_uri_complete"])
    login = await submit(browser, server, page.form)
    consent = await submit(
        browser, server, login.form, {"username": "alice", "password": "wonderland"}
    )
    assert urlsplit(consent.form.action).path == "/device/consent"
    assert "Kiosk" in consent.text and "Read your orders" in consent.text


async def test_a_wrong_password_on_the_device_login_keeps_the_code_and_asks_again(
    server, http, browser
) -> None:
    body = await started(http, server)
    page = await get_page(browser, body["verification_uri_complete"])
    login = await submit(browser, server, page.form)
    wrong = await submit(browser, server, login.form, {"username": "alice", "password": "nope"})
    assert wrong.status == 400
    assert "The username or password is not correct." in wrong.text
    assert urlsplit(wrong.form.action).path == "/device/login"
    consent = await submit(
        browser, server, wrong.form, {"username": "alice", "password": "wonderland"}
    )
    assert urlsplit(consent.form.action).path == "/device/consent"


async def test_the_link_prefills_only_a_well_formed_code(server, browser) -> None:
    page = await get_page(browser, server.endpoint('/device?user_code="><script>x</script>'))
    assert page.status == 200
    assert page.form.inputs["user_code"] == ""
    assert "<script>x" not in page.text
    page = await get_page(browser, server.endpoint("/device?user_code=wdjbmjht"))
    assert page.form.inputs["user_code"] == "WDJB-MJHT"


# ---------------------------------------------------------------------------- polling


async def test_polling_faster_than_the_interval_gets_slow_down_and_five_more_seconds(
    clocked_server, http, clock
) -> None:
    server = clocked_server
    body = await started(http, server)
    status, first = await poll(http, server, body["device_code"])
    assert_oauth_error(status, first, 400, "authorization_pending")
    status, second = await poll(http, server, body["device_code"])
    assert_oauth_error(status, second, 400, "slow_down")
    # The interval is now 6 s: waiting the original second is still too fast.
    clock.advance(1.2)
    status, third = await poll(http, server, body["device_code"])
    assert_oauth_error(status, third, 400, "slow_down")
    record = await server.services.store.device_by_user_code(
        body["user_code"].replace("-", ""), clock.now
    )
    assert record is not None and record.interval == 11.0  # raised twice


async def test_a_fast_poll_after_approval_gets_the_tokens(server, http, browser) -> None:
    body = await started(http, server)
    status, _ = await poll(http, server, body["device_code"])
    await approve_on_pages(browser, server, body["verification_uri_complete"])
    # slow_down only ever stands for "still pending": once decided, the answer is the decision.
    status, tokens = await poll(http, server, body["device_code"])
    assert status == 200, tokens


async def test_a_denied_device_gets_access_denied_on_every_poll(server, http, browser) -> None:
    body = await started(http, server)
    done = await approve_on_pages(
        browser, server, body["verification_uri_complete"], decision="deny"
    )
    assert done.status == 200
    assert "Device denied" in done.text
    for _ in range(2):
        status, polled = await poll(http, server, body["device_code"])
        assert_oauth_error(status, polled, 400, "access_denied")


async def test_an_expired_code_gets_expired_token_and_the_page_refuses_it(
    start_authserver: StartAuthServer, http, browser
) -> None:
    config = device_config(lifetimes={"device_code": "1s"})
    clock = MovableClock()
    server = await start_authserver(config, clock=clock)
    body = await started(http, server)
    assert body["expires_in"] == 1
    clock.advance(1.1)
    status, polled = await poll(http, server, body["device_code"])
    assert_oauth_error(status, polled, 400, "expired_token")
    status, page, _ = await enter_code(browser, server, body["user_code"])
    assert status == 400
    assert "not valid or has expired" in page


async def test_a_device_code_is_bound_to_its_client_and_must_be_known(server, http) -> None:
    body = await started(http, server)
    status, polled = await poll(http, server, body["device_code"], auth=("tv-secret", SECRET))
    assert_oauth_error(status, polled, 400, "invalid_grant")
    status, polled = await poll(http, server, "not-a-device-code")
    assert_oauth_error(status, polled, 400, "invalid_grant")
    status, polled, _ = await post_token(
        http, server, {"grant_type": DEVICE_GRANT, "client_id": "tv"}
    )
    assert_oauth_error(status, polled, 400, "invalid_request")


async def test_another_clients_poll_of_an_approved_code_leaves_it_to_the_device(
    server, http, browser
) -> None:
    body = await started(http, server)
    await approve_on_pages(browser, server, body["verification_uri_complete"])
    for _ in range(2):
        status, polled = await poll(http, server, body["device_code"], auth=("tv-secret", SECRET))
        assert_oauth_error(status, polled, 400, "invalid_grant")

    # The refused polls changed nothing: the device redeems its code once, and what it got
    # stays valid (no "redeemed twice" revocation).
    status, tokens = await poll(http, server, body["device_code"])
    assert status == 200, tokens
    assert (await introspect(http, server, tokens["access_token"]))["active"] is True
    status, refreshed, _ = await post_token(
        http,
        server,
        {
            "grant_type": "refresh_token",
            "refresh_token": tokens["refresh_token"],
            "client_id": "tv",
        },
    )
    assert status == 200, refreshed


async def test_another_clients_polls_of_a_pending_code_do_not_slow_the_device_down(
    server, http
) -> None:
    body = await started(http, server)
    for _ in range(3):
        status, polled = await poll(http, server, body["device_code"], auth=("tv-secret", SECRET))
        assert_oauth_error(status, polled, 400, "invalid_grant")
    # The device's first poll comes right after the other client's: still not too fast.
    status, polled = await poll(http, server, body["device_code"])
    assert_oauth_error(status, polled, 400, "authorization_pending")
    record = await server.services.store.device_by_user_code(
        body["user_code"].replace("-", ""), time.time()
    )
    assert record is not None and record.interval == 1.0


async def test_a_client_not_registered_for_the_grant_cannot_poll(server, http) -> None:
    body = await started(http, server)
    status, polled, _ = await post_token(
        http,
        server,
        {"grant_type": DEVICE_GRANT, "device_code": body["device_code"], "client_id": "spa"},
    )
    assert_oauth_error(status, polled, 400, "unauthorized_client")


# ---------------------------------------------------------------------------- misuse of the pages


async def test_wrong_codes_are_throttled_per_session(
    start_authserver: StartAuthServer, http, browser
) -> None:
    server = await start_authserver(
        device_config(device={"interval": "1s", "max_failures": 3, "max_failures_per_address": 50})
    )
    body = await started(http, server)
    for _ in range(3):
        status, page, _ = await enter_code(browser, server, "BBBB-BBBB")
        assert status == 400
        assert "not valid or has expired" in page
    # Over the limit: even the right code is not looked up.
    status, page, response = await enter_code(browser, server, body["user_code"])
    assert status == 429
    assert response.headers["Retry-After"] == str(15 * 60)
    assert "Too many wrong codes" in page
    # Another browser from the same address is not held back by this session's failures.
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as other:
        status, page, _ = await enter_code(other, server, body["user_code"])
        assert status == 200
        assert urlsplit(only_form(page).action).path == "/device/login"


async def test_wrong_codes_are_throttled_per_address_across_sessions(
    start_authserver: StartAuthServer, http
) -> None:
    server = await start_authserver(
        device_config(device={"interval": "1s", "max_failures": 50, "max_failures_per_address": 3})
    )
    body = await started(http, server)
    for _ in range(3):
        # A fresh browser each time: discarding cookies does not reset the count.
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as fresh:
            status, _, _ = await enter_code(fresh, server, "BBBB-BBBB")
            assert status == 400
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as fresh:
        status, page, response = await enter_code(fresh, server, body["user_code"])
        assert status == 429
        assert "Retry-After" in response.headers
        assert "Too many wrong codes" in page


async def test_malformed_codes_are_refused_without_counting_as_guesses(
    start_authserver: StartAuthServer, http, browser
) -> None:
    server = await start_authserver(
        device_config(device={"interval": "1s", "max_failures": 2, "max_failures_per_address": 2})
    )
    body = await started(http, server)
    for typed in ("12345678", "ABC", "AAAA-AAAA", "BCDF-GHJK-L"):
        status, page, _ = await enter_code(browser, server, typed)
        assert status == 400
        assert "Enter the 8-letter code" in page
    status, page, _ = await enter_code(browser, server, body["user_code"])
    assert status == 200
    assert urlsplit(only_form(page).action).path == "/device/login"


async def test_the_code_form_needs_the_sessions_csrf_token(server, http, browser) -> None:
    body = await started(http, server)
    form = await code_form(browser, server)
    step = await submit(
        browser, server, form, {"user_code": body["user_code"]}, drop=("csrf_token",)
    )
    assert step.status == 403
    step = await submit(browser, server, form, {"user_code": body["user_code"], "csrf_token": "x"})
    assert step.status == 403


async def test_login_and_consent_forms_refuse_a_code_that_skipped_the_code_check(
    server, http, browser
) -> None:
    # Alice signs in through one device flow, so her session may post consent.
    first = await started(http, server)
    await approve_on_pages(browser, server, first["verification_uri_complete"])
    victim = await started(http, server)
    # A consent form made by hand for another code: no proof that it passed the check.
    second = await started(http, server)
    page = await get_page(browser, second["verification_uri_complete"])
    consent = (await submit(browser, server, page.form)).form
    forged = {**consent.inputs, "user_code": victim["user_code"], "decision": "approve"}
    response = await browser.post(server.endpoint("/device/consent"), data=forged)
    assert response.status == 400
    status, polled = await poll(http, server, victim["device_code"])
    assert_oauth_error(status, polled, 400, "authorization_pending")

    # The login form likewise, from a browser that is not signed in.
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as other:
        third = await started(http, server)
        page = await get_page(other, third["verification_uri_complete"])
        login = (await submit(other, server, page.form)).form
        forged = {
            **login.inputs,
            "user_code": victim["user_code"],
            "username": "alice",
            "password": "wonderland",
        }
        response = await other.post(server.endpoint("/device/login"), data=forged)
        assert response.status == 400
        assert "This code was not checked" in await response.text()


async def test_a_decided_code_cannot_be_decided_again(server, http, browser) -> None:
    body = await started(http, server)
    page = await get_page(browser, body["verification_uri_complete"])
    login = await submit(browser, server, page.form)
    consent = await submit(
        browser, server, login.form, {"username": "alice", "password": "wonderland"}
    )
    done = await submit(browser, server, consent.form, {"decision": "deny"})
    assert "Device denied" in done.text
    again = await submit(browser, server, consent.form, {"decision": "approve"})
    assert again.status == 400
    status, polled = await poll(http, server, body["device_code"])
    assert_oauth_error(status, polled, 400, "access_denied")
