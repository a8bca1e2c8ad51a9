"""Server-side sessions: the browser holds only a random id in a cookie; tokens, the PKCE
verifier, `state` and `nonce` never leave this process.

The store is in memory and bounded (least recently used sessions go first, idle ones expire),
which is enough for an example that runs as one process. Signing in gives the session a new
id, so an id planted in a browser before sign-in is worth nothing after it.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from aiohttp import web

from .oidc import new_verifier

# Browsers do not separate cookies by port: the authorization server on the same host sets
# its own session cookie, so ours needs a name of its own.
COOKIE = "demo_web_session"
IDLE = timedelta(hours=1)
MAX_SESSIONS = 10_000
MAX_PENDING = 5  # sign-ins started in other tabs and not finished yet
PENDING_LIFETIME = timedelta(minutes=10)


@dataclass
class PendingLogin:
    """What the callback must find again: the request's state, nonce and PKCE verifier."""

    state: str
    nonce: str
    verifier: str
    started: float


@dataclass
class SignedIn:
    claims: dict[str, Any]  # of the validated ID token
    id_token: str
    access_token: str
    access_expires_at: float | None
    scope: str
    refresh_token: str | None


@dataclass
class ApiResult:
    url: str
    status: int
    body: str  # pretty-printed JSON, or the text as received


@dataclass
class Session:
    id: str
    csrf_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    pending: OrderedDict[str, PendingLogin] = field(default_factory=OrderedDict)
    user: SignedIn | None = None
    api_result: ApiResult | None = None
    notice: str | None = None  # shown once on the next page
    logout_state: str | None = None
    last_seen: float = field(default_factory=time.monotonic)
    new_id: bool = True  # the cookie must be (re)sent

    def csrf_valid(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.csrf_token.encode())

    def start_login(self) -> PendingLogin:
        now = time.time()
        for state in [s for s, p in self.pending.items() if now - p.started > _pending_seconds()]:
            del self.pending[state]
        while len(self.pending) >= MAX_PENDING:
            self.pending.popitem(last=False)
        pending = PendingLogin(
            state=secrets.token_urlsafe(32),
            nonce=secrets.token_urlsafe(32),
            verifier=new_verifier(),
            started=now,
        )
        self.pending[pending.state] = pending
        return pending

    def take_pending(self, state: str | None) -> PendingLogin | None:
        """The sign-in this `state` belongs to, removed so it cannot be completed twice."""
        if not state:
            return None
        for known in self.pending:
            if hmac.compare_digest(known.encode(), state.encode()):
                pending = self.pending.pop(known)
                if time.time() - pending.started > _pending_seconds():
                    return None
                return pending
        return None


def _pending_seconds() -> float:
    return PENDING_LIFETIME.total_seconds()


class SessionStore:
    def __init__(self, max_sessions: int = MAX_SESSIONS, idle: timedelta = IDLE) -> None:
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._max = max_sessions
        self._idle = idle.total_seconds()

    def current(self, request: web.Request) -> Session | None:
        """The session the request's cookie names, if it is still alive."""
        return self.get(request.cookies.get(COOKIE))

    def get(self, value: str | None) -> Session | None:
        if not value or len(value) > 100:
            return None
        session = self._sessions.get(value)
        if session is None:
            return None
        now = time.monotonic()
        if now - session.last_seen > self._idle:
            del self._sessions[value]
            return None
        session.last_seen = now
        self._sessions.move_to_end(value)
        return session

    def ensure(self, request: web.Request) -> Session:
        return self.current(request) or self._add(Session(id=secrets.token_urlsafe(32)))

    def renew(self, session: Session) -> Session:
        """The same session under a new id (and a new CSRF token); the old id stops working."""
        self._sessions.pop(session.id, None)
        session.id = secrets.token_urlsafe(32)
        session.csrf_token = secrets.token_urlsafe(32)
        session.new_id = True
        return self._add(session)

    def _add(self, session: Session) -> Session:
        while len(self._sessions) >= self._max:
            self._sessions.popitem(last=False)
        self._sessions[session.id] = session
        return session

    def __len__(self) -> int:
        return len(self._sessions)


def set_cookie(response: web.StreamResponse, session: Session, secure: bool) -> None:
    """HttpOnly (no script reads it), SameSite=Lax (sent on the provider's redirect back to
    /callback, a top-level GET, but not on another site's POSTs), host-only, Path=/."""
    if session.new_id:
        response.set_cookie(
            COOKIE, session.id, path="/", httponly=True, samesite="Lax", secure=secure
        )
        session.new_id = False
