"""Passkeys (WebAuthn): the pure rules, then the ceremonies against a running server, driven
at the HTTP level with a software authenticator (passkey_support.py) that makes the bytes a
browser would post: adding a passkey on the account page, passwordless sign-in, the passkey
as the second step after the password, and every refusal of bad input, with nothing stored.

The issuer is http://localhost:PORT: an RP ID must be a domain, and http is a secure context
on localhost alone (protocol/webauthn.py). The server runs on a MovableClock.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pyotp
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from fido2.cose import RS1

from authserver.protocol import assurance, webauthn
from authserver.store.base import PasskeyRecord
from tests.authserver.admin_support import StartAdminServer, admin_for, start_admin_server
from tests.authserver.conftest import (
    PASSWORD,
    MovableClock,
    RunningAuthServer,
    StartAuthServer,
    default_config,
    parse_form,
    verify_jwt,
)
from tests.authserver.device_support import device_config, poll
from tests.authserver.passkey_support import (
    PasskeyForm,
    SoftAuthenticator,
    b64,
    passkey_form,
)
from tests.authserver.test_second_factors import (
    ENCRYPTION_KEY,
    authorize_url,
    finish,
    id_token,
    post,
    secret_on,
)

__all__ = ["start_admin_server"]  # the fixture, used here by name

# ------------------------------------------------------------------------- the pure rules


def test_the_rp_id_is_the_issuers_domain_in_a_secure_context() -> None:
    assert webauthn.rp_id("https://auth.example.com/tenant") == "auth.example.com"
    assert webauthn.rp_id("http://localhost:9000") == "localhost"
    assert webauthn.rp_id("http://auth.localhost") == "auth.localhost"
    assert webauthn.rp_id("http://auth.example.com") is None  # not a secure context
    assert webauthn.rp_id("https://192.0.2.1") is None  # an IP address is no domain
    assert webauthn.rp_id("http://127.0.0.1:9000") is None
    assert webauthn.rp_id("https://[2001:db8::1]") is None


def test_the_origin_is_the_issuers_serialised_as_browsers_do() -> None:
    assert webauthn.origin("https://auth.example.com/tenant") == "https://auth.example.com"
    assert webauthn.origin("https://auth.example.com:443") == "https://auth.example.com"
    assert webauthn.origin("https://Auth.Example.com:8443/x") == "https://auth.example.com:8443"
    assert webauthn.origin("http://localhost:9000") == "http://localhost:9000"


def test_a_passkeys_methods_follow_its_backup_flag_and_user_verification() -> None:
    # RFC 8176 §2: hwk for a device-bound key, swk for a synced one; user for presence.
    alone = webauthn.methods(backup_eligible=False, user_verified=True, first=None)
    assert alone == ("hwk", "user", "mfa")
    synced = webauthn.methods(backup_eligible=True, user_verified=True, first=None)
    assert synced == ("swk", "user", "mfa")
    # Without user verification a passkey alone is one factor: no mfa, the password level.
    bare = webauthn.methods(backup_eligible=False, user_verified=False, first=None)
    assert bare == ("hwk", "user")
    assert assurance.acr_of(bare) == assurance.PASSWORD
    second = webauthn.methods(backup_eligible=True, user_verified=False, first=("pwd",))
    assert second == ("pwd", "swk", "user", "mfa")
    assert assurance.acr_of(second) == assurance.MULTI_FACTOR
    # After an upstream provider: its methods, then the passkey's; mfa once, at the end.
    federated = webauthn.methods(backup_eligible=False, user_verified=True, first=("mfa", "fed"))
    assert federated == ("fed", "hwk", "user", "mfa")


def test_a_counter_must_grow_unless_both_are_zero() -> None:
    assert webauthn.counter_moves_on(0, 0)
    assert webauthn.counter_moves_on(0, 1)
    assert webauthn.counter_moves_on(5, 6)
    assert not webauthn.counter_moves_on(5, 5)
    assert not webauthn.counter_moves_on(5, 4)
    assert not webauthn.counter_moves_on(5, 0)


def test_base64url_is_read_strictly() -> None:
    assert webauthn.base64url("AQID") == b"\x01\x02\x03"
    assert webauthn.base64url("AQI") == b"\x01\x02"
    assert webauthn.base64url("") == b""
    for bad in ("AQ==", "A", "AQ+/", "AQ ID", "é", 3, None):
        assert webauthn.base64url(bad) is None, bad
    assert webauthn.base64url("A" * 48, max_bytes=32) is None
    assert webauthn.base64url("A" * 43, max_bytes=32) is not None


def test_transports_and_names_are_kept_only_when_known_and_sensible() -> None:
    given = ["internal", "hybrid", "internal", "carrier-pigeon", 7]
    assert webauthn.known_transports(given) == ("internal", "hybrid")
    assert webauthn.known_transports("usb") == ()
    assert webauthn.passkey_name("  My   phone ") == "My phone"
    assert webauthn.passkey_name("   ") is None
    assert webauthn.passkey_name("x" * 65) is None
    assert webauthn.passkey_name("tab\x07bell") is None


# ------------------------------------------------------------------------- the server


@pytest.fixture
def clock() -> MovableClock:
    return MovableClock()


def passkey_config(**changes: Any) -> dict[str, Any]:
    config = default_config()
    config["issuer"] = "http://localhost:{port}"
    config["login_throttle"] = {
        "max_failures": 50,
        "max_failures_per_address": 100,
        "backoff_after": 100,
    }
    config.update(changes)
    return config


@pytest.fixture
async def server(start_authserver: StartAuthServer, clock: MovableClock) -> RunningAuthServer:
    return await start_authserver(passkey_config(), clock=clock)


def browser() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))


def origin_of(server: RunningAuthServer) -> str:
    return server.settings.issuer


async def submit(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    form: PasskeyForm,
    credential: dict[str, Any] | str,
    **extra: str,
) -> aiohttp.ClientResponse:
    fields = dict(form.fields)
    fields["passkey_response"] = (
        credential if isinstance(credential, str) else json.dumps(credential)
    )
    fields.update(extra)
    return await post(http, server, form.action, fields)


async def account_sign_in(http: aiohttp.ClientSession, server: RunningAuthServer) -> None:
    page = await http.get(server.endpoint("/account"))
    action, fields = parse_form(await page.text())
    fields.update(username="alice", password=PASSWORD)
    response = await post(http, server, action, fields)
    assert response.status == 303, await response.text()


async def account_passkey_form(
    http: aiohttp.ClientSession, server: RunningAuthServer
) -> PasskeyForm:
    page = await http.get(server.endpoint("/account"))
    assert page.status == 200
    form = passkey_form(await page.text())
    assert form is not None and form.mode == "create"
    return form


async def add_passkey(
    http: aiohttp.ClientSession, server: RunningAuthServer, name: str = "My laptop", **kind: Any
) -> SoftAuthenticator:
    form = await account_passkey_form(http, server)
    key = SoftAuthenticator(origin_of(server), **kind)
    response = await submit(http, server, form, key.create(form.options), name=name)
    assert response.status == 303, await response.text()
    assert response.headers["Location"].endswith("/account?done=passkey-added")
    return key


async def user_with_passkey(server: RunningAuthServer, **kind: Any) -> SoftAuthenticator:
    async with browser() as http:
        await account_sign_in(http, server)
        return await add_passkey(http, server, **kind)


async def login_page_form(
    http: aiohttp.ClientSession, server: RunningAuthServer, **extra: str
) -> tuple[PasskeyForm, str]:
    url, verifier = authorize_url(server, **extra)
    page = await http.get(url, allow_redirects=False)
    assert page.status == 200
    form = passkey_form(await page.text())
    assert form is not None and form.action.endswith("/login/passkey")
    return form, verifier


async def passkeys_stored(server: RunningAuthServer, subject: str) -> list[Any]:
    return await server.services.passkeys.passkeys.of(subject)


async def test_a_passkey_is_added_on_the_account_page_and_listed(
    server: RunningAuthServer,
) -> None:
    async with browser() as elsewhere, browser() as http:
        await account_sign_in(elsewhere, server)  # signed in before the passkey existed
        await account_sign_in(http, server)
        form = await account_passkey_form(http, server)
        # WebAuthn §5.4: this server's RP, attestation none, a random user handle.
        assert form.options["rp"]["id"] == "localhost"
        assert form.options["attestation"] == "none"
        assert form.options["authenticatorSelection"]["userVerification"] == "preferred"
        assert form.options["user"]["name"] == "alice"
        assert len(form.options["user"]["id"]) == 43  # 32 bytes
        key = SoftAuthenticator(origin_of(server))
        response = await submit(http, server, form, key.create(form.options), name="  My laptop ")
        assert response.status == 303
        page = await (await http.get(server.endpoint("/account?done=passkey-added"))).text()
        assert 'class="passkey-name">My laptop<' in page
        assert "not used yet" in page
        # Another passkey: the first is excluded (§5.4.3), the user handle is the same.
        again = await account_passkey_form(http, server)
        assert [d["id"] for d in again.options["excludeCredentials"]] == [b64(key.credential_id)]
        assert again.options["user"]["id"] == form.options["user"]["id"]
        # The first second factor ends the sessions signed in without one; not this one.
        other = await (await elsewhere.get(server.endpoint("/account"))).text()
        assert 'name="password"' in other and "Signed in as" not in other
        await add_passkey(http, server, "Second")
        assert "Signed in as" in await (await http.get(server.endpoint("/account"))).text()
    stored_ones = await passkeys_stored(server, server_subject(server, "alice"))
    [stored] = [p for p in stored_ones if p.credential_id == key.credential_id]
    assert len(stored_ones) == 2
    assert stored.transports == ("internal",)  # the unknown one dropped
    assert not stored.backup_eligible
    assert stored.name == "My laptop"


def server_subject(server: RunningAuthServer, username: str) -> str:
    return server.subject(username)


async def test_adding_a_passkey_refuses_bad_input_and_stores_nothing(
    server: RunningAuthServer, clock: MovableClock
) -> None:
    async with browser() as http:
        await account_sign_in(http, server)
        origin = origin_of(server)
        cases: list[tuple[str, Any, dict[str, str]]] = []
        form = await account_passkey_form(http, server)
        key = SoftAuthenticator(origin)
        good = key.create(form.options)
        cases.append(("malformed", "{not json", {"name": "x"}))
        cases.append(("malformed", json.dumps({**good, "rawId": "!!"}), {"name": "x"}))
        cases.append(("origin", key.create(form.options, origin="http://evil.localhost"), {}))
        wrong_rp = dict(form.options, rp={"id": "evil.localhost", "name": "x"})
        cases.append(("rp_id", key.create(wrong_rp), {}))
        other = dict(form.options, challenge=b64(b"c" * 32))
        cases.append(("challenge", key.create(other), {}))
        for reason, credential, extra in cases:
            form = await account_passkey_form(http, server)
            response = await submit(http, server, form, credential, **{"name": "n", **extra})
            assert response.status == 400, (reason, await response.text())
        # No name, or a form without CSRF token, or whose challenge was used.
        form = await account_passkey_form(http, server)
        response = await submit(http, server, form, key.create(form.options), name=" ")
        assert response.status == 400
        response = await submit(
            http, server, form, key.create(form.options), name="n", csrf_token="x"
        )
        assert response.status == 403
        assert (await submit(http, server, form, key.create(form.options), name="n")).status == 303
        replayed = await submit(http, server, form, key.create(form.options), name="n")
        assert replayed.status == 400
        assert "already used" in await replayed.text()
        # The challenge expires.
        form = await account_passkey_form(http, server)
        clock.advance(6 * 60)
        response = await submit(
            http, server, form, SoftAuthenticator(origin).create(form.options), name="n"
        )
        assert response.status in (400, 401)
    assert len(await passkeys_stored(server, server_subject(server, "alice"))) == 1


async def test_a_user_has_at_most_twenty_passkeys(server: RunningAuthServer) -> None:
    """Each passkey is stored and listed in every ceremony of its user's: their number is
    bounded, so an account cannot fill the store or every page of its own."""
    subject = server_subject(server, "alice")
    store = server.services.store

    async def stored_directly(count: int) -> None:
        for _ in range(count):
            record = PasskeyRecord(
                credential_id=os.urandom(16),
                subject=subject,
                user_handle=b"h" * 32,
                public_key=b"cose",
                sign_count=0,
                transports=(),
                backup_eligible=False,
                backed_up=False,
                name="old",
                created_at=server.clock(),
            )
            assert await store.add_passkey(record)

    async with browser() as http:
        await account_sign_in(http, server)
        await stored_directly(19)
        form = await account_passkey_form(http, server)  # the 20th may still be added
        await stored_directly(1)
        key = SoftAuthenticator(origin_of(server))
        response = await submit(http, server, form, key.create(form.options), name="21st")
        assert response.status == 409
        assert "remove one first" in await response.text()
        page = await (await http.get(server.endpoint("/account"))).text()
        assert passkey_form(page) is None and 'id="passkeys-full"' in page
    stored = await passkeys_stored(server, subject)
    assert len(stored) == 20 and key.credential_id not in {p.credential_id for p in stored}


async def test_a_new_credential_without_its_data_or_with_a_key_not_offered_is_refused(
    server: RunningAuthServer,
) -> None:
    """WebAuthn §7.1: the authenticator data must hold the attested credential data (flag
    AT), and the key's algorithm must be one of pubKeyCredParams (step "alg"): an RSA key
    with SHA-1 (COSE RS1), which this server never offered, is not kept."""
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    sha1_key = dict(RS1.from_cryptography_key(rsa_key.public_key()))
    async with browser() as http:
        await account_sign_in(http, server)
        for spoiled in ({"attested": False}, {"public_key": sha1_key}):
            form = await account_passkey_form(http, server)
            assert -65535 not in [p["alg"] for p in form.options["pubKeyCredParams"]]
            key = SoftAuthenticator(origin_of(server))
            credential = key.create(form.options, **spoiled)
            response = await submit(http, server, form, credential, name="n")
            assert response.status == 400, spoiled
            assert "was not added" in await response.text()
    assert await passkeys_stored(server, server_subject(server, "alice")) == []


async def test_adding_a_passkey_needs_a_recent_sign_in(
    server: RunningAuthServer, clock: MovableClock
) -> None:
    async with browser() as http:
        await account_sign_in(http, server)
        form = await account_passkey_form(http, server)
        clock.advance(16 * 60)
        page = await (await http.get(server.endpoint("/account"))).text()
        assert "needs a recent sign-in" in page and passkey_form(page) is None
        key = SoftAuthenticator(origin_of(server))
        response = await submit(http, server, form, key.create(form.options), name="n")
        assert response.status == 401
    assert await passkeys_stored(server, server_subject(server, "alice")) == []


async def test_passwordless_sign_in_is_two_factors_and_device_bound_is_hwk(
    server: RunningAuthServer,
) -> None:
    key = await user_with_passkey(server)
    async with browser() as http:
        form, verifier = await login_page_form(http, server)
        # Discoverable credentials: nothing listed, user verification required (§5.8.6).
        assert "allowCredentials" not in form.options
        assert form.options["userVerification"] == "required"
        response = await submit(http, server, form, key.get(form.options))
        code = await finish(http, server, response)
        claims = await id_token(http, server, code, verifier)
    assert claims["sub"] == server_subject(server, "alice")
    assert claims["amr"] == ["hwk", "user", "mfa"]
    assert claims["acr"] == assurance.MULTI_FACTOR
    [stored] = await passkeys_stored(server, claims["sub"])
    assert stored.sign_count == 1 and stored.last_used_at is not None


async def test_a_synced_passkey_is_swk(server: RunningAuthServer) -> None:
    key = await user_with_passkey(server, backup_eligible=True)
    async with browser() as http:
        form, verifier = await login_page_form(http, server)
        code = await finish(http, server, await submit(http, server, form, key.get(form.options)))
        claims = await id_token(http, server, code, verifier)
    assert claims["amr"] == ["swk", "user", "mfa"]


async def test_passwordless_sign_in_refuses_bad_assertions_and_changes_nothing(
    server: RunningAuthServer, capfd: pytest.CaptureFixture[str]
) -> None:
    key = await user_with_passkey(server)
    subject = server_subject(server, "alice")
    async with browser() as http:
        stranger = SoftAuthenticator(origin_of(server))
        stranger.user_handle = key.user_handle
        spoiled: list[tuple[str, Any]] = [
            ("challenge", lambda o: key.get(o, challenge=b64(b"z" * 32))),
            ("origin", lambda o: key.get(o, origin="http://localhost:1")),
            ("rp_id", lambda o: key.get(o, rp_id="evil.localhost")),
            ("not_verified", lambda o: key.get(o, verified=False)),
            ("signature", lambda o: key.get(o, bad_signature=True)),
            ("unknown_credential", lambda o: stranger.get(o)),
            ("unknown_credential", lambda o: key.get(o, user_handle=False)),
            ("malformed", lambda o: "[1, 2"),
            ("malformed", lambda o: json.dumps({**key.get(o), "rawId": "%%%"})),
            ("malformed", lambda o: json.dumps(["x"])),
            ("malformed", lambda o: ""),
        ]
        for reason, make in spoiled:
            form, _ = await login_page_form(http, server)
            response = await submit(http, server, form, make(form.options))
            assert response.status == 400, reason
            text = await response.text()
            assert 'role="alert"' in text, reason
            assert passkey_form(text) is not None  # the login page again, a new challenge
            key.counter = 0  # what the server stored
            await asyncio.sleep(0)  # the audit line is written at the end of the loop's turn
            [failed] = [
                e for e in audit_lines(capfd.readouterr().err) if e["event"] == "factor.failed"
            ]
            assert failed["reason"] == reason and failed["factor"] == "passkey"
        [stored] = await passkeys_stored(server, subject)
        assert stored.sign_count == 0 and stored.last_used_at is None
        # The good assertion passes.
        form, _ = await login_page_form(http, server)
        assertion = key.get(form.options)
        assert (await submit(http, server, form, assertion)).status in (200, 302, 303)
    async with browser() as other:
        # Another browser session cannot present a challenge issued to this one, even with
        # its own CSRF token: the challenge's proof is bound to the session it was issued to.
        theirs, _ = await login_page_form(other, server)
        stolen, _ = await login_page_form(other, server)
        fields = {**form.fields, "csrf_token": theirs.fields["csrf_token"]}
        replayed = await submit(
            other, server, PasskeyForm(form.action, "get", {}, fields), key.get(form.options)
        )
        assert replayed.status == 400
        assert stolen.fields["passkey_challenge"] != form.fields["passkey_challenge"]
    [stored] = await passkeys_stored(server, subject)
    assert stored.sign_count == 1


async def test_a_time_in_digits_int_cannot_read_is_refused_not_an_error(
    server: RunningAuthServer,
) -> None:
    """str.isdigit() takes "²", which int() cannot read: a challenge's or a pending
    sign-in's expiry written so is refused as any forged one, not answered with a 500."""
    key = await user_with_passkey(server)
    async with browser() as http:
        form, _ = await login_page_form(http, server)
        response = await submit(http, server, form, key.get(form.options), passkey_until="²")
        assert response.status == 400
        url, _ = authorize_url(server)
        page = await http.get(url, allow_redirects=False)
        action, fields = parse_form(await page.text())
        fields.update(username="alice", password=PASSWORD)
        step = await post(http, server, action, fields)
        second = passkey_form(await step.text())
        assert second is not None
        response = await submit(http, server, second, key.get(second.options), pending_until="²")
        assert response.status == 403


