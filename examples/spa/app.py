"""The single-page app's server: the page and its settings. It holds no token, no session
and no secret, and takes part in no OAuth exchange.

Routes:
  GET  /, /callback   the page (index.html); /callback is where the provider sends the
                      browser back, and the script on the page finishes the sign-in there
  GET  /app.js, /style.css
  GET  /config.json   issuer, client id, scope, API and the provider's endpoints (from its
                      discovery document), for the script

The script calls the provider's token and revocation endpoints itself, with fetch(), across
origins: the authorization server lets this page read the answers (CORS) because this page's
origin is that of the client's registered redirect URI. Authorization requests and sign-out
are navigations of the whole page, which need no CORS.
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
MAX_REQUEST_BYTES = 16 * 1024
MAX_DOCUMENT_BYTES = 256 * 1024
STATIC = {"/app.js": "application/javascript", "/style.css": "text/css"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Config:
    issuer: str  # exactly as the provider's tokens name it
    client_id: str  # a public client (token_endpoint_auth_method: none)
    api: str  # the gateway in front of the orders API
    base_url: str  # where browsers reach this app: the origin both servers' CORS allow
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
        self.metadata: Metadata | None = None
        self._lock = asyncio.Lock()

    async def discover(self) -> Metadata:
        async with self._lock:
            if self.metadata is None:
                # Metadata.parse checks that the document names this very issuer (OpenID
                # Connect Discovery §4.3).
                self.metadata = Metadata.parse(await self._fetch(), self.issuer)
            return self.metadata

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
    app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[access_log])
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
    return app


# ---------------------------------------------------------------------------- the page


def content_security_policy(config: Config) -> str:
    """Scripts and styles from this origin only, nothing inline; fetch() may reach this
    origin, the API's and the authorization server's, nothing else."""
    return (
        "default-src 'none'; script-src 'self'; style-src 'self'; "
        f"connect-src 'self' {origin(config.api)} {origin(config.issuer)}; "
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
        metadata = await request.app[PROVIDER].discover()
    except ProviderError as exc:
        log.warning("provider unavailable: %s", exc)
        return problem(502, "provider_unavailable", str(exc))
    # The page's Content-Security-Policy lets fetch() reach the issuer's origin only.
    called = (metadata.token_endpoint, metadata.revocation_endpoint)
    if any(url is not None and origin(url) != origin(config.issuer) for url in called):
        description = "the provider's token or revocation endpoint is not on the issuer's origin"
        log.warning("provider unusable: %s", description)
        return problem(502, "provider_unavailable", description)
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
        "tokenEndpoint": metadata.token_endpoint,
        "revocationEndpoint": metadata.revocation_endpoint,
    }
    return web.json_response(body, headers={"Cache-Control": "no-store"})
