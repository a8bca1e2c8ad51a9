"""POST /token, read top to bottom (RFC 6749 §3.2, §5):
1. parse the url-encoded form once; a parameter given twice is invalid_request;
2. the grant for grant_type, else unsupported_grant_type;
3. the DPoP proof, if one came (RFC 9449 §4.3, authserver/dpop.py): checked before the
   client is authenticated, so that a nonce challenge does not use up a client assertion's
   jti; its own jti used once the client is authenticated;
4. authenticate the client (every grant: public clients identify with client_id);
5. the client must be registered for the grant, else unauthorized_client; a client
   registered with dpop_bound_access_tokens must have sent a proof (RFC 9449 §5.2);
6. the grant issues (one store call commits the issuance, then tokens are signed), binding
   the tokens to the proof's key; a client that registered itself is kept from its first
   token on (it would be removed after `registration.unused_client_lifetime` otherwise);
7. JSON with Cache-Control: no-store. One `except OAuthError` renders every error; with
   nonces required, every answer carries the current one (DPoP-Nonce, RFC 9449 §8).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from ..clients import ClientAuthenticator
from ..clock import Clock
from ..dpop import ProofChecker, invalid_proof
from ..grants.base import Registry, TokenRequest
from ..metrics import Metrics
from ..protocol.errors import ErrorCode, OAuthError, invalid_request
from .errors import JsonAnswer, json_answer, json_response_of, oauth_error_answer
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
        dpop: ProofChecker,
        keep_client: Callable[[str], Awaitable[bool]],
    ) -> None:
        self.keep_client = keep_client
        self.dpop = dpop
        self.grants = grants
        self.clients = clients
        self.url = url
        self.clock = clock
        self.metrics = metrics

    async def handle(self, request: web.Request) -> web.Response:
        """The endpoint behind aiohttp's router and middleware."""
        answer = await self.answer(
            read_form(request),
            request.headers.getall("DPoP", []),
            request.headers.get("Authorization"),
        )
        return json_response_of(answer)

    async def answer(
        self,
        form_read: Awaitable[dict[str, str]],
        proofs: list[str],
        authorization: str | None,
    ) -> JsonAnswer:
        """The steps above for a request whose form `form_read` gives, with its DPoP and
        Authorization fields: what an answer holds, apart from how it is written."""
        headers: dict[str, str] = {}
        nonce = self.dpop.nonce()
        if nonce is not None:
            headers["DPoP-Nonce"] = nonce
        try:
            form = await form_read  # 1
            grant_type = form.get("grant_type")
            if not grant_type:
                raise invalid_request("grant_type is required")
            grant = self.grants.get(grant_type)  # 2
            proof = self.dpop.verify(proofs, "POST", self.url)  # 3
            client = await self.clients.authenticate(form, authorization, self.url)  # 4
            if proof is not None:
                await self.dpop.use(proof, self.url)
            if grant_type not in client.grant_types:  # 5
                raise OAuthError(
                    ErrorCode.UNAUTHORIZED_CLIENT, "this client may not use this grant_type"
                )
            if client.dpop_bound_access_tokens and proof is None:
                raise invalid_proof("this client must send a DPoP proof")
            token_request = TokenRequest(
                grant_type,
                form,
                self.clock(),
                self.url,
                dpop_jkt=proof.jkt if proof is not None else None,
            )
            body = await grant.issue(token_request, client)  # 6
            if client.unused_until is not None:
                await self.keep_client(client.client_id)
            self.metrics.token_issued(grant_type)
            return json_answer(body, headers=headers)  # 7
        except OAuthError as error:
            if error.code in (ErrorCode.INVALID_GRANT, ErrorCode.INVALID_CLIENT):
                log.info("token request refused", extra={"error": error.code.value})
            return oauth_error_answer(error, headers)
