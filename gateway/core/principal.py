"""Who a verified token speaks for: issuer, subject, client, scopes, audiences and claims.

Pure: built from a claims mapping, whatever verified it (a JWT signature or introspection).
"""

from __future__ import annotations

import re
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, TypeVar


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Principal:
    """Immutable, claims included: one principal serves every request with the same token
    (through the verified-token cache), so nothing is written to it after verification;
    what is derived from it per use is kept by whoever derives it."""

    issuer: str
    subject: str
    client_id: str | None
    scopes: frozenset[str]
    audiences: tuple[str, ...]
    expires_at: float  # seconds since the epoch
    claims: Mapping[str, Any]
    # The RFC 7638 thumbprint of the key the token is bound to (RFC 9449 §6: `cnf.jkt`);
    # None for a bearer token.
    jkt: str | None = None


T = TypeVar("T")


class Derived(Generic[T]):
    """What is derived from principals (their identity headers, say), remembered for as long
    as each principal lives elsewhere and never longer: an entry is held by a weak reference
    and goes when its principal does. So it holds no more than the caches that give
    principals out again (and the requests in flight) keep alive, whatever its `limit`, which
    bounds it besides (the oldest entry goes first).

    Keyed by the principal's identity: one principal serves every request with its token,
    and principals are compared by value nowhere on the request path."""

    __slots__ = ("_entries", "_limit")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._entries: OrderedDict[int, tuple[weakref.ref[Principal], T]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def principals(self) -> list[Principal]:
        """The principals remembered, the oldest first."""
        return [p for ref, _ in self._entries.values() if (p := ref()) is not None]

    def get(self, principal: Principal) -> T | None:
        found = self._entries.get(id(principal))
        if found is None or found[0]() is not principal:
            return None
        return found[1]

    def put(self, principal: Principal, value: T) -> None:
        entries = self._entries
        if len(entries) >= self._limit:
            entries.popitem(last=False)  # the oldest
        key = id(principal)

        def gone(ref: weakref.ref[Principal], entries: OrderedDict[int, Any] = entries) -> None:
            # The id is reused only after this runs: the entry under it is this one's or none.
            found = entries.get(key)
            if found is not None and found[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(principal, gone), value)


class MalformedScope(ValueError):
    """The scope claim holds something that is not a scope token (the token is refused)."""


class UnsupportedBinding(ValueError):
    """The token is bound to something the gateway cannot check (the token is refused)."""


def bound_key(claims: Mapping[str, Any]) -> str | None:
    """The thumbprint of the key a token is bound to (RFC 9449 §6.1, §6.2: `cnf.jkt`), None
    for a token without `cnf`. A `cnf` without `jkt` (RFC 8705's certificate thumbprint, a
    whole `jwk`, ...) raises UnsupportedBinding: the gateway checks DPoP bindings alone, and
    taking such a token as a bearer token would drop the binding its issuer meant."""
    cnf = claims.get("cnf")
    if cnf is None:
        return None
    jkt = cnf.get("jkt") if isinstance(cnf, dict) else None
    if not isinstance(jkt, str) or not jkt:
        raise UnsupportedBinding("the token's cnf names no DPoP key (cnf.jkt)")
    return jkt


# RFC 6749 §3.3: scope-token = 1*( %x21 / %x23-5B / %x5D-7E ): visible ASCII but `"` and `\`.
# Checked over a whole claim at once: every scope token of a string is made of these
# characters exactly when the string is made of them and the spaces between its tokens, and
# every element of an array exactly when the elements put end to end are.
_SCOPE_STRING = re.compile(r"[\x21\x23-\x5B\x5D-\x7E ]*")
_SCOPE_CHARACTERS = re.compile(r"[\x21\x23-\x5B\x5D-\x7E]*")
_EMPTY = frozenset({""})
_SCOPE_REFUSED = "a scope token holds characters RFC 6749 §3.3 does not allow"


def normalise_scopes(claims: Mapping[str, Any]) -> frozenset[str]:
    """Scopes from `scope` (RFC 9068 §2.2.3, space-separated), else `scp`.

    Issuers differ in the shape: either claim may be a space-separated string or an array of
    strings; the first of the two that has a usable shape is taken. A string is split on
    U+0020 alone (RFC 6749 §3.3), never on other whitespace, and an array element is one
    scope, never split again: a token granted the one odd scope "x<NBSP>orders:write" does
    not hold `orders:write`. A scope token with characters outside the RFC 6749 §3.3 set
    raises MalformedScope: such a claim cannot be read one way only, so it is not read at all.
    Empty items (from repeated spaces, or "" in an array) carry no scope and are dropped.
    """
    for name in ("scope", "scp"):
        value = claims.get(name)
        if isinstance(value, str):
            if not _SCOPE_STRING.fullmatch(value):
                raise MalformedScope(_SCOPE_REFUSED)
            scopes = frozenset(value.split(" "))
            return scopes - _EMPTY if "" in scopes else scopes
        if isinstance(value, list):
            items = [item for item in value if isinstance(item, str)]
            if not _SCOPE_CHARACTERS.fullmatch("".join(items)):
                raise MalformedScope(_SCOPE_REFUSED)
            return frozenset(item for item in items if item)
    return frozenset()


def audiences_of(claims: Mapping[str, Any]) -> tuple[str, ...]:
    """`aud` is a string or an array of strings (RFC 7519 §4.1.3)."""
    aud = claims.get("aud")
    if isinstance(aud, str):
        return (aud,)
    if isinstance(aud, list):
        return tuple(a for a in aud if isinstance(a, str))
    return ()


def from_claims(claims: Mapping[str, Any]) -> Principal:
    """A principal from claims already checked by a verifier (iss, sub and exp present);
    raises MalformedScope for a scope claim that is not a list of scope tokens, and
    UnsupportedBinding for a `cnf` that is not a DPoP binding."""
    # RFC 9068 §2.2 names `client_id`; OpenID Connect providers often give only `azp`.
    client_id = claims.get("client_id")
    if not isinstance(client_id, str) or not client_id:
        azp = claims.get("azp")
        client_id = azp if isinstance(azp, str) and azp else None
    # In the order of the fields, not by name: made once per verified token, and a frozen
    # dataclass takes keywords a third slower.
    return Principal(
        claims["iss"],  # issuer
        claims["sub"],  # subject
        client_id,
        normalise_scopes(claims),  # scopes
        audiences_of(claims),  # audiences
        float(claims["exp"]),  # expires_at
        MappingProxyType(dict(claims)),  # claims: a read-only copy
        bound_key(claims),  # jkt
    )
