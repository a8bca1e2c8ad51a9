"""Authenticator apps as a second factor: enrolment, the code after the password, recovery
codes, and what the ID token then says.

The server runs on a MovableClock: codes are made for the time it sees (by pyotp, an
implementation sharing no code with the server's), and the clock is moved past time steps
instead of sleeping.
"""

from __future__ import annotations

import asyncio
import base64
import html
import json
import os
import re
from typing import Any
from urllib.parse import urlencode, urlsplit

import aiohttp
import pyotp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from authserver.protocol import totp
from authserver.store.base import PasskeyRecord
from tests.authserver.admin_support import StartAdminServer, admin_for, start_admin_server
from tests.authserver.conftest import (
    PASSWORD,
    REDIRECT,
    MovableClock,
    RunningAuthServer,
    StartAuthServer,
    exchange_code,
    parse_form,
    pkce_pair,
    post_token,
    query_of,
    verify_jwt,
)
from tests.authserver.device_support import device_config

ENCRYPTION_KEY = base64.b64encode(os.urandom(32)).decode()
__all__ = ["start_admin_server"]  # the fixture, used here by name


def factor_config(**second_factors: Any) -> dict[str, Any]:
    config = device_config()
    config["second_factors"] = {"encryption_key": ENCRYPTION_KEY, **second_factors}
    return config


@pytest.fixture
def clock() -> MovableClock:
    # Codes are made for the time it shows, so no step edge is ever crossed unawares.
    return MovableClock()


@pytest.fixture
async def server(start_authserver: StartAuthServer, clock: MovableClock) -> RunningAuthServer:
    return await start_authserver(factor_config(), clock=clock)


def browser() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))


def app_code(secret: str, clock: MovableClock, steps: int = 0) -> str:
    return pyotp.TOTP(secret).at(clock.now + steps * 30)


def authorize_url(
    server: RunningAuthServer, client_id: str = "spa", **extra: str
) -> tuple[str, str]:
    verifier, challenge = pkce_pair()
    params = {
        "response_type": "code",
        "client_id": client_id,
        "redirect_uri": REDIRECT,
        "scope": "openid",
        "state": "st",
        "nonce": "nn",
        "code_challenge": challenge,
        "code_challenge_method": "S256",
        **extra,
    }
    return server.endpoint("/authorize?" + urlencode(params)), verifier


async def post(
    http: aiohttp.ClientSession, server: RunningAuthServer, action: str, fields: dict[str, str]
) -> aiohttp.ClientResponse:
    """A form posted as the browser would: to the issuer's origin, whose cookies the session
    has (localhost where passkeys are tested)."""
    issuer = urlsplit(server.settings.issuer)
    url = f"{issuer.scheme}://{issuer.netloc}{urlsplit(action).path}"
    return await http.post(url, data=fields, allow_redirects=False)


async def password_step(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    username: str = "alice",
    client_id: str = "spa",
    **extra: str,
) -> tuple[aiohttp.ClientResponse, str]:
    """Authorize, then the password: the answer to the login form, and the PKCE verifier."""
    url, verifier = authorize_url(server, client_id, **extra)
    page = await http.get(url, allow_redirects=False)
    action, fields = parse_form(await page.text())
    assert action.endswith("/login")
    fields.update(username=username, password=PASSWORD)
    return await post(http, server, action, fields), verifier


async def finish(
    http: aiohttp.ClientSession, server: RunningAuthServer, response: aiohttp.ClientResponse
) -> str:
    """Approve consent if asked; the code of the redirect."""
    if response.status == 200:
        action, fields = parse_form(await response.text())
        assert action.endswith("/consent"), action
        fields["decision"] = "approve"
        response = await post(http, server, action, fields)
    assert response.status in (302, 303), await response.text()
    return query_of(response.headers["Location"])["code"]


async def id_token(
    http: aiohttp.ClientSession, server: RunningAuthServer, code: str, verifier: str
) -> dict[str, Any]:
    status, body = await exchange_code(
        http,
        server,
        _Result(code, verifier),  # type: ignore[arg-type]
    )
    assert status == 200, body
    return await verify_jwt(http, server, body["id_token"], audience="spa")


class _Result:
    def __init__(self, code: str, verifier: str) -> None:
        self.code, self.verifier, self.redirect_uri = code, verifier, REDIRECT


async def sign_in_with_password(http: aiohttp.ClientSession, server: RunningAuthServer) -> None:
    response, _ = await password_step(http, server)
    await finish(http, server, response)


async def enrol(
    http: aiohttp.ClientSession, server: RunningAuthServer, clock: MovableClock
) -> tuple[str, list[str]]:
    """Set up an app for the signed-in user: its base32 secret and the recovery codes."""
    page = await http.get(server.endpoint("/factors"))
    assert page.status == 200
    action, fields = parse_form(await page.text())
    enrolment = await post(http, server, action, fields)
    assert enrolment.status == 200
    text = await enrolment.text()
    secret = secret_on(text)
    action, fields = parse_form(text)
    fields["code"] = app_code(secret, clock)
    done = await post(http, server, action, fields)
    assert done.status == 200, await done.text()
    return secret, recovery_codes_on(await done.text())


def secret_on(text: str) -> str:
    found = re.search(r'id="secret">([A-Z2-7 ]+)<', text)
    assert found, text[:800]
    return found.group(1).replace(" ", "")


def recovery_codes_on(text: str) -> list[str]:
    block = text.split('class="recovery-codes"', 1)[1].split("</ul>", 1)[0]
    return re.findall(r"<code>([a-z0-9-]+)</code>", block)


async def second_step(
    http: aiohttp.ClientSession, server: RunningAuthServer, response: aiohttp.ClientResponse
) -> tuple[str, dict[str, str]]:
    assert response.status == 200, await response.text()
    action, fields = parse_form(await response.text())
    assert action.endswith("/login/code"), action
    return action, fields


