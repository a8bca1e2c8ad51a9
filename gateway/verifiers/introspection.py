"""Asking the issuer whether a token is active: OAuth 2.0 Token Introspection (RFC 7662).

One `Introspector` per issuer in mode `introspection` or `auto`:
 1. the endpoint is the configured `url`, else `introspection_endpoint` from the issuer's
    discovery document (RFC 8414 §2), looked up at start-up and again when it failed;
 2. a POST of `token` and `token_type_hint=access_token` (§2.1), authenticated with the
    gateway's own client credentials by HTTP Basic (RFC 6749 §2.3.1: both parts
    form-urlencoded first);
 3. results are cached in a bounded LRU keyed by the SHA-256 of the token: an active one for
    min(cache_ttl, exp - now, the answer's max-age), an inactive one for inactive_cache_ttl;
    `Cache-Control: no-store` on the answer is meant for shared caches between us and the
    issuer, and the gateway's own cache stays bounded by cache_ttl (§4 leaves the trade-off
    between freshness and load to the resource server); with `cache: redis://...` the
    answers are also left in Redis for the other gateways, under the same deadlines, and
    looked up there before asking the issuer (shared_cache.py: a keyed hash, never the token;
    a Redis error is a miss);
 4. concurrent requests with the same token share one call (single flight), and at most
    `max_pending` distinct tokens are asked about at once: past that a new one fails at once
    with VerifierUnavailable (503 with Retry-After) rather than queue without bound;
 5. an endpoint that cannot be reached, is slow, or answers anything but a JSON object with
    a boolean `active` makes the request fail closed: VerifierUnavailable (503), never a
    guess;
 6. an active answer is checked like a JWT: `iss` (when given) must be this issuer, `exp`
    and `nbf` with leeway, a `sub`, and a `token_type` that is an access token (a refresh
    token is active too, but is no bearer credential for an API), and a `scope` made of
    RFC 6749 §3.3 scope tokens split on U+0020 alone (§2.2), as for JWTs; `cnf.jkt`, the
    key a DPoP-bound token is bound to (RFC 9449 §6.2), is kept for the bind-check, and
    `token_type: DPoP` without it is refused. Audience and
    scope are route-specific and belong to policy.decide, as for JWTs.
Neither the token nor the client secret is ever logged.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import re
from collections import OrderedDict
from collections.abc import Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any
from urllib.parse import quote_plus, urlsplit

import aiohttp
import orjson

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.principal import (
    MalformedScope,
    Principal,
    UnsupportedBinding,
    audiences_of,
    bound_key,
    normalise_scopes,
)
from ..core.records import Introspection, Issuer
from .base import InvalidToken, VerifierUnavailable
from .cache import TokenCache
from .jwks import FetchError, discovery_urls, fetch_json, issuer_tls, read_bounded
from .shared_cache import NoSharedAnswers, RedisAnswers, SharedAnswers, cache_secret
from .validity import check_validity

log = logging.getLogger("portcullis.gateway.introspection")

MAX_ANSWER_BYTES = 64 * 1024
FIRST_RETRY = timedelta(milliseconds=500)  # discovery after a failure; doubles up to a minute
MAX_RETRY = timedelta(minutes=1)
_BUSY_LOG_INTERVAL = timedelta(seconds=10)
# RFC 7662 §2.2 token_type values (RFC 6749 §7.1 types, RFC 8693 §3 identifiers) that name
# an access token; anything else (refresh_token, ...) is refused.
_ACCESS_TOKEN_TYPES = frozenset(
    {"bearer", "dpop", "access_token", "urn:ietf:params:oauth:token-type:access_token"}
)
_MAX_AGE = re.compile(r"(?:^|,)\s*max-age\s*=\s*\"?(\d+)\"?", re.IGNORECASE)


# Memory one cache entry holds at most, as measured by bench/memory.py: an active token (the
# principal made of the answer's claims, and what forwarding adds to it) and an inactive one
# (its digest and deadline). Each of the two caches holds up to `cache_size` entries.
ACTIVE_ENTRY_BYTES = 2_500
INACTIVE_ENTRY_BYTES = 240


def _basic(client_id: str, secret: str) -> str:
    raw = f"{quote_plus(client_id)}:{quote_plus(secret)}".encode()
    return "Basic " + base64.b64encode(raw).decode()


class InactiveTokens:
    """Digests of tokens the issuer called inactive, until a short deadline; bounded LRU."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, float] = OrderedDict()
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, key: bytes, now: float) -> bool:
        until = self._entries.get(key)
        if until is None:
            return False
        if now >= until:
            del self._entries[key]
            return False
        self.hits += 1
        return True

    def put(self, key: bytes, until: float) -> None:
        if self.max_entries <= 0:
            return
        self._entries[key] = until
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


