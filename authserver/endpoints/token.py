"""POST /token, read top to bottom (RFC 6749 §3.2, §5):
1. parse the url-encoded form once; a parameter given twice is invalid_request;
2. the grant for grant_type, else unsupported_grant_type;
3. authenticate the client (every grant: public clients identify with client_id);
4. the client must be registered for the grant, else unauthorized_client;
5. the grant issues (one store call commits the issuance, then tokens are signed);
6. JSON with Cache-Control: no-store. One `except OAuthError` renders every error.
"""

from __future__ import annotations

import logging

from aiohttp import web

from ..clients import ClientAuthenticator
from ..clock import Clock
from ..grants.base import Registry, TokenRequest
from ..metrics import Metrics
from ..protocol.errors import ErrorCode, OAuthError, invalid_request
from .errors import json_no_store, oauth_json_error
from .forms import read_form

log = logging.getLogger("portcullis.authserver.token")


class TokenEndpoint:
    def __init__(
        self,
        grants: Registry,
        clients: ClientAuthenticator,
        url: str,
        clock: Clock,
        metrics: Metrics,
    ) -> None:
        self.grants = grants
        self.clients = clients
        self.url = url
        self.clock = clock
        self.metrics = metrics

    async def handle(self, request: web.Request) -> web.Response:
        try:
            form = await read_form(request)  # 1
            grant_type = form.get("grant_type")
            if not grant_type:
                raise invalid_request("grant_type is required")
            grant = self.grants.get(grant_type)  # 2
            authorization = request.headers.get("Authorization")
            client = await self.clients.authenticate(form, authorization, self.url)  # 3
            if grant_type not in client.grant_types:  # 4
                raise OAuthError(
                    ErrorCode.UNAUTHORIZED_CLIENT, "this client may not use this grant_type"
                )
            token_request = TokenRequest(grant_type, form, self.clock(), self.url)
            body = await grant.issue(token_request, client)  # 5
            self.metrics.token_issued(grant_type)
            return json_no_store(body)  # 6
        except OAuthError as error:
            if error.code in (ErrorCode.INVALID_GRANT, ErrorCode.INVALID_CLIENT):
                log.info("token request refused", extra={"error": error.code.value})
            return oauth_json_error(error)