async def enrolled_user(server: RunningAuthServer, clock: MovableClock) -> tuple[str, list[str]]:
    async with browser() as http:
        await sign_in_with_password(http, server)
        secret, codes = await enrol(http, server, clock)
    clock.advance(30)  # the confirming code's step is used: the next sign-in needs another
    return secret, codes


# ---------------------------------------------------------------------------- the codes


def test_the_servers_codes_are_those_of_an_independent_implementation() -> None:
    secret = totp.new_secret()
    reference = pyotp.TOTP(totp.base32(secret))
    for now in (0.0, 59.0, 1_111_111_109.0, 2_000_000_000.0):
        assert totp.code_at(secret, totp.time_step(now)) == reference.at(now)
    uri = totp.provisioning_uri(secret, "auth.example.com", "alice")
    parsed = pyotp.parse_uri(uri)
    assert parsed.secret == totp.base32(secret)
    assert (parsed.issuer, parsed.name, parsed.digits, parsed.interval) == (
        "auth.example.com",
        "alice",
        6,
        30,
    )


def test_rfc_6238_appendix_b_vectors_for_sha1() -> None:
    secret = b"12345678901234567890"
    # RFC 6238 Appendix B gives 8 digits; the last six are the 6-digit code.
    for now, expected in [(59, "94287082"), (1111111109, "07081804"), (2000000000, "69279037")]:
        assert totp.code_at(secret, totp.time_step(now)) == expected[-6:]


def test_a_code_matches_one_step_either_side_and_only_after_the_last_used() -> None:
    secret = totp.new_secret()
    now = 1_700_000_015.0
    step = totp.time_step(now)
    for offset in (-1, 0, 1):
        assert totp.matching_step(secret, totp.code_at(secret, step + offset), now, None) == (
            step + offset
        )
    for offset in (-2, 2):
        assert totp.matching_step(secret, totp.code_at(secret, step + offset), now, None) is None
    assert totp.matching_step(secret, totp.code_at(secret, step), now, step) is None
    assert totp.matching_step(secret, totp.code_at(secret, step), now, step - 1) == step


# ---------------------------------------------------------------------------- enrolment


async def test_enrolment_shows_a_qr_code_and_the_secret_and_waits_for_a_code(
    server: RunningAuthServer, clock: MovableClock
) -> None:
    async with browser() as http:
        await sign_in_with_password(http, server)
        page = await http.get(server.endpoint("/factors"))
        action, fields = parse_form(await page.text())
        enrolment = await post(http, server, action, fields)
        text = await enrolment.text()
        assert "<svg" in text and "otpauth://totp/" in html.unescape(text)
        secret = secret_on(text)
        subject = server.subject("alice")
        waiting = await server.services.store.get_totp(subject)
        assert waiting is not None and not waiting.confirmed
        assert base64.b32decode(secret + "=" * (-len(secret) % 8)) not in waiting.sealed_secret

        # A wrong code: the same secret shown again, nothing confirmed.
        action, fields = parse_form(text)
        wrong = await post(http, server, action, {**fields, "code": "000000"})
        assert wrong.status == 400
        assert secret_on(await wrong.text()) == secret
        assert not (await server.services.store.get_totp(subject)).confirmed  # type: ignore[union-attr]

        done = await post(http, server, action, {**fields, "code": app_code(secret, clock)})
        assert done.status == 200
        codes = recovery_codes_on(await done.text())
        assert len(codes) == 10 and len(set(codes)) == 10
        record = await server.services.store.get_totp(subject)
        assert record is not None and record.confirmed and record.recovery_codes_left == 10

        # Set up: the page says so, and offers no second enrolment.
        status = await (await http.get(server.endpoint("/factors"))).text()
        assert 'id="enrolled"' in status and 'id="recovery-left">10<' in status
        assert "<form" not in status


async def test_enrolment_pages_refuse_a_visitor_not_signed_in_and_a_stale_form(
    server: RunningAuthServer,
) -> None:
    async with browser() as http:
        assert (await http.get(server.endpoint("/factors"))).status == 401
        refused = await http.post(server.endpoint("/factors/totp"), data={"csrf_token": "x"})
        assert refused.status == 401
        await sign_in_with_password(http, server)
        stale = await http.post(server.endpoint("/factors/totp"), data={"csrf_token": "forged"})
        assert stale.status == 403
        assert await server.services.store.get_totp(server.subject("alice")) is None


async def test_without_an_encryption_key_nobody_can_enrol(
    start_authserver: StartAuthServer,
) -> None:
    server = await start_authserver()
    async with browser() as http:
        await sign_in_with_password(http, server)
        assert (await http.get(server.endpoint("/factors"))).status == 404


# ---------------------------------------------------------------------------- signing in


async def test_the_code_after_the_password_signs_in_with_two_factors(
    server: RunningAuthServer, clock: MovableClock
) -> None:
    secret, _ = await enrolled_user(server, clock)
    async with browser() as http:
        response, verifier = await password_step(http, server)
        action, fields = await second_step(http, server, response)
        # No session yet: the password alone signed nobody in.
        assert (await http.get(server.endpoint("/factors"))).status == 401
        signed_in = await post(http, server, action, {**fields, "code": app_code(secret, clock)})
        claims = await id_token(http, server, await finish(http, server, signed_in), verifier)
    assert claims["amr"] == ["pwd", "otp", "mfa"]
    assert claims["acr"] == "urn:portcullis:acr:mfa"


async def test_a_password_only_sign_in_says_so(server: RunningAuthServer) -> None:
    async with browser() as http:
        response, verifier = await password_step(http, server)
        claims = await id_token(http, server, await finish(http, server, response), verifier)
    assert claims["amr"] == ["pwd"]
    assert claims["acr"] == "urn:portcullis:acr:pwd"


