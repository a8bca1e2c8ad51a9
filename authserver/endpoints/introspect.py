"""Token introspection (RFC 7662) for resource servers with configured credentials.

Anything inactive, unknown or malformed is exactly `{"active": false}` (§2.2): nothing tells
a caller why.
"""

from __future__ import annotations

from aiohttp import web

from ..clients import ClientAuthenticator
from ..clock import Clock
from ..protocol import lifecycle
from ..protocol.errors import ErrorCode, OAuthError, invalid_request
from ..protocol.lifecycle import Refresh
from ..resource_tokens import AccessTokens
from ..store.base import Store
from ..tokens import digest
from .errors import json_no_store, oauth_json_error
from .forms import read_form

INACTIVE = {"active": False}


class IntrospectionEndpoint:
    def __init__(
        self,
        clients: ClientAuthenticator,
        access_tokens: AccessTokens,
        store: Store,
        issuer: str,
        url: str,
        clock: Clock,
    ) -> None:
        self.clients = clients
        self.access_tokens = access_tokens
        self.store = store
        self.issuer = issuer
        self.url = url
        self.clock = clock

    async def handle(self, request: web.Request) -> web.Response:
        try:
            form = await read_form(request)
            authorization = request.headers.get("Authorization")
            client = await self.clients.authenticate(form, authorization, self.url)
            # Only a resource server's credentials; a public client proves nothing (§4).
            if not client.introspection or client.public:
                raise OAuthError(
                    ErrorCode.UNAUTHORIZED_CLIENT,
                    "this client may not introspect tokens",
                    status=403,
                )
            token = form.get("token")
            if token is None:
                raise invalid_request("token is required")
        except OAuthError as error:
            return oauth_json_error(error)

        hint = form.get("token_type_hint")
        lookups = [self._access, self._refresh]
        if hint == "refresh_token":
            lookups.reverse()
        for lookup in lookups:
            result = await lookup(token)
            if result is not None:
                return json_no_store(result)
        return json_no_store(INACTIVE)

    async def _access(self, token: str) -> dict[str, object] | None:
        if token.count(".") != 2:
            return None
        claims = await self.access_tokens.active(token)
        if claims is None:
            return None
        answer: dict[str, object] = {
            "active": True,
            "scope": claims.get("scope", ""),
            "client_id": claims["client_id"],
            "sub": claims["sub"],
            "exp": claims["exp"],
            "iat": claims["iat"],
            "iss": claims["iss"],
            "aud": claims.get("aud"),
            "jti": claims["jti"],
            "token_type": "Bearer",
        }
        cnf = claims.get("cnf")
        if isinstance(cnf, dict) and "jkt" in cnf:
            # RFC 9449 §6.2: the key the token is bound to, for the resource server to check
            # the proof against.
            answer["cnf"] = {"jkt": cnf["jkt"]}
            answer["token_type"] = "DPoP"  # noqa: S105 - a token type
        return answer

    async def _refresh(self, token: str) -> dict[str, object] | None:
        record = await self.store.get_refresh(digest(token))
        now = self.clock()
        if (
            record is None
            or record.state != Refresh.ACTIVE
            or lifecycle.expired(record.expires_at, now)
            or lifecycle.expired(record.family_expires_at, now)
        ):
            return None
        answer: dict[str, object] = {
            "active": True,
            "scope": record.scope,
            "client_id": record.client_id,
            "sub": record.subject,
            "exp": int(record.expires_at),
            "iat": int(record.created_at),
            "iss": self.issuer,
            "aud": record.audience,
            "token_type": "refresh_token",
        }
        if record.dpop_jkt is not None:  # RFC 9449 §5: usable only with a proof of this key
            answer["cnf"] = {"jkt": record.dpop_jkt}
        return answer
