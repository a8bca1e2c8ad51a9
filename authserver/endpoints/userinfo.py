"""UserInfo (OIDC Core §5.3): the claims the token's scopes release, for a token with `openid`.

The token comes from the Authorization header, or the form body of a POST (RFC 6750 §2.2),
never both and never the query string. Errors are RFC 6750 §3 challenges.

A token bound to a DPoP key (`cnf.jkt`, RFC 9449 §6) is accepted only as `Authorization:
DPoP <token>` with a proof of that key for this request (§7: `htm`, `htu` this endpoint's
URL, `ath` the token's hash, a fresh `jti`); sent as a bearer token it is refused. A token
that is not bound is refused under the DPoP scheme: the scheme claims a binding it lacks.
DPoP errors are §7.1 challenges, naming the algorithms proofs may use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from ..dpop import ProofChecker
from ..protocol.claims import released
from ..protocol.errors import ErrorCode, OAuthError
from ..registry import UserDirectory
from .errors import json_no_store
from .forms import read_form
from .resource_tokens import AccessTokens

BEARER = "Bearer"
DPOP = "DPoP"


class UserInfoEndpoint:
    def __init__(
        self, access_tokens: AccessTokens, users: UserDirectory, proofs: ProofChecker, url: str
    ) -> None:
        self.access_tokens = access_tokens
        self.users = users
        self.proofs = proofs
        self.url = url
        self.algs = " ".join(proofs.algorithms)

    def _challenge(
        self,
        status: int,
        scheme: str | None = None,
        error: str | None = None,
        description: str | None = None,
    ) -> web.Response:
        """An RFC 6750 §3 (Bearer) or RFC 9449 §7.1 (DPoP) challenge; both schemes when
        the request used neither."""
        body: dict[str, str] = {}
        params = ""
        if error:
            params += f', error="{error}"'
            body["error"] = error
        if description:
            params += f', error_description="{description}"'
            body["error_description"] = description
        headers: CIMultiDict[str] = CIMultiDict()
        if scheme in (None, BEARER):
            headers.add("WWW-Authenticate", f'Bearer realm="portcullis"{params}')
        if scheme in (None, DPOP):
            headers.add("WWW-Authenticate", f'DPoP realm="portcullis"{params}, algs="{self.algs}"')
        if error == ErrorCode.USE_DPOP_NONCE:
            nonce = self.proofs.nonce()
            if nonce is not None:
                headers["DPoP-Nonce"] = nonce
        response = json_no_store(body, status=status)
        response.headers.extend(headers)
        return response

    async def handle(self, request: web.Request) -> web.Response:
        header = request.headers.getall("Authorization", [])
        token, scheme = None, None
        if len(header) > 1:
            return self._challenge(
                400, None, "invalid_request", "more than one Authorization header"
            )
        if header:
            name, _, value = header[0].partition(" ")
            for known in (BEARER, DPOP):
                if name.lower() == known.lower() and value.strip():
                    token, scheme = value.strip(), known
        if request.method == "POST" and request.content_type == "application/x-www-form-urlencoded":
            try:
                form = await read_form(request)
            except OAuthError as exc:
                return self._challenge(400, scheme, "invalid_request", exc.description)
            if "access_token" in form:
                if token is not None:
                    return self._challenge(
                        400, scheme, "invalid_request", "the token was sent twice"
                    )
                token, scheme = form["access_token"], BEARER
        if token is None:
            return self._challenge(401)
        claims = await self.access_tokens.active(token)
        if claims is None:
            return self._challenge(
                401, scheme, "invalid_token", "the access token is invalid or expired"
            )
        refusal = await self._possession(request, token, scheme, claims)
        if refusal is not None:
            return refusal
        scopes = str(claims.get("scope", "")).split()
        if "openid" not in scopes:
            return self._challenge(
                403, scheme, "insufficient_scope", "the token lacks the openid scope"
            )
        user = await self.users.by_subject(str(claims["sub"]))
        if user is None:
            return self._challenge(
                401, scheme, "invalid_token", "the token's user no longer exists"
            )
        return json_no_store({"sub": user.subject, **released(user.claims, scopes)})

    async def _possession(
        self, request: web.Request, token: str, scheme: str | None, claims: Mapping[str, Any]
    ) -> web.Response | None:
        """None when the request proves what the token requires (RFC 9449 §7), else the
        refusal."""
        cnf = claims.get("cnf")
        bound = cnf.get("jkt") if isinstance(cnf, Mapping) else None
        if scheme == BEARER:
            if bound is None:
                return None
            # §7.1: a bound token is no bearer token; the challenge says how to send it.
            return self._challenge(
                401,
                DPOP,
                "invalid_token",
                "this token must be sent with the DPoP scheme and a proof",
            )
        if bound is None:
            return self._challenge(
                401, DPOP, "invalid_token", "the token is not bound to a DPoP key"
            )
        try:
            proof = await self.proofs.check(
                request.headers.getall("DPoP", []), request.method, self.url, access_token=token
            )
        except OAuthError as error:
            return self._challenge(401, DPOP, error.code.value, error.description)
        if proof is None:
            return self._challenge(401, DPOP, "invalid_dpop_proof", "a DPoP proof is required")
        if proof.jkt != bound:
            return self._challenge(
                401,
                DPOP,
                "invalid_dpop_proof",
                "the proof's key is not the one the token is bound to",
            )
        return None
