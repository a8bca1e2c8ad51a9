"""Which verifier a token goes to, from the modes of the trusted issuers.

- mode `jwt`: JWTs naming the issuer in `iss` are verified locally against its keys.
- mode `auto`: the same, and every token that is not a JWT is introspected at this issuer.
- mode `introspection`: JWTs naming the issuer are introspected at it, and so is every token
  no other issuer claims (not a JWT, or a JWT whose `iss` is not a configured issuer).
At most one issuer takes the tokens nobody claims (settings enforce it): a token is never
sent to an issuer that could not have made it.

`build` chooses the verifier's class once per configuration: `JwtVerifier` alone when no
issuer introspects, else `DispatchingVerifier` in front of it and the introspectors.

The `iss` of a JWT is read before any signature check only to choose the verifier; the
verifier then checks everything as if it had not been read (the local one takes the payload
as parsed here, which is what it would have parsed itself, instead of parsing it again).
"""

from __future__ import annotations

import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from portcullis.jose import b64url_decode

from ..core.bearer import looks_like_jwt
from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.principal import Principal
from ..core.records import Issuer, KeySetTiming
from .base import Verifier
from .cache import TokenCache, token_key
from .introspection import Introspector
from .jwks import KeySet
from .jwt import JwtVerifier, TrustedIssuer


def unverified_claims(token: str) -> dict[str, Any] | None:
    """The payload of a JWT as a JSON object, or None when it cannot be read as one (nothing
    is trusted from it). Read as the local verifier reads it: canonical base64url, then JSON."""
    try:
        claims = orjson.loads(b64url_decode(token.split(".")[1]))
    except (binascii.Error, ValueError, IndexError):
        return None
    return claims if isinstance(claims, dict) else None


def _issuer_of(claims: dict[str, Any] | None) -> str | None:
    """The `iss` of unverified claims, or None when they have no string there."""
    iss = claims.get("iss") if claims is not None else None
    return iss if isinstance(iss, str) else None


class DispatchingVerifier:
    """Local JWT verification and introspection, each token sent to the one its issuer's
    mode names; each behind its own cache of verified tokens."""

    def __init__(
        self,
        jwt: JwtVerifier,
        jwt_cache: TokenCache,
        introspectors: Mapping[str, Introspector],
        unclaimed: Introspector | None,
        unclaimed_jwts: bool,
    ) -> None:
        self._jwt = jwt
        self._jwt_cache = jwt_cache
        self._introspectors = dict(introspectors)  # issuer -> introspector, modes auto too
        self._introspected_jwts = {
            url: i for url, i in introspectors.items() if i.issuer.mode == "introspection"
        }
        self._caches: Sequence[Introspector] = tuple(introspectors.values())
        self._unclaimed = unclaimed
        self._unclaimed_jwts = unclaimed_jwts  # unknown-iss JWTs go to `unclaimed` too

    @property
    def empty(self) -> bool:
        """Whether no token is cached, by the local verifier or any introspector."""
        return not len(self._jwt_cache) and not any(len(i.cache) for i in self._caches)

    def cached(self, key: bytes) -> Principal | None:
        """The principal of a token verified (or found active) before and still valid (`key`:
        the token's `token_key`)."""
        principal = self._jwt_cache.look(key)
        if principal is None:
            for introspector in self._caches:
                principal = introspector.cached(key)
                if principal is not None:
                    break
        return principal

    async def verify(self, token: str) -> Principal:
        if looks_like_jwt(token):
            claims = unverified_claims(token)
            iss = _issuer_of(claims)
            introspector = self._introspected_jwts.get(iss) if iss is not None else None
            if introspector is None and self._unclaimed_jwts and not self._jwt.trusts(iss):
                introspector = self._unclaimed
            if introspector is None:
                # The payload is not decoded and parsed a second time: the local checks
                # read the object parsed here, which is what they would have parsed.
                return await self._jwt.verify(token, claims)
            return await introspector.verify(token, token_key(token))
        if self._unclaimed is not None:
            return await self._unclaimed.verify(token, token_key(token))
        return await self._jwt.verify(token)


def keyset_identity(issuer: Issuer, jwks: KeySetTiming) -> tuple[object, ...]:
    """What a key set depends on: the same values mean the same keys (kept on reload)."""
    return (issuer.issuer, issuer.jwks_uri, issuer.allow_http, issuer.ca_file, jwks)


def introspector_identity(issuer: Issuer) -> tuple[object, ...]:
    return (
        issuer.issuer,
        issuer.allow_http,
        issuer.leeway,
        issuer.introspection,
        issuer.ca_file,
    )


@dataclass
class Verification:
    """A verifier and the per-issuer state it reads, by identity."""

    verifier: Verifier
    keysets: dict[tuple[object, ...], KeySet]
    introspectors: dict[tuple[object, ...], Introspector]
    epoch: object  # make it the token cache's epoch when this verifier goes into service


def build(
    issuers: Sequence[Issuer],
    jwks: KeySetTiming,
    keys_session: aiohttp.ClientSession,
    cache: TokenCache,
    keysets: Mapping[tuple[object, ...], KeySet] | None = None,
    introspectors: Mapping[tuple[object, ...], Introspector] | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> Verification:
    """The verifier for these issuers, reusing the key sets and introspectors given whose
    settings are the same (new ones are not started)."""
    keysets = keysets or {}
    introspectors = introspectors or {}
    used_keysets: dict[tuple[object, ...], KeySet] = {}
    used_introspectors: dict[tuple[object, ...], Introspector] = {}
    trusted: dict[str, TrustedIssuer] = {}
    by_issuer: dict[str, Introspector] = {}
    unclaimed: Introspector | None = None
    for issuer in issuers:
        if issuer.uses_keys:
            identity = keyset_identity(issuer, jwks)
            keyset = keysets.get(identity) or KeySet(
                issuer, jwks, keys_session, clock.monotonic, clock.sleep
            )
            used_keysets[identity] = keyset
            trusted[issuer.issuer] = TrustedIssuer(
                require_typ=issuer.require_typ,
                keys=keyset,
                algorithms=frozenset(issuer.algorithms),
                leeway=issuer.leeway.total_seconds(),
            )
        if issuer.introspection is not None and issuer.takes_opaque_tokens:
            identity = introspector_identity(issuer)
            introspector = introspectors.get(identity) or Introspector(
                issuer, issuer.introspection, clock
            )
            used_introspectors[identity] = introspector
            by_issuer[issuer.issuer] = introspector
            unclaimed = introspector
    epoch = object()
    jwt = JwtVerifier(trusted, cache, clock.wall, epoch)
    verifier: Verifier = jwt
    if by_issuer:
        verifier = DispatchingVerifier(
            jwt,
            cache,
            by_issuer,
            unclaimed,
            unclaimed_jwts=unclaimed is not None and unclaimed.issuer.mode == "introspection",
        )
    return Verification(verifier, used_keysets, used_introspectors, epoch)
