"""`portcullis-gateway explain`: which rule a request meets, what it needs, and the decision.

The route's needs are listed with everything else that applies to it: the mode (enforce or
monitor), the rate limit and its key, the pre-authentication limit, CORS (and, with
`--origin`, whether that origin would get CORS headers), and WebSocket proxying.

With `--token`, the token is verified exactly as the running gateway would, fetching the
issuer's keys or asking its introspection endpoint live; the output says what was decided
and why. Rate limits are not charged: explain shows which one applies, not its state.

With `--ext-authz`, the decision is also told as the decision listener answers it, and as
each front proxy then treats that answer (nginx, Traefik, Caddy, Envoy).
"""

from __future__ import annotations

import asyncio

from . import adapter, extauthz
from .core import bearer, policy, rules
from .core.principal import Principal
from .core.records import Route, Scopes
from .settings import CorsSettings, LimitRule, Settings
from .steps import mcp
from .steps.cors import CorsPolicy
from .verifiers import dispatch
from .verifiers.base import InvalidToken, VerifierUnavailable
from .verifiers.cache import TokenCache
from .verifiers.jwks import keys_session


def _limit(rule: LimitRule, what: str) -> str:
    key = "client address" if rule.key == "ip" else rule.key
    return f"{rule.rate} (burst {rule.burst}) per {key}{what}"


def _cors(cors: CorsSettings) -> str:
    return (
        f"origins {', '.join(cors.allow_origins)}; methods {', '.join(cors.allow_methods)}; "
        f"headers {', '.join(cors.allow_headers) or '(none)'}; "
        f"credentials {'yes' if cors.allow_credentials else 'no'}; "
        f"max-age {int(cors.max_age.total_seconds())}s"
    )


def describe(
    rule: rules.Rule[Route],
    segments: list[str],
    settings: Settings,
    origin: str | None = None,
) -> list[str]:
    # The route as written: what it sets itself is told apart from what it takes from
    # the defaults.
    route = settings.routes[rule.index]
    methods = ", ".join(sorted(rule.methods)) if rule.methods else "any"
    if rule.methods != route.methods:
        methods += " (HEAD goes with GET)"
    lines = [
        f"route: {route.name} ({settings.file}:{route.line})",
        f"  path: {route.path}   methods: {methods}",
    ]
    if settings.upstream.path_case == "insensitive":
        lines.append("  letter case: ignored (upstream.path_case: insensitive)")
    if rule.path_params:
        lines.append("  path parameters (;): allowed; rules are matched on the path without them")
    params = rule.pattern.bind(segments)
    if params:
        lines.append("  params: " + ", ".join(f"{k}={v}" for k, v in params.items()))
    if rule.public:
        lines.append("  auth: none (forwarded without a token; identity headers removed)")
    else:
        lines.append("  auth: required (Authorization: Bearer <token>)")
        for issuer, audiences in rule.audiences_by_issuer.items():
            lines.append(
                f"  accepts tokens from {issuer} with aud in: {', '.join(sorted(audiences))}"
            )
            trusted = settings.issuer(issuer)
            if trusted is not None and trusted.mode != "jwt":
                how = (
                    "JWTs verified locally, other tokens by introspection"
                    if trusted.mode == "auto"
                    else "every token by introspection"
                )
                lines.append(f"    {issuer}: {how}")
        lines.extend(_dpop(rule, settings))
        if route.scopes is not None:
            what = "all of" if route.scopes.mode == "all" else "any of"
            lines.append(f"  scopes: {what} {' '.join(sorted(route.scopes.scopes))}")
        else:
            lines.append("  scopes: none required")
    if route.needs_client_cert:
        lines.append("  client certificate: required (verified by the gateway's TLS; else 403)")
    max_body = route.max_body_size or settings.limits.max_body_size
    if max_body is not None:
        lines.append(f"  max body: {max_body} bytes")
    if rule.settings.mcp is not None:
        lines.extend(_mcp(rule.settings))
    lines.extend(_extras(rule, settings, origin))
    return lines


def _mcp(route: Route) -> list[str]:
    """What an MCP server's route does with its requests' calls."""
    assert route.mcp is not None
    lines = [
        "  mcp: the client's Authorization and DPoP are not forwarded; a POST's JSON-RPC "
        f"message is read (at most {route.mcp.max_message_size} bytes) and its call judged",
    ]
    for call in route.mcp.calls:
        what = "all of" if call.scopes.mode == "all" else "any of"
        lines.append(
            f"    {call.method} {call.name or '(every name)'}: "
            f"{what} {' '.join(sorted(call.scopes.scopes))}"
        )
    if not route.mcp.calls:
        lines.append("    no call rules: every call needs the route's scopes only")
    return lines


