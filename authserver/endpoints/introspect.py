"""Token introspection (RFC 7662) for resource servers with configured credentials.

Anything inactive, unknown or malformed is exactly `{"active": false}` (§2.2): nothing tells
a caller why.
"""

from __future__ import annotations

import time

from aiohttp import web

from .. import clients
from ..protocol.errors import ErrorCode, OAuthError, invalid_request
from ..tokens import digest
from .common import json_no_store, oauth_json_error, read_form, services
from .resource_tokens import active_access_token

INACTIVE = {"active": False}


async def introspect(request: web.Request) -> web.Response:
    svc = services(request)
    try:
        form = await read_form(request)
        client = await clients.authenticate(
            form,
            request.headers.get("Authorization"),
            svc.settings,
            svc.store,
            svc.url("/introspect"),
        )
        # Only a resource server's credentials; a public client proves nothing (RFC 7662 §4).
        if not client.introspection or client.public:
            raise OAuthError(
                ErrorCode.UNAUTHORIZED_CLIENT, "this client may not introspect tokens", status=403
            )
        token = form.get("token")
        if token is None:
            raise invalid_request("token is required")
    except OAuthError as error:
        return oauth_json_error(error)

    hint = form.get("token_type_hint")
    lookups = [_access, _refresh] if hint != "refresh_token" else [_refresh, _access]
    for lookup in lookups:
        result = await lookup(request, token)
        if result is not None:
            return json_no_store(result)
    return json_no_store(INACTIVE)


async def _access(request: web.Request, token: str) -> dict[str, object] | None:
    svc = services(request)
    if token.count(".") != 2:
        return None
    claims = await active_access_token(svc, token)
    if claims is None:
        return None
    return {
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


async def _refresh(request: web.Request, token: str) -> dict[str, object] | None:
    svc = services(request)
    record = await svc.store.get_refresh(digest(token))
    now = time.time()
    if (
        record is None
        or record.state != "active"
        or record.expires_at <= now
        or record.family_expires_at <= now
        or await svc.store.family_revoked(record.family_id)
    ):
        return None
    return {
        "active": True,
        "scope": record.scope,
        "client_id": record.client_id,
        "sub": record.subject,
        "exp": int(record.expires_at),
        "iat": int(record.created_at),
        "iss": svc.settings.issuer,
        "aud": record.audience,
        "token_type": "refresh_token",
    }