async def test_a_code_is_accepted_once_and_codes_a_step_away_are_accepted(
    server: RunningAuthServer, clock: MovableClock
) -> None:
    secret, _ = await enrolled_user(server, clock)
    async with browser() as http:
        response, _ = await password_step(http, server)
        action, fields = await second_step(http, server, response)
        # The next step's code (the phone a little ahead) passes.
        ahead = app_code(secret, clock, steps=1)
        await finish(http, server, await post(http, server, action, {**fields, "code": ahead}))
    async with browser() as http:
        response, _ = await password_step(http, server)
        action, fields = await second_step(http, server, response)
        # The same code again, and the current step's (earlier than the one used): refused.
        for code in (ahead, app_code(secret, clock)):
            replay = await post(http, server, action, {**fields, "code": code})
            assert replay.status == 400
            assert "already used" in await replay.text()
        clock.advance(90)  # the step after the used one is now the step behind
        behind = app_code(secret, clock, steps=-1)
        await finish(http, server, await post(http, server, action, {**fields, "code": behind}))


async def test_codes_two_steps_away_are_refused(
    server: RunningAuthServer, clock: MovableClock
) -> None:
    secret, _ = await enrolled_user(server, clock)
    async with browser() as http:
        response, _ = await password_step(http, server)
        action, fields = await second_step(http, server, response)
        for steps in (-2, 2, 3):
            refused = await post(
                http, server, action, {**fields, "code": app_code(secret, clock, steps)}
            )
            assert refused.status == 400


async def test_the_pending_sign_in_cannot_be_skipped_forged_replayed_or_kept(
    server: RunningAuthServer, clock: MovableClock
) -> None:
    secret, _ = await enrolled_user(server, clock)
    bob = server.subject("bob")
    async with browser() as http:
        response, _ = await password_step(http, server)
        action, fields = await second_step(http, server, response)
        code = app_code(secret, clock)
        # Another subject, an expiry moved on, another browser: refused before any check.
        forged = await post(http, server, action, {**fields, "pending_subject": bob, "code": code})
        assert forged.status == 403
        later = str(int(fields["pending_until"]) + 600)
        moved = await post(http, server, action, {**fields, "pending_until": later, "code": code})
        assert moved.status == 403
        async with browser() as other:
            assert (await post(other, server, action, {**fields, "code": code})).status == 403
        # Used once: the session it was bound to is gone.
        await finish(http, server, await post(http, server, action, {**fields, "code": code}))
        clock.advance(30)
        again = await post(http, server, action, {**fields, "code": app_code(secret, clock)})
        assert again.status == 403
    async with browser() as http:
        response, _ = await password_step(http, server)
        action, fields = await second_step(http, server, response)
        clock.advance(5 * 60)
        expired = await post(http, server, action, {**fields, "code": app_code(secret, clock)})
        assert expired.status == 403


async def test_wrong_codes_are_throttled_as_passwords_are(
    server: RunningAuthServer, clock: MovableClock, capfd: pytest.CaptureFixture[str]
) -> None:
    secret, _ = await enrolled_user(server, clock)
    async with browser() as http:
        response, _ = await password_step(http, server)
        action, fields = await second_step(http, server, response)
        statuses = []
        for guess in range(6):
            answer = await post(http, server, action, {**fields, "code": f"{guess:06d}"})
            statuses.append(answer.status)
        assert statuses[:5] == [400] * 5 and statuses[5] == 429
        # Throttled, even the right code is not checked.
        right = await post(http, server, action, {**fields, "code": app_code(secret, clock)})
        assert right.status == 429 and "Retry-After" in right.headers
        clock.advance(15 * 60)
    async with browser() as http:
        response, _ = await password_step(http, server)
        action, fields = await second_step(http, server, response)
        passed = await post(http, server, action, {**fields, "code": app_code(secret, clock)})
        await finish(http, server, passed)
    # Each wrong code and each throttled one is an audit event naming the user, never a code.
    await asyncio.sleep(0)  # the audit lines of the last turn written
    written = capfd.readouterr().err
    events = [json.loads(line) for line in written.splitlines() if '"event"' in line]
    kinds = [e["event"] for e in events if e["event"].startswith("factor.")]
    assert kinds.count("factor.failed") == 5 and kinds.count("factor.throttled") == 2
    assert {e["subject"] for e in events if e["event"].startswith("factor.")} == {
        server.subject("alice")
    }
    assert all(f"{guess:06d}" not in written for guess in range(6))


async def test_each_recovery_code_signs_in_once(
    server: RunningAuthServer, clock: MovableClock, capfd: pytest.CaptureFixture[str]
) -> None:
    _, codes = await enrolled_user(server, clock)
    async with browser() as http:
        response, verifier = await password_step(http, server)
        action, fields = await second_step(http, server, response)
        typed = codes[0].upper().replace("-", " ")  # as read off paper
        signed_in = await post(http, server, action, {**fields, "code": typed})
        claims = await id_token(http, server, await finish(http, server, signed_in), verifier)
        assert claims["amr"] == ["pwd", "otp", "mfa"]
    async with browser() as http:
        response, _ = await password_step(http, server)
        action, fields = await second_step(http, server, response)
        reused = await post(http, server, action, {**fields, "code": codes[0]})
        assert reused.status == 400
        await finish(http, server, await post(http, server, action, {**fields, "code": codes[1]}))
    record = await server.services.store.get_totp(server.subject("alice"))
    assert record is not None and record.recovery_codes_left == 8
    await asyncio.sleep(0)
    written = capfd.readouterr().err
    used = [line for line in written.splitlines() if '"factor.recovery_code_used"' in line]
    assert len(used) == 2 and all('"level":"warning"' in line for line in used)
    assert not any(code in written for code in codes)


