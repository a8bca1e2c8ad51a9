"""Failed logins are throttled per username and per client address (`login_throttle`), with
one answer for an unknown user and a wrong password."""

from __future__ import annotations

import asyncio
import re
from typing import Any
from urllib.parse import urlencode

import aiohttp
import pytest

from tests.authserver.conftest import (
    PASSWORD,
    MovableClock,
    RunningAuthServer,
    default_config,
    parse_form,
)
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
    async def start_throttled(
        trusted_proxies: list[str] | None = None,
        clock: MovableClock | None = None,
        **throttle: Any,
    ) -> RunningAuthServer:
        config = default_config()
        config["keys"] = {"dir": shared_keys}
        if trusted_proxies is not None:
            config["trusted_proxies"] = trusted_proxies
        config["login_throttle"] = {
            "max_failures": 3,
            "max_failures_per_address": 5,
            "window": "1h",
            **throttle,
        }
        if clock is None:
            server: RunningAuthServer = await start_authserver(config)
        else:
            server = await start_authserver(config, clock=clock)
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
    clock = MovableClock()
    server = await start(window="1500ms", clock=clock)
    for _ in range(3):
        assert_refused(await attempt(http, server, "alice", "wrong"))
    assert_throttled(await attempt(http, server, "alice", PASSWORD), server)
    clock.advance(1.4)  # still within the window
    assert_throttled(await attempt(http, server, "alice", PASSWORD), server)
    clock.advance(0.2)
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


# ---------------------------------------------------------------------------- concurrency


def client_at(address: str = "127.0.0.1") -> aiohttp.ClientSession:
    """A browser whose connections come from `address` (any 127.0.0.0/8 address is this
    machine), with its own cookies and no cap on parallel connections."""
    return aiohttp.ClientSession(
        cookie_jar=aiohttp.CookieJar(unsafe=True),
        connector=aiohttp.TCPConnector(limit=0, local_addr=(address, 0)),
    )


async def login_pages(
    http: aiohttp.ClientSession, server: RunningAuthServer, count: int, headers: Any = None
) -> list[Reply]:
    """`count` login pages of fresh authorization requests, ready to be submitted."""
    pages = [await send(http, server, auth_params()) for _ in range(count)]
    for page in pages:
        assert page.status == 200 and form_action(page) == "/login", page.text[:300]
    return pages


async def post_login(
    http: aiohttp.ClientSession,
    server: RunningAuthServer,
    page: Reply,
    username: str,
    password: str,
    forwarded_for: str | None = None,
) -> Reply:
    """Submit a login page, optionally as a proxy would forward it."""
    action, hidden = parse_form(page.text)
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    if forwarded_for is not None:
        headers["X-Forwarded-For"] = forwarded_for
    response = await http.post(
        server.url + action,
        data=urlencode({**hidden, "username": username, "password": password}),
        headers=headers,
        allow_redirects=False,
    )
    async with response:
        return Reply(response.status, response.headers, await response.text())


def checked(replies: list[Reply]) -> int:
    """How many of the answers come from a password check (the rest must be throttled)."""
    count = 0
    for reply in replies:
        if reply.status == 400:
            assert error_message(reply) == WRONG
            count += 1
        else:
            assert reply.status == 429, reply.text[:300]
            assert error_message(reply) == THROTTLED
    return count


async def test_wrong_passwords_sent_at_once_are_checked_no_more_often_than_the_limit(
    authserver, http
):
    pages = await login_pages(http, authserver, 15)
    replies = await asyncio.gather(
        *(post_login(http, authserver, page, "alice", f"wrong-{i}") for i, page in enumerate(pages))
    )
    assert checked(list(replies)) == 3
    # The right password after the flood is not checked either.
    assert_throttled(await attempt(http, authserver, "alice", PASSWORD), authserver)
    await assert_signed_out(http, authserver)


async def test_wrong_passwords_for_many_usernames_sent_at_once_stop_at_the_address_limit(
    authserver, http
):
    pages = await login_pages(http, authserver, 15)
    replies = await asyncio.gather(
        *(post_login(http, authserver, page, f"guess{i}", "wrong") for i, page in enumerate(pages))
    )
    assert checked(list(replies)) == 5
    assert_throttled(await attempt(http, authserver, "bob", PASSWORD), authserver)


