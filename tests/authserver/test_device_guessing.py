"""The bound on guessing device user codes holds under concurrency: wrong codes sent at once
from one browser session, or from many sessions at one address, are looked up no more often
than `device.max_failures` / `device.max_failures_per_address` allow, and the right code
sent after them is refused too. Behind a trusted proxy, the address counted is the client's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from tests.authserver.conftest import RunningAuthServer, StartAuthServer
from tests.authserver.device_support import (
    Form,
    Step,
    device_config,
    get_page,
    only_form,
    start_device,
    submit,
)

RACERS = 60
WRONG = "not valid or has expired"
TOO_MANY = "Too many wrong codes"


def wrong_codes(count: int, real: str) -> list[str]:
    """Well-formed codes, none of them the real one: each would be looked up."""
    letters = "BCDFGHJKLMNPQRSTVWXZ"
    codes = [
        f"{letters[i % 20]}{letters[i // 20 % 20]}BB-{letters[i // 400 % 20]}CCC"
        for i in range(count)
    ]
    return [code for code in codes if code.replace("-", "") != real.replace("-", "")]


def browser() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        cookie_jar=aiohttp.CookieJar(unsafe=True), connector=aiohttp.TCPConnector(limit=0)
    )


@pytest.fixture
async def device_browser() -> AsyncIterator[aiohttp.ClientSession]:
    async with browser() as session:
        yield session


async def code_form(session: aiohttp.ClientSession, server: RunningAuthServer) -> Form:
    page = await get_page(session, server.endpoint("/device"))
    assert page.status == 200, page.text[:300]
    return page.form


def tally(steps: list[Step]) -> dict[str, int]:
    counts = {"looked up": 0, "throttled": 0}
    for step in steps:
        if step.status == 400 and WRONG in step.text:
            counts["looked up"] += 1
        elif step.status == 429 and TOO_MANY in step.text:
            counts["throttled"] += 1
        else:
            raise AssertionError(f"unexpected answer {step.status}: {step.text[:300]}")
    return counts


async def real_code(http: aiohttp.ClientSession, server: RunningAuthServer) -> str:
    status, body, _ = await start_device(http, server)
    assert status == 200, body
    code: str = body["user_code"]
    return code


async def test_wrong_codes_sent_at_once_from_one_session_are_looked_up_at_most_the_limit(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession, device_browser: Any
) -> None:
    server = await start_authserver(
        device_config(device={"interval": "1s", "max_failures": 5, "max_failures_per_address": 20})
    )
    code = await real_code(http, server)
    form = await code_form(device_browser, server)
    steps = await asyncio.gather(
        *(
            submit(device_browser, server, form, {"user_code": guess})
            for guess in wrong_codes(RACERS, code)
        )
    )
    counts = tally(list(steps))
    assert counts["looked up"] == 5, counts
    assert counts["throttled"] == len(steps) - 5
    # The real code, after the flood, is not looked up either.
    last = await submit(device_browser, server, form, {"user_code": code})
    assert last.status == 429, last.text[:300]
    assert TOO_MANY in last.text


async def test_wrong_codes_sent_at_once_from_many_sessions_at_one_address_are_bounded(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    server = await start_authserver(
        device_config(device={"interval": "1s", "max_failures": 50, "max_failures_per_address": 20})
    )
    code = await real_code(http, server)
    guesses = wrong_codes(RACERS, code)
    sessions = [browser() for _ in guesses]
    try:
        forms = await asyncio.gather(*(code_form(session, server) for session in sessions))
        steps = await asyncio.gather(
            *(
                submit(session, server, form, {"user_code": guess})
                for session, form, guess in zip(sessions, forms, guesses, strict=True)
            )
        )
        counts = tally(list(steps))
        assert counts["looked up"] == 20, counts
        async with browser() as fresh:
            last = await submit(fresh, server, await code_form(fresh, server), {"user_code": code})
        assert last.status == 429, last.text[:300]
    finally:
        await asyncio.gather(*(session.close() for session in sessions))


async def enter_code_via_proxy(
    session: aiohttp.ClientSession, server: RunningAuthServer, code: str, client: str
) -> Step:
    """The code form posted through a proxy at 127.0.0.1 that names `client`."""
    form = await code_form(session, server)
    response = await session.post(
        server.url + urlsplit(form.action).path,
        data={**form.inputs, "user_code": code},
        headers={"X-Forwarded-For": client},
        allow_redirects=False,
    )
    return Step(response.status, await response.text(), response)


async def test_behind_a_trusted_proxy_each_forwarded_address_has_its_own_count(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    config = device_config(
        device={"interval": "1s", "max_failures": 50, "max_failures_per_address": 3}
    )
    config["trusted_proxies"] = ["127.0.0.1/32"]
    server = await start_authserver(config)
    code = await real_code(http, server)
    sessions = [browser() for _ in range(12)]
    try:
        steps = await asyncio.gather(
            *(
                enter_code_via_proxy(session, server, guess, "203.0.113.7")
                for session, guess in zip(sessions, wrong_codes(12, code), strict=False)
            )
        )
        assert tally(list(steps))["looked up"] == 3
    finally:
        await asyncio.gather(*(session.close() for session in sessions))
    async with browser() as neighbour:
        step = await enter_code_via_proxy(neighbour, server, code, "198.51.100.20")
    assert step.status == 200, step.text[:300]
    assert urlsplit(only_form(step.text).action).path == "/device/login"