async def test_a_replayed_assertion_in_the_same_session_is_refused(
    server: RunningAuthServer,
) -> None:
    key = await user_with_passkey(server)
    async with browser() as http:
        form, _ = await login_page_form(http, server)
        assertion = key.get(form.options)
        first = await submit(http, server, form, assertion)
        assert first.status in (200, 302, 303)
        # Signed in now: the same page's fields again (the anonymous session is gone, so
        # the CSRF token is the new session's; the challenge is still the used one).
        page = await http.get(authorize_url(server, prompt="login")[0], allow_redirects=False)
        fresh = passkey_form(await page.text())
        assert fresh is not None
        fields = {**form.fields, "csrf_token": fresh.fields["csrf_token"]}
        again = await submit(
            http, server, PasskeyForm(form.action, "get", form.options, fields), assertion
        )
        assert again.status in (400, 403)


async def test_a_counter_going_back_is_refused_as_a_clone(
    server: RunningAuthServer, capfd: pytest.CaptureFixture[str]
) -> None:
    key = await user_with_passkey(server)
    async with browser() as http:
        form, _ = await login_page_form(http, server)
        assert (await submit(http, server, form, key.get(form.options, counter=10))).status in (
            200,
            302,
            303,
        )
    async with browser() as http:
        form, _ = await login_page_form(http, server)
        response = await submit(http, server, form, key.get(form.options, counter=10))
        assert response.status == 400
        assert "counter went back" in await response.text()
    await asyncio.sleep(0)  # the audit line is written at the end of the loop's turn
    events = audit_lines(capfd.readouterr().err)
    regressed = [e for e in events if e["event"] == "factor.sign_count_regressed"]
    assert len(regressed) == 1 and regressed[0]["factor"] == "passkey"
    assert regressed[0]["level"] == "warning"
    [stored] = await passkeys_stored(server, server_subject(server, "alice"))
    assert stored.sign_count == 10


