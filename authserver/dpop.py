"""Checking the DPoP proof of a request (RFC 9449 §4.3) at the token endpoint and the
resources (userinfo, the admin API: endpoints/resource_tokens.py).

In the order of §4.3, each failure an `OAuthError` the endpoint renders:
 1. exactly one `DPoP` header (none: no proof, and the caller decides whether one was due);
 2. a JWS whose header is `typ: dpop+jwt`, an allowed asymmetric `alg` and a public `jwk`
    (protocol/dpop.py);
 3. the signature verifies with that `jwk`;
 4. the claims: `htm`, `htu` (this endpoint's URL from the issuer, query and fragment
    ignored), `iat` within `dpop.proof_max_age` and `dpop.leeway`, `ath` when an access
    token comes with it (protocol/dpop.py);
 5. with `dpop.nonce`, a nonce the server gave (`use_dpop_nonce` otherwise, §8);
 6. the `jti` seen once: kept in the store's replay cache until the proof's `iat` leaves
    the window, so the check holds across replicas on one database. Kept with the key's
    thumbprint, never the signature: a proof's ECDSA twin (r, n - s), which verifies too,
    is that proof used again (portcullis/jose.py).
A failure is `invalid_dpop_proof` (§5, §7.1). The proof's key thumbprint (RFC 7638) is what
tokens are bound to.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import jwt

from .clock import Clock
from .metrics import Metrics
from .protocol import dpop
from .protocol.dpop import NonceRequired, Nonces, ProofError
from .protocol.errors import ErrorCode, OAuthError
from .settings import DpopSettings
from .store.base import Store

log = logging.getLogger("portcullis.authserver.dpop")

# The replay cache is the store's, shared with client assertions: proofs' ids are kept
# under this prefix and the key's thumbprint, apart from any client's.
_REPLAY_PREFIX = "dpop:"


@dataclass(frozen=True)
class Proof:
    """A proof whose checks 1 to 5 passed: the thumbprint of the key it was signed with,
    and its `jti`, to be used once (`use`) until `kept_until`."""

    jkt: str
    jti: str
    kept_until: float


def invalid_proof(description: str) -> OAuthError:
    return OAuthError(ErrorCode.INVALID_DPOP_PROOF, description)


class ProofChecker:
    def __init__(
        self, settings: DpopSettings, store: Store, clock: Clock, metrics: Metrics
    ) -> None:
        self.store = store
        self.clock = clock
        self.metrics = metrics
        self.max_age = settings.proof_max_age.total_seconds()
        self.leeway = settings.leeway.total_seconds()
        self.nonces: Nonces | None = None
        if settings.nonce:
            if not settings.nonce_key:  # settings refuse this: never serve without nonces
                raise ValueError("dpop.nonce needs dpop.nonce_key")
            key = str(settings.nonce_key).encode()
            self.nonces = Nonces(key, settings.nonce_lifetime.total_seconds())

    @property
    def algorithms(self) -> tuple[str, ...]:
        return dpop.ALGORITHMS

    def nonce(self) -> str | None:
        """The nonce to give clients now (the `DPoP-Nonce` header), when nonces are required."""
        return self.nonces.current(self.clock()) if self.nonces is not None else None

    async def check(
        self,
        headers: Sequence[str],
        method: str,
        url: str,
        access_token: str | None = None,
        endpoint: str | None = None,
    ) -> Proof | None:
        """The request's proof, every check passed and its jti used; None when it sent none.
        `endpoint` names the endpoint in the metrics (the last segment of `url` if None)."""
        proof = self.verify(headers, method, url, access_token, endpoint)
        if proof is not None:
            await self.use(proof, url, endpoint)
        return proof

    async def use(self, proof: Proof, url: str, endpoint: str | None = None) -> None:
        """6: the proof's jti, once. The token endpoint calls this after authenticating the
        client, so that nobody but a client fills the replay cache."""
        now = self.clock()
        if not await self.store.use_jti(
            _REPLAY_PREFIX + proof.jkt, proof.jti, proof.kept_until, now
        ):
            log.info("DPoP proof replayed", extra={"endpoint": url})
            self._count(url, endpoint, "replayed")
            raise invalid_proof("the DPoP proof was already used")
        self._count(url, endpoint, "accepted")

    def _count(self, url: str, endpoint: str | None, result: str) -> None:
        # The endpoint by name, else by the last segment of its URL (token, userinfo): a
        # bounded set of labels, never a path with ids in it (the admin API's).
        self.metrics.dpop_proof(endpoint or url.rsplit("/", 1)[-1], result)

    def verify(
        self,
        headers: Sequence[str],
        method: str,
        url: str,
        access_token: str | None = None,
        endpoint: str | None = None,
    ) -> Proof | None:
        """Checks 1 to 5 of the request's proof; None when it sent none."""
        try:
            return self._verify(headers, method, url, access_token)
        except OAuthError as error:
            nonce = error.code is ErrorCode.USE_DPOP_NONCE
            self._count(url, endpoint, "nonce_required" if nonce else "invalid")
            raise

    def _verify(
        self, headers: Sequence[str], method: str, url: str, access_token: str | None
    ) -> Proof | None:
        if not headers:
            return None
        if len(headers) > 1:  # 1
            raise invalid_proof("send exactly one DPoP header")
        token = headers[0].strip()
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError:
            raise invalid_proof("the DPoP proof is not a JWT") from None
        try:
            alg, jwk = dpop.check_header(header)  # 2
            jkt = dpop.thumbprint(jwk)
            key = jwt.PyJWK(dict(jwk), algorithm=alg).key
        except ProofError as error:
            raise invalid_proof(str(error)) from None
        except (jwt.PyJWTError, ValueError, TypeError, KeyError):
            raise invalid_proof("the proof's jwk is not a usable key for its alg") from None
        try:
            payload = jwt.decode(  # 3: the signature only; the claims are checked below
                token,
                key,
                algorithms=[alg],
                options={
                    "verify_exp": False,
                    "verify_nbf": False,
                    "verify_iat": False,
                    "verify_aud": False,
                    "verify_iss": False,
                },
            )
        except (jwt.InvalidTokenError, ValueError, TypeError):
            raise invalid_proof("the DPoP proof's signature does not verify") from None
        now = self.clock()
        try:
            claims = dpop.check_claims(  # 4
                payload,
                method=method,
                url=url,
                now=now,
                max_age=self.max_age,
                leeway=self.leeway,
                access_token=access_token,
            )
            if self.nonces is not None:  # 5
                self.nonces.check(claims.nonce, now)
        except NonceRequired as error:
            raise OAuthError(ErrorCode.USE_DPOP_NONCE, str(error)) from None
        except ProofError as error:
            raise invalid_proof(str(error)) from None
        # Remembered until the window would refuse the proof anyway.
        return Proof(jkt, claims.jti, claims.iat + self.max_age + self.leeway)