def _call_needs(route: Route, call: str) -> tuple[mcp.Call, Scopes | None]:
    method, _, name = call.partition(":")
    asked = mcp.Call(method, name or None)
    assert route.mcp is not None
    return asked, mcp.scopes_for(asked, route.mcp.calls)


def _dpop(rule: rules.Rule[Route], settings: Settings) -> list[str]:
    """The route's DPoP requirement (RFC 9449), and where proofs must say they were sent."""
    route = rule.settings
    if route.dpop_required:
        lines = [
            "  dpop: required (Authorization: DPoP <token> and a DPoP proof; bearer tokens: 401)"
        ]
    else:
        lines = ["  dpop: allowed (bearer tokens, or DPoP-bound tokens with a proof of their key)"]
    for issuer in rule.audiences_by_issuer:
        trusted = settings.issuer(issuer)
        if trusted is not None and trusted.dpop == "required" and not route.dpop_required:
            lines.append(f"    {issuer}: DPoP-bound tokens only (issuer dpop: required)")
    if route.public_url is not None:
        lines.append(f"  dpop proofs name (htu): {route.public_url}<path>")
    return lines


def _extras(rule: rules.Rule[Route], settings: Settings, origin: str | None) -> list[str]:
    route = settings.routes[rule.index]
    lines = []
    mode = route.mode or settings.mode
    if mode == "monitor":
        lines.append(
            "  mode: monitor (refusals are logged as would_deny; the request is forwarded)"
        )
    else:
        lines.append("  mode: enforce")
    limit = settings.rate_limits.default if route.rate_limit is None else route.rate_limit
    if limit:
        source = "route" if route.rate_limit else "default"
        lines.append("  rate limit: " + _limit(limit, f" ({source} policy, {route.name!r})"))
    else:
        lines.append("  rate limit: none")
    pre_auth = settings.rate_limits.pre_auth
    if pre_auth is not None and not rule.public:
        lines.append(
            "  pre-auth limit: " + _limit(pre_auth, " (counted when a token must be verified)")
        )
    cors = settings.cors if route.cors is None else route.cors
    if cors:
        lines.append(f"  cors: {_cors(cors)}")
        if origin is not None:
            allowed = CorsPolicy(adapter.cors(cors)).allows(origin)
            lines.append(
                f"  origin {origin}: "
                + (
                    "allowed (Access-Control-Allow-Origin is sent)"
                    if allowed
                    else "not allowed (no CORS headers; preflights get 403)"
                )
            )
    else:
        lines.append("  cors: none (preflights are forwarded like any OPTIONS request)")
    websocket = settings.websocket_of(route)
    if websocket is not None:
        expiry = "yes" if websocket.close_on_token_expiry else "no"
        lines.append(f"  websocket: proxied (closed when the token expires: {expiry})")
    return lines


async def _verify(settings: Settings, token: str) -> Principal:
    async with keys_session() as session:
        verification = dispatch.build(
            adapter.issuers(settings), adapter.key_set_timing(settings), session, TokenCache(0)
        )
        try:
            return await verification.verifier.verify(token)
        finally:
            for keyset in verification.keysets.values():
                await keyset.close()
            for introspector in verification.introspectors.values():
                await introspector.close()


class _Front:
    """What `--ext-authz` adds: the decision listener's answer, and each front proxy's."""

    def __init__(self, settings: Settings) -> None:
        self.identity = adapter.identity_headers(settings.identity_headers)
        self.listen = settings.ext_authz.listen if settings.ext_authz is not None else None

    def allow(self, principal: Principal | None) -> None:
        self.listener()
        print("  answer: 200, empty body, with every identity header (empty without a value):")
        if principal is None:
            answer = tuple((name, "") for name in self.identity.names())
        else:
            answer = extauthz.identity_answer(self.identity, principal)
        for name, value in answer:
            print(f"    {name}: {value}")
        print("  nginx auth_request: the request goes on; auth_request_set copies the headers")
        print("  Traefik forwardAuth: the request goes on with authResponseHeaders")
        print("  Caddy forward_auth: the request goes on with copy_headers")
        print("  Envoy ext_authz: the request goes on with allowed_upstream_headers")

    def deny(self, status: int) -> None:
        self.listener()
        print(f"  answer: {status}, as in proxy mode (challenge, Retry-After, error body)")
        if status in (401, 403):
            nginx = f"{status}" + (
                " with WWW-Authenticate"
                if status == 401
                else " (the challenge only with the example's error_page)"
            )
        else:
            nginx = f"500 (the example's error_page restores {status})"
        print(f"  nginx auth_request: {nginx}")
        print(f"  Traefik forwardAuth: {status}, answer returned as is")
        print(f"  Caddy forward_auth: {status}, answer returned as is")
        print(f"  Envoy ext_authz: {status} and the body; headers in allowed_client_headers only")

    def unjudged(self) -> None:
        self.listener()
        print("  answer: 403 mcp_calls_unjudged, whatever the call, where the question carries")
        print("  no body (nginx, Traefik, Caddy; Envoy without with_request_body): this route's")
        print("  call rules need it; Envoy passing the whole body gets the call judged as above")

    def listener(self) -> None:
        where = f"{self.listen.host}:{self.listen.port}" if self.listen else "not configured"
        print(f"ext_authz (decision listener: {where}):")