async def test_a_passkey_whose_backup_eligibility_changed_is_refused(
    server: RunningAuthServer, capfd: pytest.CaptureFixture[str]
) -> None:
    """WebAuthn §6.1.3, §7.2: the BE flag is fixed when the credential is created; the amr
    says `hwk` or `swk` by it, so an assertion whose flag differs from the stored one is
    refused rather than named a device-bound key it no longer claims to be."""
    key = await user_with_passkey(server)  # device-bound: BE clear
    key.backup_eligible = True
    async with browser() as http:
        form, _ = await login_page_form(http, server)
        response = await submit(http, server, form, key.get(form.options))
        assert response.status == 400
    await asyncio.sleep(0)  # the audit line is written at the end of the loop's turn
    [failed] = [e for e in audit_lines(capfd.readouterr().err) if e["event"] == "factor.failed"]
    assert failed["reason"] == "backup_eligibility"
    [stored] = await passkeys_stored(server, server_subject(server, "alice"))
    assert stored.sign_count == 0 and stored.last_used_at is None
    key.backup_eligible = False
    async with browser() as http:
        form, verifier = await login_page_form(http, server)
        code = await finish(http, server, await submit(http, server, form, key.get(form.options)))
        claims = await id_token(http, server, code, verifier)
    assert claims["amr"] == ["hwk", "user", "mfa"]


