"""The request path of one configuration, as named steps read top to bottom in `handle`:

 1. match      route = rules.match(method, path)   unmatched → 404; a CORS preflight is
                                                   answered here; a bad target → 400
 2. certificate clientcert.of(request)             403 without a verified client
                                                   certificate when the route requires one
 3. extract    credentials = bearer.credentials(headers)  unless the route is public;
 4. verify     principal = verifier.verify(token)  a token verified before comes from the
               cache without either step
 5. bind-check dpop: the proof of possession       every request, cache hit or not: a token
                                                   bound to a key (cnf.jkt) needs a proof
                                                   of it (RFC 9449); routes and issuers
                                                   with dpop: required take no other token
 6. revocation-check  revocations.check(principal)  401 for a token its issuer revoked,
               cache hit or not; 503 while the issuer's event stream is down past
               max_stream_lag with on_stream_down: fail
 7. decide     policy.decide(route, principal)     401 audience/issuer, 403 insufficient_scope
 8. limit      limiter.take(policy, key)           429 with Retry-After and the RateLimit fields
 7b. call      mcp.read_call(body)                 on an MCP server's route, a POST's JSON-RPC
                                                   call and the scopes its rules give it (403);
                                                   a message that cannot be judged: 400, 413
 9. forward    forward.send(request, principal)    a body on GET/HEAD refused unless the route
                                                   allows it, one too large refused (413); on
                                                   an MCP route without the client's credentials
Before step 1, a request for a resource's metadata (RFC 9728: resource_metadata.py) is
answered, whatever the rules say.
Each step gives its value or a `Refusal` (errors.py): data saying what the answer is to
be, recorded once on the exchange by `admit` and rendered once, where the request ends
(`handle`, or the decision listener). In monitor mode (global or per route) a refusal at
any step is recorded as would_deny with its reason and the request goes on, and no answer
is built for it; identity headers still come only from a token valid for the route.

Routes and issuers come as records (records.py, built by adapter.py), each route with its
defaults already resolved. Everything a step reads is built once per configuration by the
composition root (app.py):
which verifier, limiter and forwarder classes run is decided there, never per request.
The last step is given, not imported: `handle` forwards what `admit` (steps 1 to 8)
admitted, and the decision listener for front proxies (extauthz) runs `admit` on the request
a front proxy describes and answers it instead.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, NamedTuple, Protocol, TypeVar

from aiohttp import hdrs, web
from multidict import CIMultiDictProxy

from portcullis.addresses import ClientAddresses

from ..core import bearer, dpop, policy, rules
from ..core.bearer import Credentials
from ..core.clock import Now
from ..core.exchange import PREFLIGHT, Exchange
from ..core.principal import Principal
from ..core.records import Issuer, Mcp, RequestPath, Route, WebSocket
from ..core.records import Resource as ProtectedResource
from ..ops.metrics import Metrics
from ..transport import clientcert
from ..verifiers.base import InvalidToken, Verifier, VerifierUnavailable
from ..verifiers.cache import token_key
from . import errors, mcp, resource_metadata
from .cors import CorsPolicy, CorsRefused
from .errors import Refusal
from .ratelimit import Limiter, Policy, Verdict
from .revocations import REVOKED, DenySet

_VERIFIER_RETRY_AFTER = 5  # seconds, on a 503 when tokens cannot be verified
# The key of DPoP nonces when dpop.nonce_key is not set: this process's own, the same for
# every configuration it loads, so a reload does not void the nonces handed out.
_PROCESS_NONCE_KEY = secrets.token_bytes(32)
# RFC 9110 §9.3.1, §9.3.2: content on GET or HEAD has no defined semantics.
_NO_BODY_METHODS = frozenset({"GET", "HEAD"})
# The longest Authorization value a connection remembers (LastToken); a longer one is hashed
# on every request. Part of what memory.CONNECTION_BYTES allows each connection.
REMEMBERED_AUTHORIZATION_CHARS = 4096


class LastToken:
    """What one client connection sent last in Authorization, with its token's cache key: a
    client on a keep-alive connection sends the same token request after request, and this
    spares the per-request parsing and SHA-256 of it. Only the key is saved: the
    verified-token cache is asked on every request as before, and every step after it runs
    as on any request (expiry, LRU order, hits, reloads and revocations all behave as
    without it). Held by the connection, gone with it; values longer than
    REMEMBERED_AUTHORIZATION_CHARS are not kept."""

    __slots__ = ("credentials", "key", "prefix", "size")

    def __init__(self) -> None:
        # The credentials of the value remembered (None before any), parsed from exactly
        # `prefix` (the scheme and one space) followed by the token, `size` characters in
        # all; the value itself is not kept beside the token.
        self.credentials: Credentials | None = None
        self.prefix = ""
        self.size = 0
        self.key = b""

    def recall(self, value: str) -> Credentials | None:
        """The credentials of `value` when it is the Authorization value remembered."""
        credentials = self.credentials
        if (
            credentials is not None
            and len(value) == self.size
            and value.endswith(credentials.token)
            and value.startswith(self.prefix)
        ):
            return credentials
        return None


class Forward(Protocol):
    """Step 9: where an admitted request goes."""

    def is_websocket_upgrade(self, request: web.BaseRequest) -> bool: ...

    def websocket(
        self,
        request: web.BaseRequest,
        principal: Principal | None,
        exchange: Exchange,
        settings: WebSocket,
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
        *,
        body: bytes | None = None,
        strip_credentials: bool = False,
    ) -> Awaitable[web.StreamResponse]: ...

    def read_whole(
        self, request: web.BaseRequest, limit: int
    ) -> Awaitable[bytes | web.Response]: ...


class Incoming(Protocol):
    """What steps 1 to 8 read of a request: an aiohttp request on the public listener, or
    the request a front proxy describes to the decision listener (extauthz)."""

    @property
    def method(self) -> str: ...

    @property
    def raw_path(self) -> str: ...

    @property
    def headers(self) -> CIMultiDictProxy[str]: ...

    @property
    def remote(self) -> str | None: ...

    @property
    def scheme(self) -> str: ...

    @property
    def host(self) -> str: ...

    @property
    def transport(self) -> asyncio.Transport | None: ...


class Resource(Protocol):
    """Something a pipeline used that is closed once its last request is done."""

    async def close(self) -> None: ...


F = TypeVar("F", bound=Forward)
R = TypeVar("R", bound=web.StreamResponse)


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """A rule and what it needs beyond matching, compiled once per configuration. The plan
    without a rule is for requests no rule matches, forwarded in monitor mode."""

    rule: rules.Rule[Route] | None
    monitor: bool
    cors: CorsPolicy | None
    limit: Policy | None
    websocket: WebSocket | None
    max_body: int | None
    allow_body_on_get: bool
    client_cert: bool  # the route requires a verified TLS client certificate
    offer: errors.Offer  # the schemes its 401s name
    dpop_required: bool  # bearer tokens are refused
    origin: str | None  # scheme://host[:port] of its external URI; the request's when None
    mcp: Mcp | None = None  # an MCP server's route: its calls decided, no token passthrough


class Admitted(NamedTuple):
    """A request that passed steps 1 to 8: its route's plan, the principal whose identity
    goes with it (None on a public route, or in monitor mode without a valid token), and
    the headers its answer gets (CORS, RateLimit)."""

    plan: RoutePlan
    principal: Principal | None
    extra: tuple[tuple[str, str], ...]


class Pipeline(Generic[F]):
    """The request path for one configuration, with everything it reads built up front."""

    def __init__(
        self,
        settings: RequestPath,
        routes: Sequence[Route],
        issuers: Sequence[Issuer],
        *,
        resources: Sequence[ProtectedResource] = (),
        verifier: Verifier,
        limiter: Limiter,
        forwarder: F,
        metrics: Metrics,
        replay: dpop.ReplayCache,
        now: Now,
        revocations: DenySet | None = None,
    ) -> None:
        """`replay` remembers the DPoP proofs seen; `now` reads the wall clock (the scale of
        a proof's iat)."""
        self.settings = settings
        self.revocations = revocations  # None when no issuer streams its revocations
        self.realm = settings.realm
        self.router = rules.compile_rules(routes, issuers, fold_case=settings.fold_case)
        self.verifier = verifier
        self._look = verifier.cached  # asked on every request with a token
        self.limiter = limiter
        self.forwarder = forwarder
        self.metrics = metrics
        self.monitor = settings.monitor
        self.traceparent = settings.traceparent
        self.addresses = ClientAddresses(settings.trusted_proxies)
        self._limit_headers = settings.limit_headers
        pre_auth = settings.pre_auth
        self._pre_auth = Policy("pre_auth", pre_auth, self.addresses) if pre_auth else None
        self._max_body = settings.max_body_size
        proofs = settings.proofs
        self.nonces = (
            dpop.NonceMaker(
                proofs.nonce_key.encode() or _PROCESS_NONCE_KEY,
                proofs.nonce_lifetime.total_seconds(),
            )
            if proofs.nonce
            else None
        )
        self.proofs = dpop.ProofChecker(
            dpop.ProofPolicy(
                frozenset(proofs.algorithms),
                proofs.proof_max_age.total_seconds(),
                proofs.leeway.total_seconds(),
            ),
            self.nonces,
        )
        self.replay = replay
        self._now = now
        self._offer = errors.Offer(dpop_algs=self.proofs.policy.challenge_algorithms)
        self._dpop_only = errors.Offer(False, self._offer.dpop_algs)
        self._dpop_issuers = frozenset(i.issuer for i in issuers if i.dpop_required)
        self.documents = resource_metadata.Documents(resources, proofs.algorithms)
        self._documents = bool(self.documents)
        self._plans = tuple(self._plan(rule) for rule in self.router.rules)
        self._unmatched = RoutePlan(
            None, True, None, None, None, self._max_body, False, False, self._offer, False, None
        )
        self._preflights = any(plan.cors is not None for plan in self._plans)
        self.inflight = 0
        self.drained: asyncio.Event | None = None  # set when retired and the last request ends
        # Resources of this pipeline alone (a key set of an issuer it dropped, ...), closed
        # by the gateway once the last request on this pipeline is done.
        self.retired: list[Resource] = []

    def _plan(self, rule: rules.Rule[Route]) -> RoutePlan:
        route = rule.settings
        offer = self._dpop_only if route.dpop_required else self._offer
        if route.resource is not None:
            offer = replace(
                offer,
                metadata_path=resource_metadata.WELL_KNOWN + route.resource,
                origin=route.public_url,
                scope=" ".join(sorted(route.scopes.scopes)) if route.scopes else None,
            )
        return RoutePlan(
            rule=rule,
            monitor=route.monitor,
            cors=CorsPolicy(route.cors) if route.cors is not None else None,
            limit=(
                Policy(route.name, route.rate_limit, self.addresses)
                if route.rate_limit is not None
                else None
            ),
            websocket=route.websocket,
            max_body=route.max_body_size,
            allow_body_on_get=route.allow_body_on_get,
            client_cert=route.client_cert,
            offer=offer,
            dpop_required=route.dpop_required,
            origin=route.public_url,
            mcp=route.mcp,
        )

    async def handle(
        self, request: web.BaseRequest, exchange: Exchange, last: LastToken | None = None
    ) -> web.StreamResponse:
        """The steps of the module's docstring; the answer the first refusal gives (in
        enforce mode), else the forwarded one (`last`: the token the request's connection
        sent before, see LastToken)."""
        admitted = await self.admit(request, exchange, last)
        if isinstance(admitted, Refusal):
            return self.render(admitted, request)
        if not isinstance(admitted, Admitted):
            return admitted
        plan, principal, extra = admitted
        forwarder = self.forwarder

        # 9. forward
        if request.body_exists:
            refused = refuse_body(request, plan)
            if refused is not None:
                exchange.deny(refused.reason, False)  # in monitor mode too: unread
                return errors.render(refused, self.realm, extra)
        if plan.mcp is not None:
            return await self.forward_mcp(request, exchange, admitted)
        if plan.websocket is not None and forwarder.is_websocket_upgrade(request):
            return await forwarder.websocket(request, principal, exchange, plan.websocket, extra)
        return await forwarder.send(
            request, principal, exchange, plan.max_body, extra, plan.cors is not None
        )

    async def forward_mcp(
        self, request: web.BaseRequest, exchange: Exchange, admitted: Admitted
    ) -> web.StreamResponse:
        """Steps 7b and 9 on a route that serves an MCP server: a POST's JSON-RPC message is
        read (up to the route's limit) and its call decided by the route's rules; then the
        request goes upstream without the client's credentials."""
        plan, principal, extra = admitted
        assert plan.mcp is not None
        body = None
        if request.method == "POST":
            read = await self.forwarder.read_whole(request, plan.mcp.max_message_size)
            if isinstance(read, web.Response):
                exchange.deny("mcp_message_unread", False)
                read.headers.extend(extra)
                return read
            body = read
            refused = self.decide_call(plan, request.headers, body, principal)
            if refused is not None:
                exchange.deny(refused.reason, plan.monitor and refused.status != 400)
                if not plan.monitor or refused.status == 400:
                    return self.render(_with_headers(refused, extra), request)
        return await self.forwarder.send(
            request,
            principal,
            exchange,
            plan.max_body,
            extra,
            plan.cors is not None,
            body=body,
            strip_credentials=True,
        )

    def decide_call(
        self,
        plan: RoutePlan,
        headers: CIMultiDictProxy[str],
        body: bytes,
        principal: Principal | None,
    ) -> Refusal | None:
        """7b. The scopes the MCP call in `body` needs beyond the route's (RFC 6750 §3.1: a
        403 insufficient_scope naming every scope the call needs, so that a client asks for
        them at once); a message that cannot be judged is a 400."""
        assert plan.mcp is not None
        try:
            call = mcp.read_call(body, headers)
        except mcp.BadMessage as exc:
            return errors.refused(
                "mcp_bad_message", 400, "bad_request", f"The MCP request is refused: {exc}."
            )
        needed = mcp.scopes_for(call, plan.mcp.calls)
        if needed is None or principal is None or policy.holds(needed, principal.scopes):
            return None
        # Every scope the request needs, the route's (as far as the token meets them, for
        # `any`) with the call's: a client that asks for these alone keeps what it had.
        route = plan.rule.settings.scopes if plan.rule is not None else None
        kept: frozenset[str] = frozenset()
        if route is not None:
            kept = route.scopes if route.mode == "all" else route.scopes & principal.scopes
        scope = " ".join(sorted(needed.scopes | kept))
        scheme = bearer.DPOP if principal.jkt is not None else bearer.BEARER
        return errors.insufficient_scope(
            f"{call.method} {call.name or ''}".rstrip() + f" needs {policy.wording(needed)}",
            scope,
            plan.offer,
            scheme,
            principal,
        )

    def render(self, refusal: Refusal, request: Incoming | None = None) -> web.Response:
        """The answer a refusal gives (its challenges in this configuration's realm; the
        resource metadata named in them at the request's origin when the route has none)."""
        origin = (
            resource_metadata.request_origin(request.scheme, request.host)
            if request is not None
            else None
        )
        return errors.render(refusal, self.realm, origin=origin)

    async def admit(
        self, request: Incoming, exchange: Exchange, last: LastToken | None = None
    ) -> Admitted | Refusal | web.Response:
        """Steps 1 to 8: what the request is admitted with, the refusal that ends it (in
        enforce mode), or the answer to a CORS preflight. Every refusal is recorded on the
        exchange here, once, from what the step returned; in monitor mode the request goes
        on. The proxy forwards what is admitted; the decision listener (extauthz) answers
        the front proxy instead."""
        # 1. match
        matched = self.match(request)
        if isinstance(matched, Refusal):
            exchange.deny(matched.reason, False)  # which rule it meets is not known
            return matched
        if isinstance(matched, Preflight):
            exchange.route, exchange.decision = matched.route, PREFLIGHT
            return matched.response
        plan, noted = matched
        if plan.rule is not None:
            exchange.route = plan.rule.name
        if noted is not None:  # refused, and let through by monitor mode
            exchange.deny(noted.reason, True)
        monitor = plan.monitor
        headers = request.headers
        principal = None
        extra = plan.cors.actual(headers.get("Origin")) if plan.cors is not None else ()

        # 2. certificate
        if plan.client_cert and clientcert.of(request) is None:
            refusal = errors.client_certificate_required()
            exchange.deny(refusal.reason, monitor)
            if not monitor:
                return _with_headers(refusal, extra)

        rule = plan.rule
        if rule is not None and not rule.public:
            # 3-4. extract, verify: a token verified before comes from the cache.
            presented = self.cached(headers, last) or await self.verify(request, rule, plan)
            if isinstance(presented, Refusal):
                refused: Refusal | None = presented
            else:
                principal, credentials = presented
                # 5-7. bind-check, revocation-check, decide: every request, cache hit or not.
                if principal.jkt is None and credentials.scheme == bearer.BEARER:
                    refused = self.check_bearer(plan, rule, principal)
                else:
                    refused, nonce = await self.check_bound(
                        request, plan, rule, principal, credentials
                    )
                    if nonce is not None:  # RFC 9449 §9: the nonce for the client's next proof
                        extra = (*extra, ("DPoP-Nonce", nonce))
            if refused is not None:
                exchange.deny(refused.reason, monitor)
                if not monitor:
                    return _with_headers(refused, extra)
                principal = refused.principal
            exchange.principal = principal

        # 8. limit
        limit = plan.limit
        if limit is not None:
            key = limit.key(principal, headers, request.remote)
            verdict = self.limiter.buckets.take_now(limit, key)
            if verdict is None:
                verdict = await self.limiter.take(limit, key)
            limit_headers = limit.headers(verdict) if self._limit_headers else []
            if not verdict.allowed:
                self.metrics.rate_limit_rejected(exchange.route, limit.name)
                refusal = _over_limit("rate_limited", verdict, limit_headers)
                exchange.deny(refusal.reason, monitor)
                if not monitor:
                    return _with_headers(refusal, extra)
            extra = (*extra, *limit_headers)
        return Admitted(plan, principal, extra)

    # ------------------------------------------------------------------ 1. match

    def match(self, request: Incoming) -> tuple[RoutePlan, Refusal | None] | Preflight | Refusal:
        """The plan of the rule the request meets, with a refusal monitor mode lets through
        (no route, a preflight refused); the answer to a CORS preflight; or the refusal
        that ends the request: a bad target or path (400, in monitor mode too: which rule it
        meets is not known), or no rule (404)."""
        target = request.raw_path
        # RFC 9112 §3.2: a request target carries no fragment, yet the parser lets `#` through.
        # The upstream would be sent the URL without it while the rules saw it, so a public
        # `/docs/**` would carry `/docs/secret#` to a protected `/docs/secret`.
        if "#" in target:
            return errors.refused(
                "fragment", 400, "bad_request", "The request target must not contain '#'."
            )
        headers = request.headers
        path_only = target.partition("?")[0]
        if self._documents and target.startswith(_WELL_KNOWN) and self.documents.asks(path_only):
            # RFC 9728 §3: a resource's metadata, whatever the rules and `unmatched` say.
            origin = resource_metadata.request_origin(request.scheme, request.host)
            document = self.documents.answer(
                request.method, path_only, origin, headers.get("If-None-Match")
            )
            return Preflight(METADATA_ROUTE, document)
        noted = None
        try:
            path = self.router.read(path_only)
            # A CORS preflight is matched by the method it asks about.
            if (
                self._preflights
                and request.method == "OPTIONS"
                and "Access-Control-Request-Method" in headers
                and "Origin" in headers
            ):
                answer = self.preflight(request, path)
                if isinstance(answer, Preflight):
                    return answer
                if answer is not None:
                    if not answer[0].monitor:
                        return answer[1]
                    noted = answer[1]
            rule = self.router.route(request.method, path)
        except rules.BadPath as exc:
            return errors.refused(
                exc.reason, 400, "bad_request", f"The request path is refused: {exc}."
            )
        if rule is None:
            refusal = errors.refused(
                "no_route", 404, "not_found", "No route of this gateway serves this request."
            )
            return (self._unmatched, refusal) if self.monitor else refusal
        return self._plans[rule.index], noted

    def preflight(
        self, request: Incoming, path: rules.RequestPath
    ) -> Preflight | tuple[RoutePlan, Refusal] | None:
        """The answer to a CORS preflight; or its refusal with the plan of the route it asks
        about; or None when that route has no CORS policy (then it is an ordinary OPTIONS
        request)."""
        headers = request.headers
        asked = headers["Access-Control-Request-Method"].strip()
        rule = self.router.route(asked, path)
        if rule is None:
            return None
        plan = self._plans[rule.index]
        if plan.cors is None:
            return None
        try:
            allowed = plan.cors.preflight(
                headers["Origin"], asked, headers.get("Access-Control-Request-Headers")
            )
        except CorsRefused as exc:
            return plan, errors.cors_refused(str(exc))
        return Preflight(rule.name, web.Response(status=204, headers=allowed))

    # ------------------------------------------------------------------ 3-4. extract, verify

    def cached(
        self, headers: CIMultiDictProxy[str], last: LastToken | None = None
    ) -> tuple[Principal, Credentials] | None:
        """Steps 3 and 4 in the common case: one `Bearer <token>` or `DPoP <token>` header
        whose token was verified before. A hit means this exact string passed every check
        of `verify`. `last`, the connection's memory, spares parsing and hashing a value it
        sent last, and remembers a new one's cache key."""
        authorization = headers.getall(hdrs.AUTHORIZATION, ())
        if len(authorization) != 1:
            return None
        value = authorization[0]
        verifier = self.verifier
        if last is not None:
            remembered = last.recall(value)
            if remembered is not None:
                principal = self._look(last.key)
                return (principal, remembered) if principal is not None else None
        if value.startswith("Bearer "):
            credentials = Credentials(bearer.BEARER, value[7:])
        elif value.startswith("DPoP "):
            credentials = Credentials(bearer.DPOP, value[5:])
        else:
            return None
        if verifier.empty:  # nothing to find (always so when the caches are off): no digest
            return None
        key = token_key(credentials.token)
        if last is not None and len(value) <= REMEMBERED_AUTHORIZATION_CHARS:
            last.credentials, last.key, last.size = credentials, key, len(value)
            last.prefix = value[: len(value) - len(credentials.token)]
        principal = self._look(key)
        if principal is None:
            return None
        return principal, credentials

    async def verify(
        self, request: Incoming, rule: rules.Rule[Route], plan: RoutePlan
    ) -> tuple[Principal, Credentials] | Refusal:
        """Steps 3 and 4 for a token not in the cache: its principal and how it came, or
        why not (the route plan's `offer`: the schemes its challenges name)."""
        offer = plan.offer
        try:
            credentials = bearer.credentials(request.headers.getall("Authorization", ()))
        except bearer.MalformedAuthorization as exc:
            return errors.invalid_request(str(exc), offer)
        if credentials is None:
            return errors.unauthorized(offer)
        pre_auth = self._pre_auth
        if pre_auth is not None:
            # Only tokens that must be verified are counted: floods of made-up tokens are
            # what this protects the verifier (and the issuer) from.
            verdict = await self.limiter.take(
                pre_auth, pre_auth.key(None, request.headers, request.remote)
            )
            if not verdict.allowed:
                self.metrics.rate_limit_rejected(rule.name, pre_auth.name)
                return _over_limit("pre_auth_rate_limited", verdict, pre_auth.headers(verdict))
        try:
            return await self.verifier.verify(credentials.token), credentials
        except InvalidToken as exc:
            return errors.invalid_token(exc.description, offer, credentials.scheme)
        except VerifierUnavailable:
            return errors.unavailable_refusal(
                "verifier_unavailable",
                _VERIFIER_RETRY_AFTER,
                "The gateway cannot verify tokens right now; try again shortly.",
            )

    # ------------------------------------------------------------------ 5. bind-check

    def check_bearer(
        self, plan: RoutePlan, rule: rules.Rule[Route], principal: Principal
    ) -> Refusal | None:
        """Steps 5 to 7 for a bearer token bound to no key: None when it is allowed."""
        # 5. bind-check: refused where DPoP is required, by the route or the token's issuer.
        if plan.dpop_required or principal.issuer in self._dpop_issuers:
            return self.bearer_refused(plan)
        return self.allowed(plan, rule, principal, bearer.BEARER)

    async def check_bound(
        self,
        request: Incoming,
        plan: RoutePlan,
        rule: rules.Rule[Route],
        principal: Principal,
        credentials: Credentials,
    ) -> tuple[Refusal | None, str | None]:
        """Steps 5 to 7 for a token bound to a key, or one sent with the DPoP scheme: None
        and, when nonces are on, the nonce for the client's next proof; or the refusal (which
        carries that nonce once the proof passed)."""
        # 5. bind-check
        refused = await self.bind_check(request, plan, principal, credentials)
        if refused is not None:
            return refused, None
        refused = self.allowed(plan, rule, principal, credentials.scheme)
        if self.nonces is None:
            return refused, None
        nonce = self.nonces.current(self._now())
        if refused is not None:
            return _with_headers(refused, (("DPoP-Nonce", nonce),)), None
        return None, nonce

    def bearer_refused(self, plan: RoutePlan) -> Refusal:
        """The refusal of a bearer token bound to no key where DPoP is required: by the
        route, else by the token's issuer."""
        if plan.dpop_required:
            description = "this route accepts DPoP-bound tokens only"
        else:
            description = "this issuer's tokens are accepted DPoP-bound only"
        return errors.invalid_token(description, plan.offer, bearer.DPOP, "dpop_required")

    async def bind_check(
        self,
        request: Incoming,
        plan: RoutePlan,
        principal: Principal,
        credentials: Credentials,
    ) -> Refusal | None:
        """RFC 9449 §4.3, §7: a DPoP token needs a proof of the key it is bound to, made for
        this request and used once; a bound token presented as Bearer is refused (§7.2)."""
        jkt = principal.jkt
        offer = plan.offer
        if credentials.scheme == bearer.BEARER:
            # §7.2: a DPoP-bound token must not be accepted as a bearer token.
            return errors.invalid_token(
                "the token is DPoP-bound: send it as Authorization: DPoP with a proof",
                offer,
                bearer.DPOP,
                "dpop_bound_as_bearer",
            )
        if jkt is None:
            # §7.1: the DPoP scheme is for bound tokens; an unbound one proves nothing.
            return errors.invalid_token(
                "the token is not DPoP-bound", offer, bearer.DPOP, "dpop_unbound_token"
            )
        now = self._now()
        try:
            proof = self.proofs.check(
                request.headers.getall("DPoP", ()),
                method=request.method,
                uri=self.external_uri(request, plan),
                access_token=credentials.token,
                now=now,
            )
            dpop.check_binding(proof, jkt)
        except dpop.UseNonce as exc:
            assert self.nonces is not None  # only a checker given nonces raises it
            return errors.use_dpop_nonce(exc.description, offer, self.nonces.current(now))
        except dpop.InvalidProof as exc:
            return errors.invalid_dpop_proof(exc.description, offer)
        except dpop.InvalidBinding as exc:
            return errors.invalid_token(exc.description, offer, bearer.DPOP, "dpop_key_mismatch")
        # §11.1: last, so that only proofs that passed every check take a place.
        try:
            first = self.replay.first_use_now(proof.replay_key, proof.replay_until, now)
            if first is None:
                first = await self.replay.first_use(proof.replay_key, proof.replay_until, now)
        except dpop.ReplayCacheUnavailable:
            return errors.replay_cache_unavailable()
        if not first:
            return errors.invalid_dpop_proof(
                "the DPoP proof was used before", offer, "dpop_proof_replayed"
            )
        return None

    @staticmethod
    def external_uri(request: Incoming, plan: RoutePlan) -> str:
        """The URI the client sent the request to, as a proof's htu names it (§4.3 item 9):
        behind a TLS terminator the configured public_url gives scheme and host, which the
        request as it reaches the gateway does not carry; else the request's own."""
        origin = plan.origin or f"{request.scheme}://{request.host}"
        return origin + request.raw_path

    # ------------------------------------------------------------------ 6. revocation-check

    def revocation_check(
        self, plan: RoutePlan, principal: Principal, scheme: str
    ) -> Refusal | None:
        """None, unless the principal's issuer revoked the token (401 invalid_token, RFC 6750
        §3.1), or the issuer's revocations cannot be known and it asks to fail (503)."""
        assert self.revocations is not None
        why = self.revocations.check(principal)
        if why is None:
            return None
        if why == REVOKED:
            return errors.invalid_token(
                "the token has been revoked", plan.offer, scheme, "token_revoked"
            )
        return errors.unavailable_refusal(
            "revocations_unknown",
            _VERIFIER_RETRY_AFTER,
            "The gateway cannot learn the issuer's revocations right now; try again shortly.",
        )

    # ------------------------------------------------------------------ 7. decide

    def allowed(
        self, plan: RoutePlan, rule: rules.Rule[Route], principal: Principal, scheme: str
    ) -> Refusal | None:
        """Steps 6 and 7 for a token whose binding was checked: None when the route allows
        its principal (`scheme`: the one the token came with, whose challenge carries the
        error)."""
        # 6. revocation-check
        if self.revocations is not None:
            refused = self.revocation_check(plan, principal, scheme)
            if refused is not None:
                return refused
        # 7. decide
        decision = policy.decide(rule, principal)
        if decision is policy.ALLOW:
            return None
        assert isinstance(decision, policy.Deny)
        if decision.code == "insufficient_scope":
            # The token is valid for this API; only the scope is missing.
            return errors.insufficient_scope(
                decision.reason, decision.scope or "", plan.offer, scheme, principal
            )
        return errors.invalid_token(decision.reason, plan.offer, scheme)


def _with_headers(refusal: Refusal, extra: Sequence[tuple[str, str]]) -> Refusal:
    """A refusal whose answer also gets `extra` (the route's CORS fields), after its own."""
    if not extra:
        return refusal
    return replace(refusal, headers=(*refusal.headers, *extra))


_WELL_KNOWN = resource_metadata.WELL_KNOWN
# The route name the access log and the metrics give requests for resource metadata.
METADATA_ROUTE = "oauth-protected-resource"


class Preflight(NamedTuple):
    """An answer the gateway gives itself before any rule (a CORS preflight the route it
    asks about allows, a resource's metadata): the route's name and the answer."""

    route: str
    response: web.Response


def _over_limit(reason: str, verdict: Verdict, headers: Sequence[tuple[str, str]]) -> Refusal:
    """The refusal of a request over a rate limit: 429, or 503 when the limit's store cannot
    say."""
    if verdict.known:
        return errors.rate_limited(reason, verdict.retry_after, headers)
    return errors.rate_limit_unknown(reason)


# ---------------------------------------------------------------------------- 9. forward


def refuse_body(request: web.BaseRequest, plan: RoutePlan) -> Refusal | None:
    """Why a request with a body is refused before any of the body is read, if it is: a body
    on GET or HEAD where the route does not allow one (400), a Content-Length over the
    route's limit (413)."""
    if not plan.allow_body_on_get and request.method in _NO_BODY_METHODS:
        return errors.body_on_get(request.method)
    max_body = plan.max_body
    if max_body is not None:
        length = request.content_length
        if length is not None and length > max_body:
            return errors.too_large(max_body)
    return None
