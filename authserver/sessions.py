"""Browser sessions: a random id in a cookie (only its SHA-256 in the store) and a CSRF token
bound to it.

Every visitor who reaches a form gets a session, anonymous until login, so that the login
form carries a CSRF token too. Logging in replaces the session id (no fixation). Cookies are
HttpOnly, SameSite=Lax, host-only, Path=/, and Secure with the `__Host-` prefix when the
issuer is https.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

from aiohttp import web

from portcullis.addresses import ClientAddresses

from .clock import Clock
from .registry import UserDirectory
from .store.base import SessionRecord, Store

ANONYMOUS = ""
_ANONYMOUS_LIFETIME = 3600.0  # seconds: long enough to fill a login form


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass(frozen=True)
class Session:
    record: SessionRecord
    cookie: str | None  # a new cookie value to set on the response, if any

    @property
    def logged_in(self) -> bool:
        return self.record.subject != ANONYMOUS

    @property
    def amr(self) -> tuple[str, ...]:
        """How the user signed in (RFC 8176); a session stored before sessions recorded
        it was signed in with a password."""
        if not self.logged_in:
            return ()
        return self.record.amr or ("pwd",)


class Sessions:
    def __init__(
        self,
        store: Store,
        users: UserDirectory,
        *,
        secure: bool,
        lifetime: timedelta,
        addresses: ClientAddresses,
        clock: Clock = time.time,
    ) -> None:
        """`secure` for an https issuer: the cookie is Secure, with the `__Host-` prefix;
        `lifetime` is a login session's; `addresses` tells the address a login came from,
        which the session keeps (the account page shows it)."""
        self.store = store
        self.addresses = addresses
        self.users = users
        self.clock = clock
        self.secure = secure
        self.name = "__Host-portcullis_session" if self.secure else "portcullis_session"
        self.lifetime = lifetime.total_seconds()

    async def current(self, request: web.BaseRequest) -> Session | None:
        value = request.cookies.get(self.name)
        if not value or len(value) > 100:
            return None
        record = await self.store.get_session(hashlib.sha256(value.encode()).digest(), self.clock())
        if record is None:
            return None
        if record.subject != ANONYMOUS and await self.users.by_subject(record.subject) is None:
            return None  # the user was removed from the configuration since signing in
        return Session(record, None)

    async def ensure(self, request: web.BaseRequest) -> Session:
        """The current session, or a new anonymous one (its cookie must be set)."""
        return await self.current(request) or await self._new(ANONYMOUS, 0.0, _ANONYMOUS_LIFETIME)

    async def login(
        self,
        request: web.BaseRequest,
        subject: str,
        amr: tuple[str, ...] = ("pwd",),
        auth_time: float | None = None,
    ) -> Session:
        """A new session signed in with the methods `amr` (RFC 8176) at `auth_time` (now
        when not given), replacing the current one."""
        old = await self.current(request)
        if old is not None:
            await self.store.delete_session(old.record.session_hash)
        forwarded = request.headers.getall("X-Forwarded-For", ())
        address = self.addresses.client(request.remote, forwarded)
        when = self.clock() if auth_time is None else auth_time
        return await self._new(subject, when, self.lifetime, address, amr)

    async def logout(self, request: web.BaseRequest) -> None:
        old = await self.current(request)
        if old is not None:
            await self.store.delete_session(old.record.session_hash)

    async def _new(
        self,
        subject: str,
        auth_time: float,
        lifetime: float,
        address: str = "",
        amr: tuple[str, ...] = (),
    ) -> Session:
        value = _b64(os.urandom(32))
        record = SessionRecord(
            session_hash=hashlib.sha256(value.encode()).digest(),
            subject=subject,
            auth_time=auth_time,
            expires_at=self.clock() + lifetime,
            csrf_secret=os.urandom(32),
            address=address,
            amr=amr,
        )
        await self.store.save_session(record)
        return Session(record, value)

    def set_cookie(self, response: web.StreamResponse, session: Session) -> None:
        if session.cookie is None:
            return
        response.set_cookie(
            self.name,
            session.cookie,
            path="/",
            httponly=True,
            samesite="Lax",
            secure=self.secure,
            max_age=int(session.record.expires_at - self.clock()),
        )

    def clear_cookie(self, response: web.StreamResponse) -> None:
        response.del_cookie(self.name, path="/", secure=self.secure, httponly=True, samesite="Lax")

    @staticmethod
    def csrf_token(session: Session) -> str:
        return _b64(hmac.new(session.record.csrf_secret, b"csrf", hashlib.sha256).digest())

    @staticmethod
    def csrf_valid(session: Session | None, token: str | None) -> bool:
        if session is None or not token:
            return False
        return hmac.compare_digest(Sessions.csrf_token(session), token)

    @staticmethod
    def proof(session: Session, items: Iterable[tuple[str, str]]) -> str:
        """A value only this session can present, vouching for these exact parameters (a
        form the server rendered after checking them); distinct from the CSRF token."""
        message = b"proof\x00" + json.dumps(sorted(items), separators=(",", ":")).encode()
        return _b64(hmac.new(session.record.csrf_secret, message, hashlib.sha256).digest())

    @staticmethod
    def proof_valid(session: Session, items: Iterable[tuple[str, str]], value: str | None) -> bool:
        return bool(value) and hmac.compare_digest(Sessions.proof(session, items), value or "")