async def test_a_passkey_backed_up_yet_not_backup_eligible_is_refused(
    server: RunningAuthServer, capfd: pytest.CaptureFixture[str]
) -> None:
    """WebAuthn §7.1 and §7.2: if the BE flag is not set, the BS flag must not be either;
    such authenticator data is refused, when a passkey is added and when one signs in."""
    async with browser() as http:
        await account_sign_in(http, server)
        form = await account_passkey_form(http, server)
        contradictory = SoftAuthenticator(origin_of(server), backed_up=True)
        response = await submit(http, server, form, contradictory.create(form.options), name="n")
        assert response.status == 400
        assert "was not added" in await response.text()
    assert await passkeys_stored(server, server_subject(server, "alice")) == []
    key = await user_with_passkey(server)  # device-bound: BE and BS clear
    key.backed_up = True
    async with browser() as http:
        form, _ = await login_page_form(http, server)
        response = await submit(http, server, form, key.get(form.options))
        assert response.status == 400
    await asyncio.sleep(0)  # the audit line is written at the end of the loop's turn
    failed = [e for e in audit_lines(capfd.readouterr().err) if e["event"] == "factor.failed"]
    # The registration's refusal and the sign-in's, for this reason and no other.
    assert [e["reason"] for e in failed] == ["backup_state", "backup_state"]
    [stored] = await passkeys_stored(server, server_subject(server, "alice"))
    assert stored.sign_count == 0 and stored.last_used_at is None


def audit_lines(err: str) -> list[dict[str, Any]]:
    found = []
    for line in err.splitlines():
        if '"portcullis.authserver.audit"' in line:
            found.append(json.loads(line))
    return found


async def test_failed_passkey_attempts_are_throttled(
    start_authserver: StartAuthServer, clock: MovableClock
) -> None:
    config = passkey_config()
    config["login_throttle"]["max_failures"] = 3
    server = await start_authserver(config, clock=clock)
    key = await user_with_passkey(server)
    async with browser() as http:
        statuses = []
        for _ in range(4):
            form, _ = await login_page_form(http, server)
            response = await submit(http, server, form, key.get(form.options, verified=False))
            statuses.append(response.status)
        assert statuses == [400, 400, 400, 429]
        assert "Retry-After" in response.headers
        # Throttled, even a good assertion is not checked.
        form, _ = await login_page_form(http, server)
        assert (await submit(http, server, form, key.get(form.options))).status == 429


async def test_failed_passwordless_attempts_from_one_address_do_not_slow_another_down(
    start_authserver: StartAuthServer, clock: MovableClock
) -> None:
    """A passwordless attempt names no user: its count is its address's. Were they counted
    under one name for everybody, anyone could hold every passwordless sign-in back."""
    config = passkey_config(trusted_proxies=["127.0.0.1/32"])
    config["login_throttle"]["backoff_after"] = 2
    server = await start_authserver(config, clock=clock)
    key = await user_with_passkey(server)

    async def attempt(http: aiohttp.ClientSession, address: str, verified: bool) -> int:
        form, _ = await login_page_form(http, server)
        fields = dict(form.fields)
        fields["passkey_response"] = json.dumps(key.get(form.options, verified=verified))
        url = origin_of(server) + urlsplit(form.action).path
        response = await http.post(
            url, data=fields, headers={"X-Forwarded-For": address}, allow_redirects=False
        )
        return response.status

    async with browser() as attacker:
        for _ in range(4):
            assert await attempt(attacker, "203.0.113.7", verified=False) in (400, 429)
    async with browser() as http:
        assert await attempt(http, "198.51.100.9", verified=True) in (200, 302, 303)


async def test_a_passkey_is_the_second_step_after_the_password(
    server: RunningAuthServer, capfd: pytest.CaptureFixture[str]
) -> None:
    key = await user_with_passkey(server, backup_eligible=True)
    async with browser() as http:
        url, verifier = authorize_url(server)
        page = await http.get(url, allow_redirects=False)
        action, fields = parse_form(await page.text())
        fields.update(username="alice", password=PASSWORD)
        step = await post(http, server, action, fields)
        assert step.status == 200
        text = await step.text()
        # No authenticator app: the passkey is the only way on, and it is listed.
        assert 'name="code"' not in text
        form = passkey_form(text)
        assert form is not None and form.action.endswith("/login/passkey")
        assert [d["id"] for d in form.options["allowCredentials"]] == [b64(key.credential_id)]
        assert form.options["userVerification"] == "preferred"
        # Without user verification it is still a second factor after the password.
        response = await submit(http, server, form, key.get(form.options, verified=False))
        code = await finish(http, server, response)
        claims = await id_token(http, server, code, verifier)
    assert claims["amr"] == ["pwd", "swk", "user", "mfa"]
    assert claims["acr"] == assurance.MULTI_FACTOR
    await asyncio.sleep(0)
    used = [e for e in audit_lines(capfd.readouterr().err) if e["event"] == "factor.used"]
    assert used[-1]["factor"] == "passkey" and used[-1]["subject"] == claims["sub"]


