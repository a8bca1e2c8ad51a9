"""Authentication context classes (`acr`, OIDC Core §2) this server asserts, and which
sign-ins satisfy them.

Two levels, named by URNs of the product's own (OIDC Core §2 leaves the values to the
server; none of a registry fits a password and an authenticator app better):
- `urn:portcullis:acr:pwd`: signed in with a password alone;
- `urn:portcullis:acr:mfa`: signed in with a password and a second factor.
The level of a sign-in follows from its `amr` (RFC 8176): `mfa` among the methods makes it
the second. A request for a level (`acr_values`, a client's `default_acr_values`, its
`require_mfa`) is met by a sign-in at that level or above; values this server does not know
are ignored, as OIDC Core §3.1.2.1 makes `acr_values` a voluntary claim.

Pure: standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

PASSWORD = "urn:portcullis:acr:pwd"  # noqa: S105 - a level's name, not a password
# The method of a sign-in at an upstream provider that named none (its ID token had no
# `amr`): kept in sessions so that no method is claimed for it, never written in an ID token.
EXTERNAL = "fed"
MULTI_FACTOR = "urn:portcullis:acr:mfa"
SUPPORTED = (PASSWORD, MULTI_FACTOR)  # lowest first
_RANK = {value: rank for rank, value in enumerate(SUPPORTED)}


def acr_of(amr: Sequence[str]) -> str:
    return MULTI_FACTOR if "mfa" in amr else PASSWORD


def needs_second_factor(requested: Iterable[str]) -> bool:
    """Whether the lowest known level among `requested` (a space-separated `acr_values`,
    split) asks for a second factor. OIDC Core §3.1.2.1 lists values in order of
    preference; any one of them satisfies, so the request asks for the least it lists."""
    known = [_RANK[value] for value in requested if value in _RANK]
    return bool(known) and min(known) >= _RANK[MULTI_FACTOR]


def known(value: str) -> bool:
    return value in _RANK
