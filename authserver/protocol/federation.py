"""Signing in through an upstream OpenID Connect provider, the parts that need no I/O: what
the authorization response and the ID token must say, and what a first sign-in may do.

The checks, in the order federation.py runs them on the way back from the provider:
 1. `check_response_issuer`: the `iss` of the authorization response (RFC 9207 §2.4), when
    sent or promised;
 2. `id_token_algorithms`: what the ID token may be signed with: the algorithms the provider
    advertises, public-key ones only (never `none`, never HMAC, whose key would be the
    client secret, RFC 8725 §3.1); RS256 when it advertises none (OIDC Discovery §3);
 3. `check_id_token_claims`: OIDC Core §3.1.3.7, steps 2, 3, 4, 9, 10 and 11 (the signature,
    steps 6 and 7, is federation.py's, with the keys of the provider's jwks_uri);
 4. `with_userinfo`: the claims the ID token lacks, from the userinfo response about the
    same `sub` (OIDC Core §5.3.2);
 5. `email_to_link`: whether a first sign-in may be linked to an existing user: only by the
    operator's rule, an email the provider says is verified, of a trusted domain;
 6. `profile_of`: what a user created at a first sign-in is given;
 7. `refreshed_claims`, `offered_username`: what a linked user's later sign-ins change of
    them: the mapped claims the provider now gives, an address only once it is verified.
Every refusal is a `FederationRefused` whose message can be shown as it is.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

# RFC 7518 §3.1 and RFC 8037: the public-key JWS algorithms an ID token may use.
PUBLIC_KEY_ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
DEFAULT_ALGORITHM = "RS256"  # OIDC Discovery §3: always supported by a provider
LEEWAY = 60.0  # seconds of clock difference allowed either way on exp and iat
MAX_ID_TOKEN_AGE = 600.0  # seconds: an older `iat` is refused (OIDC Core §3.1.3.7 step 10)
_USERNAME = re.compile(r"[^A-Za-z0-9._@+-]+")


class FederationRefused(Exception):
    """Why a sign-in through a provider is refused: `reason` for the log and metrics, the
    message for the person."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def check_response_issuer(given: str | None, issuer: str, advertised: bool) -> None:
    """RFC 9207 §2.4: an `iss` sent must be the provider's exactly; one the provider
    promised (`authorization_response_iss_parameter_supported`) must be sent."""
    if given is None:
        if advertised:
            raise FederationRefused("iss_missing", "The sign-in response did not name its issuer.")
        return
    if given != issuer:
        raise FederationRefused(
            "iss_mismatch", "The sign-in response came from another issuer than the one asked."
        )


def endpoint_allowed(issuer: str, url: object) -> TypeGuard[str]:
    """Whether a URL of the discovery document may be used: https for an https issuer (the
    code, the client's credentials and the tokens travel there); plain http only when the
    issuer is itself plain http, which the configuration allows on loopback alone."""
    if not isinstance(url, str) or "#" in url:
        return False
    if url.startswith("https://"):
        return len(url) > len("https://")
    return issuer.startswith("http://") and url.startswith("http://") and len(url) > len("http://")


def id_token_algorithms(advertised: object) -> frozenset[str]:
    """Step 2: what the provider's `id_token_signing_alg_values_supported` allows of the
    public-key algorithms."""
    if not isinstance(advertised, list):
        return frozenset({DEFAULT_ALGORITHM})
    return PUBLIC_KEY_ALGORITHMS.intersection(a for a in advertised if isinstance(a, str))


@dataclass(frozen=True)
class Expected:
    """What the ID token of one sign-in must say."""

    issuer: str
    client_id: str
    nonce: str
    now: float


