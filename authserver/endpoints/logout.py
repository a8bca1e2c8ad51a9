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

from ..keys import SigningRing
from ..protocol.errors import OAuthError
from ..registry import ClientRegistry, UserDirectory
from ..sessions import Sessions
from .forms import query_items, read_form, single_valued, with_query
from .pages import Pages

CARRIED = ("id_token_hint", "post_logout_redirect_uri", "state", "client_id")


class LogoutEndpoint:
    def __init__(
        self,
        *,
        clients: ClientRegistry,
        users: UserDirectory,
        sessions: Sessions,
        pages: Pages,
        keyring: SigningRing,
        issuer: str,
        id_token_algs: list[str],
        base_path: str,
    ) -> None:
        self.clients = clients
        self.users = users
        self.sessions = sessions
        self.pages = pages
        self.keyring = keyring
        self.issuer = issuer
        self.id_token_algs = id_token_algs
        self.base_path = base_path

    def _hint_claims(self, hint: str | None) -> dict[str, Any] | None:
        if not hint:
            return None
        try:
            header = jwt.get_unverified_header(hint)
        except jwt.InvalidTokenError:
            return None
        # Only an ID token is a hint, not an access token the same key ring signed (RFC 9068
        # §2.1 gives those typ at+jwt; the algorithms may be the same).
        algorithms = self.id_token_algs
        if header.get("alg") not in algorithms or header.get("typ") == "at+jwt":
            return None
        if not isinstance(header.get("kid"), str):
            return None
        try:
            return self.keyring.verify(
                hint,
                algorithms,
                issuer=self.issuer,
                options={"verify_aud": False, "verify_exp": False, "require": ["sub", "aud"]},
            )
        except (jwt.InvalidTokenError, ValueError):
            return None

    def _refused(self, message: str) -> web.Response:
        return self.pages.error(400, "Sign-out request refused", message)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            params = (
                await read_form(request)
                if request.method == "POST"
                else single_valued(query_items(request), "query")
            )
        except OAuthError as exc:
            return self.pages.error(400, "Sign-out request malformed", exc.description)

        hint = self._hint_claims(params.get("id_token_hint"))
        if params.get("id_token_hint") and hint is None:
            return self._refused("The ID token hint is not valid.")
        client_id = params.get("client_id")
        if hint is not None:
            aud = hint["aud"]
            hinted = aud if isinstance(aud, str) else (aud[0] if aud else None)
            if client_id is not None and client_id != hinted:
                return self._refused("client_id does not match the ID token hint.")
            client_id = hinted
        target = params.get("post_logout_redirect_uri")
        if target is not None:
            client = await self.clients.client(client_id) if client_id else None
            if client is None or target not in client.post_logout_redirect_uris:
                return self._refused("The address to return to is not registered.")

        session = await self.sessions.current(request)
        if session is not None and session.logged_in:
            proven = hint is not None and hint.get("sub") == session.record.subject
            confirmed = (
                request.method == "POST"
                and params.get("confirm") == "yes"
                and Sessions.csrf_valid(session, params.get("csrf_token"))
            )
            if not (proven or confirmed):
                user = await self.users.by_subject(session.record.subject)
                return self.pages.render(
                    "logout.html",
                    title="Sign out",
                    action=self.base_path + "/logout",
                    csrf_token=Sessions.csrf_token(session),
                    carried=[(k, params[k]) for k in CARRIED if k in params],
                    user_name=user.display_name if user else "",
                    form_targets=[target] if target else [],
                )
            await self.sessions.logout(request)

        response: web.StreamResponse
        if target is not None:
            status = 303 if request.method == "POST" else 302
            response = web.Response(
                status=status,
                headers={"Location": with_query(target, {"state": params.get("state")})},
            )
        else:
            response = self.pages.render("signed_out.html", title="Signed out")
        self.sessions.clear_cookie(response)
        return response