async def test_a_passkey_made_for_another_relying_party_id_is_listed_but_no_factor(
    server: RunningAuthServer,
) -> None:
    """WebAuthn §5.1.2: a credential signs only for the RP ID it was created for. One kept
    from before the issuer's host changed is still the user's (listed, removable), but is
    neither offered at the second step nor counted as a second factor."""
    key = await user_with_passkey(server)
    subject = server_subject(server, "alice")
    store = server.services.store
    [current] = await passkeys_stored(server, subject)
    assert current.rp_id == "localhost"
    old = PasskeyRecord(
        credential_id=os.urandom(16),
        subject=subject,
        user_handle=current.user_handle,
        public_key=current.public_key,
        sign_count=0,
        transports=(),
        backup_eligible=False,
        backed_up=False,
        name="Old address",
        created_at=current.created_at,
        rp_id="auth.old.example",
    )
    assert await store.add_passkey(old)
    passkeys = server.services.passkeys.passkeys
    # The account page lists every one (Passkeys.of); only the current one can sign.
    assert {p.name for p in await passkeys.of(subject)} == {"My laptop", "Old address"}
    assert [p.name for p in await passkeys.usable(subject)] == ["My laptop"]
    async with browser() as http:
        url, _ = authorize_url(server)
        action, fields = parse_form(await (await http.get(url, allow_redirects=False)).text())
        step = await post(
            http, server, action, {**fields, "username": "alice", "password": PASSWORD}
        )
        form = passkey_form(await step.text())
        assert form is not None
        assert [d["id"] for d in form.options["allowCredentials"]] == [b64(key.credential_id)]
    # With only the old one left, the password alone signs in: consent, no second step.
    assert await store.delete_passkey(subject, current.credential_id)
    async with browser() as http:
        url, _ = authorize_url(server)
        action, fields = parse_form(await (await http.get(url, allow_redirects=False)).text())
        step = await post(
            http, server, action, {**fields, "username": "alice", "password": PASSWORD}
        )
        text = await step.text()
        assert step.status == 200 and "Allow access?" in text and passkey_form(text) is None
    assert [p.name for p in await passkeys_stored(server, subject)] == ["Old address"]


async def test_at_the_second_step_another_users_passkey_is_refused(
    server: RunningAuthServer, start_authserver: StartAuthServer
) -> None:
    alices = await user_with_passkey(server)
    async with browser() as http:
        page = await http.get(server.endpoint("/account"))
        action, fields = parse_form(await page.text())
        fields.update(username="bob", password=PASSWORD)
        response = await post(http, server, action, fields)
        assert response.status == 303
        bobs = await add_passkey(http, server, "Bob's")
    async with browser() as http:
        url, _ = authorize_url(server)
        page = await http.get(url, allow_redirects=False)
        action, fields = parse_form(await page.text())
        fields.update(username="bob", password=PASSWORD)
        step = await post(http, server, action, fields)
        form = passkey_form(await step.text())
        assert form is not None
        response = await submit(http, server, form, alices.get(form.options))
        assert response.status == 400
        refused = await response.text()
        assert "not one of this account" in refused and "alice" not in refused.lower()
        # A passkey registered to nobody reads the same: the page does not tell them apart.
        again = passkey_form(refused)
        assert again is not None
        stranger = SoftAuthenticator(origin_of(server))
        response = await submit(http, server, again, stranger.get(again.options))
        assert response.status == 400
        assert "not one of this account" in await response.text()
        # The pending sign-in's fields are needed: without them it is not a second step,
        # and a forged subject is refused.
        forged = dict(form.fields, pending_subject=server_subject(server, "alice"))
        response = await post(
            http,
            server,
            form.action,
            {**forged, "passkey_response": json.dumps(alices.get(form.options))},
        )
        assert response.status == 403
        # Bob's own passkey passes, from the page the refusal showed.
        again = passkey_form(await response.text())
        assert again is None  # the forged form's answer is an error page
        fresh = await post(http, server, action, fields)  # the password again
        form = passkey_form(await fresh.text())
        assert form is not None
        done = await submit(http, server, form, bobs.get(form.options))
        assert done.status in (200, 302, 303), await done.text()
    [alices_stored] = await passkeys_stored(server, server_subject(server, "alice"))
    assert alices_stored.sign_count == 0 and alices_stored.last_used_at is None


async def test_a_passkey_is_removed_with_the_csrf_token_of_its_owners_session(
    server: RunningAuthServer,
) -> None:
    subject = server_subject(server, "alice")
    async with browser() as http:
        await account_sign_in(http, server)
        key = await add_passkey(http, server)
        page = await (await http.get(server.endpoint("/account"))).text()
        csrf = parse_form(page)[1]["csrf_token"]
        remove = server.endpoint("/account/passkeys/remove")
        path = urlsplit(remove).path
        fields = {"csrf_token": "nope", "credential": b64(key.credential_id)}
        assert (
            await http.post(origin_of(server) + path, data=fields, allow_redirects=False)
        ).status == 403
        fields = {"csrf_token": csrf, "credential": b64(b"other")}
        assert (
            await http.post(origin_of(server) + path, data=fields, allow_redirects=False)
        ).status == 400
        fields = {"csrf_token": csrf, "credential": "%%"}
        assert (
            await http.post(origin_of(server) + path, data=fields, allow_redirects=False)
        ).status == 400
        assert len(await passkeys_stored(server, subject)) == 1
        fields = {"csrf_token": csrf, "credential": b64(key.credential_id)}
        done = await http.post(origin_of(server) + path, data=fields, allow_redirects=False)
        assert done.status == 303 and done.headers["Location"].endswith("done=passkey-removed")
        page = await (await http.get(server.endpoint("/account?done=passkey-removed"))).text()
        assert "That passkey was removed." in page and 'id="no-passkeys"' in page
    assert await passkeys_stored(server, subject) == []
    async with browser() as http:
        # Removed, it signs nobody in.
        form, _ = await login_page_form(http, server)
        assert (await submit(http, server, form, key.get(form.options))).status == 400


async def test_the_account_page_signs_in_with_a_passkey_too(server: RunningAuthServer) -> None:
    key = await user_with_passkey(server)
    async with browser() as http:
        page = await (await http.get(server.endpoint("/account"))).text()
        form = passkey_form(page)
        assert form is not None and form.action.endswith("/account/login/passkey")
        response = await submit(http, server, form, key.get(form.options))
        assert response.status == 303
        page = await (await http.get(server.endpoint("/account"))).text()
        assert "Signed in as" in page
        # The password then the passkey, on the account page's second step.
    async with browser() as http:
        page = await http.get(server.endpoint("/account"))
        action, fields = parse_form(await page.text())
        fields.update(username="alice", password=PASSWORD)
        step = await post(http, server, action, fields)
        assert step.status == 200
        form = passkey_form(await step.text())
        assert form is not None and form.action.endswith("/account/login/passkey")
        response = await submit(http, server, form, key.get(form.options))
        assert response.status == 303


async def test_an_https_issuer_names_its_host_and_an_ip_issuer_offers_no_passkeys(
    start_authserver: StartAuthServer,
) -> None:
    server = await start_authserver(default_config())  # http://127.0.0.1:PORT
    async with browser() as http:
        url, _ = authorize_url(server)
        page = await http.get(url, allow_redirects=False)
        text = await page.text()
        assert passkey_form(text) is None
        assert "script-src" not in page.headers["Content-Security-Policy"]
        await account_sign_in(http, server)
        page = await http.get(server.endpoint("/account"))
        assert 'id="passkeys-heading"' not in await page.text()
        fields = {"csrf_token": "x", "name": "n"}
        path = urlsplit(server.endpoint("/account/passkeys")).path
        response = await http.post(origin_of(server) + path, data=fields, allow_redirects=False)
        assert response.status == 404