def check_id_token_claims(claims: Mapping[str, Any], expected: Expected) -> str:
    """Step 3, the claims of an ID token whose signature was verified; its `sub`."""

    def refuse(reason: str, problem: str) -> FederationRefused:
        return FederationRefused(reason, f"The provider's ID token {problem}.")

    # §3.1.3.7 step 2: the issuer is the provider's, compared exactly.
    if claims.get("iss") != expected.issuer:
        raise refuse("wrong_issuer", "was issued by another issuer")
    # Step 3: this server's client_id among the audiences (a string or a list).
    audience = claims.get("aud")
    audiences = [audience] if isinstance(audience, str) else audience
    if not isinstance(audiences, list) or expected.client_id not in audiences:
        raise refuse("wrong_audience", "is meant for another client")
    # Step 4 (and OIDC Core errata): with several audiences `azp` names this client.
    if len(audiences) > 1 and claims.get("azp") != expected.client_id:
        raise refuse("wrong_audience", "is meant for several clients and authorizes another")
    if "azp" in claims and claims["azp"] != expected.client_id:
        raise refuse("wrong_audience", "was issued to another client")
    # Step 9: not expired.
    exp = _number(claims.get("exp"))
    if exp is None or exp + LEEWAY <= expected.now:
        raise refuse("expired", "has expired or gives no expiry")
    # Step 10: issued recently, and not in the future.
    iat = _number(claims.get("iat"))
    if iat is None or iat - LEEWAY > expected.now or iat + MAX_ID_TOKEN_AGE < expected.now:
        raise refuse("stale", "was not issued just now")
    # Step 11: the nonce of this sign-in, which binds the token to this browser.
    if claims.get("nonce") != expected.nonce:
        raise refuse("wrong_nonce", "belongs to another sign-in")
    subject = claims.get("sub")
    if not isinstance(subject, str) or not subject or len(subject) > 255:
        raise refuse("no_subject", "names no user")  # OIDC Core §2: 1 to 255 characters
    return subject


def _number(value: object) -> float | None:
    """A JSON number (NumericDate, RFC 7519 §2), never a boolean."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


@dataclass(frozen=True)
class ClaimNames:
    """Which of the provider's claims fill the local user (`identity_providers[].claims`)."""

    username: str
    email: str
    name: str


def missing_claims(claims: Mapping[str, Any], names: ClaimNames) -> bool:
    """Whether the ID token lacks a claim the local user is filled from."""
    return any(name not in claims for name in (names.username, names.email, names.name))


def with_userinfo(claims: Mapping[str, Any], userinfo: object, subject: str) -> dict[str, Any]:
    """The ID token's claims, completed by the userinfo response's. OIDC Core §5.3.2: its
    `sub` must be the ID token's, else nothing of it is used. The ID token's own claims, and
    the ones the checks relied on, are never replaced."""
    if not isinstance(userinfo, dict) or userinfo.get("sub") != subject:
        raise FederationRefused(
            "userinfo_subject", "The provider's userinfo is about another user."
        )
    return {**userinfo, **claims}


def verified_email(claims: Mapping[str, Any], names: ClaimNames) -> str | None:
    """The email, when the provider says it is verified: `email_verified` exactly true (a
    string "true" is not), OIDC Core §5.1. `email_verified` speaks of the standard `email`
    claim alone: an email read from another claim (`claims.email` mapped elsewhere) is never
    verified, so never linked by."""
    email = claims.get(names.email)
    if names.email != "email":
        return None
    if claims.get("email_verified") is True and isinstance(email, str) and "@" in email:
        return email
    return None


def email_to_link(
    claims: Mapping[str, Any], names: ClaimNames, domains: Collection[str]
) -> str | None:
    """Step 5: the email whose existing local user a first sign-in signs in as; None when
    the rule does not allow linking (no trusted domains, an unverified email, another
    domain). Domains match exactly, case-insensitively: a subdomain is another domain."""
    email = verified_email(claims, names)
    if email is None:
        return None
    domain = email.rpartition("@")[2].lower()
    return email if domain in domains else None


def same_email(a: object, b: str) -> bool:
    return isinstance(a, str) and a.lower() == b.lower()


def offered_username(claims: Mapping[str, Any], names: ClaimNames) -> str | None:
    """The username the provider's claim offers, its characters kept to a safe set; None
    when it gives none."""
    raw = claims.get(names.username)
    username = _USERNAME.sub("-", raw).strip("-")[:64] if isinstance(raw, str) else ""
    return username or None


