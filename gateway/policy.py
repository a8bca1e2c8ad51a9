"""Whether a verified principal may use a route. Pure: no I/O, no aiohttp.

Issuer and audience failures are 401 invalid_token (RFC 6750 §3.1: the token is not valid
for this resource); a missing scope is 403 insufficient_scope naming the scopes needed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .principal import Principal
from .records import Route
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


def decide(rule: Rule[Route], principal: Principal) -> Allow | Deny:
    audiences = rule.audiences_by_issuer.get(principal.issuer)
    if audiences is None:
        return Deny(401, "invalid_token", "tokens from this issuer are not accepted here")
    if audiences.isdisjoint(principal.audiences):
        return Deny(401, "invalid_token", "the token is not meant for this API (audience)")
    scopes = rule.settings.scopes
    if scopes is not None:
        if scopes.mode == "all":
            ok = scopes.scopes <= principal.scopes
        else:
            ok = not scopes.scopes.isdisjoint(principal.scopes)
        if not ok:
            needed = " ".join(sorted(scopes.scopes))
            what = "all of" if scopes.mode == "all" else "one of"
            return Deny(403, "insufficient_scope", f"the token needs {what}: {needed}", needed)
    return ALLOW
