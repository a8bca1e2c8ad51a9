"""Passwords are checked on a pool of `password_hashing.workers` threads with at most
`max_waiting` checks queued behind them: a sign-in beyond that gets the 503 page with
Retry-After at once, never a place in a backlog that grows without bound."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
from typing import Any

import aiohttp

from authserver import users
from tests.authserver.conftest import PASSWORD, StartAuthServer, default_config
from tests.authserver.test_authorize import auth_params, form_action, send, submit

WRONG = "The username or password is not correct."
BUSY = "The service cannot handle this right now."


def costly_hash(password: str, log2_n: int = 16) -> str:
    """A hash in the stored format at twice the server's own cost (64 MiB, a few tenths of
    a second): long enough that sign-ins sent together find the pool busy."""
    salt = os.urandom(16)
    digest = hashlib.scrypt(
        password.encode(), salt=salt, n=1 << log2_n, r=8, p=1, maxmem=1 << 27, dklen=32
    )
    b64 = lambda data: base64.urlsafe_b64encode(data).rstrip(b"=").decode()  # noqa: E731
    stored = f"scrypt${log2_n}$8$1${b64(salt)}${b64(digest)}"
    assert users.verify_password(password, stored)
    return stored


def hashing_config(workers: int, max_waiting: int) -> dict[str, Any]:
    config = default_config()
    config["users"][0]["password_hash"] = costly_hash(PASSWORD)  # alice
    config["password_hashing"] = {"workers": workers, "max_waiting": max_waiting}
    # Throttles out of the way: this is about the pool, not about guessing.
    config["login_throttle"] = {
        "max_failures": 1000,
        "max_failures_per_address": 1000,
        "backoff_after": 1000,
    }
    return config


async def test_sign_ins_beyond_the_pool_get_the_503_page_and_then_it_serves_again(
    start_authserver: StartAuthServer, http: aiohttp.ClientSession
) -> None:
    server = await start_authserver(hashing_config(workers=1, max_waiting=1))
    page = await send(http, server, auth_params())
    assert form_action(page) == "/login"

    # Twelve at once: one is checked, one waits, and the others arrive while the first
    # check still runs.
    replies = await asyncio.gather(
        *(submit(http, server, page, username="alice", password="wrong") for _ in range(12))
    )

    assert {reply.status for reply in replies} <= {400, 503}
    checked = [reply for reply in replies if reply.status == 400]
    busy = [reply for reply in replies if reply.status == 503]
    assert checked and all(WRONG in reply.text for reply in checked)
    assert busy
    for reply in busy:
        assert int(reply.headers["Retry-After"]) >= 1
        assert BUSY in reply.text
        assert reply.headers["Content-Type"].startswith("text/html")

    # The pool drained, a sign-in goes through.
    signed_in = await submit(http, server, page, username="alice", password=PASSWORD)
    assert signed_in.status == 200, signed_in.text[:300]
    assert form_action(signed_in) == "/consent"