async def test_an_operator_lists_a_users_passkeys_and_removes_a_lost_one(
    start_admin_server: StartAdminServer, capfd: pytest.CaptureFixture[str]
) -> None:
    """On SQLite and on PostgreSQL: the admin API shows no key, and removes one passkey."""
    server = await start_admin_server()
    bob = server.subject("bob")
    store = server.services.store
    for label, synced in (("phone", True), ("key", False)):
        record = PasskeyRecord(
            credential_id=label.encode() * 4,
            subject=bob,
            user_handle=b"h" * 32,
            public_key=b"cose-" + label.encode(),
            sign_count=0,
            transports=("internal",),
            backup_eligible=synced,
            backed_up=synced,
            name=f"Bob's {label}",
            created_at=server.clock(),
        )
        assert await store.add_passkey(record)
    async with browser() as http:
        admin = await admin_for(http, server)
        status, listed, _ = await admin.get(f"/users/{bob}/passkeys?sort=name")
        assert status == 200, listed
        assert [p["name"] for p in listed["data"]] == ["Bob's key", "Bob's phone"]
        assert [p["backupEligible"] for p in listed["data"]] == [False, True]
        assert "cose" not in json.dumps(listed)  # never the key
        lost = listed["data"][1]["id"]
        assert lost == b64(b"phone" * 4)
        assert (await admin.delete(f"/users/{bob}/passkeys/{lost}"))[0] == 204
        assert (await admin.delete(f"/users/{bob}/passkeys/{lost}"))[0] == 404
        assert (await admin.delete(f"/users/{bob}/passkeys/%25%25"))[0] == 404
        assert (await admin.get("/users/nobody/passkeys"))[0] == 404
        status, listed, _ = await admin.get(f"/users/{bob}/passkeys")
        assert [p["name"] for p in listed["data"]] == ["Bob's key"]
    await asyncio.sleep(0)
    removed = [e for e in audit_lines(capfd.readouterr().err) if e["event"] == "factor.removed"]
    assert len(removed) == 1 and removed[0]["factor"] == "passkey"
    assert removed[0]["actor"] == "admin" and removed[0]["subject"] == bob


async def test_a_limit_in_digits_int_cannot_read_is_a_bad_request(
    start_admin_server: StartAdminServer,
) -> None:
    """A list's `limit` of "²" (a digit to str.isdigit(), not to int()) is refused as any
    other limit that is no whole number (422, naming the parameter), not answered with a
    500."""
    server = await start_admin_server()
    async with browser() as http:
        admin = await admin_for(http, server)
        for path in (f"/users/{server.subject('bob')}/passkeys", "/users"):
            status, refused, _ = await admin.get(path + "?limit=%C2%B2")
            assert status == 422, refused
            assert (await admin.get(path + "?limit=x"))[1] == refused


async def test_a_user_with_an_app_and_a_passkey_is_offered_both_at_the_second_step(
    start_authserver: StartAuthServer, clock: MovableClock
) -> None:
    config = passkey_config()
    config["second_factors"] = {"encryption_key": ENCRYPTION_KEY}
    server = await start_authserver(config, clock=clock)
    async with browser() as http:
        await account_sign_in(http, server)
        page = await http.get(server.endpoint("/factors"))
        action, fields = parse_form(await page.text())
        enrolment = await (await post(http, server, action, fields)).text()
        secret = secret_on(enrolment)
        action, fields = parse_form(enrolment)
        fields["code"] = pyotp.TOTP(secret).at(clock.now)
        assert (await post(http, server, action, fields)).status == 200
        key = await add_passkey(http, server)
    async with browser() as http:
        url, verifier = authorize_url(server)
        page = await http.get(url, allow_redirects=False)
        action, fields = parse_form(await page.text())
        fields.update(username="alice", password=PASSWORD)
        step = await (await post(http, server, action, fields)).text()
        assert 'name="code"' in step  # the app's code, and beside it the passkey
        form = passkey_form(step)
        assert form is not None
        code = await finish(http, server, await submit(http, server, form, key.get(form.options)))
        claims = await id_token(http, server, code, verifier)
    assert claims["amr"] == ["pwd", "hwk", "user", "mfa"]


# ------------------------------------------------- the device page, the set-up of a factor


def required_config(**second_factors: Any) -> dict[str, Any]:
    """passkey_config() with the device clients and `second_factors` (with a key when
    `required_for_everyone` is given, which needs one)."""
    config = passkey_config()
    config["clients"] = device_config()["clients"]
    config["device"] = {"interval": "1s"}
    config["second_factors"] = second_factors
    return config


async def device_second_step(
    http: aiohttp.ClientSession, server: RunningAuthServer, user_code: str
) -> aiohttp.ClientResponse:
    """The device page for `user_code`, then the password: its answer."""
    page = await http.get(server.endpoint("/device"))
    action, fields = parse_form(await page.text())
    checked = await post(http, server, action, {**fields, "user_code": user_code})
    action, fields = parse_form(await checked.text())
    assert action.endswith("/device/login"), action
    return await post(http, server, action, {**fields, "username": "alice", "password": PASSWORD})


async def start_device(http: aiohttp.ClientSession, server: RunningAuthServer) -> dict[str, Any]:
    started = await http.post(
        server.endpoint("/device_authorization"), data={"client_id": "tv", "scope": "openid"}
    )
    assert started.status == 200
    return dict(await started.json())


async def test_the_device_page_offers_a_passkey_bound_to_its_user_code(
    start_authserver: StartAuthServer, clock: MovableClock
) -> None:
    """A passkey-only user, of whom the operator requires a second factor, passes the device
    page with it (without, the consent page would refuse them); the challenge is bound to
    the user code it was issued for, and the ID token tells of the password and the key."""
    config = required_config(encryption_key=ENCRYPTION_KEY, required_for_everyone=True)
    server = await start_authserver(config, clock=clock)
    key = await user_with_passkey(server)
    async with browser() as http:
        device = await start_device(http, server)
        other = await start_device(http, server)
        step = await device_second_step(http, server, device["user_code"])
        assert step.status == 200
        text = await step.text()
        assert 'name="code"' not in text  # no app: the passkey is the way on
        form = passkey_form(text)
        assert form is not None and form.action.endswith("/device/login/passkey")
        assert [d["id"] for d in form.options["allowCredentials"]] == [b64(key.credential_id)]
        # Another device's second step, in the same session: its challenge is for its code.
        theirs = passkey_form(
            await (await device_second_step(http, server, other["user_code"])).text()
        )
        assert theirs is not None
        ceremony = {k: v for k, v in theirs.fields.items() if k.startswith("passkey_")}
        crossed = await submit(
            http,
            server,
            PasskeyForm(form.action, "get", theirs.options, {**form.fields, **ceremony}),
            key.get(theirs.options),
        )
        assert crossed.status == 400
        again = await crossed.text()
        assert "expired or was already used" in again
        key.counter -= 1  # that assertion was not counted
        # The page shown again, with a challenge of its own: the passkey passes.
        form = passkey_form(again)
        assert form is not None
        consent = await submit(http, server, form, key.get(form.options))
        assert consent.status == 200, await consent.text()
        action, fields = parse_form(await consent.text())
        assert action.endswith("/device/consent")
        done = await post(http, server, action, {**fields, "decision": "approve"})
        assert "Device connected" in await done.text()
        status, tokens = await poll(http, server, device["device_code"])
        assert status == 200, tokens
        claims = await verify_jwt(http, server, tokens["id_token"], audience="tv")
    assert claims["amr"] == ["pwd", "hwk", "user", "mfa"]
    assert claims["acr"] == assurance.MULTI_FACTOR


