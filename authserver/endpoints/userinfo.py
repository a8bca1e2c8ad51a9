"""UserInfo (OIDC Core §5.3): the claims the token's scopes release, for a token with `openid`.

The token comes from the Authorization header, or the form body of a POST (RFC 6750 §2.2),
never both and never the query string. Errors are RFC 6750 §3 challenges.
"""

from __future__ import annotations

from aiohttp import web

from ..protocol.claims import released
from ..protocol.errors import OAuthError
from ..registry import UserDirectory
from .errors import json_no_store
from .forms import read_form
from .resource_tokens import AccessTokens


def _challenge(
    status: int, error: str | None = None, description: str | None = None
) -> web.Response:
    value = 'Bearer realm="portcullis"'
    body = {}
    if error:
        value += f', error="{error}"'
        body["error"] = error
    if description:
        value += f', error_description="{description}"'
        body["error_description"] = description
    return json_no_store(body, status=status, headers={"WWW-Authenticate": value})


class UserInfoEndpoint:
    def __init__(self, access_tokens: AccessTokens, users: UserDirectory) -> None:
        self.access_tokens = access_tokens
        self.users = users

    async def handle(self, request: web.Request) -> web.Response:
        header = request.headers.getall("Authorization", [])
        token = None
        if len(header) > 1:
            return _challenge(400, "invalid_request", "more than one Authorization header")
        if header:
            scheme, _, value = header[0].partition(" ")
            if scheme.lower() == "bearer" and value.strip():
                token = value.strip()
        if request.method == "POST" and request.content_type == "application/x-www-form-urlencoded":
            try:
                form = await read_form(request)
            except OAuthError as exc:
                return _challenge(400, "invalid_request", exc.description)
            if "access_token" in form:
                if token is not None:
                    return _challenge(400, "invalid_request", "the token was sent twice")
                token = form["access_token"]
        if token is None:
            return _challenge(401)
        claims = await self.access_tokens.active(token)
        if claims is None:
            return _challenge(401, "invalid_token", "the access token is invalid or expired")
        scopes = str(claims.get("scope", "")).split()
        if "openid" not in scopes:
            return _challenge(403, "insufficient_scope", "the token lacks the openid scope")
        user = await self.users.by_subject(str(claims["sub"]))
        if user is None:
            return _challenge(401, "invalid_token", "the token's user no longer exists")
        return json_no_store({"sub": user.subject, **released(user.claims, scopes)})
