"""Rate limits: token buckets, one per (policy, key), in memory or shared through Redis.

A policy is a `Bucket` compiled once: a name (the route's, `default` or `pre_auth`), how
to find the bucket's key in a request, and the header values that never change. A bucket
holds up to `burst` tokens and gains `rate` tokens a second; a request takes one or is
refused with the time until one is back.

Backends, behind one protocol:
- `MemoryBuckets`: this process only. Bounded: a bucket that has filled up again is the
  same as no bucket and is dropped as the oldest entries are visited, and past `max_keys`
  the least recently used bucket goes, so a flood of distinct keys cannot grow it.
- `RedisBuckets`: shared by every replica. One Lua script per check reads, refills, takes
  and writes atomically, on Redis's clock, so replicas never disagree on time. Every call
  has a short timeout and a failed one answers as `on_backend_error` says (allow or deny),
  counted; after a few failures in a row Redis is left alone for a moment, and meanwhile
  each check answers that way at once.

Answers carry the `RateLimit-Policy` and `RateLimit` fields of the IETF httpapi draft
(draft-ietf-httpapi-ratelimit-headers-10, §3 and §4): `"name";q=<burst>;w=<seconds to
refill>` and `"name";r=<remaining>;t=<seconds until full>`; a refusal adds `Retry-After`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Protocol

import orjson
from multidict import MultiMapping

from portcullis.addresses import ClientAddresses

from ..core.clock import Now
from ..core.principal import Principal
from ..core.records import Bucket, BucketStore
from ..transport.redis_pool import redis_client, redis_failures

log = logging.getLogger("portcullis.gateway.ratelimit")

# After this many failed Redis calls in a row, checks skip Redis for BACKEND_RETRY instead of
# each waiting for its own timeout; then calls try again. One slow answer alone does not.
FAILURES_BEFORE_RESTING = 3
BACKEND_RETRY = timedelta(seconds=1)
# Longer keys (header values, claims) are stored as a digest: a client picks them.
_MAX_RAW_KEY = 64
# Memory buckets visited per check to drop those that have filled up again.
_SWEEP_PER_CHECK = 2
# Memory one bucket of MemoryBuckets holds at most (its key of the longest kind, its state),
# as measured by bench/memory.py (rate-limit-bucket); `max_keys` of them at most.
BUCKET_BYTES = 460


@dataclass(slots=True)
class Verdict:
    allowed: bool
    remaining: int
    reset: float  # seconds until the bucket is full again
    retry_after: float  # seconds until one request would pass; 0 when allowed
    known: bool = True  # False: the backend could not answer, so nothing can be told


class BackendUnavailable(Exception):
    """The shared backend could not answer in time."""


class Policy:
    """A limit ready for requests: its bucket parameters, key, and constant header value."""

    def __init__(self, name: str, rule: Bucket, addresses: ClientAddresses) -> None:
        self.name = name
        self.rule = rule
        self.rate = rule.rate.per_second
        self.burst = rule.burst
        self.key_kind, _, self.key_name = rule.key.partition(":")
        self._addresses = addresses
        self.window = max(1, math.ceil(self.burst / self.rate))
        quoted = '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'
        self.quoted_name = quoted
        self.policy_header = f"{quoted};q={self.burst};w={self.window}"

    def key(self, principal: Principal | None, headers: MultiMapping[str], peer: str | None) -> str:
        """The bucket of this request. Keys that need what the request lacks (no verified
        token, no such header or claim) fall back to the client's address."""
        kind = self.key_kind
        if principal is not None:
            if kind == "subject":
                return _per_issuer(_SUBJECT, principal.issuer, principal.subject)
            if kind == "client_id" and principal.client_id is not None:
                return _per_issuer(_CLIENT, principal.issuer, principal.client_id)
            if kind == "claim":
                value = principal.claims.get(self.key_name)
                if value is not None:
                    text = value if isinstance(value, str) else orjson.dumps(value).decode()
                    # A claim's value, like a subject, means something within its issuer.
                    return _per_issuer(_CLAIM, principal.issuer, text)
        if kind == "route":
            return "r"
        if kind == "header":
            values = headers.getall(self.key_name, ())
            if values:
                return "h:" + _bounded(",".join(values))
        return "ip:" + self._addresses.client(peer, headers.getall("X-Forwarded-For", ()))

    def headers(self, verdict: Verdict) -> list[tuple[str, str]]:
        """RateLimit-Policy and RateLimit for an answer (draft-10 §3, §4)."""
        if not verdict.known:
            return []
        reset = math.ceil(verdict.reset)
        return [
            ("RateLimit-Policy", self.policy_header),
            ("RateLimit", f"{self.quoted_name};r={verdict.remaining};t={reset}"),
        ]


