"""Checking the password typed into a login form, behind the throttle every login form
shares: failures are counted per username and per client address (`login_throttle`), and
over either limit nothing is checked until the window has passed.

Used by the authorization endpoint's login page and the device page's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from aiohttp import web

from .. import users
from ..settings import UserSettings
from .common import Services

log = logging.getLogger("portcullis.authserver.signin")

THROTTLED = "Too many failed attempts. Please wait a few minutes and try again."
# One answer for an unknown user and a wrong password.
WRONG = "The username or password is not correct."


@dataclass(frozen=True)
class Throttled:
    retry_after: int  # seconds


async def check_password(
    svc: Services, request: web.Request, username: str, password: str
) -> UserSettings | Throttled | None:
    """The user, Throttled, or None when the username or password is wrong."""
    throttle = svc.settings.login_throttle
    now = time.time()
    window = throttle.window.total_seconds()
    user_key = f"login:user:{username.lower()}"
    address_key = f"login:ip:{request.remote or '-'}"
    limits = (
        (user_key, throttle.max_failures),
        (address_key, throttle.max_failures_per_address),
    )
    for key, limit in limits:
        if await svc.store.failures(key, now, window) >= limit:
            log.warning("login throttled", extra={"key_kind": key.split(":")[1]})
            return Throttled(int(window))
    user = svc.settings.user(username)
    # scrypt takes tens of milliseconds: off the event loop, so one login does not stall
    # every other request.
    ok = await asyncio.to_thread(
        users.verify_password, password, user.password_hash if user else users.dummy_hash()
    )
    if user is None or not ok:
        for key, _ in limits:
            await svc.store.count_failure(key, now, window)
        return None
    await svc.store.clear_failures(user_key)
    return user
