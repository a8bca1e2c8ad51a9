"""Client authentication at the token, introspection, revocation and device endpoints.

Methods (RFC 6749 §2.3, RFC 7523, OIDC Core §9): `client_secret_basic`,
`client_secret_post`, `private_key_jwt`, and `none` for public clients. Rules:
 - exactly one method per request; two → invalid_request (RFC 6749 §2.3);
 - the method used must be the one the client registered: a confidential client cannot
   fall back to `none`, and a secret client cannot switch to another secret method;
 - secrets are compared as SHA-256 digests in constant time (they are high-entropy, so a
   slow hash would only cost throughput);
 - private_key_jwt: `iss` = `sub` = client_id, `aud` the issuer identifier and nothing
   else (a string, or an array of that one string; with `client_assertion_audience: compat`
   the token endpoint URL alone is taken too), `exp` at most `client_assertion_max_lifetime`
   ahead (default 1 hour: what Authlib signs; pyoidc signs 10 minutes), `jti` used once:
   kept in the store's replay cache until `exp` plus the clock leeway, the last moment the
   assertion could be accepted; signed by a key of the client's registered `jwks` with an
   asymmetric algorithm.
Every failure is the same `invalid_client` (401) so nothing tells the caller which part was
wrong; the log says it (`reason`), naming the client but never its secret or assertion.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, NamedTuple
from urllib.parse import unquote_plus

import jwt

from . import accesslog
from .clock import Clock
from .protocol.errors import ErrorCode, OAuthError, invalid_request
from .registry import Client, ClientRegistry
from .store.base import Store

ASSERTION_TYPE = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
# The algorithms a client assertion may be signed with, and so the ones discovery advertises
# (RFC 8414 §2 token_endpoint_auth_signing_alg_values_supported): asymmetric only, never
# `none` or a MAC (RFC 7523 §3; a MAC would be keyed with the client's public key).
ASSERTION_ALGORITHMS = (
    "RS256",
    "RS384",
    "RS512",
    "PS256",
    "PS384",
    "PS512",
    "ES256",
    "ES384",
    "EdDSA",
)
# Clock skew allowed on an assertion's exp, nbf and iat.
ASSERTION_LEEWAY = timedelta(seconds=30)
FAILED = "client authentication failed"

log = logging.getLogger("portcullis.authserver.clients")


class ClientAuthError(OAuthError):
    """invalid_client; `basic` tells the endpoint to answer with a Basic challenge (§5.2).

    `reason` is for the log only: a short code saying which check failed."""

    def __init__(self, description: str, *, basic: bool, reason: str = "") -> None:
        super().__init__(ErrorCode.INVALID_CLIENT, description, status=401)
        self.basic = basic
        self.reason = reason or description


class Presented(NamedTuple):
    """What the request offered to identify the client (a NamedTuple, for the reason
    TokenRequest is one: grants/base.py)."""

    method: str  # client_secret_basic | client_secret_post | private_key_jwt | none
    client_id: str
    secret: str | None = None
    assertion: str | None = None


def presented(form: Mapping[str, str], authorization: str | None) -> Presented:
    methods = []
    basic: tuple[str, str] | None = None
    if authorization and authorization[:6].lower() == "basic ":
        try:
            decoded = base64.b64decode(authorization[6:].strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise ClientAuthError(
                "malformed Basic credentials", basic=True, reason="malformed_basic"
            ) from None
        user, sep, password = decoded.partition(":")
        if not sep:
            raise ClientAuthError(
                "malformed Basic credentials", basic=True, reason="malformed_basic"
            )
        # RFC 6749 §2.3.1: both parts are form-urlencoded before base64.
        basic = (_form_decoded(user), _form_decoded(password))
        methods.append("client_secret_basic")
    if "client_secret" in form:
        methods.append("client_secret_post")
    if "client_assertion" in form or "client_assertion_type" in form:
        methods.append("private_key_jwt")
    if len(methods) > 1:
        raise invalid_request("use one client authentication method, not " + " and ".join(methods))

    form_id = form.get("client_id")
    if basic is not None:
        if form_id is not None and form_id != basic[0]:
            raise ClientAuthError(
                "client_id does not match the credentials", basic=True, reason="client_id_mismatch"
            )
        return Presented("client_secret_basic", basic[0], secret=basic[1])
    if methods == ["client_secret_post"]:
        if not form_id:
            raise ClientAuthError(
                "client_id is required with client_secret", basic=False, reason="no_client_id"
            )
        return Presented("client_secret_post", form_id, secret=form["client_secret"])
    if methods == ["private_key_jwt"]:
        if form.get("client_assertion_type") != ASSERTION_TYPE or not form.get("client_assertion"):
            raise ClientAuthError(
                "client_assertion_type must be jwt-bearer",
                basic=False,
                reason="wrong_assertion_type",
            )
        assertion = form["client_assertion"]
        try:
            claimed = jwt.decode(assertion, options={"verify_signature": False})
        except jwt.InvalidTokenError:
            raise ClientAuthError(
                "client_assertion is not a JWT", basic=False, reason="assertion_not_a_jwt"
            ) from None
        sub = claimed.get("sub")
        if not isinstance(sub, str) or (form_id is not None and form_id != sub):
            raise ClientAuthError(
                "client_assertion sub must be the client_id",
                basic=False,
                reason="assertion_sub_mismatch",
            )
        return Presented("private_key_jwt", sub, assertion=assertion)
    if not form_id:
        # Nothing identifies the client: the 401 carries a challenge (RFC 9110 §15.5.2).
        raise ClientAuthError(
            "client authentication is required", basic=True, reason="no_credentials"
        )
    return Presented("none", form_id)


def _form_decoded(text: str) -> str:
    """`unquote_plus(text)`, without its work when there is nothing to decode."""
    return unquote_plus(text) if "%" in text or "+" in text else text


def _secret_matches(client: Client, secret: str) -> bool:
    if client.client_secret_sha256 is None:
        return False
    digest = hashlib.sha256(secret.encode()).digest()
    return hmac.compare_digest(digest, client.client_secret_sha256)


class ClientAuthenticator:
    """Authenticates clients against the registry; assertion ids are kept in the store.

    `max_assertion_lifetime` is `client_assertion_max_lifetime`: the longest a
    private_key_jwt assertion may live (exp - now). `assertion_audiences` are the values an
    assertion's `aud` may be, alone (`assertion_audiences()` from the settings)."""

    def __init__(
        self,
        clients: ClientRegistry,
        store: Store,
        issuer: str,
        max_assertion_lifetime: timedelta,
        clock: Clock = time.time,
        assertion_audiences: frozenset[str] | None = None,
    ) -> None:
        self.clients = clients
        self.store = store
        self.issuer = issuer
        self.max_assertion_lifetime = max_assertion_lifetime.total_seconds()
        self.clock = clock
        self.assertion_audiences = (
            frozenset({issuer}) if assertion_audiences is None else assertion_audiences
        )

    async def authenticate(
        self, form: Mapping[str, str], authorization: str | None, endpoint_url: str
    ) -> Client:
        """The authenticated client, or ClientAuthError / invalid_request.

        Each refusal is logged with its reason, the client_id presented (if any) and
        `endpoint_url`, where the request came."""
        offer: Presented | None = None
        try:
            offer = presented(form, authorization)
            client = await self._authenticate(offer)
        except ClientAuthError as error:
            client_id = offer.client_id if offer is not None else form.get("client_id", "")
            log.info(
                "client authentication failed",
                extra={
                    "reason": error.reason,
                    # Whatever the caller sent, bounded: registered ids are at most 128 long.
                    "client_id": client_id[:128],
                    "method": offer.method if offer is not None else "-",
                    "endpoint": endpoint_url,
                },
            )
            raise
        accesslog.client_known(client.client_id)
        return client

    async def _authenticate(self, offer: Presented) -> Client:
        basic = offer.method == "client_secret_basic"
        client = await self.clients.client(offer.client_id)
        if client is None:
            raise ClientAuthError(FAILED, basic=basic, reason="unknown_client")
        if client.token_endpoint_auth_method != offer.method:
            raise ClientAuthError(
                FAILED,
                basic=basic,
                reason=f"wrong_method (registered {client.token_endpoint_auth_method})",
            )
        if offer.method in ("client_secret_basic", "client_secret_post"):
            if offer.secret is None or not _secret_matches(client, offer.secret):
                raise ClientAuthError(FAILED, basic=basic, reason="wrong_secret")
        elif offer.method == "private_key_jwt":
            await self._check_assertion(client, offer.assertion or "")
        return client

    async def _check_assertion(self, client: Client, assertion: str) -> None:
        """RFC 7523 §3 with RFC 7521 §5.2: signature, then claims, then the jti's single use."""

        def failed(reason: str) -> ClientAuthError:
            return ClientAuthError(FAILED, basic=False, reason=reason)

        try:
            header = jwt.get_unverified_header(assertion)
        except jwt.InvalidTokenError:
            raise failed("assertion_not_a_jwt") from None
        alg = header.get("alg")
        if alg not in ASSERTION_ALGORITHMS:  # never `none` or a MAC keyed with public data
            raise failed("algorithm_not_allowed")
        keys = _candidate_keys(client.jwks, header.get("kid"), alg)
        if not keys:
            raise failed("no_matching_key")
        leeway = ASSERTION_LEEWAY.total_seconds()
        now = self.clock()
        claims: dict[str, Any] | None = None
        for key in keys:
            try:
                claims = jwt.decode(
                    assertion,
                    key,
                    algorithms=[alg],
                    issuer=client.client_id,
                    # The audience is checked below: PyJWT takes any one match in a list.
                    options={"require": ["iss", "sub", "aud", "exp", "jti"], "verify_aud": False},
                    leeway=leeway,
                )
            except (jwt.InvalidSignatureError, TypeError, ValueError):
                # Another of the client's keys, or one of another type than `alg` needs (PyJWT
                # raises TypeError then).
                continue
            except jwt.PyJWTError as error:
                # PyJWT checks the signature first: this key signed it, and a claim is wrong.
                raise failed(_claims_reason(error)) from None
            break
        if claims is None:
            raise failed("bad_signature")
        if claims.get("sub") != client.client_id:
            raise failed("assertion_sub_mismatch")
        if not _sole_audience(claims["aud"], self.assertion_audiences):
            raise failed("wrong_audience")
        expires = float(claims["exp"])
        if expires > now + self.max_assertion_lifetime + leeway:
            raise failed("assertion_lifetime_too_long")
        # Remembered until the last moment the leeway would still accept it (RFC 7523 §3
        # item 7). By the client and the jti, never the signature: an assertion's ECDSA twin
        # (r, n - s), which verifies too, is that assertion used again (portcullis/jose.py).
        jti, kept_until = str(claims["jti"]), expires + leeway
        if not await self.store.use_jti(client.client_id, jti, kept_until, now):
            raise failed("replayed_jti")


