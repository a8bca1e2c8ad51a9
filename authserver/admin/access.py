"""Who may call the admin API (a resource server of its own, identified `{issuer}/admin/v1`).

In order, each refusal with its RFC 6750 §3 challenge:
1. A bearer token in the Authorization header, else 401 without an error code (§3.1: the
   request carried no authentication).
2. An access token of this server, unexpired and not revoked, of a client that still
   exists (endpoints/resource_tokens.py), else 401 `invalid_token`.
3. Its `aud` names this API (RFC 8707: the client asked for it as `resource`), else 401
   `invalid_token`: a token for another resource server is no credential here.
4. Its scope has `admin:write`, or `admin:read` for a safe method, else 403
   `insufficient_scope` (write implies read).
5. A user's token (its subject is not its client) is only as good as its user: one
   without the `admin` role gets 403 `forbidden`.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from ..endpoints.resource_tokens import AccessTokens
from ..registry import UserDirectory
from .http import ApiError

READ = "admin:read"
WRITE = "admin:write"
ADMIN_ROLE = "admin"
SAFE_METHODS = frozenset({"GET", "HEAD"})


@dataclass(frozen=True)
class Caller:
    """Who is calling: the token's client, and its user when it has one."""

    client_id: str
    subject: str | None


def _challenge(error: str | None = None, scope: str | None = None) -> dict[str, str]:
    value = 'Bearer realm="portcullis-admin"'
    if error:
        value += f', error="{error}"'
    if scope:
        value += f', scope="{scope}"'
    return {"WWW-Authenticate": value}


class AdminAccess:
    def __init__(self, access_tokens: AccessTokens, users: UserDirectory, audience: str) -> None:
        self.access_tokens = access_tokens
        self.users = users
        self.audience = audience

    async def caller(self, request: web.Request) -> Caller:
        headers = request.headers.getall("Authorization", [])
        scheme, _, token = (headers[0] if len(headers) == 1 else "").partition(" ")
        if len(headers) > 1:
            raise ApiError(400, "invalid_request", "more than one Authorization header")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(
                401, "unauthorized", "send an access token for this API", headers=_challenge()
            )
        claims = await self.access_tokens.active(token.strip())
        refused = ApiError(
            401,
            "invalid_token",
            "the access token is invalid, expired or revoked",
            headers=_challenge("invalid_token"),
        )
        if claims is None:
            raise refused
        audience = claims.get("aud")
        audiences = audience if isinstance(audience, list) else [audience]
        if self.audience not in audiences:
            raise ApiError(
                401,
                "invalid_token",
                f"the access token is not for this API: ask for resource={self.audience}",
                headers=_challenge("invalid_token"),
            )
        scopes = set(str(claims.get("scope", "")).split())
        needed = READ if request.method in SAFE_METHODS else WRITE
        if WRITE not in scopes and needed not in scopes:
            raise ApiError(
                403,
                "insufficient_scope",
                f"the access token lacks the {needed} scope",
                headers=_challenge("insufficient_scope", needed),
            )
        client_id, subject = str(claims["client_id"]), str(claims["sub"])
        if subject == client_id:
            return Caller(client_id, None)
        user = await self.users.by_subject(subject)
        if user is None:
            raise refused
        if ADMIN_ROLE not in user.roles:
            raise ApiError(403, "forbidden", f"the user lacks the {ADMIN_ROLE} role")
        return Caller(client_id, subject)