async def test_the_account_page_asks_for_the_code_too(
    server: RunningAuthServer, clock: MovableClock
) -> None:
    """The account page's own sign-in is no way around the app: the password alone signs
    nothing in there, the code does, and its pending sign-in is used once."""
    secret, _ = await enrolled_user(server, clock)
    async with browser() as http:
        page = await http.get(server.url + "/account")
        action, fields = parse_form(await page.text())
        assert action.endswith("/account/login")
        fields.update(username="alice", password=PASSWORD)
        answer = await post(http, server, action, fields)
        assert answer.status == 200
        action, pending = parse_form(await answer.text())
        assert action.endswith("/account/login/code")
        # Not signed in yet: the page is still its sign-in form.
        still = await http.get(server.url + "/account")
        assert parse_form(await still.text())[0].endswith("/account/login")
        wrong = await post(http, server, action, {**pending, "code": "000000"})
        assert wrong.status == 400
        signed_in = await post(http, server, action, {**pending, "code": app_code(secret, clock)})
        assert signed_in.status in (302, 303)
        account = await http.get(server.url + "/account")
        page = await account.text()
        assert "Connected apps" in page
        # The pending sign-in died with the session it was bound to: sent again with the new
        # session's CSRF token, its proof no longer holds.
        _, signed_in_fields = parse_form(page)
        again = await post(
            http,
            server,
            action,
            {
                **pending,
                "csrf_token": signed_in_fields["csrf_token"],
                "code": app_code(secret, clock, 1),
            },
        )
        assert again.status == 403 and "This sign-in has expired" in await again.text()
    session = await server.services.store.sessions_of(server.subject("alice"), clock.now)
    assert any(record.amr == ("pwd", "otp", "mfa") for record in session)


async def test_a_user_without_an_app_signs_in_with_the_password_alone(
    server: RunningAuthServer, clock: MovableClock
) -> None:
    await enrolled_user(server, clock)  # alice has one; bob does not
    async with browser() as http:
        response, _ = await password_step(http, server, username="bob")
        await finish(http, server, response)


async def test_the_device_page_asks_for_the_code_too(
    server: RunningAuthServer, clock: MovableClock
) -> None:
    secret, _ = await enrolled_user(server, clock)
    async with browser() as http:
        started = await http.post(
            server.endpoint("/device_authorization"),
            data={"client_id": "tv", "scope": "openid"},
        )
        assert started.status == 200
        user_code = (await started.json())["user_code"]
        page = await http.get(server.endpoint("/device"))
        action, fields = parse_form(await page.text())
        checked = await post(http, server, action, {**fields, "user_code": user_code})
        action, fields = parse_form(await checked.text())
        login = await post(
            http, server, action, {**fields, "username": "alice", "password": PASSWORD}
        )
        action, fields = parse_form(await login.text())
        assert action.endswith("/device/login/code")
        consent = await post(http, server, action, {**fields, "code": app_code(secret, clock)})
        action, _ = parse_form(await consent.text())
        assert action.endswith("/device/consent")


# ---------------------------------------------------------------------------- requiring it

MFA = "urn:portcullis:acr:mfa"


async def enrolment_led_by_sign_in(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    clock: MovableClock,
    response: aiohttp.ClientResponse,
) -> aiohttp.ClientResponse:
    """From the page that leads a user without an app to set one up, through to the
    request going on: the answer of the authorization endpoint afterwards."""
    text = await response.text()
    assert response.status == 200 and 'id="reason"' in text, text[:600]
    # The issuer is an IP address, where browsers offer no passkeys: the app alone.
    assert "data-passkey" not in text and 'id="add-passkey"' not in text
    action, fields = parse_form(text)
    assert action.endswith("/factors/totp")
    enrolment = await post(http, server, action, fields)
    text = await enrolment.text()
    action, fields = parse_form(text)
    fields["code"] = app_code(secret_on(text), clock)
    done = await post(http, server, action, fields)
    action, fields = parse_form(await done.text())
    assert action.endswith("/authorize"), action
    return await post(http, server, action, fields)


async def test_acr_values_lead_a_user_without_an_app_to_set_one_up_then_on(
    server: RunningAuthServer, clock: MovableClock
) -> None:
    async with browser() as http:
        response, verifier = await password_step(http, server, acr_values=MFA)
        after = await enrolment_led_by_sign_in(http, server, clock, response)
        claims = await id_token(http, server, await finish(http, server, after), verifier)
    assert claims["acr"] == MFA and claims["amr"] == ["pwd", "otp", "mfa"]


async def test_acr_values_ask_a_password_only_session_to_sign_in_again_with_the_code(
    server: RunningAuthServer, clock: MovableClock
) -> None:
    async with browser() as before, browser() as other:
        await sign_in_with_password(before, server)  # signed in before the app was set up
        await sign_in_with_password(other, server)
        secret, _ = await enrol(other, server, clock)
        clock.advance(30)
        url, verifier = authorize_url(server, acr_values=MFA)
        page = await before.get(url, allow_redirects=False)
        action, fields = parse_form(await page.text())
        assert action.endswith("/login")  # the password again, then the code
        fields.update(username="alice", password=PASSWORD)
        response = await post(before, server, action, fields)
        action, fields = await second_step(before, server, response)
        code = app_code(secret, clock)
        signed_in = await post(before, server, action, {**fields, "code": code})
        claims = await id_token(before, server, await finish(before, server, signed_in), verifier)
        assert claims["acr"] == MFA


async def test_prompt_login_and_max_age_ask_for_both_steps_again(
    server: RunningAuthServer, clock: MovableClock
) -> None:
    secret, _ = await enrolled_user(server, clock)
    async with browser() as http:
        response, _ = await password_step(http, server)
        action, fields = await second_step(http, server, response)
        code = app_code(secret, clock)
        await finish(http, server, await post(http, server, action, {**fields, "code": code}))
        for extra in ({"prompt": "login"}, {"max_age": "0"}):
            clock.advance(30)
            url, verifier = authorize_url(server, **extra)
            page = await http.get(url, allow_redirects=False)
            action, fields = parse_form(await page.text())
            assert action.endswith("/login"), extra
            fields.update(username="alice", password=PASSWORD)
            response = await post(http, server, action, fields)
            action, fields = await second_step(http, server, response)
            code = app_code(secret, clock)
            signed_in = await post(http, server, action, {**fields, "code": code})
            claims = await id_token(http, server, await finish(http, server, signed_in), verifier)
            assert claims["amr"] == ["pwd", "otp", "mfa"]
            assert claims["auth_time"] == int(clock.now)


