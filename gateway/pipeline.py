"""The request path of one configuration, as named steps read top to bottom in `handle`:

 1. match      route = rules.match(method, path)   unmatched → 404; a CORS preflight is
                                                   answered here; a bad target → 400
 2. certificate clientcert.of(request)             403 without a verified client
                                                   certificate when the route requires one
 3. extract    token = bearer.extract(headers)     unless the route is public; a token
 4. verify     principal = verifier.verify(token)  verified before comes from the cache
               without either step
 5. bind-check, revocation-check                   the checks every request gets, cache
               hit or not, go between verify and decide (none are configured yet)
 6. decide     policy.decide(route, principal)     401 audience/issuer, 403 insufficient_scope
 7. limit      limiter.take(policy, key)           429 with Retry-After and the RateLimit fields
 8. forward    forward.send(request, principal)    a body on GET/HEAD refused unless the route
                                                   allows it, one too large refused (413)
Each step gives its value or a `Refusal`. In monitor mode (global or per route) a refusal
at any step is recorded as would_deny with its reason and the request goes on; identity
headers still come only from a token valid for the route.

Everything a step reads is built once per configuration by the composition root (app.py):
which verifier, limiter and forwarder classes run is decided there, never per request.
The last step is given, not imported: the proxy forwards upstream, and a forward-auth
listener would answer the front proxy instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from aiohttp import web
from multidict import CIMultiDictProxy

from portcullis.addresses import ClientAddresses

from . import bearer, clientcert, errors, policy, rules
from .cors import CorsPolicy, CorsRefused
from .exchange import PREFLIGHT, Exchange
from .metrics import Metrics
from .principal import Principal
from .ratelimit import Limiter, Policy, Verdict
from .settings import RouteSettings, Settings, WebSocketSettings
from .verifiers.base import InvalidToken, Verifier, VerifierUnavailable

_VERIFIER_RETRY_AFTER = 5  # seconds, on a 503 when tokens cannot be verified
# RFC 9110 §9.3.1, §9.3.2: content on GET or HEAD has no defined semantics.
_NO_BODY_METHODS = frozenset({"GET", "HEAD"})


class Forward(Protocol):
    """Step 8: where an admitted request goes."""

    def is_websocket_upgrade(self, request: web.BaseRequest) -> bool: ...

    def websocket(
        self,
        request: web.BaseRequest,
        principal: Principal | None,
        exchange: Exchange,
        settings: WebSocketSettings,
        extra: Sequence[tuple[str, str]] = (),
    ) -> Awaitable[web.StreamResponse]: ...

    def send(
        self,
        request: web.BaseRequest,
        principal: Principal | None,
        exchange: Exchange,
        max_body: int | None,
        extra: Sequence[tuple[str, str]] = (),
        own_cors: bool = False,
    ) -> Awaitable[web.StreamResponse]: ...


class Resource(Protocol):
    """Something a pipeline used that is closed once its last request is done."""

    async def close(self) -> None: ...


F = TypeVar("F", bound=Forward)


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """A rule and what it needs beyond matching, compiled once per configuration. The plan
    without a rule is for requests no rule matches, forwarded in monitor mode."""

    rule: rules.Rule[RouteSettings] | None
    monitor: bool
    cors: CorsPolicy | None
    limit: Policy | None
    websocket: WebSocketSettings | None
    max_body: int | None
    allow_body_on_get: bool
    client_cert: bool  # the route requires a verified TLS client certificate


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a step refused, and the answer enforce mode gives."""

    reason: str  # a short code: the metrics label and the access log's reason
    response: web.Response
    principal: Principal | None = None  # a token valid for the route (for monitor mode)


