"""POST /token, read top to bottom (RFC 6749 §3.2, §5):
1. parse the url-encoded form once; a parameter given twice is invalid_request;
2. the grant for grant_type, else unsupported_grant_type;
3. authenticate the client (every grant: public clients identify with client_id);
4. the client must be registered for the grant, else unauthorized_client;
5. the grant issues (store changes in one transaction, then tokens are signed);
6. JSON with Cache-Control: no-store. One `except OAuthError` renders every error.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

from .. import clients
from ..grants.base import TokenRequest
from ..protocol.errors import ErrorCode, OAuthError, invalid_request
from .common import json_no_store, oauth_json_error, read_form, services

log = logging.getLogger("portcullis.authserver.token")


async def token(request: web.Request) -> web.Response:
    svc = services(request)
    try:
        form = await read_form(request)  # 1
        grant_type = form.get("grant_type")
        if not grant_type:
            raise invalid_request("grant_type is required")
        grant = svc.grants.get(grant_type)  # 2
        endpoint = svc.url("/token")
        client = await clients.authenticate(  # 3
            form, request.headers.get("Authorization"), svc.settings, svc.store, endpoint
        )
        if grant_type not in client.grant_types:  # 4
            raise OAuthError(
                ErrorCode.UNAUTHORIZED_CLIENT, "this client may not use this grant_type"
            )
        body = await grant.issue(TokenRequest(grant_type, form, time.time(), endpoint), client)  # 5
        svc.metrics.token_issued(grant_type)
        return json_no_store(body)  # 6
    except OAuthError as error:
        if error.code in (ErrorCode.INVALID_GRANT, ErrorCode.INVALID_CLIENT):
            log.info("token request refused", extra={"error": error.code.value})
        return oauth_json_error(error)
