"""The bearer token of a request, from the Authorization header only (RFC 6750 §2.1).

Tokens in the query string (§2.3) or a form body (§2.2) are never looked at: they end up in
logs and caches. Pure: works on header values, not on a request object.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# RFC 6750 §2.1: credentials = "Bearer" 1*SP b64token
_B64TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


class MalformedAuthorization(ValueError):
    """The Authorization header is present but cannot be a bearer credential (400)."""


def extract(authorization: Sequence[str]) -> str | None:
    """The token from the request's Authorization header values, or None when there is none.

    Several Authorization headers, or a Bearer credential that is not a b64token, raise
    MalformedAuthorization: RFC 6750 §3.1 answers those with 400 invalid_request. A header
    with another scheme (Basic, ...) is not a bearer token: None, so the client is told that
    Bearer is expected.
    """
    if not authorization:
        return None
    if len(authorization) > 1:
        raise MalformedAuthorization("more than one Authorization header")
    scheme, _, rest = authorization[0].strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    token = rest.strip(" ")
    if not _B64TOKEN.fullmatch(token):
        raise MalformedAuthorization("the bearer token is not a valid b64token")
    return token


def looks_like_jwt(token: str) -> bool:
    """A JWS compact serialisation: three dot-separated parts, the header a JSON object."""
    return token.count(".") == 2 and token.startswith("eyJ")
