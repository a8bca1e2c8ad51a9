"""CORS on the endpoints a browser app calls: the middleware that applies protocol/cors.py.

Which endpoints (paths under the issuer's):
 - discovery at every well-known path, and /jwks: DOCUMENT, `*` for every origin;
 - /token, /revoke, /device_authorization: CLIENT, the browser client's own origins;
 - /userinfo: BEARER, any browser client's origin.
/introspect is for resource servers, which are confidential clients and no pages: no CORS.
The pages (/authorize, /login, /consent, /device, /logout) are navigations and form posts,
which need no CORS: none either. Every other path passes through untouched.

Preflights to these paths are answered here, before routing (the observing middleware
calls `answer` for them), so no OPTIONS routes exist.
Browser clients are the configured public clients of application_type web; their origins
are computed when a configuration is loaded (at start and on each reload).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from aiohttp import web
from aiohttp.typedefs import Handler

from portcullis.http import json_response

from .declarations import DeclaredClient
from .protocol.cors import (
    BEARER,
    CLIENT,
    DOCUMENT,
    CorsPolicy,
    CorsRefused,
    Endpoint,
    Kind,
    browser_client,
    origin,
)

log = logging.getLogger("portcullis.authserver.cors")

FORM = "application/x-www-form-urlencoded"
# The token endpoint refuses larger forms without reading them (endpoints/forms.py): the
# client of such a request is not looked for.
MAX_FORM_BYTES = 64 * 1024


def policy(clients: Iterable[DeclaredClient], allow_origins: Iterable[str]) -> CorsPolicy:
    """Each browser client's origins: those of its redirect URIs that have one; and the
    origins allowed beyond those (`cors.allow_origins`)."""
    browser_clients = {
        client.client_id: {o for o in map(origin, client.redirect_uris) if o}
        for client in clients
        if client.public and client.application_type == "web"
    }
    return CorsPolicy(browser_clients, allow_origins)


def endpoints(base: str) -> dict[str, Endpoint]:
    """The CORS endpoint of each path, for an issuer whose path is `base`."""
    table = {
        base + "/.well-known/openid-configuration": DOCUMENT,
        base + "/.well-known/oauth-authorization-server": DOCUMENT,
        base + "/jwks": DOCUMENT,
        base + "/token": CLIENT,
        base + "/revoke": CLIENT,
        base + "/device_authorization": CLIENT,
        base + "/userinfo": BEARER,
    }
    if base:  # RFC 8414 §3.1 and §5: the well-known segment first
        table["/.well-known/oauth-authorization-server" + base] = DOCUMENT
        table["/.well-known/openid-configuration" + base] = DOCUMENT
    return table


async def answer(
    cors: CorsPolicy, endpoint: Endpoint, request: web.Request, handler: Handler
) -> web.StreamResponse:
    """The answer to a request for `endpoint` (one of `endpoints(base)`) under the policy of
    the configuration in force, so a reload that adds a browser client allows its origins:
    a preflight is answered here, before routing; any other request is `handler`'s answer
    with the CORS fields its page may read it with. The one observing middleware
    (app.py) calls it for these paths alone."""
    origins = request.headers.getall("Origin", ())
    # A browser sends one Origin; anything else is no browser's and gets no CORS.
    page = origins[0] if len(origins) == 1 else None
    asked = request.headers.get("Access-Control-Request-Method")
    if request.method == "OPTIONS" and page is not None and asked is not None:
        return _preflight(cors, endpoint, page, asked, request)
    response = await handler(request)
    client_id = None
    if endpoint.kind is Kind.CLIENT and page is not None and cors.allows(endpoint, page):
        client_id = await _browser_client(request)
        if not cors.allows_client(client_id, page):
            log.info(
                "cross-origin answer withheld: not a browser client of this origin",
                extra={"origin": page[:200], "client_id": (client_id or "")[:200]},
            )
    for name, value in cors.actual(endpoint, page, client_id):
        if name == "Vary" and "Vary" in response.headers:
            response.headers["Vary"] += ", " + value
        else:
            response.headers[name] = value
    return response


def _preflight(
    cors: CorsPolicy, endpoint: Endpoint, page: str, asked: str, request: web.Request
) -> web.Response:
    try:
        headers = cors.preflight(
            endpoint, page, asked.strip(), request.headers.get("Access-Control-Request-Headers")
        )
    except CorsRefused as exc:
        # No CORS header: the browser stops the request; the body says why to whoever reads.
        return json_response(
            {"error": "cors_refused", "error_description": f"Not allowed: {exc}."},
            status=403,
            headers={"Cache-Control": "no-store", "Vary": "Origin"},
        )
    return web.Response(status=204, headers=headers)


async def _browser_client(request: web.Request) -> str | None:
    """The browser client the request names. The endpoint has read the form by now; aiohttp
    keeps the body, so this reads nothing more from the network."""
    length = request.content_length
    if request.content_type != FORM or length is None or length > MAX_FORM_BYTES:
        return None
    return browser_client(await request.read(), request.headers.getall("Authorization", []))