def _decided(deny: str, monitor: bool, front: _Front | None = None) -> int:
    """Print a refusal; in monitor mode it is only noted and the request goes on."""
    if monitor:
        print(f"decision: would deny ({deny}); monitor mode forwards the request")
        if front is not None:
            front.allow(None)
        return 0
    print(f"decision: {deny}")
    if front is not None:
        front.deny(int(deny.split()[0]))
    return 1


def explain(
    settings: Settings,
    method: str,
    target: str,
    token: str | None,
    origin: str | None = None,
    ext_authz: bool = False,
    call: str | None = None,
) -> int:
    front = _Front(settings) if ext_authz else None
    path = target.partition("?")[0]
    router = rules.compile_rules(
        adapter.routes(settings),
        adapter.issuers(settings),
        fold_case=settings.upstream.path_case == "insensitive",
    )
    if "#" in target:
        return _decided("400 — the request target must not contain '#'", False, front)
    try:
        rule = router.route(method.upper(), router.read(path))
    except rules.BadPath as exc:
        return _decided(f"400 — the path is refused: {exc}", False, front)
    # The params as the upstream receives them: decoded, in the client's case.
    segments = rules.split_path(path)
    if rule is None:
        print(f"no route matches {method.upper()} {path}")
        return _decided("404 not_found (unmatched: deny)", settings.mode == "monitor", front)
    for line in describe(rule, segments, settings, origin):
        print(line)
    monitor = rule.settings.monitor
    needs: Scopes | None = None
    if call is not None:
        if rule.settings.mcp is None:
            print(f"call {call}: this route serves no MCP server (no `mcp:`); calls are not read")
        else:
            asked, needs = _call_needs(rule.settings, call)
            named = f"{asked.method} {asked.name}" if asked.name else asked.method
            if needs is None:
                print(f"call {named}: no call rule matches; the route's scopes are enough")
            else:
                what = "all of" if needs.mode == "all" else "any of"
                print(f"call {named}: needs {what} {' '.join(sorted(needs.scopes))}")
    if rule.public:
        print("decision: forward")
        if front is not None:
            front.allow(None)
        return 0
    if token is None:
        print("decision without a token: 401 (pass --token to check one)")
        if front is not None:
            front.deny(401)
        return 0
    if token.lower().startswith("bearer "):
        token = token[7:].strip()
    takes_opaque = any(i.takes_opaque_tokens for i in settings.issuers)
    if not bearer.looks_like_jwt(token) and not takes_opaque:
        print("token: not a JWT")
        return _decided("401 invalid_token", monitor, front)
    try:
        principal = asyncio.run(_verify(settings, token))
    except InvalidToken as exc:
        print(f"token: refused — {exc.description}")
        return _decided("401 invalid_token", monitor, front)
    except VerifierUnavailable as exc:
        print(f"token: cannot be verified now — {exc}")
        return _decided("503 (the gateway is not ready for this issuer)", monitor, front)
    print(
        f"token: valid — iss {principal.issuer}, sub {principal.subject}, "
        f"client {principal.client_id or '-'}, aud {', '.join(principal.audiences)}"
    )
    print(f"  scopes: {' '.join(sorted(principal.scopes)) or '(none)'}")
    if principal.jkt is not None:
        print(f"  DPoP-bound to key {principal.jkt}: each request needs a proof of it")
    elif rule.settings.dpop_required or (
        (trusted := settings.issuer(principal.issuer)) is not None and trusted.dpop == "required"
    ):
        return _decided("401 invalid_token — a bearer token where DPoP is required", monitor)
    decision = policy.decide(rule, principal)
    if isinstance(decision, policy.Deny):
        return _decided(f"{decision.status} {decision.code} — {decision.reason}", monitor, front)
    # The decision listener cannot read a POST's call: it refuses what the proxy decides.
    mcp = rule.settings.mcp
    unjudged = front is not None and method.upper() == "POST" and bool(mcp and mcp.calls)
    if needs is not None and not policy.holds(needs, principal.scopes):
        code = _decided(
            "403 insufficient_scope — the call needs " + " ".join(sorted(needs.scopes)),
            monitor,
            None if unjudged else front,
        )
        if not unjudged:
            return code
    else:
        print("decision: forward, with the identity headers of this token")
        if not unjudged:
            if front is not None:
                front.allow(principal)
            return 0
    assert front is not None
    front.unjudged()
    return 1
