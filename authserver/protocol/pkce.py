"""PKCE (RFC 7636), S256 only.

`plain` is refused (RFC 9700 §2.1.1: use S256); verifier and challenge syntax are checked
(§4.1, §4.2: 43 to 128 characters of ALPHA / DIGIT / "-" / "." / "_" / "~").
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re

from .errors import invalid_grant, invalid_request

_SYNTAX = re.compile(r"^[A-Za-z0-9\-._~]{43,128}$")
SUPPORTED_METHODS = ("S256",)


def check_challenge(challenge: str | None, method: str | None) -> None:
    """Validate an authorization request's code_challenge and code_challenge_method."""
    if challenge is None:
        raise invalid_request("code_challenge is required (PKCE with S256)")
    if method is None:
        # RFC 7636 §4.3 would default to plain; plain is not supported, so the method
        # must be given explicitly.
        raise invalid_request("code_challenge_method is required and must be S256")
    if method != "S256":
        raise invalid_request("code_challenge_method must be S256")
    if not _SYNTAX.match(challenge):
        raise invalid_request("code_challenge must be 43-128 characters of [A-Za-z0-9-._~]")


def s256(verifier: str) -> str:
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def check_verifier(verifier: str | None, challenge: str | None) -> None:
    """Token request side: the verifier must hash to the challenge stored with the code.

    A verifier sent for a code issued without a challenge is rejected too: accepting it would
    let an attacker who injected such a code pass as PKCE-protected (RFC 9700 §4.8.2).
    """
    if challenge is None:
        if verifier is not None:
            raise invalid_grant("code_verifier sent for a code issued without code_challenge")
        return
    if verifier is None:
        raise invalid_grant("code_verifier is required")
    if not _SYNTAX.match(verifier):
        raise invalid_grant("code_verifier must be 43-128 characters of [A-Za-z0-9-._~]")
    if not hmac.compare_digest(s256(verifier), challenge):
        raise invalid_grant("code_verifier does not match the code_challenge")