async def test_a_password_only_session_asked_for_a_second_factor_with_prompt_none_is_refused(
    server: RunningAuthServer,
) -> None:
    async with browser() as http:
        await sign_in_with_password(http, server)
        url, _ = authorize_url(server, prompt="none", acr_values=MFA)
        answer = await http.get(url, allow_redirects=False)
        assert answer.status == 302
        assert query_of(answer.headers["Location"])["error"] == "interaction_required"
        assert await server.services.store.get_totp(server.subject("alice")) is None


async def test_a_lower_level_among_acr_values_is_met_by_the_password(
    server: RunningAuthServer,
) -> None:
    async with browser() as http:
        response, verifier = await password_step(
            http, server, acr_values=f"urn:example:unknown urn:portcullis:acr:pwd {MFA}"
        )
        claims = await id_token(http, server, await finish(http, server, response), verifier)
    assert claims["acr"] == "urn:portcullis:acr:pwd"


def client_requiring(config: dict[str, Any], **declared: Any) -> dict[str, Any]:
    spa = next(c for c in config["clients"] if c["client_id"] == "spa")
    spa.update(declared)
    return config


async def test_a_client_that_requires_a_second_factor_leads_to_enrolment(
    start_authserver: StartAuthServer, clock: MovableClock
) -> None:
    server = await start_authserver(
        client_requiring(factor_config(), require_mfa=True), clock=clock
    )
    async with browser() as http:
        response, verifier = await password_step(http, server, username="bob")
        after = await enrolment_led_by_sign_in(http, server, clock, response)
        claims = await id_token(http, server, await finish(http, server, after), verifier)
    assert claims["amr"] == ["pwd", "otp", "mfa"]


async def test_a_clients_default_acr_values_lead_to_enrolment(
    start_authserver: StartAuthServer, clock: MovableClock
) -> None:
    config = client_requiring(factor_config(), default_acr_values=[MFA])
    server = await start_authserver(config, clock=clock)
    async with browser() as http:
        response, _ = await password_step(http, server)
        assert 'id="reason"' in await response.text()


async def test_a_required_second_factor_without_an_encryption_key_is_refused(
    start_authserver: StartAuthServer,
) -> None:
    server = await start_authserver(client_requiring(device_config(), require_mfa=True))
    async with browser() as http:
        response, _ = await password_step(http, server)
        assert response.status == 303
        query = query_of(response.headers["Location"])
        assert query["error"] == "access_denied" and query["state"] == "st"


async def test_the_operator_may_require_a_second_factor_of_a_role(
    start_authserver: StartAuthServer, clock: MovableClock
) -> None:
    config = factor_config(required_for_roles=["admin"])
    next(u for u in config["users"] if u["username"] == "alice")["roles"] = ["admin"]
    server = await start_authserver(config, clock=clock)
    async with browser() as http:
        response, _ = await password_step(http, server, username="bob")
        await finish(http, server, response)  # bob is no admin: the password is enough
    async with browser() as http:
        response, verifier = await password_step(http, server)
        after = await enrolment_led_by_sign_in(http, server, clock, response)
        claims = await id_token(http, server, await finish(http, server, after), verifier)
        assert claims["acr"] == MFA
    # The device page refuses an admin without the code, and sets nothing up there.
    async with browser() as http:
        started = await http.post(
            server.endpoint("/device_authorization"), data={"client_id": "tv", "scope": "openid"}
        )
        user_code = (await started.json())["user_code"]
        page = await http.get(server.endpoint("/device"))
        action, fields = parse_form(await page.text())
        checked = await post(http, server, action, {**fields, "user_code": user_code})
        action, fields = parse_form(await checked.text())
        login = await post(
            http, server, action, {**fields, "username": "alice", "password": PASSWORD}
        )
        action, fields = parse_form(await login.text())
        assert action.endswith("/device/login/code")  # enrolled by now: the code is asked


async def test_the_operator_may_require_a_second_factor_of_everyone(
    start_authserver: StartAuthServer, clock: MovableClock
) -> None:
    server = await start_authserver(factor_config(required_for_everyone=True), clock=clock)
    async with browser() as http:
        response, _ = await password_step(http, server, username="bob")
        assert 'id="reason"' in await response.text()
        # Nothing set up until the code comes.
        assert await server.services.store.get_totp(server.subject("bob")) is None


async def test_discovery_names_the_levels(server: RunningAuthServer) -> None:
    async with browser() as http:
        document = await (
            await http.get(server.endpoint("/.well-known/openid-configuration"))
        ).json()
    assert document["acr_values_supported"] == ["urn:portcullis:acr:pwd", MFA]
    assert {"amr", "acr"} <= set(document["claims_supported"])


def test_an_unknown_default_acr_value_is_a_configuration_error(tmp_path: Any) -> None:
    from portcullis.yamlconf import ConfigError
    from tests.authserver.conftest import load_settings

    config = client_requiring(factor_config(), default_acr_values=["urn:example:gold"])
    with pytest.raises(ConfigError, match="not a level"):
        load_settings(config, tmp_path, 9000)


def test_requiring_a_second_factor_without_a_key_is_a_configuration_error(tmp_path: Any) -> None:
    from portcullis.yamlconf import ConfigError
    from tests.authserver.conftest import load_settings

    config = device_config()
    config["second_factors"] = {"required_for_everyone": True}
    with pytest.raises(ConfigError, match="encryption key"):
        load_settings(config, tmp_path, 9000)


# ---------------------------------------------------------------------------- the admin API


