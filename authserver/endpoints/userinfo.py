"""UserInfo (OIDC Core §5.3): the claims the token's scopes release, for a token with `openid`.

The token comes from the Authorization header, or the form body of a POST (RFC 6750 §2.2),
never both and never the query string. It is checked as every resource of this server
checks one (resource_tokens.ResourceTokens): active, and a token bound to a DPoP key only
as `Authorization: DPoP <token>` with a proof of that key for this request (RFC 9449 §7).
Errors are RFC 6750 §3 or RFC 9449 §7.1 challenges, in an RFC 6750 error body.
"""

from __future__ import annotations

from aiohttp import web

from ..protocol.claims import released
from ..protocol.errors import OAuthError
from ..registry import UserDirectory
from ..resource_tokens import (
    BEARER,
    INVALID_REQUEST,
    INVALID_TOKEN,
    Credential,
    ResourceTokens,
    TokenRefused,
    credential_in_header,
)
from .errors import json_no_store
from .forms import read_form

REALM = "portcullis"


class UserInfoEndpoint:
    def __init__(self, tokens: ResourceTokens, users: UserDirectory, url: str) -> None:
        self.tokens = tokens
        self.users = users
        self.url = url

    async def handle(self, request: web.Request) -> web.Response:
        try:
            return await self._answer(request)
        except TokenRefused as refused:
            body: dict[str, str] = {}
            if refused.error:
                body["error"] = refused.error
            if refused.description:
                body["error_description"] = refused.description
            response = json_no_store(body, status=refused.status)
            response.headers.extend(self.tokens.challenges(refused, REALM))
            return response

    async def _answer(self, request: web.Request) -> web.Response:
        credential = await self._credential(request)
        found = await self.tokens.check(request, credential, self.url, "userinfo")
        scheme, claims = credential.scheme, found.claims
        scopes = str(claims.get("scope", "")).split()
        if "openid" not in scopes:
            raise TokenRefused(
                403, "insufficient_scope", "the token lacks the openid scope", scheme
            )
        user = await self.users.by_subject(str(claims["sub"]))
        if user is None:
            raise TokenRefused(401, INVALID_TOKEN, "the token's user no longer exists", scheme)
        return json_no_store({"sub": user.subject, **released(user.claims, scopes)})

    async def _credential(self, request: web.Request) -> Credential:
        """The token of the header, else of a POST form body (a bearer token, RFC 6750
        §2.2); never both."""
        credential = credential_in_header(request)
        scheme = credential.scheme if credential is not None else None
        if request.method == "POST" and request.content_type == "application/x-www-form-urlencoded":
            try:
                form = await read_form(request)
            except OAuthError as exc:
                raise TokenRefused(400, INVALID_REQUEST, exc.description, scheme) from None
            if "access_token" in form:
                if credential is not None:
                    raise TokenRefused(400, INVALID_REQUEST, "the token was sent twice", scheme)
                return Credential(form["access_token"], BEARER)
        if credential is None:
            raise TokenRefused(401)
        return credential