# ---------------------------------------------------------------------------- no lockout


async def test_failures_from_another_address_do_not_lock_the_user_out(authserver, http):
    async with client_at("127.0.0.2") as attacker:
        pages = await login_pages(attacker, authserver, 10)
        replies = await asyncio.gather(
            *(post_login(attacker, authserver, page, "alice", "wrong") for page in pages)
        )
        assert checked(list(replies)) == 3
        assert_throttled(await attempt(attacker, authserver, "alice", PASSWORD), authserver)
    consent = await attempt(http, authserver, "alice", PASSWORD)
    assert consent.status == 200 and form_action(consent) == "/consent"


async def test_failures_for_a_username_from_many_addresses_slow_it_down_without_a_lock(start, http):
    clock = MovableClock()
    server = await start(max_failures=50, max_failures_per_address=50, backoff_after=4, clock=clock)
    attackers = [client_at(f"127.0.0.{host}") for host in range(2, 14)]
    try:
        for attacker in attackers[:4]:
            assert_refused(await attempt(attacker, server, "alice", "wrong"))
        # Four failures across addresses: from now on each attempt for alice waits a delay
        # (1s, then 2s, ...) after the previous one, whichever address sends it.
        pages = [(await login_pages(a, server, 1))[0] for a in attackers[4:]]
        replies = await asyncio.gather(
            *(
                post_login(attacker, server, page, "alice", "wrong")
                for attacker, page in zip(attackers[4:], pages, strict=True)
            )
        )
        assert checked(list(replies)) <= 1
        refused = [reply for reply in replies if reply.status == 429]
        assert refused
        waits = [int(reply.headers["Retry-After"]) for reply in refused]
        assert all(1 <= wait <= 2 for wait in waits), waits
    finally:
        await asyncio.gather(*(attacker.close() for attacker in attackers))
    # A delay, not a lock: once it has passed, alice signs in from her own address.
    clock.advance(max(waits) + 1)
    consent = await attempt(http, server, "alice", PASSWORD)
    assert consent.status == 200 and form_action(consent) == "/consent"


# ---------------------------------------------------------------------------- trusted proxies


async def test_behind_a_trusted_proxy_each_forwarded_address_has_its_own_bucket(start, http):
    server = await start(trusted_proxies=["127.0.0.1/32"])
    pages = await login_pages(http, server, 12)
    replies = await asyncio.gather(
        *(
            post_login(http, server, page, f"guess{i}", "wrong", forwarded_for="203.0.113.7")
            for i, page in enumerate(pages)
        )
    )
    assert checked(list(replies)) == 5
    (page,) = await login_pages(http, server, 1)
    blocked = await post_login(http, server, page, "bob", PASSWORD, forwarded_for="203.0.113.7")
    assert_throttled(blocked, server)
    # Another user behind the same proxy is not held back; the rightmost address not
    # trusted is the client's, whatever the client wrote before it.
    (page,) = await login_pages(http, server, 1)
    other = await post_login(
        http, server, page, "bob", PASSWORD, forwarded_for="203.0.113.7, 198.51.100.20"
    )
    assert other.status == 200 and form_action(other) == "/consent", other.text[:300]


async def test_forwarded_for_from_a_peer_that_is_not_trusted_is_ignored(start, http):
    server = await start(trusted_proxies=["127.0.0.1/32"])
    async with client_at("127.0.0.2") as untrusted:
        pages = await login_pages(untrusted, server, 12)
        replies = await asyncio.gather(
            *(
                post_login(
                    untrusted, server, page, f"guess{i}", "wrong", forwarded_for=f"198.51.100.{i}"
                )
                for i, page in enumerate(pages)
            )
        )
        assert checked(list(replies)) == 5


async def test_without_trusted_proxies_forwarded_for_is_never_read(authserver, http):
    pages = await login_pages(http, authserver, 12)
    replies = await asyncio.gather(
        *(
            post_login(
                http, authserver, page, f"guess{i}", "wrong", forwarded_for=f"198.51.100.{i}"
            )
            for i, page in enumerate(pages)
        )
    )
    assert checked(list(replies)) == 5
