"""What every verifier promises, and the two ways it can say no."""

from __future__ import annotations

from typing import Protocol

from ..core.principal import Principal


class InvalidToken(Exception):
    """The token is not acceptable: 401 with error="invalid_token" (RFC 6750 §3.1).

    The description is shown to the client, so it names the rule broken and never a key,
    a claim value or an internal detail.
    """

    def __init__(self, description: str) -> None:
        super().__init__(description)
        self.description = description


class VerifierUnavailable(Exception):
    """Verification cannot happen right now (no keys yet, issuer unreachable): 503."""


class Verifier(Protocol):
    """What the request path asks about a token: first `cached`, without waiting; on a miss,
    `verify`."""

    def cached(self, key: bytes) -> Principal | None:
        """The principal of a token verified (or found active) before and still valid, by
        the token's cache key (`cache.token_key`)."""
        ...

    @property
    def empty(self) -> bool:
        """Whether no token is cached: `cached` can only miss, so the token's cache key need
        not be computed (always so when every cache is off)."""
        ...

    async def verify(self, token: str) -> Principal:
        """The principal of a valid token; raises InvalidToken or VerifierUnavailable."""
        ...
