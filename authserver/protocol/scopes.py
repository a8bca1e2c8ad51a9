"""Scope strings (RFC 6749 §3.3): parsing, checking against what a client may ask for; and
the scopes every server knows, with what the consent page says of each."""

from __future__ import annotations

import re
from collections.abc import Iterable

from .errors import invalid_scope

_SCOPE_TOKEN = re.compile(r"^[\x21\x23-\x5B\x5D-\x7E]+$")

# OpenID Connect's (Core §5.4, and §11 offline_access).
STANDARD_SCOPES = {
    "openid": "Sign you in",
    "profile": "Know your name",
    "email": "Know your email address",
    "address": "Know your postal address",
    "phone": "Know your phone number",
    "offline_access": "Stay connected when you are away",
}
# Scopes every server knows besides those: the `roles` claim (RFC 9068 §2.2.3.1), and the
# admin API's, which only clients registered with them get.
BUILTIN_SCOPES = {
    "roles": "Know your roles",
    "admin:read": "Read the server's clients, users, grants and keys",
    "admin:write": "Change the server's clients, users, grants and keys",
}
KNOWN_SCOPES = {**STANDARD_SCOPES, **BUILTIN_SCOPES}


def parse(scope: str | None) -> tuple[str, ...]:
    """Space-delimited scope tokens in first-seen order, duplicates dropped."""
    if not scope:
        return ()
    seen: dict[str, None] = {}
    for token in scope.split(" "):
        if not token:
            continue
        if not _SCOPE_TOKEN.match(token):
            raise invalid_scope("scope contains a character that a scope may not hold")
        seen.setdefault(token, None)
    return tuple(seen)


def render(scopes: Iterable[str]) -> str:
    return " ".join(scopes)


def require_allowed(requested: Iterable[str], allowed: Iterable[str]) -> None:
    """Every requested scope must be one the client may ask for (else invalid_scope)."""
    allowed_set = set(allowed)
    refused = [s for s in requested if s not in allowed_set]
    if refused:
        # Not named: error_description never quotes what the request sent.
        raise invalid_scope("a requested scope is not allowed for this client")


def narrow(requested: Iterable[str], granted: Iterable[str]) -> tuple[str, ...]:
    """A refresh may ask for fewer scopes, never more (RFC 6749 §6)."""
    granted_set = set(granted)
    wanted = tuple(requested)
    extra = [s for s in wanted if s not in granted_set]
    if extra:
        raise invalid_scope("a requested scope is not in the original grant")
    return wanted
