"""Failed logins are throttled per username and per client address (`login_throttle`), with
one answer for an unknown user and a wrong password."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import aiohttp
import pytest

from tests.authserver.conftest import PASSWORD, RunningAuthServer, default_config
from tests.authserver.test_authorize import (
    Reply,
    assert_error_redirect,
    auth_params,
    form_action,
    send,
    submit,
)

THROTTLED = "Too many failed attempts. Please wait a few minutes and try again."
WRONG = "The username or password is not correct."


@pytest.fixture(scope="session")
def shared_keys(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("throttle") / "keys")


@pytest.fixture
def start(start_authserver: Any, shared_keys: str) -> Any:
    async def start_throttled(**throttle: Any) -> RunningAuthServer:
        config = default_config()
        config["keys"] = {"dir": shared_keys}
        config["login_throttle"] = {
            "max_failures": 3,
            "max_failures_per_address": 5,
            "window": "1h",
            **throttle,
        }
        server: RunningAuthServer = await start_authserver(config)
        return server

    return start_throttled


@pytest.fixture
async def authserver(start: Any) -> RunningAuthServer:
    server: RunningAuthServer = await start()
    return server


async def attempt(
    http: aiohttp.ClientSession, server: RunningAuthServer, username: str, password: str
) -> Reply:
    """Open the login page of a fresh authorization request and submit it."""
    page = await send(http, server, auth_params())
    assert page.status == 200 and form_action(page) == "/login", page.text[:300]
    return await submit(http, server, page, username=username, password=password)


def error_message(reply: Reply) -> str:
    found = re.search(r'<p class="error" role="alert">([^<]*)</p>', reply.text)
    assert found, reply.text[:500]
    return found.group(1)


def assert_refused(reply: Reply) -> None:
    assert reply.status == 400, reply.text[:300]
    assert error_message(reply) == WRONG
    assert "Location" not in reply.headers


def assert_throttled(reply: Reply, server: RunningAuthServer) -> None:
    assert reply.status == 429, reply.text[:300]
    assert error_message(reply) == THROTTLED
    assert "Location" not in reply.headers
    assert int(reply.headers["Retry-After"]) == int(
        server.settings.login_throttle.window.total_seconds()
    )
    assert reply.headers["X-Frame-Options"] == "DENY"
    assert form_action(reply) == "/login"


async def assert_signed_out(http: aiohttp.ClientSession, server: RunningAuthServer) -> None:
    check = await send(http, server, auth_params(prompt="none"))
    assert_error_redirect(check, server, "login_required")


async def test_failed_logins_for_one_username_end_in_a_429_page_even_for_the_right_password(
    authserver, http
):
    for _ in range(3):
        assert_refused(await attempt(http, authserver, "alice", "wrong"))
    throttled = await attempt(http, authserver, "alice", PASSWORD)
    assert_throttled(throttled, authserver)
    await assert_signed_out(http, authserver)


async def test_username_throttle_does_not_lock_out_other_users(authserver, http):
    for _ in range(3):
        assert_refused(await attempt(http, authserver, "alice", "wrong"))
    assert_throttled(await attempt(http, authserver, "alice", PASSWORD), authserver)
    consent = await attempt(http, authserver, "bob", PASSWORD)
    assert consent.status == 200 and form_action(consent) == "/consent"


async def test_username_throttle_ignores_letter_case(authserver, http):
    for name in ("Alice", "ALICE", "alice"):
        assert_refused(await attempt(http, authserver, name, "wrong"))
    assert_throttled(await attempt(http, authserver, "alice", PASSWORD), authserver)


async def test_failed_logins_from_one_address_are_throttled_across_usernames(authserver, http):
    for index in range(5):
        assert_refused(await attempt(http, authserver, f"guess{index}", "wrong"))
    assert_throttled(await attempt(http, authserver, "bob", PASSWORD), authserver)
    await assert_signed_out(http, authserver)


async def test_limits_come_from_the_login_throttle_settings(start, http):
    server = await start(max_failures=1, max_failures_per_address=100)
    assert_refused(await attempt(http, server, "alice", "wrong"))
    assert_throttled(await attempt(http, server, "alice", "wrong"), server)


async def test_unknown_user_and_wrong_password_get_the_same_answer(authserver, http):
    unknown = await attempt(http, authserver, "mallory", "wrong")
    wrong = await attempt(http, authserver, "alice", "wrong")
    assert unknown.status == wrong.status == 400
    assert error_message(unknown) == error_message(wrong) == WRONG

    def without_echo(reply: Reply, username: str) -> str:
        text = reply.text.replace(f'value="{username}"', 'value=""')
        return re.sub(r'name="csrf_token" value="[^"]*"', "", text)

    assert without_echo(unknown, "mallory") == without_echo(wrong, "alice")


async def test_a_successful_login_clears_the_username_counter(authserver, http):
    for _ in range(2):
        assert_refused(await attempt(http, authserver, "alice", "wrong"))
    consent = await attempt(http, authserver, "alice", PASSWORD)
    assert consent.status == 200 and form_action(consent) == "/consent"

    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as other:
        # Two more failures: three in total for alice, but the success came between.
        for _ in range(2):
            assert_refused(await attempt(other, authserver, "alice", "wrong"))
        consent = await attempt(other, authserver, "alice", PASSWORD)
    assert consent.status == 200 and form_action(consent) == "/consent"


async def test_throttle_lifts_when_the_window_has_passed(start, http):
    server = await start(window="1500ms")
    for _ in range(3):
        assert_refused(await attempt(http, server, "alice", "wrong"))
    last_failure = time.monotonic()
    assert_throttled(await attempt(http, server, "alice", PASSWORD), server)
    await asyncio.sleep(max(0.0, last_failure + 1.6 - time.monotonic()))
    consent = await attempt(http, server, "alice", PASSWORD)
    assert consent.status == 200 and form_action(consent) == "/consent"


async def test_while_throttled_the_right_and_wrong_password_get_the_same_answer(authserver, http):
    """A throttled attempt is not checked, so it cannot be used to probe the password."""
    for _ in range(3):
        assert_refused(await attempt(http, authserver, "alice", "wrong"))
    answers = [await attempt(http, authserver, "alice", p) for p in ("wrong", PASSWORD)]
    for answer in answers:
        assert_throttled(answer, authserver)
    csrf = re.compile(r'name="csrf_token" value="[^"]*"')
    assert csrf.sub("", answers[0].text) == csrf.sub("", answers[1].text)
    await assert_signed_out(http, authserver)