async def test_clients_made_through_the_admin_api_may_require_a_second_factor(
    start_admin_server: StartAdminServer, clock: MovableClock
) -> None:
    """On SQLite and on PostgreSQL: the whole of a sign-in with a second factor, from a
    client the API made."""

    def with_factors(config: dict[str, Any]) -> None:
        config["second_factors"] = {"encryption_key": ENCRYPTION_KEY}

    server = await start_admin_server(with_factors, clock)
    async with browser() as http:
        admin = await admin_for(http, server)
        bad = {"defaultAcrValues": ["urn:example:gold"], "requireMfa": "yes"}
        status, body, _ = await admin.post("/clients", {**MFA_CLIENT, **bad})
        assert status == 422 and body["error"]["code"] == "validation_error"
        fields = {d["field"] for d in body["error"]["details"]}
        assert {"defaultAcrValues[0]", "requireMfa"} <= fields, body
        status, listed, _ = await admin.get("/clients")
        assert all(c["clientId"] != "mfa-app" for c in listed["data"])  # nothing stored

        status, made, _ = await admin.post("/clients", MFA_CLIENT)
        assert status == 201, made
        assert made["requireMfa"] is True and made["defaultAcrValues"] == [MFA]

    async with browser() as http:
        response, verifier = await password_step(http, server, username="bob", client_id="mfa-app")
        after = await enrolment_led_by_sign_in(http, server, clock, response)
        code = await finish(http, server, after)
        status, tokens = await exchange_code(
            http,
            server,
            _Result(code, verifier),
            client_id="mfa-app",  # type: ignore[arg-type]
        )
        assert status == 200, tokens
        claims = await verify_jwt(http, server, tokens["id_token"], audience="mfa-app")
        assert claims["acr"] == MFA and claims["amr"] == ["pwd", "otp", "mfa"]

    # bob lost his phone and his codes: an operator removes the factor.
    bob = server.subject("bob")
    async with browser() as http:
        admin = await admin_for(http, server)
        status, factor, _ = await admin.get(f"/users/{bob}/second-factor")
        assert status == 200 and factor["kind"] == "totp" and factor["recoveryCodesLeft"] == 10
        assert "secret" not in str(factor).lower()
        status, _, _ = await admin.delete(f"/users/{bob}/second-factor")
        assert status == 204
        assert (await admin.get(f"/users/{bob}/second-factor"))[0] == 404
        assert (await admin.delete(f"/users/{bob}/second-factor"))[0] == 404
        assert (await admin.get("/users/nobody/second-factor"))[0] == 404
    assert await server.services.store.get_totp(bob) is None
    assert factor_counts(server)[("changes", "totp", "removed")] == 1  # the one that was there
    async with browser() as http:
        # The password alone for a client that asks no more; set up again where required.
        response, _ = await password_step(http, server, username="bob")
        await finish(http, server, response)
    async with browser() as http:
        response, _ = await password_step(http, server, username="bob", client_id="mfa-app")
        assert 'id="reason"' in await response.text()


MFA_CLIENT = {
    "clientId": "mfa-app",
    "clientName": "Payroll",
    "tokenEndpointAuthMethod": "none",
    "redirectUris": [REDIRECT],
    "grantTypes": ["authorization_code"],
    "scope": "openid",
    "requireMfa": True,
    "defaultAcrValues": [MFA],
}


async def test_a_client_that_registers_itself_may_require_a_second_factor(
    start_authserver: StartAuthServer, clock: MovableClock
) -> None:
    config = factor_config()
    config["registration"] = {"enabled": True}
    server = await start_authserver(config, clock=clock)
    asked = {
        "redirect_uris": ["http://127.0.0.1/cb"],
        "token_endpoint_auth_method": "none",
        "application_type": "native",
        "grant_types": ["authorization_code"],
        "scope": "openid",
    }
    async with browser() as http:
        before = len(await server.services.store.list_clients())
        bad = {**asked, "default_acr_values": ["urn:example:gold"]}
        refused = await http.post(server.endpoint("/register"), json=bad)
        assert refused.status == 400
        assert (await refused.json())["error"] == "invalid_client_metadata"
        assert len(await server.services.store.list_clients()) == before  # nothing stored
        made = await http.post(server.endpoint("/register"), json={**asked, "require_mfa": True})
        assert made.status == 201
        body = await made.json()
        assert body["require_mfa"] is True
    async with browser() as http:
        response, _ = await password_step(http, server, client_id=body["client_id"])
        assert 'id="reason"' in await response.text()


async def test_a_refreshed_id_token_tells_of_the_same_sign_in(
    server: RunningAuthServer, clock: MovableClock
) -> None:
    secret, _ = await enrolled_user(server, clock)
    async with browser() as http:
        url, verifier = authorize_url(server, scope="openid offline_access")
        page = await http.get(url, allow_redirects=False)
        action, fields = parse_form(await page.text())
        fields.update(username="alice", password=PASSWORD)
        response = await post(http, server, action, fields)
        action, fields = await second_step(http, server, response)
        signed_in = await post(http, server, action, {**fields, "code": app_code(secret, clock)})
        code = await finish(http, server, signed_in)
        status, tokens = await exchange_code(http, server, _Result(code, verifier))  # type: ignore[arg-type]
        assert status == 200
        status, refreshed, _ = await post_token(
            http,
            server,
            {
                "grant_type": "refresh_token",
                "refresh_token": tokens["refresh_token"],
                "client_id": "spa",
            },
        )
        assert status == 200, refreshed
        claims = await verify_jwt(http, server, refreshed["id_token"], audience="spa")
    assert claims["amr"] == ["pwd", "otp", "mfa"] and claims["acr"] == MFA


async def test_setting_up_an_app_needs_a_recent_sign_in(
    server: RunningAuthServer, clock: MovableClock
) -> None:
    async with browser() as http:
        await sign_in_with_password(http, server)
        page = await http.get(server.endpoint("/factors"))
        action, fields = parse_form(await page.text())
        clock.advance(16 * 60)
        stale = await post(http, server, action, fields)
        assert stale.status == 401 and "sign in again" in (await stale.text()).lower()
        assert await server.services.store.get_totp(server.subject("alice")) is None