async def device_login_page(
    http: aiohttp.ClientSession, server: RunningAuthServer, user_code: str
) -> str:
    """The device page's sign-in form for `user_code`, checked."""
    page = await http.get(server.endpoint("/device"))
    action, fields = parse_form(await page.text())
    checked = await post(http, server, action, {**fields, "user_code": user_code})
    assert checked.status == 200
    return await checked.text()


async def test_the_device_pages_sign_in_offers_a_passkey_instead_of_the_password(
    start_authserver: StartAuthServer, clock: MovableClock
) -> None:
    """As the login page: any discoverable passkey, user verification required, its
    challenge bound to the user code the page checked; it meets the operator's requirement
    of a second factor alone, and the device's consent page follows."""
    config = required_config(encryption_key=ENCRYPTION_KEY, required_for_everyone=True)
    server = await start_authserver(config, clock=clock)
    key = await user_with_passkey(server)
    async with browser() as http:
        device = await start_device(http, server)
        other = await start_device(http, server)
        text = await device_login_page(http, server, device["user_code"])
        assert 'name="password"' in text  # the password form is still there
        form = passkey_form(text)
        assert form is not None and form.action.endswith("/device/login/passkey")
        assert "allowCredentials" not in form.options
        assert form.options["userVerification"] == "required"
        assert "passkey_subject" not in form.fields and "pending_subject" not in form.fields
        # Another code's challenge, in the same session, does not pass for this code.
        theirs = passkey_form(await device_login_page(http, server, other["user_code"]))
        assert theirs is not None
        ceremony = {k: v for k, v in theirs.fields.items() if k.startswith("passkey_")}
        crossed = await submit(
            http,
            server,
            PasskeyForm(form.action, "get", theirs.options, {**form.fields, **ceremony}),
            key.get(theirs.options),
        )
        assert crossed.status == 400
        again = await crossed.text()
        assert "expired or was already used" in again and 'name="password"' in again
        key.counter -= 1  # that assertion was not counted
        # Without user verification a passkey alone is no sign-in.
        form = passkey_form(again)
        assert form is not None
        unverified = await submit(http, server, form, key.get(form.options, verified=False))
        assert unverified.status == 400
        assert "did not verify it was you" in await unverified.text()
        key.counter -= 1
        form = passkey_form(await device_login_page(http, server, device["user_code"]))
        assert form is not None
        consent = await submit(http, server, form, key.get(form.options))
        assert consent.status == 200, await consent.text()
        action, fields = parse_form(await consent.text())
        assert action.endswith("/device/consent")
        assert fields["user_code"] == device["user_code"].replace("-", "")
        done = await post(http, server, action, {**fields, "decision": "approve"})
        assert "Device connected" in await done.text()
        status, tokens = await poll(http, server, device["device_code"])
        assert status == 200, tokens
        claims = await verify_jwt(http, server, tokens["id_token"], audience="tv")
        # The other device still waits: nothing was decided for its code.
        status, waiting = await poll(http, server, other["device_code"])
        assert status == 400 and waiting["error"] == "authorization_pending"
    assert claims["sub"] == server.subject("alice")
    assert claims["amr"] == ["hwk", "user", "mfa"]
    assert claims["acr"] == assurance.MULTI_FACTOR
    [stored] = await passkeys_stored(server, server.subject("alice"))
    assert stored.sign_count == 1


async def test_a_forged_or_stale_device_passkey_form_looks_no_code_up(
    server: RunningAuthServer,
) -> None:
    key = await user_with_passkey(server)
    async with browser() as http:
        page = await http.get(server.endpoint("/device"))
        csrf = parse_form(await page.text())[1]["csrf_token"]
        path = server.endpoint("/device/login/passkey")
        for fields, status in (
            ({"csrf_token": "x", "user_code": "BCDFGHJK"}, 403),
            ({"csrf_token": csrf, "user_code": "BCDFGHJK", "code_checked": "x"}, 400),
        ):
            response = await http.post(path, data=fields, allow_redirects=False)
            assert response.status == status
    assert [p.sign_count for p in await passkeys_stored(server, server.subject("alice"))] == [0]
    assert key.counter == 0


@pytest.mark.parametrize("app_available", [True, False], ids=["app-or-passkey", "passkey-only"])
async def test_the_page_leading_to_a_second_factor_offers_a_passkey_then_goes_on(
    start_authserver: StartAuthServer, clock: MovableClock, app_available: bool
) -> None:
    """A request that needs a second factor, of a user who has none: the page offers a
    passkey beside the authenticator app (alone, on a server that keeps no apps); once it
    is added, the request's second step asks for it, and the code follows."""
    config = required_config(**({"encryption_key": ENCRYPTION_KEY} if app_available else {}))
    server = await start_authserver(config, clock=clock)
    async with browser() as http:
        url, verifier = authorize_url(server, acr_values=assurance.MULTI_FACTOR)
        page = await http.get(url, allow_redirects=False)
        action, fields = parse_form(await page.text())
        fields.update(username="alice", password=PASSWORD)
        led = await post(http, server, action, fields)
        assert led.status == 200
        text = await led.text()
        assert 'id="reason"' in text
        assert ('action="/factors/totp"' in text) is app_available
        form = passkey_form(text)
        assert form is not None and form.mode == "create"
        assert form.fields["acr_values"] == assurance.MULTI_FACTOR  # the request, carried
        assert "script-src 'self'" in led.headers["Content-Security-Policy"]
        key = SoftAuthenticator(origin_of(server))
        step = await submit(http, server, form, key.create(form.options), name="My laptop")
        assert step.status == 200, await step.text()
        text = await step.text()
        assert 'name="code"' not in text
        second = passkey_form(text)
        assert second is not None and second.action.endswith("/login/passkey")
        code = await finish(
            http, server, await submit(http, server, second, key.get(second.options))
        )
        claims = await id_token(http, server, code, verifier)
    assert claims["amr"] == ["pwd", "hwk", "user", "mfa"]
    assert claims["acr"] == assurance.MULTI_FACTOR
    [stored] = await passkeys_stored(server, server.subject("alice"))
    assert stored.name == "My laptop" and stored.sign_count == 1


