"""RP-Initiated Logout 1.0: `id_token_hint`, `post_logout_redirect_uri` (registered, exact),
`state`, `client_id`.

A valid ID token hint for the signed-in user ends the session at once; without one the user
confirms on a page (a POST with a CSRF token), so a link on another site cannot sign anyone
out. Afterwards the browser goes back to the registered URI with `state`, or sees a page.
"""

from __future__ import annotations

from typing import Any

import jwt
from aiohttp import web

from ..protocol.errors import OAuthError
from ..sessions import Sessions
from .common import (
    error_page,
    page,
    query_items,
    read_form,
    services,
    single_valued,
    with_query,
)

CARRIED = ("id_token_hint", "post_logout_redirect_uri", "state", "client_id")


def _hint_claims(request: web.Request, hint: str | None) -> dict[str, Any] | None:
    if not hint:
        return None
    svc = services(request)
    try:
        header = jwt.get_unverified_header(hint)
    except jwt.InvalidTokenError:
        return None
    # Only an ID token is a hint, not an access token the same key ring signed (RFC 9068 §2.1
    # gives those typ at+jwt; the algorithms may be the same).
    algorithms = svc.settings.id_token_algs
    if header.get("alg") not in algorithms or header.get("typ") == "at+jwt":
        return None
    if not isinstance(header.get("kid"), str):
        return None
    try:
        return svc.keyring.verify(
            hint,
            algorithms,
            issuer=svc.settings.issuer,
            options={"verify_aud": False, "verify_exp": False, "require": ["sub", "aud"]},
        )
    except (jwt.InvalidTokenError, ValueError):
        return None


async def logout(request: web.Request) -> web.StreamResponse:
    svc = services(request)
    try:
        params = (
            await read_form(request)
            if request.method == "POST"
            else single_valued(query_items(request), "query")
        )
    except OAuthError as exc:
        return error_page(request, 400, "Sign-out request malformed", exc.description)

    hint = _hint_claims(request, params.get("id_token_hint"))
    if params.get("id_token_hint") and hint is None:
        return error_page(
            request, 400, "Sign-out request refused", "The ID token hint is not valid."
        )
    client_id = params.get("client_id")
    if hint is not None:
        aud = hint["aud"]
        hinted = aud if isinstance(aud, str) else (aud[0] if aud else None)
        if client_id is not None and client_id != hinted:
            return error_page(
                request,
                400,
                "Sign-out request refused",
                "client_id does not match the ID token hint.",
            )
        client_id = hinted
    target = params.get("post_logout_redirect_uri")
    if target is not None:
        client = svc.settings.client(client_id) if client_id else None
        if client is None or target not in client.post_logout_redirect_uris:
            return error_page(
                request,
                400,
                "Sign-out request refused",
                "The address to return to is not registered.",
            )

    session = await svc.sessions.current(request)
    if session is not None and session.logged_in:
        proven = hint is not None and hint.get("sub") == session.record.subject
        confirmed = (
            request.method == "POST"
            and params.get("confirm") == "yes"
            and Sessions.csrf_valid(session, params.get("csrf_token"))
        )
        if not (proven or confirmed):
            user = svc.settings.user_by_subject(session.record.subject)
            return page(
                request,
                "logout.html",
                title="Sign out",
                action=svc.base_path + "/logout",
                csrf_token=Sessions.csrf_token(session),
                carried=[(k, params[k]) for k in CARRIED if k in params],
                user_name=(user.claims.get("name") or user.username) if user else "",
                form_targets=[target] if target else [],
            )
        await svc.sessions.logout(request)

    response: web.StreamResponse
    if target is not None:
        status = 303 if request.method == "POST" else 302
        response = web.Response(
            status=status, headers={"Location": with_query(target, {"state": params.get("state")})}
        )
    else:
        response = page(request, "signed_out.html", title="Signed out")
    svc.sessions.clear_cookie(response)
    return response
