"""Who may call the admin API (a resource server of its own, identified `{issuer}/admin/v1`).

In order, each refusal with its RFC 6750 §3 or RFC 9449 §7.1 challenge:
1. An access token of this server, active, in the Authorization header under the Bearer or
   the DPoP scheme, proven as it requires: a token bound to a DPoP key only with a proof
   of that key for this very request (method and URL, `ath`). The check every resource of
   this server makes (resource_tokens.py): 401 without an error code when there
   is no token, else 401 `invalid_token` or `invalid_dpop_proof`.
2. Its `aud` names this API (RFC 8707: the client asked for it as `resource`), else 401
   `invalid_token`: a token for another resource server is no credential here.
3. Its client is still registered for this API: the client exists (step 1) and has this
   API among its resources now, else 401 `invalid_token`. A token is only as good as the
   registration it was issued under, as it is now.
4. Its scope, as far as its client is still registered for it, has `admin:write`, or
   `admin:read` for a safe method, else 403 `insufficient_scope` (write implies read).
5. A user's token (its subject is not its client) is only as good as its user: one
   without the `admin` role gets 403 `forbidden`.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from ..registry import UserDirectory
from ..resource_tokens import (
    INVALID_TOKEN,
    Credential,
    ResourceTokens,
    TokenRefused,
    credential_in_header,
)
from .http import ApiError

READ = "admin:read"
WRITE = "admin:write"
ADMIN_ROLE = "admin"
SAFE_METHODS = frozenset({"GET", "HEAD"})
REALM = "portcullis-admin"
# The endpoint's name in the DPoP proof metrics.
ENDPOINT = "admin"


@dataclass(frozen=True)
class Caller:
    """Who is calling: the token's client, and its user when it has one."""

    client_id: str
    subject: str | None


class AdminAccess:
    def __init__(self, tokens: ResourceTokens, users: UserDirectory, audience: str) -> None:
        self.tokens = tokens
        self.users = users
        self.audience = audience

    async def caller(self, request: web.Request, url: str) -> Caller:
        """The caller of `request`, sent to `url` (this API's URL and the request's path)."""
        try:
            return await self._caller(request, url)
        except TokenRefused as refused:
            raise ApiError(
                refused.status,
                refused.error or "unauthorized",
                refused.description or "send an access token for this API",
                headers=self.tokens.challenges(refused, REALM),
            ) from None

    async def _caller(self, request: web.Request, url: str) -> Caller:
        credential = credential_in_header(request)
        if credential is None:
            raise TokenRefused(401)
        found = await self.tokens.check(request, credential, url, ENDPOINT)  # 1
        claims, client = found.claims, found.client
        audience = claims.get("aud")
        audiences = audience if isinstance(audience, list) else [audience]
        if self.audience not in audiences:  # 2
            raise _invalid(
                credential,
                f"the access token is not for this API: ask for resource={self.audience}",
            )
        if self.audience not in client.resources:  # 3
            raise _invalid(credential, "the token's client may no longer use this API")
        # 4: RFC 6749 §3.3, the scope of a token is at most its client's registered scope.
        scopes = set(str(claims.get("scope", "")).split()) & set(client.scope)
        needed = READ if request.method in SAFE_METHODS else WRITE
        if WRITE not in scopes and needed not in scopes:
            raise TokenRefused(
                403,
                "insufficient_scope",
                f"the access token lacks the {needed} scope",
                credential.scheme,
                scope=needed,
            )
        client_id, subject = client.client_id, str(claims["sub"])
        if subject == client_id:
            return Caller(client_id, None)
        user = await self.users.by_subject(subject)  # 5
        if user is None:
            raise _invalid(credential, "the access token is invalid, expired or revoked")
        if ADMIN_ROLE not in user.roles:
            raise ApiError(403, "forbidden", f"the user lacks the {ADMIN_ROLE} role")
        return Caller(client_id, subject)


def _invalid(credential: Credential, description: str) -> TokenRefused:
    return TokenRefused(401, INVALID_TOKEN, description, credential.scheme)