def assertion_audiences(issuer: str, token_endpoint: str, policy: str) -> frozenset[str]:
    """What an assertion's `aud` may be under `client_assertion_audience`: the issuer
    identifier (draft-ietf-oauth-rfc7523bis, its update of RFC 7523 §3); `compat` adds the
    token endpoint URL, which Authlib and pyoidc send by default."""
    if policy == "compat":
        return frozenset({issuer, token_endpoint})
    return frozenset({issuer})


def _sole_audience(aud: Any, accepted: frozenset[str]) -> bool:
    """Whether `aud` names one accepted value and nothing else: a string, or an array of
    exactly one string. draft-ietf-oauth-rfc7523bis: the authorization server rejects an
    assertion without its issuer identifier as the sole audience, so an array that also
    names another party (an assertion made for, or passed through, someone else: the
    audience injection attack on client assertions) is refused, whatever else it holds."""
    if isinstance(aud, list):
        if len(aud) != 1:
            return False
        (aud,) = aud
    return isinstance(aud, str) and aud in accepted


# What a claim check PyJWT makes after the signature verified says about the assertion.
_CLAIM_FAILURES: tuple[tuple[type[jwt.PyJWTError], str], ...] = (
    (jwt.ExpiredSignatureError, "assertion_expired"),
    (jwt.ImmatureSignatureError, "assertion_not_yet_valid"),
    (jwt.InvalidIssuerError, "wrong_issuer"),
    (jwt.MissingRequiredClaimError, "missing_claim"),
    (jwt.DecodeError, "malformed_assertion"),
)


def _claims_reason(error: jwt.PyJWTError) -> str:
    for kind, reason in _CLAIM_FAILURES:
        if isinstance(error, kind):
            if isinstance(error, jwt.MissingRequiredClaimError):
                return f"{reason} ({error.claim})"
            return reason
    return "invalid_claims"


def _candidate_keys(jwks: Mapping[str, Any] | None, kid: Any, alg: str) -> list[Any]:
    """The client's signing keys that may have signed with `kid` and `alg`.

    A key whose JWK names another algorithm or another use is skipped (RFC 7517 §4.2, §4.4);
    keys of the wrong type for `alg` fail verification below and are skipped too.
    """
    entries = (jwks or {}).get("keys")
    if not isinstance(entries, list):
        return []
    keys = []
    for entry in entries:
        if not isinstance(entry, Mapping):
            continue
        if kid is not None and entry.get("kid") != kid:
            continue
        if entry.get("use", "sig") != "sig" or entry.get("alg", alg) != alg:
            continue
        try:
            keys.append(jwt.PyJWK(dict(entry)).key)
        except jwt.PyJWTError:
            continue
    return keys
