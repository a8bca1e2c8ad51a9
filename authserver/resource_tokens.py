"""Access tokens this server issued, read (`AccessTokens`) and presented to its own
resources (`ResourceTokens`).

`AccessTokens` reads a token: signature, issuer, expiry, and revocation state. Used by
userinfo, introspection, revocation and the admin API. Verification, then the store: the
token revoked (itself or its grant), its client gone or its secret rotated since it was
issued, its user gone or disabled (events.Revocations cuts them off) all make it inactive.

`ResourceTokens` is the one check of a request whose credential is such a token, for every
endpoint of this server that serves a resource (userinfo, the admin API: both are given it,
neither imports the other), in order:
1. at most one Authorization header, else 400 `invalid_request`; the token under the
   `Bearer` (RFC 6750 §2.1) or the `DPoP` scheme (RFC 9449 §7.1), else no token: 401 without
   an error code (RFC 6750 §3.1). The endpoint may take it from elsewhere (userinfo: a
   POST form body, RFC 6750 §2.2), as a bearer token;
2. an active access token of this server (`AccessTokens`), else 401 `invalid_token`;
3. possession (RFC 9449 §7): a token bound to a key (`cnf.jkt`, §6.1) only under the DPoP
   scheme with a proof of that key for this request (`htm`, `htu` the URL the request was
   sent to, `ath` the token's hash, a fresh `jti`: §4.3, authserver/dpop.py); sent as a
   bearer token, with or without a proof beside it, it is refused (§7.1: a bound token is
   no bearer token). A token not bound is refused under the DPoP scheme: the scheme claims
   a binding the token lacks (§7.1).
Every refusal is a `TokenRefused`, whose challenges (`challenges`) are RFC 6750 §3 (Bearer)
or RFC 9449 §7.1 (DPoP, with the algorithms proofs may use) for the scheme the request used,
both when it used neither; a `use_dpop_nonce` refusal carries the nonce to use (§8).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jwt
from aiohttp import web
from multidict import CIMultiDict

from . import accesslog
from .dpop import ProofChecker
from .keys import SigningRing
from .protocol.errors import ErrorCode, OAuthError
from .registry import Client, ClientRegistry, UserDirectory
from .store.base import Store

BEARER = "Bearer"
DPOP = "DPoP"
INVALID_REQUEST = "invalid_request"
INVALID_TOKEN = "invalid_token"  # noqa: S105 - an error code
INVALID_DPOP_PROOF = ErrorCode.INVALID_DPOP_PROOF.value


@dataclass(frozen=True)
class ActiveToken:
    """An active access token's claims, and its client as registered now."""

    claims: dict[str, Any]
    client: Client


class AccessTokens:
    def __init__(
        self,
        keyring: SigningRing,
        alg: str,
        issuer: str,
        store: Store,
        clients: ClientRegistry,
        users: UserDirectory,
    ) -> None:
        self.keyring = keyring
        self.alg = alg
        self.issuer = issuer
        self.store = store
        self.clients = clients
        self.users = users

    async def active(self, token: str) -> dict[str, Any] | None:
        """The claims of a valid, unexpired, unrevoked access token of this server, else None."""
        found = await self.verified(token)
        return None if found is None else found.claims

    async def verified(self, token: str) -> ActiveToken | None:
        """A valid, unexpired, unrevoked access token of this server with its client, else
        None."""
        try:
            header = jwt.get_unverified_header(token)
            if str(header.get("typ", "")).lower() not in ("at+jwt", "application/at+jwt"):
                return None
            claims = self.keyring.verify(
                token,
                [self.alg],
                issuer=self.issuer,
                options={"verify_aud": False, "require": ["exp", "iat", "jti", "sub", "client_id"]},
            )
        except (jwt.InvalidTokenError, ValueError):
            return None
        if not await self.store.access_token_active(str(claims["jti"])):
            return None
        client = await self.clients.client(str(claims["client_id"]))
        # iat is in whole seconds: a token from the second of a rotation is refused, even
        # one issued just after it (the client asks again a second later).
        if client is None or int(claims["iat"]) <= int(client.tokens_valid_from):
            return None
        subject = str(claims["sub"])
        # client_credentials tokens have the client as their subject; others a user.
        if subject != client.client_id and await self.users.by_subject(subject) is None:
            return None
        return ActiveToken(claims, client)

    def signed(self, token: str) -> dict[str, Any] | None:
        """The claims of an access token this server signed, expired or not, else None."""
        try:
            return self.keyring.verify(
                token,
                [self.alg],
                issuer=self.issuer,
                options={"verify_aud": False, "verify_exp": False, "require": ["jti", "exp"]},
            )
        except (jwt.InvalidTokenError, ValueError):
            return None


@dataclass(frozen=True)
class Credential:
    """The access token a request presents, and the scheme it came under."""

    token: str
    scheme: str  # BEARER or DPOP


