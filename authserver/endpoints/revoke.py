"""Token revocation (RFC 7009).

A refresh token revokes its whole family and the access tokens issued under it (§2.1); an
access token is denied on introspection until it expires. A client may revoke only its own
tokens. Unknown or already invalid tokens answer 200 (§2.2): the client's goal is reached.
`token_type_hint` only changes the order of the lookups.
"""

from __future__ import annotations

from aiohttp import web

from .. import audit
from ..audit import Event
from ..clients import ClientAuthenticator
from ..clock import Clock
from ..protocol.errors import ErrorCode, OAuthError, invalid_request
from ..resource_tokens import AccessTokens
from ..store.base import Store
from ..tokens import digest
from .errors import oauth_json_error
from .forms import read_form


class RevocationEndpoint:
    def __init__(
        self,
        clients: ClientAuthenticator,
        access_tokens: AccessTokens,
        store: Store,
        url: str,
        clock: Clock,
    ) -> None:
        self.clients = clients
        self.access_tokens = access_tokens
        self.store = store
        self.url = url
        self.clock = clock

    async def handle(self, request: web.Request) -> web.Response:
        try:
            form = await read_form(request)
            authorization = request.headers.get("Authorization")
            client = await self.clients.authenticate(form, authorization, self.url)
            token = form.get("token")
            if token is None:
                raise invalid_request("token is required")
            await self._revoke(token, client.client_id)
        except OAuthError as error:
            return oauth_json_error(error)
        return web.Response(status=200, headers={"Cache-Control": "no-store"})

    async def _revoke(self, token: str, client_id: str) -> None:
        now = self.clock()
        record = await self.store.get_refresh(digest(token))
        if record is not None:
            if record.client_id != client_id:
                raise OAuthError(
                    ErrorCode.UNAUTHORIZED_CLIENT, "the token belongs to another client"
                )
            await self.store.revoke_grant(record.family_id, now)
            audit.record(
                Event.GRANT_REVOKED,
                audit.CLIENT,
                client_id=client_id,
                subject=record.subject,
                grant_id=record.family_id,
                reason="revoked",
            )
            return
        claims = self.access_tokens.signed(token) if token.count(".") == 2 else None
        if claims is None:
            return
        if claims.get("client_id") != client_id:
            raise OAuthError(ErrorCode.UNAUTHORIZED_CLIENT, "the token belongs to another client")
        if claims["exp"] > now:
            await self.store.revoke_access_token(str(claims["jti"]), float(claims["exp"]), now)
            audit.record(
                Event.TOKEN_REVOKED,
                audit.CLIENT,
                client_id=client_id,
                subject=str(claims.get("sub", "")) or None,
                jti=str(claims["jti"]),
                reason="revoked",
            )