_SUBJECT = "s:"
_CLIENT = "c:"
_CLAIM = "j:"


@functools.lru_cache(maxsize=4096)
def _per_issuer(kind: str, issuer: str, value: str) -> str:
    """A key for a value its issuer alone makes unique: a subject is unique within its issuer
    (RFC 7519 §4.1.2), a client id within its authorization server (RFC 6749 §2.2), so two
    issuers' "alice" are two buckets. Remembered for the busiest principals (a long key is
    a digest), not recomputed on every request."""
    # The issuer's length first: no issuer and value can run into another pair's.
    return kind + _bounded(f"{len(issuer)}:{issuer}{value}")


def _bounded(text: str) -> str:
    if len(text) <= _MAX_RAW_KEY and text.isascii():
        return text
    return "#" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def verdict_from(tokens: float, allowed: bool, policy: Policy) -> Verdict:
    rate, burst = policy.rate, policy.burst
    return Verdict(
        allowed=allowed,
        remaining=max(0, math.floor(tokens)),
        reset=max(0.0, (burst - tokens) / rate),
        retry_after=0.0 if allowed else max(0.0, (1 - tokens) / rate),
    )


class Buckets(Protocol):
    name: str
    errors: int  # checks the backend could not answer

    def take_now(self, policy: Policy, key: str) -> Verdict | None:
        """Take one token when the backend answers without waiting (memory), else None:
        then `take` asks it."""
        ...

    async def take(self, policy: Policy, key: str) -> Verdict:
        """Take one token; raises BackendUnavailable when the backend cannot answer."""
        ...

    def start(self) -> None: ...

    async def close(self) -> None: ...