class Pipeline(Generic[F]):
    """The request path for one configuration, with everything it reads built up front."""

    def __init__(
        self,
        settings: Settings,
        *,
        verifier: Verifier,
        limiter: Limiter,
        forwarder: F,
        metrics: Metrics,
    ) -> None:
        self.settings = settings
        self.realm = settings.realm
        self.router = rules.compile_rules(
            settings.routes,
            settings.issuers,
            fold_case=settings.upstream.path_case == "insensitive",
        )
        self.verifier = verifier
        self.limiter = limiter
        self.forwarder = forwarder
        self.metrics = metrics
        self.monitor = settings.mode == "monitor"
        self.traceparent = settings.forward.traceparent
        self.addresses = ClientAddresses(settings.trusted_proxies)
        limits = settings.rate_limits
        self._limit_headers = limits.headers
        self._pre_auth = (
            Policy("pre_auth", limits.pre_auth, self.addresses) if limits.pre_auth else None
        )
        self._max_body = settings.limits.max_body_size
        self._plans = tuple(self._plan(rule) for rule in self.router.rules)
        self._unmatched = RoutePlan(None, True, None, None, None, self._max_body, False, False)
        self._preflights = any(plan.cors is not None for plan in self._plans)
        self.inflight = 0
        self.drained: asyncio.Event | None = None  # set when retired and the last request ends
        # Resources of this pipeline alone (a key set of an issuer it dropped, ...), closed
        # by the gateway once the last request on this pipeline is done.
        self.retired: list[Resource] = []

    def _plan(self, rule: rules.Rule[RouteSettings]) -> RoutePlan:
        settings, route = self.settings, rule.settings
        cors = settings.cors if route.cors is None else route.cors
        limit_rule = settings.rate_limits.default if route.rate_limit is None else route.rate_limit
        mode = route.mode or settings.mode
        max_body = route.max_body_size if route.max_body_size is not None else self._max_body
        return RoutePlan(
            rule=rule,
            monitor=mode == "monitor",
            cors=CorsPolicy(cors) if cors else None,
            limit=Policy(route.name, limit_rule, self.addresses) if limit_rule else None,
            websocket=settings.websocket_of(route),
            max_body=max_body,
            allow_body_on_get=route.allow_body_on_get,
            client_cert=route.needs_client_cert,
        )

    async def handle(self, request: web.BaseRequest, exchange: Exchange) -> web.StreamResponse:
        """The steps of the module's docstring; the answer the first refusal gives (in
        enforce mode), else the forwarded one."""
        # 1. match
        plan = self.match(request, exchange)
        if not isinstance(plan, RoutePlan):
            return plan
        monitor = plan.monitor
        headers = request.headers
        extra = plan.cors.actual(headers.get("Origin")) if plan.cors is not None else ()

        # 2. certificate
        if plan.client_cert:
            refusal = self.certificate(request)
            if refusal is not None:
                exchange.deny(refusal.reason, monitor)
                if not monitor:
                    return _with_headers(refusal.response, extra)

        principal = None
        rule = plan.rule
        if rule is not None and not rule.public:
            # 3-4. extract, verify
            verified = self.cached(headers) or await self.verify(request, rule)
            # 5. Checks every request needs, cache hit or not, go here, before decide: the
            # token's proof of possession (bind-check) and the revocations (revocation-check).
            # 6. decide
            if not isinstance(verified, Refusal):
                verified = self.decide(rule, verified)
            if isinstance(verified, Refusal):
                exchange.deny(verified.reason, monitor)
                if not monitor:
                    return _with_headers(verified.response, extra)
                principal = verified.principal
            else:
                principal = verified
            exchange.principal = principal

        # 7. limit
        limit = plan.limit
        if limit is not None:
            key = limit.key(principal, headers, request.remote)
            verdict = self.limiter.buckets.take_now(limit, key)
            if verdict is None:
                verdict = await self.limiter.take(limit, key)
            limit_headers = limit.headers(verdict) if self._limit_headers else []
            if not verdict.allowed:
                refusal = self.limited(exchange.route, limit, verdict, limit_headers)
                exchange.deny(refusal.reason, monitor)
                if not monitor:
                    return _with_headers(refusal.response, extra)
            extra = (*extra, *limit_headers)

        # 8. forward
        if request.body_exists:
            refused = refuse_body(request, plan, exchange)
            if refused is not None:
                return _with_headers(refused, extra)
        forwarder = self.forwarder
        if plan.websocket is not None and forwarder.is_websocket_upgrade(request):
            return await forwarder.websocket(request, principal, exchange, plan.websocket, extra)
        return await forwarder.send(
            request, principal, exchange, plan.max_body, extra, plan.cors is not None
        )

    # ------------------------------------------------------------------ 1. match

    def match(self, request: web.BaseRequest, exchange: Exchange) -> RoutePlan | web.Response:
        """The plan of the rule the request meets, or the answer that ends the request here:
        a bad target or path (400, in monitor mode too: which rule it meets is not known), a
        CORS preflight's answer, or 404 when no rule matches (the unmatched plan in monitor
        mode)."""
        target = request.raw_path
        # RFC 9112 §3.2: a request target carries no fragment, yet the parser lets `#` through.
        # The upstream would be sent the URL without it while the rules saw it, so a public
        # `/docs/**` would carry `/docs/secret#` to a protected `/docs/secret`.
        if "#" in target:
            exchange.deny("fragment", False)
            return errors.bad_request("The request target must not contain '#'.")
        headers = request.headers
        try:
            path = self.router.read(target.partition("?")[0])
            # A CORS preflight is matched by the method it asks about.
            if (
                self._preflights
                and request.method == "OPTIONS"
                and "Access-Control-Request-Method" in headers
                and "Origin" in headers
            ):
                answer = self._preflight(request, path, exchange)
                if answer is not None:
                    return answer
            rule = self.router.route(request.method, path)
        except rules.BadPath as exc:
            exchange.deny(exc.reason, False)
            return errors.bad_request(f"The request path is refused: {exc}.")
        if rule is None:
            exchange.deny("no_route", self.monitor)
            return self._unmatched if self.monitor else errors.not_found()
        exchange.route = rule.name
        return self._plans[rule.index]

    def _preflight(
        self, request: web.BaseRequest, path: rules.RequestPath, exchange: Exchange
    ) -> web.Response | None:
        """The answer to a CORS preflight, or None when the route it asks about has no CORS
        policy (then it is an ordinary OPTIONS request)."""
        headers = request.headers
        asked = headers["Access-Control-Request-Method"].strip()
        rule = self.router.route(asked, path)
        if rule is None:
            return None
        plan = self._plans[rule.index]
        if plan.cors is None:
            return None
        exchange.route = rule.name
        try:
            allowed = plan.cors.preflight(
                headers["Origin"], asked, headers.get("Access-Control-Request-Headers")
            )
        except CorsRefused as exc:
            exchange.deny("cors_refused", plan.monitor)
            if plan.monitor:
                return None
            return errors.cors_refused(str(exc))
        exchange.decision = PREFLIGHT
        return web.Response(status=204, headers=allowed)

    # ------------------------------------------------------------------ 2. certificate

    @staticmethod
    def certificate(request: web.BaseRequest) -> Refusal | None:
        """403 for a request on a route that requires a client certificate, when its
        connection has no verified one (see clientcert: only the gateway's own TLS listener
        can know it)."""
        if clientcert.of(request) is None:
            return Refusal("no_client_certificate", errors.client_certificate_required())
        return None

    # ------------------------------------------------------------------ 3-4. extract, verify

    def cached(self, headers: CIMultiDictProxy[str]) -> Principal | None:
        """Steps 3 and 4 in the common case: one `Bearer <token>` header whose token was
        verified before. A hit means this exact string passed every check of `verify`."""
        authorization = headers.getall("Authorization", ())
        if len(authorization) == 1 and authorization[0].startswith("Bearer "):
            return self.verifier.cached(authorization[0][7:])
        return None

    async def verify(
        self, request: web.BaseRequest, rule: rules.Rule[RouteSettings]
    ) -> Principal | Refusal:
        """Steps 3 and 4 for a token not in the cache: its principal, or why not."""
        try:
            token = bearer.extract(request.headers.getall("Authorization", ()))
        except bearer.MalformedAuthorization as exc:
            return Refusal("malformed_authorization", errors.invalid_request(self.realm, str(exc)))
        if token is None:
            return Refusal("no_token", errors.unauthorized(self.realm))
        pre_auth = self._pre_auth
        if pre_auth is not None:
            # Only tokens that must be verified are counted: floods of made-up tokens are
            # what this protects the verifier (and the issuer) from.
            verdict = await self.limiter.take(
                pre_auth, pre_auth.key(None, request.headers, request.remote)
            )
            if not verdict.allowed:
                self.metrics.rate_limit_rejected(rule.name, pre_auth.name)
                return Refusal(
                    "pre_auth_rate_limited",
                    errors.too_many_requests(verdict.retry_after, pre_auth.headers(verdict))
                    if verdict.known
                    else errors.rate_limit_unavailable(),
                )
        try:
            return await self.verifier.verify(token)
        except InvalidToken as exc:
            return Refusal("invalid_token", errors.invalid_token(self.realm, exc.description))
        except VerifierUnavailable:
            return Refusal(
                "verifier_unavailable",
                errors.unavailable(
                    _VERIFIER_RETRY_AFTER,
                    "The gateway cannot verify tokens right now; try again shortly.",
                ),
            )

    # ------------------------------------------------------------------ 6. decide

    def decide(self, rule: rules.Rule[RouteSettings], principal: Principal) -> Principal | Refusal:
        """Whether the verified principal may use the route."""
        decision = policy.decide(rule, principal)
        if isinstance(decision, policy.Allow):
            return principal
        if decision.code == "insufficient_scope":
            # The token is valid for this API; only the scope is missing.
            return Refusal(
                "insufficient_scope",
                errors.insufficient_scope(self.realm, decision.reason, decision.scope or ""),
                principal,
            )
        return Refusal("invalid_token", errors.invalid_token(self.realm, decision.reason))

    # ------------------------------------------------------------------ 7. limit

    def limited(
        self, route: str, limit: Policy, verdict: Verdict, limit_headers: list[tuple[str, str]]
    ) -> Refusal:
        """The refusal of a request over its route's rate limit (counted)."""
        self.metrics.rate_limit_rejected(route, limit.name)
        return Refusal(
            "rate_limited",
            errors.too_many_requests(verdict.retry_after, limit_headers)
            if verdict.known
            else errors.rate_limit_unavailable(),
        )


# ---------------------------------------------------------------------------- 8. forward


def refuse_body(
    request: web.BaseRequest, plan: RoutePlan, exchange: Exchange
) -> web.Response | None:
    """Why a request with a body is refused before any of the body is read, if it is: a body
    on GET or HEAD where the route does not allow one (400), a Content-Length over the
    route's limit (413). A refusal is counted as a denial, in monitor mode too."""
    if not plan.allow_body_on_get and request.method in _NO_BODY_METHODS:
        exchange.deny("body_on_get", False)
        return errors.body_not_allowed(request.method)
    max_body = plan.max_body
    if max_body is not None:
        length = request.content_length
        if length is not None and length > max_body:
            exchange.deny("body_too_large", False)
            return errors.payload_too_large(max_body)
    return None


def _with_headers(
    response: web.StreamResponse, extra: Iterable[tuple[str, str]]
) -> web.StreamResponse:
    response.headers.extend(extra)
    return response
