"""The web application's pages: sign in, the callback, calling the API, refresh, sign out.

Routes:
  GET  /            start page: a "Sign in" link, or the signed-in user's claims and buttons
  GET  /login       a new authorization request (PKCE S256, state, nonce kept in the session)
  GET  /callback    the provider's answer: state, then iss (RFC 9207), then the code exchange
                    and the ID token checks; the user is signed in only when all pass
  POST /call-api    GET the API's /orders?limit=5 through the gateway with the access token
  POST /refresh     new tokens from the refresh token (the new refresh token replaces it)
  POST /logout      revoke the refresh token, then RP-initiated logout at the provider
  GET  /signed-out  where the provider sends the browser back after logout
Every POST carries the session's CSRF token. Pages are rendered on the server by Jinja2 with
autoescaping and need no JavaScript; a strict Content-Security-Policy forbids any.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import jinja2
from aiohttp import web

from .oidc import IdTokenError, Provider, ProviderError, TokenEndpointError
from .sessions import ApiResult, Session, SessionStore, SignedIn, set_cookie

log = logging.getLogger("web_client")

HERE = Path(__file__).resolve().parent
DEFAULT_SCOPE = "openid profile email offline_access orders:read orders:write"
API_PATH = "/orders?limit=5"
MAX_API_BODY = 1024 * 1024
TIME_CLAIMS = ("exp", "iat", "auth_time", "nbf", "updated_at")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Config:
    issuer: str  # exactly as the provider's tokens name it
    client_id: str
    client_secret: str
    api: str  # the gateway in front of the orders API
    base_url: str  # where browsers reach this application
    scope: str = DEFAULT_SCOPE

    @property
    def redirect_uri(self) -> str:
        return self.base_url + "/callback"

    @property
    def post_logout_redirect_uri(self) -> str:
        return self.base_url + "/signed-out"

    @property
    def secure_cookies(self) -> bool:
        return self.base_url.startswith("https://")


@dataclass
class State:
    """What the handlers share. The HTTP client and provider exist while the app runs."""

    config: Config
    sessions: SessionStore = field(default_factory=SessionStore)
    pages: jinja2.Environment = field(
        default_factory=lambda: jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
    )
    http: aiohttp.ClientSession | None = None
    provider: Provider | None = None


STATE = web.AppKey("web_client", State)


@web.middleware
async def access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
    """One line per request, without the query: /callback's carries the code and state."""
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        log.info("%s %s %s", request.method, request.path, exc.status)
        raise
    log.info("%s %s %s", request.method, request.path, response.status)
    return response


def create_app(config: Config) -> web.Application:
    app = web.Application(client_max_size=64 * 1024, middlewares=[access_log])
    state = State(config)
    app[STATE] = state

    async def lifecycle(_: web.Application) -> Any:
        async with aiohttp.ClientSession() as http:
            state.http = http
            state.provider = Provider(config.issuer, config.client_id, config.client_secret, http)
            yield
            state.provider = state.http = None

    app.cleanup_ctx.append(lifecycle)
    app.router.add_get("/", index)
    app.router.add_get("/login", login)
    app.router.add_get("/callback", callback)
    app.router.add_post("/call-api", call_api)
    app.router.add_post("/refresh", refresh)
    app.router.add_post("/logout", logout)
    app.router.add_get("/signed-out", signed_out)
    app.router.add_get("/style.css", stylesheet)
    return app


# ---------------------------------------------------------------------------- helpers


def _state(request: web.Request) -> State:
    return request.app[STATE]


def _provider(request: web.Request) -> Provider:
    provider = _state(request).provider
    assert provider is not None, "the application is not running"
    return provider


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def page(
    request: web.Request,
    template: str,
    session: Session | None = None,
    *,
    status: int = 200,
    **context: Any,
) -> web.Response:
    state = _state(request)
    body = state.pages.get_template(template).render(**context)
    # No script at all; forms post here, and logout's redirect goes on to the provider (a
    # browser applies form-action to the redirects that follow a form too).
    csp = (
        "default-src 'none'; style-src 'self'; "
        f"form-action 'self' {_origin(state.config.issuer)}; "
        "frame-ancestors 'none'; base-uri 'none'"
    )
    response = web.Response(
        text=body,
        status=status,
        content_type="text/html",
        charset="utf-8",
        headers={
            "Content-Security-Policy": csp,
            "X-Frame-Options": "DENY",
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",  # never leak a code or state in a Referer
            "Cache-Control": "no-store",
        },
    )
    if session is not None:
        set_cookie(response, session, state.config.secure_cookies)
    return response


def message(
    request: web.Request,
    status: int,
    heading: str,
    text: str,
    session: Session | None = None,
    *,
    detail: str | None = None,
) -> web.Response:
    return page(
        request,
        "message.html",
        session,
        status=status,
        title=heading,
        heading=heading,
        text=text,
        detail=detail,
    )