class MemoryBuckets:
    """Buckets of this process: [tokens, updated, full_at] per (policy, key), LRU order."""

    name = "memory"

    def __init__(self, max_keys: int, clock: Now = time.monotonic) -> None:
        self.errors = 0
        self.max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[tuple[str, str], list[float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    async def take(self, policy: Policy, key: str) -> Verdict:
        return self.take_now(policy, key)

    def take_now(self, policy: Policy, key: str) -> Verdict:
        now = self._clock()
        buckets = self._buckets
        slot = (policy.name, key)
        bucket = buckets.get(slot)
        rate, burst = policy.rate, policy.burst
        if bucket is None:
            self._sweep(now)  # before adding: the new bucket is full, hence sweepable
            tokens = float(burst)
            bucket = buckets[slot] = [tokens, now, now]
        else:
            buckets.move_to_end(slot)
            tokens = bucket[0] + (now - bucket[1]) * rate
            if tokens > burst:
                tokens = float(burst)
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
        refill = (burst - tokens) / rate  # seconds until full again
        bucket[0] = tokens
        bucket[1] = now
        bucket[2] = now + refill
        # 0 <= tokens <= burst: int() is the floor.
        return Verdict(allowed, int(tokens), refill, 0.0 if allowed else (1.0 - tokens) / rate)

    def _sweep(self, now: float) -> None:
        """Drop the oldest buckets that are full again (they hold nothing a fresh one would
        not), and past max_keys the least recently used ones."""
        buckets = self._buckets
        for _ in range(_SWEEP_PER_CHECK):
            if not buckets:
                break
            oldest = next(iter(buckets))
            if buckets[oldest][2] > now:
                break
            del buckets[oldest]
        while len(buckets) >= self.max_keys:
            buckets.popitem(last=False)  # room for the one about to be added

    def sweep(self) -> None:
        """Drop every bucket that has filled up again (for an idle gateway)."""
        now = self._clock()
        for slot in [slot for slot, bucket in self._buckets.items() if bucket[2] <= now]:
            del self._buckets[slot]

    def start(self) -> None:
        return None

    async def close(self) -> None:
        return None


# KEYS[1]: the bucket. ARGV: rate (tokens a second), burst. Returns {allowed, tokens}.
# TIME is Redis's clock: every replica computes with the same one. Since Redis 5 scripts
# replicate their effects, so reading the time before writing is allowed.
BUCKET_SCRIPT = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 't', 'u')
local tokens = tonumber(state[1])
local updated = tonumber(state[2])
if tokens == nil or updated == nil then
  tokens = burst
  updated = now
end
local elapsed = now - updated
if elapsed < 0 then elapsed = 0 end
tokens = math.min(burst, tokens + elapsed * rate)
local allowed = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
end
redis.call('HSET', KEYS[1], 't', string.format('%.6f', tokens), 'u', string.format('%.6f', now))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1000)
return {allowed, string.format('%.6f', tokens)}
"""


class RedisBuckets:
    """Buckets in Redis, shared by every gateway using the same server and key prefix."""

    name = "redis"

    def __init__(
        self,
        url: str,
        timeout: timedelta,
        key_prefix: str,
        max_connections: int = 32,
        now: Now = time.monotonic,
    ) -> None:
        # How Redis being unreachable, slow or in trouble shows: anything else is a fault of
        # the gateway's own and is not taken for one.
        self._backend_failures = redis_failures()
        seconds = timeout.total_seconds()
        self._timeout = seconds
        self._pool, self._client = redis_client(url, seconds, max_connections)
        self._script = self._client.register_script(BUCKET_SCRIPT)
        self._prefix = key_prefix
        self._now = now  # monotonic: the rest after failures
        self._failures_in_a_row = 0
        self._resting_until = 0.0
        self.errors = 0
        self._warming: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Connect and load the script ahead of the first request (failures are ignored:
        the first check tries again)."""
        self._warming = asyncio.create_task(self._warm_up())

    async def _warm_up(self) -> None:
        try:
            async with asyncio.timeout(max(self._timeout, 1.0)):
                await self._client.script_load(BUCKET_SCRIPT)
        except self._backend_failures as exc:
            log.info("rate limit backend not warmed up", extra={"reason": type(exc).__name__})

    def take_now(self, policy: Policy, key: str) -> None:
        """Never: every check is a round trip to Redis."""
        return None

    async def take(self, policy: Policy, key: str) -> Verdict:
        if self._now() < self._resting_until:
            raise BackendUnavailable("resting after a failure")
        redis_key = f"{self._prefix}{policy.name}:{key}"
        try:
            # The socket timeouts bound each read and connect; this bounds the whole call,
            # including a NOSCRIPT retry.
            async with asyncio.timeout(self._timeout * 2):
                allowed, tokens = await self._script(
                    keys=[redis_key], args=[repr(policy.rate), policy.burst]
                )
        except self._backend_failures as exc:
            self._failures_in_a_row += 1
            if self._failures_in_a_row >= FAILURES_BEFORE_RESTING:
                self._resting_until = self._now() + BACKEND_RETRY.total_seconds()
            raise BackendUnavailable(type(exc).__name__) from None
        self._failures_in_a_row = 0
        return verdict_from(float(tokens), bool(allowed), policy)

    async def close(self) -> None:
        if self._warming is not None:
            self._warming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._warming
        # A server already gone cannot be said goodbye to.
        with contextlib.suppress(*self._backend_failures):
            await self._client.aclose()
        with contextlib.suppress(*self._backend_failures):
            await self._pool.disconnect()


def buckets_for(store: BucketStore, now: Now = time.monotonic) -> Buckets:
    """The backend `store` names; `now` is a monotonic clock."""
    if store.redis:
        return RedisBuckets(
            store.backend, store.timeout, store.key_prefix, store.max_connections, now
        )
    return MemoryBuckets(store.max_keys, now)


class Limiter:
    """Checks a policy for a request through the backend; a backend failure becomes the
    configured answer, never an error or a wait.

    The request path asks the backend's `take_now` first: one that answers without waiting
    (memory) costs no coroutine and cannot fail; otherwise (None) it awaits `take` here."""

    def __init__(
        self,
        on_backend_error: Literal["allow", "deny"],
        buckets: Buckets,
        now: Now = time.monotonic,
    ) -> None:
        self.buckets = buckets
        self._now = now  # monotonic: the pace of warnings
        self._fail_open = on_backend_error == "allow"
        self._unknown_allow = Verdict(True, 0, 0.0, 0.0, known=False)
        self._unknown_deny = Verdict(False, 0, 0.0, BACKEND_RETRY.total_seconds(), known=False)
        self._last_warning = -math.inf

    async def take(self, policy: Policy, key: str) -> Verdict:
        try:
            return await self.buckets.take(policy, key)
        except BackendUnavailable as exc:
            self.buckets.errors += 1
            now = self._now()
            if now - self._last_warning >= 10:
                self._last_warning = now
                log.warning(
                    "rate limit backend unavailable",
                    extra={
                        "backend": self.buckets.name,
                        "reason": str(exc),
                        "answer": "allow" if self._fail_open else "deny",
                    },
                )
            return self._unknown_allow if self._fail_open else self._unknown_deny