def profile_of(
    claims: Mapping[str, Any], names: ClaimNames, subject: str
) -> tuple[str, dict[str, Any]]:
    """Step 6: the username a created user is offered (`offered_username`; the provider's
    subject when the claim is absent) and the OpenID Connect claims kept about them: the
    email with the provider's word on its verification, and the name."""
    username = offered_username(claims, names)
    local: dict[str, Any] = {}
    email = claims.get(names.email)
    if isinstance(email, str) and email:
        local["email"] = email
        local["email_verified"] = verified_email(claims, names) is not None
    name = claims.get(names.name)
    if isinstance(name, str) and name:
        local["name"] = name
    return username or _USERNAME.sub("-", subject)[:64], local


def refreshed_claims(
    local: Mapping[str, Any], claims: Mapping[str, Any], names: ClaimNames
) -> dict[str, Any]:
    """Step 7: a linked user's claims after a later sign-in whose claims are `claims`. The
    name the provider gives replaces the local one. An address replaces the local one only
    when the provider says it is verified (OIDC Core §5.1 `email_verified`): an unverified
    one may belong to anyone who typed it there. For the address the user has already, its
    verification follows the provider's word, either way. A claim the provider no longer
    gives removes nothing; every other claim (and the `sub`, never a claim here) is kept."""
    updated = dict(local)
    name = claims.get(names.name)
    if isinstance(name, str) and name:
        updated["name"] = name
    email = claims.get(names.email)
    if isinstance(email, str) and email:
        verified = verified_email(claims, names) is not None
        if same_email(local.get("email"), email):
            updated["email_verified"] = verified
            if verified:
                updated["email"] = email  # the provider's spelling of it
        elif verified:
            updated["email"] = email
            updated["email_verified"] = True
    return updated


def usernames(first: str, suffixes: Iterable[str]) -> Iterable[str]:
    """`first`, then `first` with each suffix: the names tried for a created user until one
    is free."""
    yield first
    for suffix in suffixes:
        yield f"{first}-{suffix}"


# RFC 8176 §2: the registered authentication method reference values.
REGISTERED_METHODS = frozenset(
    {
        "face", "fpt", "geo", "hwk", "iris", "kba", "mca", "mfa", "otp", "pin", "pop",
        "pwd", "rba", "retina", "sc", "sms", "swk", "tel", "user", "vbm", "wia",
    }
)  # fmt: skip


def provider_methods(amr: object) -> tuple[str, ...]:
    """The methods a provider's ID token says the sign-in used, as this server passes them
    on: its registered values, in its order, at most 8; nothing for a missing or malformed
    claim. A provider trusted to say who the user is is trusted to say how it knew."""
    if not isinstance(amr, list):
        return ()
    kept = [m for m in amr if isinstance(m, str) and m in REGISTERED_METHODS]
    return tuple(dict.fromkeys(kept))[:8]


# How far the provider's clock may be from ours when its `auth_time` is judged.
AUTH_TIME_LEEWAY = 30.0


def signed_in_at(
    claims: Mapping[str, Any],
    now: float,
    *,
    started_at: float,
    login_forced: bool,
    max_age: int | None,
) -> float:
    """When the user signed in at the provider, as this server's session then says: the ID
    token's `auth_time`, else now. Where the client forced a sign-in (`prompt=login`) or
    bounded its age (`max_age`), both passed on to the provider, the ID token must say when
    (OIDC Core §3.1.2.1: `auth_time` is required then), after this sign-in began for
    `prompt=login`, within `max_age` for the other: a provider's single sign-on left in
    place is no fresh sign-in. FederationRefused otherwise."""
    raw = claims.get("auth_time")
    given = (
        float(raw)
        if isinstance(raw, int | float) and not isinstance(raw, bool) and math.isfinite(raw)
        else None
    )
    if given is not None and given > now + AUTH_TIME_LEEWAY:
        raise FederationRefused("auth_time_future", "The provider's answer is not yet valid.")
    if login_forced or max_age is not None:
        if given is None:
            raise FederationRefused(
                "no_auth_time", "The provider did not say when you signed in there."
            )
        if login_forced and given < started_at - AUTH_TIME_LEEWAY:
            raise FederationRefused(
                "not_signed_in_again", "The provider did not ask you to sign in again."
            )
        if max_age is not None and now - given > max_age + AUTH_TIME_LEEWAY:
            raise FederationRefused(
                "auth_too_old", "You signed in at the provider too long ago: sign in there again."
            )
    return min(given, now) if given is not None else now