def redirect(
    request: web.Request, location: str, session: Session | None = None, status: int = 303
) -> web.Response:
    response = web.Response(
        status=status, headers={"Location": location, "Cache-Control": "no-store"}
    )
    if session is not None:
        set_cookie(response, session, _state(request).config.secure_cookies)
    return response


def _claim_rows(claims: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for name in sorted(claims):
        value = claims[name]
        if name in TIME_CLAIMS and isinstance(value, int | float):
            when = datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
            text = f"{value} ({when})"
        elif isinstance(value, str):
            text = value
        else:
            text = json.dumps(value, ensure_ascii=False)
        rows.append((name, text))
    return rows


async def _post_session(request: web.Request) -> Session | web.Response:
    """The session of a POST whose CSRF token is right, else the page that refuses it."""
    session = _state(request).sessions.current(request)
    try:
        form = await request.post()
    except ValueError:
        form = None
    token = form.get("csrf_token") if form is not None else None
    if session is None or not session.csrf_valid(token if isinstance(token, str) else None):
        return message(
            request,
            403,
            "This form has expired",
            "Go back to the start page and try again.",
        )
    return session


# ---------------------------------------------------------------------------- pages


async def index(request: web.Request) -> web.Response:
    state = _state(request)
    session = state.sessions.current(request)
    user = session.user if session else None
    notice = None
    if session is not None:
        notice, session.notice = session.notice, None
    expiry = ""
    if user is not None and user.access_expires_at is not None:
        left = int(user.access_expires_at - time.time())
        expiry = f"expires in {left} s" if left > 0 else "expired"
    return page(
        request,
        "index.html",
        session,
        title="Orders" if user else "Welcome",
        user=user,
        display_name=(user.claims.get("name") or user.claims["sub"]) if user else "",
        claims=_claim_rows(user.claims) if user else [],
        expiry=expiry,
        api_result=session.api_result if session else None,
        notice=notice,
        csrf_token=session.csrf_token if session else "",
        issuer=state.config.issuer,
        api=state.config.api,
    )


async def login(request: web.Request) -> web.Response:
    state = _state(request)
    provider = _provider(request)
    session = state.sessions.ensure(request)
    try:
        metadata = await provider.metadata()
    except ProviderError as exc:
        return message(request, 502, "The sign-in service is unavailable", exc.message, session)
    pending = session.start_login()
    location = provider.authorization_url(
        metadata,
        redirect_uri=state.config.redirect_uri,
        scope=state.config.scope,
        state=pending.state,
        nonce=pending.nonce,
        verifier=pending.verifier,
    )
    return redirect(request, location, session, status=302)


async def callback(request: web.Request) -> web.Response:
    state = _state(request)
    provider = _provider(request)
    query = request.query
    session = state.sessions.current(request)
    refused = "The sign-in was refused"
    repeated = sorted({k for k in query if len(query.getall(k)) > 1})
    if repeated:
        return message(
            request, 400, refused, f"The answer gives {', '.join(repeated)} more than once."
        )
    # 1. state: this answer belongs to a sign-in this browser started here (RFC 6749 §10.12).
    pending = session.take_pending(query.get("state")) if session else None
    if session is None or pending is None:
        log.warning("callback with an unknown state")
        return message(
            request,
            400,
            refused,
            "This answer does not belong to a sign-in started in this browser (state does not "
            "match). Start again from the start page.",
            session,
        )
    # 2. iss: the answer comes from the server we asked, not another one the user also uses
    # (mix-up attacks, RFC 9207 §2.4).
    try:
        metadata = await provider.metadata()
    except ProviderError as exc:
        return message(request, 502, "The sign-in service is unavailable", exc.message, session)
    iss = query.get("iss")
    if iss is None and metadata.iss_parameter_supported:
        return message(
            request, 400, refused, "The answer does not say which server sent it (iss).", session
        )
    if iss is not None and iss != state.config.issuer:
        log.warning("callback from another issuer", extra={"iss": iss})
        return message(
            request, 400, refused, "The answer comes from another server (iss).", session
        )
    # 3. An error answer (RFC 6749 §4.1.2.1), e.g. the user chose Deny.
    if "error" in query:
        detail = query["error"]
        if query.get("error_description"):
            detail += ": " + query["error_description"]
        return message(
            request,
            400,
            refused,
            "The authorization server did not sign you in.",
            session,
            detail=detail,
        )
    code = query.get("code")
    if not code:
        return message(request, 400, refused, "The answer has no authorization code.", session)
    # 4. The code for tokens, then the ID token's checks; only then is anyone signed in.
    try:
        tokens = await provider.exchange_code(
            code,
            redirect_uri=state.config.redirect_uri,
            verifier=pending.verifier,
            scope_asked=state.config.scope,
        )
        assert tokens.id_token is not None
        claims = await provider.validate_id_token(
            tokens.id_token, nonce=pending.nonce, access_token=tokens.access_token
        )
    except ProviderError as exc:
        log.warning("sign-in failed", extra={"reason": exc.message})
        return message(request, 502, refused, exc.message, session)
    session.user = SignedIn(
        claims=claims,
        id_token=tokens.id_token,
        access_token=tokens.access_token,
        access_expires_at=tokens.expires_at,
        scope=tokens.scope,
        refresh_token=tokens.refresh_token,
    )
    session.api_result = None
    session.pending.clear()
    session = state.sessions.renew(session)  # no session fixation
    session.notice = f"Signed in as {claims.get('name') or claims['sub']}."
    return redirect(request, "/", session)


async def call_api(request: web.Request) -> web.Response:
    state = _state(request)
    session = await _post_session(request)
    if isinstance(session, web.Response):
        return session
    if session.user is None:
        session.notice = "Sign in first."
        return redirect(request, "/", session)
    assert state.http is not None
    url = state.config.api + API_PATH
    try:
        async with state.http.get(
            url,
            headers={"Authorization": f"Bearer {session.user.access_token}"},
            timeout=aiohttp.ClientTimeout(total=10),
        ) as response:
            status = response.status
            raw = await response.content.read(MAX_API_BODY)
            content_type = response.content_type
    except (aiohttp.ClientError, TimeoutError) as exc:
        session.api_result = ApiResult(url, 0, f"no answer ({exc.__class__.__name__})")
        return redirect(request, "/", session)
    text = raw.decode("utf-8", "replace")
    if content_type == "application/json":
        with contextlib.suppress(ValueError):
            text = json.dumps(json.loads(raw), indent=2, ensure_ascii=False)
    session.api_result = ApiResult(url, status, text)
    if status == 401:
        session.notice = "The API refused the access token: refresh it or sign in again."
    return redirect(request, "/", session)


async def refresh(request: web.Request) -> web.Response:
    provider = _provider(request)
    session = await _post_session(request)
    if isinstance(session, web.Response):
        return session
    user = session.user
    if user is None or user.refresh_token is None:
        session.notice = "There is no refresh token: sign in again."
        return redirect(request, "/", session)
    try:
        tokens = await provider.refresh(user.refresh_token, user.scope)
        claims, id_token = user.claims, user.id_token
        if tokens.id_token is not None:
            claims = await provider.validate_id_token(
                tokens.id_token, nonce=None, access_token=tokens.access_token, previous=user.claims
            )
            id_token = tokens.id_token
    except TokenEndpointError as exc:
        if exc.error != "invalid_grant":
            return message(request, 502, "The tokens could not be refreshed", exc.message, session)
        # The grant ended at the server (revoked, expired, or a reused token was detected).
        session.user = None
        session.notice = "Your sign-in has ended at the authorization server: sign in again."
        return redirect(request, "/", session)
    except IdTokenError as exc:
        session.user = None
        return message(request, 502, "The tokens could not be refreshed", exc.message, session)
    except ProviderError as exc:
        return message(request, 502, "The tokens could not be refreshed", exc.message, session)
    session.user = SignedIn(
        claims=claims,
        id_token=id_token,
        access_token=tokens.access_token,
        access_expires_at=tokens.expires_at,
        scope=tokens.scope,
        refresh_token=tokens.refresh_token,
    )
    rotated = " and a new refresh token" if tokens.refresh_token != user.refresh_token else ""
    session.notice = f"Tokens refreshed: a new access token{rotated}."
    return redirect(request, "/", session)


async def logout(request: web.Request) -> web.Response:
    state = _state(request)
    provider = _provider(request)
    session = await _post_session(request)
    if isinstance(session, web.Response):
        return session
    user, session.user, session.api_result = session.user, None, None
    session = state.sessions.renew(session)
    if user is None:
        return redirect(request, "/signed-out", session)
    if user.refresh_token is not None:
        # RFC 7009: the refresh token would outlive the sign-in otherwise.
        await provider.revoke(user.refresh_token, "refresh_token")
    try:
        metadata = await provider.metadata()
    except ProviderError:
        return redirect(request, "/signed-out", session)
    session.logout_state = secrets.token_urlsafe(32)
    location = provider.end_session_url(
        metadata,
        id_token=user.id_token,
        post_logout_redirect_uri=state.config.post_logout_redirect_uri,
        state=session.logout_state,
    )
    return redirect(request, location or "/signed-out", session)


async def signed_out(request: web.Request) -> web.Response:
    session = _state(request).sessions.current(request)
    expected = session.logout_state if session else None
    given = request.query.get("state")
    at_provider = bool(expected and given and secrets.compare_digest(expected, given))
    if session is not None:
        session.logout_state = None
    return message(
        request,
        200,
        "Signed out",
        "You are signed out of this application"
        + (" and of the authorization server." if at_provider else "."),
        session,
    )


async def stylesheet(_: web.Request) -> web.FileResponse:
    return web.FileResponse(HERE / "static" / "style.css")