class TokenRefused(Exception):
    """A request's credential refused: the status, the error code (None when the request
    carried no token, RFC 6750 §3.1), and the scheme its challenge names (None: both)."""

    def __init__(
        self,
        status: int,
        error: str | None = None,
        description: str | None = None,
        scheme: str | None = None,
        scope: str | None = None,
    ) -> None:
        super().__init__(description or error or "no access token")
        self.status = status
        self.error = error
        self.description = description
        self.scheme = scheme
        self.scope = scope  # the scope an insufficient_scope refusal asks for (RFC 6750 §3)


def credential_in_header(request: web.Request) -> Credential | None:
    """1: the token of the Authorization header, under a scheme this server takes; None
    when there is none (another scheme counts as none)."""
    header = request.headers.getall("Authorization", [])
    if len(header) > 1:
        raise TokenRefused(400, INVALID_REQUEST, "more than one Authorization header")
    if not header:
        return None
    name, _, value = header[0].partition(" ")
    for scheme in (BEARER, DPOP):  # RFC 9110 §11.1: the scheme is case-insensitive
        if name.lower() == scheme.lower() and value.strip():
            return Credential(value.strip(), scheme)
    return None


class ResourceTokens:
    """Steps 2 and 3 above, and the challenges of every refusal."""

    def __init__(self, access_tokens: AccessTokens, proofs: ProofChecker) -> None:
        self.access_tokens = access_tokens
        self.proofs = proofs
        self.algs = " ".join(proofs.algorithms)

    async def check(
        self, request: web.Request, credential: Credential, url: str, endpoint: str
    ) -> ActiveToken:
        """The token, active and proven as it requires for a request to `url` (the URL the
        request was sent to, as clients name it in proofs); `endpoint` names the endpoint
        in the proof metrics."""
        found = await self.access_tokens.verified(credential.token)  # 2
        if found is None:
            raise TokenRefused(
                401,
                INVALID_TOKEN,
                "the access token is invalid, expired or revoked",
                credential.scheme,
            )
        await self._possession(request, credential, found.claims, url, endpoint)  # 3
        client_id = found.claims.get("client_id")
        if isinstance(client_id, str):
            accesslog.client_known(client_id)
        return found

    async def _possession(
        self,
        request: web.Request,
        credential: Credential,
        claims: Mapping[str, Any],
        url: str,
        endpoint: str,
    ) -> None:
        cnf = claims.get("cnf")
        bound = cnf.get("jkt") if isinstance(cnf, Mapping) else None
        if credential.scheme == BEARER:
            if bound is None:
                return
            # RFC 9449 §7.1: a bound token is no bearer token; the challenge says how to
            # send it.
            raise TokenRefused(
                401,
                INVALID_TOKEN,
                "this token must be sent with the DPoP scheme and a proof",
                DPOP,
            )
        if bound is None:
            raise TokenRefused(401, INVALID_TOKEN, "the token is not bound to a DPoP key", DPOP)
        try:
            # §4.3, §7.1: htm, htu, and ath the hash of this very token.
            proof = await self.proofs.check(
                request.headers.getall("DPoP", []),
                request.method,
                url,
                access_token=credential.token,
                endpoint=endpoint,
            )
        except OAuthError as error:
            raise TokenRefused(401, error.code.value, error.description, DPOP) from None
        if proof is None:
            raise TokenRefused(401, INVALID_DPOP_PROOF, "a DPoP proof is required", DPOP)
        if proof.jkt != bound:  # §7.1: the proof's key must be the one the token names
            raise TokenRefused(
                401,
                INVALID_DPOP_PROOF,
                "the proof's key is not the one the token is bound to",
                DPOP,
            )

    def challenges(self, refused: TokenRefused, realm: str) -> CIMultiDict[str]:
        """The headers of a refusal: an RFC 6750 §3 (Bearer) or RFC 9449 §7.1 (DPoP)
        challenge, both when the request used neither scheme; the nonce to use after
        `use_dpop_nonce` (§8)."""
        params = ""
        if refused.error:
            params += f', error="{refused.error}"'
        if refused.description:
            params += f', error_description="{refused.description}"'
        if refused.scope:
            params += f', scope="{refused.scope}"'
        headers: CIMultiDict[str] = CIMultiDict()
        if refused.scheme in (None, BEARER):
            headers.add("WWW-Authenticate", f'Bearer realm="{realm}"{params}')
        if refused.scheme in (None, DPOP):
            headers.add("WWW-Authenticate", f'DPoP realm="{realm}"{params}, algs="{self.algs}"')
        if refused.error == ErrorCode.USE_DPOP_NONCE.value:
            nonce = self.proofs.nonce()
            if nonce is not None:
                headers["DPoP-Nonce"] = nonce
        return headers
