"""Whether a verified principal may use a route. Pure: no I/O, no aiohttp.

Issuer and audience failures are 401 invalid_token (RFC 6750 §3.1: the token is not valid
for this resource); a missing scope is 403 insufficient_scope naming the scopes needed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .principal import Principal
from .records import Route, Scopes
from .rules import Rule


@dataclass(frozen=True, slots=True)
class Allow:
    pass


@dataclass(frozen=True, slots=True)
class Deny:
    status: int
    code: str  # invalid_token | insufficient_scope
    reason: str
    scope: str | None = None  # for insufficient_scope: the scopes that would do


ALLOW = Allow()


def holds(needed: Scopes, scopes: frozenset[str]) -> bool:
    """Whether `scopes` meet what is `needed`: every one (`all`), or one of them (`any`)."""
    if needed.mode == "all":
        return needed.scopes <= scopes
    return not needed.scopes.isdisjoint(scopes)


def wording(needed: Scopes) -> str:
    """How a refusal names what is needed: "all of: a b", "one of: a b"."""
    what = "all of" if needed.mode == "all" else "one of"
    return f"{what}: {' '.join(sorted(needed.scopes))}"


def decide(rule: Rule[Route], principal: Principal) -> Allow | Deny:
    audiences = rule.audiences_by_issuer.get(principal.issuer)
    if audiences is None:
        return Deny(401, "invalid_token", "tokens from this issuer are not accepted here")
    if audiences.isdisjoint(principal.audiences):
        return Deny(401, "invalid_token", "the token is not meant for this API (audience)")
    scopes = rule.settings.scopes
    if scopes is not None and not holds(scopes, principal.scopes):
        needed = " ".join(sorted(scopes.scopes))
        return Deny(403, "insufficient_scope", f"the token needs {wording(scopes)}", needed)
    return ALLOW