async def test_an_old_session_led_to_set_up_an_app_signs_in_again_first(
    server: RunningAuthServer, clock: MovableClock
) -> None:
    async with browser() as http:
        await sign_in_with_password(http, server)
        clock.advance(16 * 60)
        url, verifier = authorize_url(server, acr_values=MFA)
        page = await http.get(url, allow_redirects=False)
        action, fields = parse_form(await page.text())
        assert action.endswith("/login")
        fields.update(username="alice", password=PASSWORD)
        response = await post(http, server, action, fields)
        after = await enrolment_led_by_sign_in(http, server, clock, response)
        claims = await id_token(http, server, await finish(http, server, after), verifier)
    assert claims["acr"] == MFA


# ---------------------------------------------------------------------------- the account page


async def account_signed_in(
    http: aiohttp.ClientSession, server: RunningAuthServer, secret: str, clock: MovableClock
) -> str:
    """Sign in to the account page with the password and a code: the page."""
    page = await http.get(server.url + "/account")
    action, fields = parse_form(await page.text())
    fields.update(username="alice", password=PASSWORD)
    answer = await post(http, server, action, fields)
    action, pending = parse_form(await answer.text())
    signed_in = await post(http, server, action, {**pending, "code": app_code(secret, clock)})
    assert signed_in.status == 303
    clock.advance(30)  # that step is used
    account = await http.get(server.url + "/account")
    return await account.text()


def security_form(page: str, path: str) -> dict[str, str]:
    """The hidden fields of the Security section's form posting to `path`."""
    section = page.split('id="security-heading"', 1)[1]
    form = section.split(f'action="/account{path}"', 1)[1].split("</form>", 1)[0]
    return dict(re.findall(r'<input type="hidden" name="([a-z_]+)" value="([^"]*)"', form))


