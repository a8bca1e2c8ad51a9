"""Local verification of JWT access tokens against the issuers' cached key sets.

The checks, in order (each failure is a 401 invalid_token with a short description):
 1. verified-token cache: a hit skips everything below until the token expires;
 2. compact JWS shape, each part canonical base64url (RFC 7515 §2, RFC 4648 §5: its own
    alphabet, no padding, zero pad bits), so one token has one spelling and the cache can
    never hold a second name for a signature; header and payload are JSON objects. (An
    ECDSA signature (r, s) and its twin (r, n - s) both verify, and issuers sign either:
    both are taken, and are one token to the cache, keyed by the low-S spelling:
    cache.token_key, portcullis/jose.py);
 3. `alg` on the issuer's allow-list (never `none` or HS*: RFC 8725 §3.1-3.2), no `crit`
    we do not understand (we understand none: RFC 7515 §4.1.11); `jku`, `x5u` and `jwk`
    headers are ignored, keys only ever come from the configured key set (RFC 8725 §3.10);
 4. `iss` is a configured issuer, exact string match, before any network call;
 5. `typ` is `at+jwt` when the issuer requires it (RFC 9068 §4);
 6. key by `kid` whose `kty`/`crv`/`alg` fit the header's `alg`; an unknown kid may trigger
    one throttled key refresh;
 7. signature;
 8. `exp` (required), `nbf`, `iat` with leeway; `sub` and `aud` present;
 9. not an ID token (RFC 9068 §4 asks resource servers to tell them apart);
10. the scope claim is a list of RFC 6749 §3.3 scope tokens (principal.normalise_scopes);
11. a `cnf` claim names a DPoP key (`jkt`, RFC 9449 §6.1): the proof is checked per request
    by the pipeline's bind-check, cache hit or not.
Audience and scope are route-specific and belong to policy.decide. Steps 2-11 run only for a
token the cache of step 1 does not hold, and what they accept is what it then holds.
"""

from __future__ import annotations

import binascii
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from portcullis.jose import NotAnObject, compact_parts, decode_checked_alphabet, json_object
from portcullis.jose import b64url_decode as b64url_decode  # the canonical decoder, re-exported

from ..core.clock import Now
from ..core.principal import MalformedScope, Principal, UnsupportedBinding, from_claims
from .base import InvalidToken, VerifierUnavailable
from .cache import TokenCache, token_key
from .jwks import KeySet, VerifyKey
from .signatures import SignatureBatch
from .validity import check_validity

_AT_JWT_TYPES = frozenset({"at+jwt", "application/at+jwt"})  # RFC 9068 §4, case-insensitive
# Distinct token headers remembered parsed: an issuer's tokens share one per signing key.
# Only headers of up to _HEADER_CHARS_REMEMBERED characters are kept (an `alg`, `typ` and
# `kid` take about 100), so the memory holds 256 KiB at most.
_HEADERS_REMEMBERED = 256
_HEADER_CHARS_REMEMBERED = 1024


def _json_object(part: str, what: str) -> dict[str, Any]:
    """The JSON object the token's header or payload (`what`) encodes."""
    try:
        return json_object(part)
    except NotAnObject as exc:
        raise InvalidToken(f"the token {what} {exc.problem}") from None


@dataclass(frozen=True)
class TrustedIssuer:
    require_typ: bool  # RFC 9068 §4
    keys: KeySet
    algorithms: frozenset[str]
    leeway: float  # seconds