class Introspector:
    """Introspection at one issuer: endpoint, credentials, caches and calls in flight."""

    def __init__(
        self,
        issuer: Issuer,
        settings: Introspection,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.issuer = issuer
        self.settings = settings
        self._now = clock.wall  # answers' exp and the caches' deadlines
        self._monotonic = clock.monotonic  # the pace of discovery attempts
        self._authorization = _basic(settings.client_id, settings.client_secret)
        self._endpoint: str | None = settings.url
        self._leeway = issuer.leeway.total_seconds()
        self._cache_ttl = settings.cache_ttl.total_seconds()
        self._inactive_ttl = settings.inactive_cache_ttl.total_seconds()
        self._timeout = aiohttp.ClientTimeout(total=settings.timeout.total_seconds())
        self.cache = TokenCache(settings.cache_size, clock.wall)
        self.inactive = InactiveTokens(settings.cache_size)
        self.shared: SharedAnswers = NoSharedAnswers()
        if settings.cache is not None:
            self.shared = RedisAnswers(
                settings.cache,
                cache_secret(issuer.issuer, settings.client_id, settings.client_secret),
                settings.cache_key_prefix,
                settings.cache_timeout,
                clock.wall,
                clock.monotonic,
            )
        self._flights: dict[bytes, asyncio.Task[Principal]] = {}
        self._max_pending = settings.max_pending
        self._log_issuer = {"issuer": issuer.issuer}
        self.refused_busy = 0
        self._busy_warned_at = -math.inf
        self._session: aiohttp.ClientSession | None = None
        self._discovery: asyncio.Task[str | None] | None = None
        self._last_discovery = -math.inf
        self._runner: asyncio.Task[None] | None = None
        self.calls = 0
        self.active = 0
        self.inactive_answers = 0
        self.failures = 0
        self.last_error: str | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def ready(self) -> bool:
        return self._endpoint is not None

    @property
    def endpoint(self) -> str | None:
        return self._endpoint

    async def wait_ready(self) -> None:
        """Until the endpoint is known, or this discovery attempt has failed."""
        if self._endpoint is None:
            await self._discover_now()

    def start(self) -> None:
        if self._endpoint is None and self._runner is None:
            self._runner = asyncio.create_task(
                self._discover_until_found(), name=f"introspection {self.issuer.issuer}"
            )

    async def close(self) -> None:
        for task in (self._runner, self._discovery, *self._flights.values()):
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, InvalidToken, VerifierUnavailable):
                    pass  # how a call ends when cancelled, or when it ended meanwhile
                except Exception:
                    log.exception("introspection task failed", extra=self._log_issuer)
        if self._session is not None:
            await self._session.close()
            self._session = None
        await self.shared.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self.settings.max_connections, ssl=issuer_tls(self.issuer)
                ),
                cookie_jar=aiohttp.DummyCookieJar(),
                headers={"User-Agent": "portcullis-gateway"},
            )
        return self._session

    # ------------------------------------------------------------------ request path

    def cached(self, key: bytes) -> Principal | None:
        return self.cache.look(key)

    async def verify(self, token: str, key: bytes) -> Principal:
        principal = self.cache.get(key)
        if principal is not None:
            return principal
        if self.inactive.contains(key, self._now()):
            raise InvalidToken("the token is not active")
        flight = self._flights.get(key)
        if flight is None:
            if len(self._flights) >= self._max_pending:
                self._refuse_busy()
                raise VerifierUnavailable("too many introspections in flight")
            flight = asyncio.create_task(self._introspect(token, key))
            self._flights[key] = flight
            flight.add_done_callback(lambda done: self._landed(key, done))
        # Shielded: one caller going away must not cancel the answer the others wait for.
        return await asyncio.shield(flight)

    def _landed(self, key: bytes, flight: asyncio.Task[Principal]) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
        if not flight.cancelled():
            flight.exception()  # retrieved here even when every waiter has gone

    async def _introspect(self, token: str, key: bytes) -> Principal:
        found = await self.shared.lookup(token)
        if found is not None and isinstance(found.answer.get("active"), bool):
            # Another gateway asked: the same checks as for the issuer's own answer.
            return self._answered(found.answer, key, self._now(), found.until)
        endpoint = self._endpoint or await self._discover_now()
        if endpoint is None:
            raise VerifierUnavailable("the introspection endpoint is not known")
        self.calls += 1
        try:
            async with self._http().post(
                endpoint,
                data={"token": token, "token_type_hint": "access_token"},
                headers={"Authorization": self._authorization, "Accept": "application/json"},
                timeout=self._timeout,
                allow_redirects=False,
            ) as response:
                if response.status != 200:
                    raise FetchError(f"answered {response.status}")
                body = await read_bounded(response, MAX_ANSWER_BYTES)
                if body is None:
                    raise FetchError(f"answered more than {MAX_ANSWER_BYTES} bytes")
                cache_control = response.headers.get("Cache-Control")
            answer = orjson.loads(body)
        except (TimeoutError, aiohttp.ClientError, FetchError, orjson.JSONDecodeError) as exc:
            self._failed(exc)
            raise VerifierUnavailable("introspection failed") from None
        if not isinstance(answer, dict) or not isinstance(answer.get("active"), bool):
            self._failed(FetchError("the answer has no boolean active member"))
            raise VerifierUnavailable("introspection failed")
        self.last_error = None
        now = self._now()
        if answer["active"]:
            self.active += 1
        else:
            self.inactive_answers += 1
        until = now + self._inactive_ttl
        try:
            principal = self._principal(answer, now) if answer["active"] else None
        except InvalidToken:
            principal = None
        if principal is not None:
            ttl = min(self._cache_ttl, principal.expires_at - now, _max_age(cache_control))
            until = now + ttl
        await self.shared.store(token, answer, until)
        return self._answered(answer, key, now, until)

    def _answered(
        self, answer: Mapping[str, Any], key: bytes, now: float, until: float
    ) -> Principal:
        """The principal of an answer (the issuer's, or another gateway's from the shared
        cache), cached in memory until `until`; InvalidToken for an inactive or unacceptable
        one, remembered as inactive for inactive_cache_ttl at most."""
        inactive_until = min(until, now + self._inactive_ttl)
        if not answer["active"]:
            self.inactive.put(key, inactive_until)
            raise InvalidToken("the token is not active")
        try:
            principal = self._principal(answer, now)
        except InvalidToken:
            self.inactive.put(key, inactive_until)
            raise
        if until > now:
            self.cache.put(key, principal, until)
        return principal

    def _refuse_busy(self) -> None:
        self.refused_busy += 1
        now = self._monotonic()
        # Once in a while, not per request: a flood of tokens must not flood the log.
        if now - self._busy_warned_at >= _BUSY_LOG_INTERVAL.total_seconds():
            self._busy_warned_at = now
            log.warning(
                "introspection refused: too many distinct tokens in flight",
                extra={
                    "issuer": self.issuer.issuer,
                    "max_pending": self._max_pending,
                    "refused_so_far": self.refused_busy,
                },
            )

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        reason = str(exc) or type(exc).__name__
        self.last_error = reason
        log.warning(
            "introspection failed",
            extra={"issuer": self.issuer.issuer, "reason": reason},
        )

    def _principal(self, answer: Mapping[str, Any], now: float) -> Principal:
        """The checks a JWT gets, applied to what the issuer said about the token."""
        iss = answer.get("iss", self.issuer.issuer)
        if iss != self.issuer.issuer:
            raise InvalidToken("the token's issuer is not trusted")
        token_type = answer.get("token_type")
        if token_type is not None and (
            not isinstance(token_type, str) or token_type.lower() not in _ACCESS_TOKEN_TYPES
        ):
            raise InvalidToken("the token is not an access token")
        expires_at = check_validity(answer, now, self._leeway, exp_required=False, check_iat=False)
        sub: str = answer["sub"]
        client_id = answer.get("client_id")
        claims = {k: v for k, v in answer.items() if k != "active"}
        claims["iss"] = self.issuer.issuer
        try:
            scopes = normalise_scopes(claims)
        except MalformedScope:
            raise InvalidToken("the token's scope is not a list of scope tokens") from None
        try:
            jkt = bound_key(claims)
        except UnsupportedBinding as exc:
            raise InvalidToken(str(exc)) from None
        # RFC 9449 §6.2: a DPoP-bound token is reported with token_type DPoP and its cnf.
        if jkt is None and isinstance(token_type, str) and token_type.lower() == "dpop":
            raise InvalidToken("the token is DPoP-bound but its key is not known (no cnf.jkt)")
        return Principal(
            issuer=self.issuer.issuer,
            subject=sub,
            client_id=client_id if isinstance(client_id, str) and client_id else None,
            scopes=scopes,
            audiences=audiences_of(claims),
            expires_at=expires_at,
            claims=MappingProxyType(claims),
            jkt=jkt,
        )

    # ------------------------------------------------------------------ discovery

    async def _discover_until_found(self) -> None:
        backoff = FIRST_RETRY.total_seconds()
        while self._endpoint is None:
            if await self._discover_now() is None:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_RETRY.total_seconds())

    async def _discover_now(self) -> str | None:
        """The endpoint from discovery: one lookup at a time, at most one a second."""
        if self._endpoint is not None:
            return self._endpoint
        if self._discovery is None:
            now = self._monotonic()
            if now - self._last_discovery < 1:
                return None
            self._last_discovery = now
            self._discovery = asyncio.create_task(self._discover())
            self._discovery.add_done_callback(self._discovered)
        return await asyncio.shield(self._discovery)

    def _discovered(self, task: asyncio.Task[str | None]) -> None:
        if self._discovery is task:
            self._discovery = None

    async def _discover(self) -> str | None:
        problems = []
        timeout = self.settings.timeout.total_seconds()
        for url in discovery_urls(self.issuer.issuer):
            try:
                document, _ = await fetch_json(self._http(), url, timeout)
            except FetchError as exc:
                problems.append(str(exc))
                continue
            if not isinstance(document, dict) or document.get("issuer") != self.issuer.issuer:
                problems.append(f"{url} is not this issuer's metadata")
                continue
            endpoint = document.get("introspection_endpoint")
            if not isinstance(endpoint, str) or not self._acceptable(endpoint):
                problems.append(f"{url} gives no usable introspection_endpoint")
                continue
            self._endpoint = endpoint
            self.last_error = None
            log.info(
                "introspection endpoint found",
                extra={"issuer": self.issuer.issuer, "endpoint": endpoint},
            )
            return endpoint
        self.last_error = "discovery failed: " + "; ".join(problems)
        log.warning(
            "introspection discovery failed",
            extra={"issuer": self.issuer.issuer, "reason": self.last_error},
        )
        return None

    def _acceptable(self, endpoint: str) -> bool:
        parts = urlsplit(endpoint)
        if parts.scheme == "https" and parts.hostname:
            return True
        # The token and the gateway's secret travel in this request: plain http only where
        # the issuer itself is plain http (loopback) or allow_http says so.
        return (
            parts.scheme == "http"
            and bool(parts.hostname)
            and (self.issuer.allow_http or urlsplit(self.issuer.issuer).scheme == "http")
        )


def _max_age(cache_control: str | None) -> float:
    if cache_control:
        match = _MAX_AGE.search(cache_control)
        if match:
            return float(match.group(1))
    return math.inf