async def test_the_factors_page_shows_the_users_passkeys_and_adds_one(
    start_authserver: StartAuthServer, clock: MovableClock
) -> None:
    """GET /factors, where passkeys work: beside the authenticator app, how many passkeys
    the user has and the form adding one; once the sign-in is old, a word instead."""
    config = required_config(encryption_key=ENCRYPTION_KEY)
    server = await start_authserver(config, clock=clock)
    async with browser() as http:
        await account_sign_in(http, server)
        page = await http.get(server.endpoint("/factors"))
        assert page.status == 200
        text = await page.text()
        assert 'action="/factors/totp"' in text  # the app, as before
        assert 'id="passkey-count">You have no passkey yet.' in text
        assert 'href="/account"' in text
        assert "script-src 'self'" in page.headers["Content-Security-Policy"]
        form = passkey_form(text)
        assert form is not None and form.mode == "create"
        assert form.action.endswith("/account/passkeys")
        key = SoftAuthenticator(origin_of(server))
        added = await submit(http, server, form, key.create(form.options), name="Phone")
        assert added.status == 303, await added.text()
        text = await (await http.get(server.endpoint("/factors"))).text()
        assert 'id="passkey-count">You have one passkey.' in text
        clock.advance(16 * 60)
        text = await (await http.get(server.endpoint("/factors"))).text()
        assert passkey_form(text) is None and 'id="passkey-sign-in-again"' in text
    assert [p.name for p in await passkeys_stored(server, server.subject("alice"))] == ["Phone"]


async def test_without_an_encryption_key_a_required_factor_is_a_passkey(
    start_authserver: StartAuthServer, clock: MovableClock
) -> None:
    """`required_for_everyone` on an issuer where passkeys work needs no encryption key:
    no app is offered anywhere, and a passkey meets the requirement."""
    server = await start_authserver(required_config(required_for_everyone=True), clock=clock)
    async with browser() as http:
        url, verifier = authorize_url(server)
        page = await http.get(url, allow_redirects=False)
        action, fields = parse_form(await page.text())
        led = await post(http, server, action, {**fields, "username": "bob", "password": PASSWORD})
        assert led.status == 200
        text = await led.text()
        assert 'id="reason"' in text and "/factors/totp" not in text
        creation = passkey_form(text)
        assert creation is not None and creation.mode == "create"
        # The page of factors offers the passkey alone too.
        factors = await http.get(server.endpoint("/factors"))
        assert factors.status == 200
        factors_text = await factors.text()
        assert "/factors/totp" not in factors_text and 'id="passkey-count"' in factors_text
        assert passkey_form(factors_text) is not None
        assert (await http.post(server.endpoint("/factors/totp"))).status == 404
        # The device page (this session signed in with the password alone) names the
        # passkey as the one way to set a factor up.
        device = await start_device(http, server)
        page = await http.get(server.endpoint("/device"))
        action, fields = parse_form(await page.text())
        refused = await post(http, server, action, {**fields, "user_code": device["user_code"]})
        assert refused.status == 403
        message = await refused.text()
        assert "set up a passkey at /factors" in message and "authenticator app" not in message
        key = SoftAuthenticator(origin_of(server))
        step = await submit(http, server, creation, key.create(creation.options), name="Key")
        assert step.status == 200, await step.text()
        second = passkey_form(await step.text())
        assert second is not None
        code = await finish(
            http, server, await submit(http, server, second, key.get(second.options))
        )
        claims = await id_token(http, server, code, verifier)
    assert claims["amr"] == ["pwd", "hwk", "user", "mfa"]


def test_a_required_factor_no_issuer_can_meet_is_a_configuration_error(tmp_path: Any) -> None:
    """Without an encryption key and on an issuer where browsers offer no passkeys (an IP
    address), nothing could meet the requirement."""
    from portcullis.yamlconf import ConfigError
    from tests.authserver.conftest import load_settings

    for issuer in ("http://127.0.0.1:{port}", "http://[::1]:{port}"):
        config = required_config(required_for_roles=["admin"])
        config["issuer"] = issuer
        with pytest.raises(ConfigError, match="passkeys need an https issuer") as raised:
            load_settings(config, tmp_path, 9000)
        assert "second_factors.encryption_key" in str(raised.value)
    for issuer in ("http://localhost:{port}", "https://auth.example.com"):
        config = required_config(required_for_roles=["admin"])
        config["issuer"] = issuer
        assert load_settings(config, tmp_path, 9000).second_factors.required


# ------------------------------------------------- removing one


def remove_fields(page: str, credential: bytes) -> dict[str, str]:
    """The hidden fields of the form removing the passkey `credential`."""
    item = page.split(f'data-credential-id="{b64(credential)}"', 1)[1].split("</li>", 1)[0]
    return dict(re.findall(r'<input type="hidden" name="([a-z_]+)" value="([^"]*)"', item))


async def test_removing_a_passkey_needs_a_recent_sign_in_or_the_password(
    start_authserver: StartAuthServer, clock: MovableClock
) -> None:
    """As removing the authenticator app: after 15 minutes the current password; the last
    factor the operator requires stays; a credential of another user is no such passkey,
    whatever that user's factors."""
    config = required_config(encryption_key=ENCRYPTION_KEY, required_for_everyone=True)
    server = await start_authserver(config, clock=clock)
    alice = server.subject("alice")
    async with browser() as http:
        page = await http.get(server.endpoint("/account"))
        action, fields = parse_form(await page.text())
        fields.update(username="bob", password=PASSWORD)
        assert (await post(http, server, action, fields)).status == 303
        bobs = await add_passkey(http, server, "Bob's")  # bob's only one
    async with browser() as http:
        await account_sign_in(http, server)
        first = await add_passkey(http, server, "First")
        page = await (await http.get(server.endpoint("/account"))).text()
        csrf = remove_fields(page, first.credential_id)["csrf_token"]
        # Not hers: no such passkey, before the refusal of removing her only factor.
        response = await post(
            http,
            server,
            "/account/passkeys/remove",
            {"csrf_token": csrf, "credential": b64(bobs.credential_id)},
        )
        assert response.status == 400 and "no such passkey" in await response.text()
        second = await add_passkey(http, server, "Second")
        clock.advance(16 * 60)  # older than a set-up would allow
        page = await (await http.get(server.endpoint("/account"))).text()
        assert 'id="passkey-current-1"' in page
        fields = remove_fields(page, first.credential_id)
        for wrong in ({}, {"current": "not-the-password"}):
            refused = await post(http, server, "/account/passkeys/remove", {**fields, **wrong})
            assert refused.status == 400
            text = await refused.text()
            assert 'id="passkeys-problem"' in text
            assert "The current password is not correct." in text
        assert len(await passkeys_stored(server, alice)) == 2
        removed = await post(
            http, server, "/account/passkeys/remove", {**fields, "current": PASSWORD}
        )
        assert removed.status == 303, await removed.text()
        # The last one, which the operator requires: kept, whatever the password.
        fields = remove_fields(page, second.credential_id)
        kept = await post(http, server, "/account/passkeys/remove", {**fields, "current": PASSWORD})
        assert kept.status == 409
    assert [p.name for p in await passkeys_stored(server, alice)] == ["Second"]
    assert len(await passkeys_stored(server, server.subject("bob"))) == 1