class JwtVerifier:
    """The verifier when every issuer's tokens are JWTs checked here: the verified-token
    cache, then the checks above."""

    def __init__(
        self,
        issuers: Mapping[str, TrustedIssuer],
        cache: TokenCache,
        now: Now = time.time,
        epoch: object | None = None,
    ) -> None:
        self._issuers = issuers
        self._cache = cache
        # The principal of a token verified before and not expired since, else None, by the
        # token's `token_key`: the cache's own look, which the request path calls directly.
        self.cached: Callable[[bytes], Principal | None] = cache.look
        self._epoch = epoch  # the cache takes this verifier's verdicts while it is current
        self._now = now  # the wall clock, the scale of exp, nbf and iat
        self._accepted_algorithms = frozenset(
            alg for issuer in issuers.values() for alg in issuer.algorithms
        )
        # Encoded header -> the JSON object it decodes to, only read once parsed. Emptied
        # when full, so headers made up to fill it leave no lasting mark.
        self._headers: dict[str, dict[str, Any]] = {}
        self._signatures = SignatureBatch()  # checked together at the end of a loop turn

    def trusts(self, iss: str | None) -> bool:
        """Whether `iss` is an issuer whose JWTs this verifier checks itself."""
        return iss in self._issuers

    @property
    def empty(self) -> bool:
        """Whether no token is cached (always so when the cache is off)."""
        return not len(self._cache)

    async def verify(self, token: str, payload: dict[str, Any] | None = None) -> Principal:
        """The principal of a valid token, else InvalidToken or VerifierUnavailable.
        `payload`: the token's payload as a caller already parsed it from this token
        (dispatch.unverified_claims), so it is not decoded and parsed again; None when it
        could not be, or was not."""
        cache = self._cache
        if cache.off:
            # Nothing to find and nothing to keep: the token needs no digest.
            cache.count_miss()
            principal, _ = await self._verify(token, payload)
            return principal
        key = token_key(token)
        cached = cache.get(key)
        if cached is not None:
            return cached
        principal, valid_until = await self._verify(token, payload)
        cache.put(key, principal, valid_until, self._epoch)
        return principal

    async def _verify(self, token: str, payload: dict[str, Any] | None) -> tuple[Principal, float]:
        parts = compact_parts(token)
        if parts is None:
            raise InvalidToken("the token is not a signed JWT")
        header_b64, payload_b64, signature_b64 = parts
        header = self._headers.get(header_b64)
        if header is None:
            header = _json_object(header_b64, "header")
            if len(header_b64) <= _HEADER_CHARS_REMEMBERED:
                if len(self._headers) >= _HEADERS_REMEMBERED:
                    self._headers.clear()
                self._headers[header_b64] = header
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self._accepted_algorithms:
            raise InvalidToken("the token's signing algorithm is not accepted")
        if "crit" in header:
            raise InvalidToken("the token has critical header parameters that are not supported")
        claims = _json_object(payload_b64, "payload") if payload is None else payload
        # Decoded before any key lookup: a signature spelt otherwise than canonically is
        # refused without the refetch an unknown kid may cause.
        try:
            signature = decode_checked_alphabet(signature_b64)
        except binascii.Error:
            raise InvalidToken("the token signature is not base64url") from None

        iss = claims.get("iss")
        # An `iss` that is not a string (an array, an object) is untrusted, not a server error.
        issuer = self._issuers.get(iss) if isinstance(iss, str) else None
        if issuer is None:
            raise InvalidToken("the token's issuer is not trusted")
        if alg not in issuer.algorithms:
            raise InvalidToken("the token's signing algorithm is not accepted")
        if issuer.require_typ:
            typ = header.get("typ")
            if not isinstance(typ, str) or typ.lower() not in _AT_JWT_TYPES:
                raise InvalidToken("the token is not an access token (typ must be at+jwt)")

        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise InvalidToken("the token's kid is not a string")
        verify_key = issuer.keys.find(kid, alg)
        if verify_key is None:
            verify_key = await self._key_after_miss(issuer, kid, alg)

        signing_input = token[: len(header_b64) + 1 + len(payload_b64)].encode()
        if not await self._signatures.verify(alg, verify_key.key, signing_input, signature):
            raise InvalidToken("the token signature is invalid")

        leeway = issuer.leeway
        exp = check_validity(claims, self._now(), leeway, exp_required=True, check_iat=True)
        aud = claims.get("aud")
        if not (isinstance(aud, str) or (isinstance(aud, list) and aud)):
            raise InvalidToken("the token has no audience")
        if _is_id_token(claims):
            raise InvalidToken("ID tokens are not access tokens")
        try:
            principal = from_claims(claims)
        except MalformedScope:
            raise InvalidToken("the token's scope is not a list of scope tokens") from None
        except UnsupportedBinding as exc:
            raise InvalidToken(str(exc)) from None
        return principal, exp + leeway

    @staticmethod
    async def _key_after_miss(issuer: TrustedIssuer, kid: str | None, alg: str) -> VerifyKey:
        """The key that must have signed the token, when the set in memory has none that
        fits. Only a kid the set does not hold (or no set at all yet) may refetch: a known
        kid naming a key of another type never does."""
        keys = issuer.keys
        if not keys.loaded or not keys.knows(kid):
            await keys.refetch_for_unknown_kid()
            verify_key = keys.find(kid, alg)
            if verify_key is not None:
                return verify_key
        if not keys.loaded:
            raise VerifierUnavailable("the issuer's keys are not loaded yet")
        if kid is None:
            if keys.count_fitting(alg) > 1:
                raise InvalidToken(
                    "the token has no kid and more than one key could have signed it"
                )
            raise InvalidToken("the token is signed with an unknown key")
        if keys.knows(kid):
            # RFC 8725 §3.1: the key's type (and curve) must be the one the algorithm needs.
            raise InvalidToken("the token's key does not fit its algorithm")
        raise InvalidToken("the token is signed with an unknown key")


# OpenID Connect Core defines these for ID tokens alone (§2 nonce, §3.1.3.6 at_hash, §3.3.2.11
# c_hash); RFC 9068 §2.2 gives access tokens none of them.
_ID_TOKEN_ONLY = ("nonce", "at_hash", "c_hash")
# The authentication event (OIDC Core §2). RFC 9068 §2.2.1 lets access tokens carry them too,
# so they mark an ID token only where the claims every access token has and an ID token
# lacks (RFC 9068 §2.2: client_id; §2.2.3: scope) are missing as well.
_AUTHENTICATION_CLAIMS = ("auth_time", "acr", "amr")


def _is_id_token(claims: Mapping[str, Any]) -> bool:
    """An OpenID Connect ID token offered as an access token. RFC 9068 §4 asks resource
    servers to tell the two apart; `typ` does when the issuer sets it (RFC 8725 §3.11), and
    without it the claims must (RFC 8725 §3.12: mutually exclusive rules for each kind):
    a claim only ID tokens have, authentication claims without scope or client_id, or an
    audience that is the client itself (`aud` equal to `azp`/`client_id`) and no scope."""
    if any(name in claims for name in _ID_TOKEN_ONLY):
        return True
    if "scope" in claims or "scp" in claims:
        return False
    if "client_id" not in claims and any(name in claims for name in _AUTHENTICATION_CLAIMS):
        return True
    aud = claims.get("aud")
    audiences = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
    client = claims.get("azp", claims.get("client_id"))
    return isinstance(client, str) and audiences == [client]
