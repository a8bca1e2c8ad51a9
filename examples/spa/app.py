"""The single-page app's server: the page, its settings, and a pass-through to the token and
revocation endpoints. It holds no token, no session and no secret.

Routes:
  GET  /, /callback   the page (index.html); /callback is where the provider sends the
                      browser back, and the script on the page finishes the sign-in there
  GET  /app.js, /style.css
  GET  /config.json   issuer, client id, scope, API and the provider's endpoints (from its
                      discovery document), for the script
  POST /oauth/token   passed unchanged to the provider's token endpoint
  POST /oauth/revoke  passed unchanged to its revocation endpoint

Why the pass-through: the script calls the token endpoint with fetch(), and a browser lets a
page read another origin's answer only when that origin allows it (CORS), which this
authorization server does not do yet. Through this server the call is same-origin; it
forwards the form as the browser sent it (a public client: no credentials are added) and
the answer as it came, and keeps nothing. Authorization requests and sign-out are
navigations of the whole page, which need no CORS, and go to the provider directly.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from examples.web_client.oidc import Metadata, ProviderError

log = logging.getLogger("spa")

HERE = Path(__file__).resolve().parent
DEFAULT_SCOPE = "openid profile offline_access orders:read"
TIMEOUT = aiohttp.ClientTimeout(total=10)
MAX_FORM_BYTES = 16 * 1024
MAX_DOCUMENT_BYTES = 256 * 1024
STATIC = {"/app.js": "application/javascript", "/style.css": "text/css"}
RELAYED = {"/oauth/token": "token_endpoint", "/oauth/revoke": "revocation_endpoint"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Config:
    issuer: str  # exactly as the provider's tokens name it
    client_id: str  # a public client (token_endpoint_auth_method: none)
    api: str  # the gateway in front of the orders API
    base_url: str  # where browsers reach this app; its origin is the one CORS must allow
    scope: str = DEFAULT_SCOPE

    @property
    def redirect_uri(self) -> str:
        return self.base_url + "/callback"

    @property
    def post_logout_redirect_uri(self) -> str:
        return self.base_url + "/"


def origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


class Provider:
    """The provider's discovery document, fetched on first use and kept (not a failure)."""

    def __init__(self, issuer: str, http: aiohttp.ClientSession) -> None:
        self.issuer = issuer
        self.http = http
        self.document: dict[str, Any] | None = None
        self.metadata: Metadata | None = None
        self._lock = asyncio.Lock()

    async def discover(self) -> tuple[Metadata, dict[str, Any]]:
        async with self._lock:
            if self.metadata is None or self.document is None:
                document = await self._fetch()
                # Metadata.parse checks that the document names this very issuer (OpenID
                # Connect Discovery §4.3).
                self.metadata = Metadata.parse(document, self.issuer)
                self.document = document
            return self.metadata, self.document

    async def _fetch(self) -> dict[str, Any]:
        url = self.issuer + "/.well-known/openid-configuration"
        try:
            async with self.http.get(url, timeout=TIMEOUT) as response:
                if response.status != 200:
                    raise ProviderError(f"the discovery document answered {response.status}")
                body = await response.content.read(MAX_DOCUMENT_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ProviderError(f"the discovery document could not be fetched ({exc})") from None
        try:
            document = json.loads(body[:MAX_DOCUMENT_BYTES])
        except ValueError:
            raise ProviderError("the discovery document is not JSON") from None
        if not isinstance(document, dict):
            raise ProviderError("the discovery document is not a JSON object")
        return document


PROVIDER = web.AppKey("spa_provider", Provider)
CONFIG = web.AppKey("spa_config", Config)


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
    app = web.Application(client_max_size=MAX_FORM_BYTES, middlewares=[access_log])
    app[CONFIG] = config

    async def lifecycle(app: web.Application) -> Any:
        async with aiohttp.ClientSession() as http:
            app[PROVIDER] = Provider(config.issuer, http)
            yield

    app.cleanup_ctx.append(lifecycle)
    app.router.add_get("/", page)
    app.router.add_get("/callback", page)
    for path in STATIC:
        app.router.add_get(path, static)
    app.router.add_get("/config.json", settings)
    for path in RELAYED:
        app.router.add_post(path, relay)
    return app


# ---------------------------------------------------------------------------- the page


def content_security_policy(config: Config) -> str:
    """Scripts and styles from this origin only, nothing inline; fetch() may reach this
    origin and the API's, nothing else."""
    return (
        "default-src 'none'; script-src 'self'; style-src 'self'; "
        f"connect-src 'self' {origin(config.api)}; "
        "form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
    )


def page_headers(config: Config) -> dict[str, str]:
    return {
        "Content-Security-Policy": content_security_policy(config),
        "X-Content-Type-Options": "nosniff",
        # /callback's address carries the code until the script removes it: never send it on.
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-store",
    }


async def page(request: web.Request) -> web.Response:
    return web.Response(
        body=(HERE / "static" / "index.html").read_bytes(),
        content_type="text/html",
        charset="utf-8",
        headers=page_headers(request.app[CONFIG]),
    )


async def static(request: web.Request) -> web.Response:
    return web.Response(
        body=(HERE / "static" / request.path.lstrip("/")).read_bytes(),
        content_type=STATIC[request.path],
        charset="utf-8",
        headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"},
    )


def problem(status: int, error: str, description: str) -> web.Response:
    return web.json_response(
        {"error": error, "error_description": description},
        status=status,
        headers={"Cache-Control": "no-store"},
    )


async def settings(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    try:
        metadata, document = await request.app[PROVIDER].discover()
    except ProviderError as exc:
        log.warning("provider unavailable: %s", exc)
        return problem(502, "provider_unavailable", str(exc))
    body = {
        "issuer": config.issuer,
        "clientId": config.client_id,
        "scope": config.scope,
        "api": config.api,
        "redirectUri": config.redirect_uri,
        "postLogoutRedirectUri": config.post_logout_redirect_uri,
        "authorizationEndpoint": metadata.authorization_endpoint,
        "endSessionEndpoint": metadata.end_session_endpoint,
        "issParameterSupported": metadata.iss_parameter_supported,
        "tokenEndpoint": "/oauth/token",
        "revocationEndpoint": "/oauth/revoke" if "revocation_endpoint" in document else None,
    }
    return web.json_response(body, headers={"Cache-Control": "no-store"})


# ---------------------------------------------------------------------------- pass-through


async def relay(request: web.Request) -> web.Response:
    """POST the browser's form to the provider's endpoint; answer with what it answered."""
    config = request.app[CONFIG]
    # Only this app's own pages: a browser sends Origin with every POST from a script.
    if request.headers.get("Origin") != origin(config.base_url):
        return problem(403, "invalid_request", "only this application's pages may call this")
    if request.content_type != "application/x-www-form-urlencoded":
        return problem(415, "invalid_request", "send application/x-www-form-urlencoded")
    try:
        _, document = await request.app[PROVIDER].discover()
    except ProviderError as exc:
        log.warning("provider unavailable: %s", exc)
        return problem(502, "provider_unavailable", str(exc))
    target = document.get(RELAYED[request.path])
    if not isinstance(target, str):
        return problem(404, "not_found", "the provider has no such endpoint")
    form = await request.read()
    try:
        async with request.app[PROVIDER].http.post(
            target,
            data=form,
            headers={
                "Content-Type": "application/x-www-form-urlencoded",
                "Accept": "application/json",
            },
            timeout=TIMEOUT,
            allow_redirects=False,
        ) as answer:
            body = await answer.content.read(MAX_DOCUMENT_BYTES + 1)
            status, content_type = answer.status, answer.content_type
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("provider unreachable: %s", exc.__class__.__name__)
        return problem(502, "provider_unavailable", "the authorization server did not answer")
    if len(body) > MAX_DOCUMENT_BYTES:
        return problem(502, "provider_unavailable", "the answer is too large")
    # RFC 6749 §5.1: token answers are never cached.
    return web.Response(
        status=status,
        body=body,
        content_type=content_type or "application/json",
        headers={"Cache-Control": "no-store", "Pragma": "no-cache"},
    )
