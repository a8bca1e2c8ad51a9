"""The checks a token gets whichever way it was verified: its lifetime and its subject.

Pure: claims (a JWT's payload, or what an introspection answer says about the token), the
time and the issuer's leeway in; the time the token stops being valid out, or InvalidToken.
 - `exp` (RFC 7519 §4.1.4): required in a JWT (RFC 9068 §2.2); optional in an
   introspection answer (RFC 7662 §2.2), where its absence means no expiry is known;
 - `nbf` (RFC 7519 §4.1.5), and for JWTs `iat` (§4.1.6) not in the future, with leeway;
 - `sub` (RFC 7519 §4.1.2): a non-empty string, the subject the identity headers name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeGuard

from .base import InvalidToken


def is_number(value: Any) -> TypeGuard[int | float]:
    """A JSON number (RFC 7519 §2 NumericDate): an int or float, never a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_validity(
    claims: Mapping[str, Any],
    now: float,
    leeway: float,
    *,
    exp_required: bool,
    check_iat: bool,
) -> float:
    """The token's `exp` (infinity when it has none and none is required), once `exp`,
    `nbf`, `iat` (with `check_iat`) and `sub` are acceptable at `now`; else InvalidToken."""
    exp = claims.get("exp")
    if exp is None and not exp_required:
        expires_at = math.inf
    elif is_number(exp):
        expires_at = float(exp)
        if now >= expires_at + leeway:
            raise InvalidToken("the token has expired")
    elif exp_required:
        raise InvalidToken("the token has no expiry")
    else:
        raise InvalidToken("the token has no usable expiry")
    nbf = claims.get("nbf")
    if nbf is not None and (not is_number(nbf) or now + leeway < nbf):
        raise InvalidToken("the token is not valid yet")
    if check_iat:
        iat = claims.get("iat")
        if iat is not None and (not is_number(iat) or iat > now + leeway):
            raise InvalidToken("the token was issued in the future")
    sub = claims.get("sub")
    if not isinstance(sub, str) or not sub:
        raise InvalidToken("the token has no subject")
    return expires_at
