"""`portcullis-gateway explain`: which rule a request meets, what it needs, and the decision.

With `--token`, the token is verified exactly as the running gateway would, fetching the
issuer's keys live; the output says what was decided and why.
"""

from __future__ import annotations

import asyncio

from . import bearer, policy, rules
from .app import keys_session
from .jwks import KeySet
from .principal import Principal
from .settings import Settings
from .verifiers.base import InvalidToken, VerifierUnavailable
from .verifiers.cache import TokenCache
from .verifiers.jwt import JwtVerifier, TrustedIssuer


def describe(rule: rules.Rule, segments: list[str], settings: Settings) -> list[str]:
    route = rule.settings
    methods = ", ".join(sorted(route.methods)) if route.methods else "any"
    lines = [
        f"route: {route.name} ({settings.file}:{route.line})",
        f"  path: {route.path}   methods: {methods}",
    ]
    params = rule.pattern.bind(segments)
    if params:
        lines.append("  params: " + ", ".join(f"{k}={v}" for k, v in params.items()))
    if rule.public:
        lines.append("  auth: none (forwarded without a token; identity headers removed)")
        return lines
    lines.append("  auth: required (Authorization: Bearer <token>)")
    for issuer, audiences in rule.audiences_by_issuer.items():
        lines.append(f"  accepts tokens from {issuer} with aud in: {', '.join(sorted(audiences))}")
    if route.scopes is not None:
        what = "all of" if route.scopes.mode == "all" else "any of"
        lines.append(f"  scopes: {what} {' '.join(sorted(route.scopes.scopes))}")
    else:
        lines.append("  scopes: none required")
    max_body = route.max_body_size or settings.limits.max_body_size
    if max_body is not None:
        lines.append(f"  max body: {max_body} bytes")
    return lines


async def _verify(settings: Settings, token: str) -> Principal:
    async with keys_session() as session:
        keysets = {i.issuer: KeySet(i, settings.jwks, session) for i in settings.issuers}
        verifier = JwtVerifier(
            {
                i.issuer: TrustedIssuer(
                    i, keysets[i.issuer], frozenset(i.algorithms), i.leeway.total_seconds()
                )
                for i in settings.issuers
            },
            TokenCache(0),
        )
        try:
            return await verifier.verify(token)
        finally:
            for keyset in keysets.values():
                await keyset.close()


def explain(settings: Settings, method: str, target: str, token: str | None) -> int:
    path = target.partition("?")[0]
    try:
        segments = rules.split_path(path)
    except rules.BadPath as exc:
        print(f"decision: 400 — the path is refused: {exc}")
        return 1
    router = rules.compile_rules(settings.routes, settings.issuers)
    rule = router.match(method.upper(), segments)
    if rule is None:
        print(f"no route matches {method.upper()} {path}")
        print("decision: 404 not_found (unmatched: deny)")
        return 1
    for line in describe(rule, segments, settings):
        print(line)
    if rule.public:
        print("decision: forward")
        return 0
    if token is None:
        print("decision without a token: 401 (pass --token to check one)")
        return 0
    if token.lower().startswith("bearer "):
        token = token[7:].strip()
    if not bearer.looks_like_jwt(token):
        print("token: not a JWT")
        print("decision: 401 invalid_token")
        return 1
    try:
        principal = asyncio.run(_verify(settings, token))
    except InvalidToken as exc:
        print(f"token: refused — {exc.description}")
        print("decision: 401 invalid_token")
        return 1
    except VerifierUnavailable as exc:
        print(f"token: cannot be verified now — {exc}")
        print("decision: 503 (the gateway is not ready for this issuer)")
        return 1
    print(
        f"token: valid — iss {principal.issuer}, sub {principal.subject}, "
        f"client {principal.client_id or '-'}, aud {', '.join(principal.audiences)}"
    )
    print(f"  scopes: {' '.join(sorted(principal.scopes)) or '(none)'}")
    decision = policy.decide(rule, principal)
    if isinstance(decision, policy.Deny):
        print(f"decision: {decision.status} {decision.code} — {decision.reason}")
        return 1
    print("decision: forward, with the identity headers of this token")
    return 0
