"""The DPoP proof of a request (RFC 9449 §4.3) at the token endpoint and the resources
(userinfo, the admin API: resource_tokens.py).

The checks are the kernel's (portcullis/dpop.py, the same as the gateway's): one `DPoP`
header, a JWS of `typ: dpop+jwt` signed by an asymmetric `alg` with the public `jwk` it
carries, `htm`, `htu` (this endpoint's URL from the issuer, query and fragment ignored,
RFC 3986 normalised), `iat` within `dpop.proof_max_age` and `dpop.leeway`, `ath` when an
access token comes with it and, with `dpop.nonce`, a nonce the server gave. What is this
server's own is here:
- the policy: every asymmetric algorithm is accepted (the list discovery advertises); the
  ages and the nonces are the composition root's, from the settings;
- a failure is an `OAuthError` the endpoint renders: `invalid_dpop_proof` (§5, §7.1), or
  `use_dpop_nonce` (§8);
- the `jti` seen once: kept in the store's replay cache until the proof's `iat` leaves
  the window, so the check holds across replicas on one database. Kept with the key's
  thumbprint, never the signature: a proof's ECDSA twin (r, n - s), which verifies too,
  is that proof used again (portcullis/jose.py);
- the proofs counted by endpoint and result.
The proof's key thumbprint (RFC 7638) is what tokens are bound to.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta

from portcullis import dpop
from portcullis.dpop import ASYMMETRIC_ALGORITHMS, InvalidProof, NonceMaker, Proof, UseNonce

from .clock import Clock
from .metrics import Metrics
from .protocol.errors import ErrorCode, OAuthError
from .store.base import Store

__all__ = ["NonceMaker", "Proof", "ProofChecker", "invalid_proof"]

log = logging.getLogger("portcullis.authserver.dpop")

# The replay cache is the store's, shared with client assertions: proofs' ids are kept
# under this prefix and the key's thumbprint, apart from any client's.
_REPLAY_PREFIX = "dpop:"


def invalid_proof(description: str) -> OAuthError:
    return OAuthError(ErrorCode.INVALID_DPOP_PROOF, description)


class ProofChecker:
    def __init__(
        self,
        store: Store,
        clock: Clock,
        metrics: Metrics,
        *,
        max_age: timedelta,
        leeway: timedelta,
        nonces: NonceMaker | None = None,
    ) -> None:
        """Proofs as old as `max_age`, and from up to `leeway` ahead; with `nonces`, only
        those carrying one of them."""
        self.store = store
        self.clock = clock
        self.metrics = metrics
        self.nonces = nonces
        # Every asymmetric algorithm: the list discovery advertises (RFC 9449 §5.1).
        policy = dpop.ProofPolicy(
            frozenset(ASYMMETRIC_ALGORITHMS), max_age.total_seconds(), leeway.total_seconds()
        )
        self._checks = dpop.ProofChecker(policy, nonces)

    @property
    def algorithms(self) -> tuple[str, ...]:
        return ASYMMETRIC_ALGORITHMS

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
        """The proof's jti, once (§11.1). The token endpoint calls this after authenticating
        the client, so that nobody but a client fills the replay cache."""
        now = self.clock()
        if not await self.store.use_jti(
            _REPLAY_PREFIX + proof.jkt, proof.jti, proof.replay_until, now
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
        """The kernel's checks of the request's proof, for a request to `url` (the URL
        clients name in `htu`) with `access_token` (None at the token endpoint: no `ath`);
        None when it sent none, and the caller decides whether one was due."""
        if not headers:
            return None
        try:
            return self._checks.check(
                headers, method=method, uri=url, access_token=access_token, now=self.clock()
            )
        except UseNonce as refused:
            self._count(url, endpoint, "nonce_required")
            raise OAuthError(ErrorCode.USE_DPOP_NONCE, refused.description) from None
        except InvalidProof as refused:
            self._count(url, endpoint, "invalid")
            raise invalid_proof(refused.description) from None