def audit_events(capfd: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    written = capfd.readouterr().err
    return [json.loads(line) for line in written.splitlines() if '"event"' in line]


async def test_the_account_page_renews_the_recovery_codes_and_voids_the_old_ones(
    server: RunningAuthServer, clock: MovableClock, capfd: pytest.CaptureFixture[str]
) -> None:
    secret, old = await enrolled_user(server, clock)
    subject = server.subject("alice")
    async with browser() as http:
        page = await account_signed_in(http, server, secret, clock)
        assert 'id="recovery-left">10<' in page and "Authenticator app set up" in page
        fields = security_form(page, "/factors/recovery-codes")
        assert "current" not in page.split('id="security-heading"', 1)[1]  # a recent sign-in
        # Without this session's CSRF token, nothing changes.
        forged = await post(http, server, "/account/factors/recovery-codes", {"csrf_token": "x"})
        assert forged.status == 403
        renewed = await post(http, server, "/account/factors/recovery-codes", fields)
        assert renewed.status == 200
        text = await renewed.text()
        assert 'id="renewed"' in text and renewed.headers["Cache-Control"] == "no-store"
        new = recovery_codes_on(text)
        assert len(new) == 10 and not set(new) & set(old)
        after = await (await http.get(server.url + "/account")).text()
        assert 'id="recovery-left">10<' in after
    # Only their digests are kept, under the subject.
    record = await server.services.store.get_totp(subject)
    assert record is not None and record.recovery_codes_left == 10
    await asyncio.sleep(0)
    events = audit_events(capfd)
    renewals = [e for e in events if e["event"] == "factor.recovery_codes_renewed"]
    assert [(e["actor"], e["subject"]) for e in renewals] == [("user", subject)]
    assert not any(code in json.dumps(events) for code in new)
    # An old code, even an unused one, no longer signs in; a new one does, once.
    async with browser() as http:
        response, _ = await password_step(http, server)
        action, fields = await second_step(http, server, response)
        refused = await post(http, server, action, {**fields, "code": old[1]})
        assert refused.status == 400
        await finish(http, server, await post(http, server, action, {**fields, "code": new[0]}))
    record = await server.services.store.get_totp(subject)
    assert record is not None and record.recovery_codes_left == 9


async def test_removing_the_app_needs_a_recent_sign_in_or_the_password(
    server: RunningAuthServer, clock: MovableClock, capfd: pytest.CaptureFixture[str]
) -> None:
    secret, _ = await enrolled_user(server, clock)
    subject = server.subject("alice")
    async with browser() as http:
        await account_signed_in(http, server, secret, clock)
        clock.advance(16 * 60)  # older than a set-up would allow
        page = await (await http.get(server.url + "/account")).text()
        assert 'id="remove-current"' in page and 'id="renew-current"' in page
        fields = security_form(page, "/factors/totp/remove")
        for wrong in ({}, {"current": "not-the-password"}):
            refused = await post(http, server, "/account/factors/totp/remove", {**fields, **wrong})
            assert refused.status == 400
            assert "The current password is not correct." in await refused.text()
        assert await server.services.authorize.factors.enrolled(subject)
        renewal = security_form(page, "/factors/recovery-codes")
        stale = await post(http, server, "/account/factors/recovery-codes", renewal)
        assert stale.status == 400
        removed = await post(
            http, server, "/account/factors/totp/remove", {**fields, "current": PASSWORD}
        )
        assert removed.status == 303
        assert removed.headers["Location"] == "/account?done=factor-removed"
        notice = await (await http.get(server.url + removed.headers["Location"])).text()
        assert "Your authenticator app was removed." in notice and "Set one up" in notice
        again = await post(
            http, server, "/account/factors/totp/remove", {**fields, "current": PASSWORD}
        )
        assert again.status == 400 and "no authenticator app" in await again.text()
    assert await server.services.store.get_totp(subject) is None
    await asyncio.sleep(0)
    removals = [e for e in audit_events(capfd) if e["event"] == "factor.removed"]
    assert [(e["actor"], e["subject"]) for e in removals] == [("user", subject)]
    # The password alone signs in again.
    async with browser() as http:
        response, verifier = await password_step(http, server)
        claims = await id_token(http, server, await finish(http, server, response), verifier)
    assert claims["amr"] == ["pwd"]


async def test_an_app_the_operator_requires_is_not_removed_when_it_is_the_only_factor(
    start_authserver: StartAuthServer, clock: MovableClock
) -> None:
    server = await start_authserver(factor_config(required_for_everyone=True), clock=clock)
    async with browser() as http:
        response, _ = await password_step(http, server)
        await finish(http, server, await enrolment_led_by_sign_in(http, server, clock, response))
    clock.advance(30)
    subject = server.subject("alice")
    record = await server.services.store.get_totp(subject)
    assert record is not None
    async with browser() as http:
        page = await http.get(server.url + "/account")
        action, fields = parse_form(await page.text())
        fields.update(username="alice", password=PASSWORD)
        answer = await post(http, server, action, fields)
        action, pending = parse_form(await answer.text())
        secret = _secret_of(server, record)
        await post(http, server, action, {**pending, "code": app_code(secret, clock)})
        page_text = await (await http.get(server.url + "/account")).text()
        assert 'id="factor-required"' in page_text
        assert 'action="/account/factors/totp/remove"' not in page_text
        csrf = security_form(page_text, "/factors/recovery-codes")
        refused = await post(http, server, "/account/factors/totp/remove", csrf)
        assert refused.status == 409
        assert "cannot be removed here" in await refused.text()
        # Renewing the recovery codes stays open to them.
        renewed = await post(http, server, "/account/factors/recovery-codes", csrf)
        assert renewed.status == 200
    assert await server.services.authorize.factors.enrolled(subject)


async def test_a_passkey_this_issuer_cannot_use_does_not_let_the_required_app_go(
    start_authserver: StartAuthServer, clock: MovableClock
) -> None:
    """On an issuer where passkeys cannot work (an IP address), a passkey kept from before
    signs nobody in: the app is still the user's only factor, and is not removed."""
    server = await start_authserver(factor_config(required_for_everyone=True), clock=clock)
    async with browser() as http:
        response, _ = await password_step(http, server)
        await finish(http, server, await enrolment_led_by_sign_in(http, server, clock, response))
    clock.advance(30)
    subject = server.subject("alice")
    record = await server.services.store.get_totp(subject)
    assert record is not None
    kept = PasskeyRecord(
        credential_id=os.urandom(16),
        subject=subject,
        user_handle=os.urandom(32),
        public_key=b"cose",
        sign_count=0,
        transports=(),
        backup_eligible=False,
        backed_up=False,
        name="from another address",
        created_at=clock.now,
    )
    assert await server.services.store.add_passkey(kept)
    async with browser() as http:
        page = await http.get(server.url + "/account")
        action, fields = parse_form(await page.text())
        fields.update(username="alice", password=PASSWORD)
        answer = await post(http, server, action, fields)
        action, pending = parse_form(await answer.text())
        secret = _secret_of(server, record)
        await post(http, server, action, {**pending, "code": app_code(secret, clock)})
        page_text = await (await http.get(server.url + "/account")).text()
        assert 'id="factor-required"' in page_text
        csrf = security_form(page_text, "/factors/recovery-codes")
        refused = await post(http, server, "/account/factors/totp/remove", csrf)
        assert refused.status == 409
    assert await server.services.authorize.factors.enrolled(subject)


def _secret_of(server: RunningAuthServer, record: Any) -> str:
    """The base32 secret of a stored factor, opened as the server opens it."""
    factors = server.services.authorize.factors
    assert factors.cipher is not None
    opened = factors.cipher.open_bytes(b"totp\x00" + record.subject.encode(), record.sealed_secret)
    assert opened is not None
    return totp.base32(opened)


def factor_counts(server: RunningAuthServer) -> dict[tuple[str, str, str], float]:
    """The second-factor series of the metrics: (metric, factor, outcome or change) -> value."""
    exposition = server.services.token.metrics.exposition().decode()
    counts = {}
    for family in text_string_to_metric_families(exposition):
        kind = family.name.removeprefix("portcullis_authserver_second_factor_")
        if kind in ("attempts", "changes"):
            for sample in family.samples:
                what = sample.labels.get("outcome") or sample.labels["change"]
                counts[(kind, sample.labels["factor"], what)] = sample.value
    return counts


async def test_second_steps_are_counted_by_factor_and_outcome(
    start_authserver: StartAuthServer, clock: MovableClock
) -> None:
    config = factor_config()
    config["login_throttle"] = {"max_failures": 3}
    server = await start_authserver(config, clock=clock)
    secret, codes = await enrolled_user(server, clock)
    used = app_code(secret, clock)
    async with browser() as http:
        response, _ = await password_step(http, server)
        action, fields = await second_step(http, server, response)
        await finish(http, server, await post(http, server, action, {**fields, "code": used}))
    async with browser() as http:
        response, _ = await password_step(http, server)
        action, fields = await second_step(http, server, response)
        assert (await post(http, server, action, {**fields, "code": used})).status == 400
        assert (await post(http, server, action, {**fields, "code": "000000"})).status == 400
        signed_in = await post(http, server, action, {**fields, "code": codes[0]})
        await finish(http, server, signed_in)
    async with browser() as http:
        response, _ = await password_step(http, server)
        action, fields = await second_step(http, server, response)
        for _ in range(3):
            await post(http, server, action, {**fields, "code": "aaaaa-aaaaa"})
        assert (await post(http, server, action, {**fields, "code": codes[1]})).status == 429
    assert factor_counts(server) == {
        ("attempts", "totp", "succeeded"): 1,
        ("attempts", "totp", "replayed"): 1,
        ("attempts", "totp", "failed"): 1,
        ("attempts", "recovery_code", "succeeded"): 1,
        ("attempts", "recovery_code", "failed"): 3,
        ("attempts", "recovery_code", "throttled"): 1,
        ("changes", "totp", "enrolled"): 1,
    }
    factors = server.services.authorize.factors
    assert await factors.renew_recovery_codes(server.subject("alice")) is not None
    assert await factors.remove(server.subject("alice"))
    counts = factor_counts(server)
    assert counts[("changes", "recovery_code", "renewed")] == 1
    assert counts[("changes", "totp", "removed")] == 1
    with pytest.raises(ValueError, match="factor 'sms'"):
        factors.metrics.count_factor("sms", "succeeded")
