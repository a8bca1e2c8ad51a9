"""Token revocation (RFC 7009).

A refresh token revokes its whole family and the access tokens issued under it (§2.1); an
access token is denied on introspection until it expires. A client may revoke only its own
tokens. Unknown or already invalid tokens answer 200 (§2.2): the client's goal is reached.
`token_type_hint` only changes the order of the lookups.
"""

from __future__ import annotations

import time

import jwt
from aiohttp import web

from .. import clients
from ..protocol.errors import ErrorCode, OAuthError, invalid_request
from ..tokens import digest
from .common import oauth_json_error, read_form, services


async def revoke(request: web.Request) -> web.Response:
    svc = services(request)
    try:
        form = await read_form(request)
        client = await clients.authenticate(
            form, request.headers.get("Authorization"), svc.settings, svc.store, svc.url("/revoke")
        )
        token = form.get("token")
        if token is None:
            raise invalid_request("token is required")
        now = time.time()
        record = await svc.store.get_refresh(digest(token))
        if record is not None:
            if record.client_id != client.client_id:
                raise OAuthError(
                    ErrorCode.UNAUTHORIZED_CLIENT, "the token belongs to another client"
                )
            await svc.store.revoke_grant(record.family_id, now)
        elif token.count(".") == 2:
            try:
                claims = svc.keyring.verify(
                    token,
                    [svc.settings.keys.access_token_alg],
                    issuer=svc.settings.issuer,
                    options={"verify_aud": False, "verify_exp": False, "require": ["jti", "exp"]},
                )
            except (jwt.InvalidTokenError, ValueError):
                claims = None
            if claims is not None:
                if claims.get("client_id") != client.client_id:
                    raise OAuthError(
                        ErrorCode.UNAUTHORIZED_CLIENT, "the token belongs to another client"
                    )
                if claims["exp"] > now:
                    await svc.store.revoke_access_token(str(claims["jti"]), float(claims["exp"]))
    except OAuthError as error:
        return oauth_json_error(error)
    return web.Response(status=200, headers={"Cache-Control": "no-store"})
