"""The most memory a configuration lets the gateway hold, to set a container's limit from.

Everything the gateway keeps grows up to a bound the configuration sets: the verified-token
cache (`token_cache_size`), each issuer's introspection caches (`cache_size`, for active
and for inactive tokens), the in-memory rate-limit buckets (`rate_limits.max_keys`), the
DPoP replay cache (`dpop.replay_cache_size`, when it is in memory), each issuer's key set
(a fetch accepts at most jwks.MAX_DOCUMENT_BYTES of it), the revocation deny-set
(`revocation_events.max_entries` per issuer, and a key set of the stream's own), and the
client connections (`limits.max_connections`). The worst case is each bound times what one entry
holds, plus what an idle process holds; with `workers: N`, N such processes and their
supervisor. Bodies in flight are not counted: up to `forward.buffer_size` each.

The bytes per entry are measured by bench/memory.py (figures in bench/README.md) and kept
next to each structure; the process-wide ones are here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .core.dpop import REPLAY_ENTRY_BYTES
from .settings import Settings
from .steps.pipeline import REMEMBERED_AUTHORIZATION_CHARS
from .steps.ratelimit import BUCKET_BYTES
from .steps.revocations import DENY_ENTRY_BYTES
from .verifiers.cache import ENTRY_BYTES
from .verifiers.introspection import ACTIVE_ENTRY_BYTES, INACTIVE_ENTRY_BYTES
from .verifiers.jwks import KEY_SET_BYTES

KiB = 1024
MiB = 1024 * KiB

# Measured by bench/memory.py: `process` (a ready gateway with one issuer's key set, and what
# each idle keep-alive client connection adds to it) and `supervisor` (workers: 2). A
# connection also holds the Authorization value it sent last, up to a bound (LastToken).
IDLE_PROCESS_BYTES = 56 * MiB
CONNECTION_BYTES = 9 * KiB + REMEMBERED_AUTHORIZATION_CHARS
SUPERVISOR_BYTES = 42 * MiB


@dataclass(frozen=True)
class Part:
    """One bounded structure at its bound: `count` entries of `each` bytes."""

    name: str
    count: int
    each: int

    @property
    def total(self) -> int:
        return self.count * self.each

    def __str__(self) -> str:
        if self.count == 1:
            return f"{self.name} {_mib(self.each)}"
        return f"{self.name} {self.count} × {_size(self.each)} = {_mib(self.total)}"


@dataclass(frozen=True)
class Estimate:
    parts: tuple[Part, ...]  # of one process
    workers: int

    @property
    def per_process(self) -> int:
        return sum(part.total for part in self.parts)

    @property
    def total(self) -> int:
        if self.workers == 1:
            return self.per_process
        return self.workers * self.per_process + SUPERVISOR_BYTES

    def __str__(self) -> str:
        parts = ", ".join(str(part) for part in self.parts if part.count)
        if self.workers == 1:
            return f"about {_mib(self.total)} ({parts})"
        return (
            f"about {_mib(self.total)} ({self.workers} workers × {_mib(self.per_process)} "
            f"and the supervisor {_mib(SUPERVISOR_BYTES)}; each worker: {parts})"
        )


def worst_case(settings: Settings) -> Estimate:
    """What `settings` let one process hold at most, part by part."""
    issuers = settings.issuers
    parts = [
        Part("idle process", 1, IDLE_PROCESS_BYTES),
        Part("token cache", settings.token_cache_size, ENTRY_BYTES),
        Part(
            "introspection cache",
            sum(i.introspection.cache_size for i in issuers if i.introspection is not None),
            ACTIVE_ENTRY_BYTES,
        ),
        Part(
            "inactive-token cache",
            sum(i.introspection.cache_size for i in issuers if i.introspection is not None),
            INACTIVE_ENTRY_BYTES,
        ),
        Part("rate-limit buckets", _buckets(settings), BUCKET_BYTES),
        Part("DPoP replay cache", _replay_entries(settings), REPLAY_ENTRY_BYTES),
        Part(
            "key sets",
            sum(issuer.uses_keys + (issuer.revocation_events is not None) for issuer in issuers),
            KEY_SET_BYTES,
        ),
        Part(
            "revocation deny-set",
            sum(i.revocation_events.max_entries for i in issuers if i.revocation_events),
            DENY_ENTRY_BYTES,
        ),
        Part("client connections", settings.limits.max_connections, CONNECTION_BYTES),
    ]
    return Estimate(tuple(parts), settings.workers)


def _buckets(settings: Settings) -> int:
    """Buckets the memory backend may hold: `max_keys` when any rate limit is configured."""
    limits = settings.rate_limits
    if limits.redis:
        return 0
    limited = (
        limits.default is not None
        or limits.pre_auth is not None
        or any(route.rate_limit for route in settings.routes)
    )
    return limits.max_keys if limited else 0


def _replay_entries(settings: Settings) -> int:
    """Proofs the memory replay cache may hold (none in memory when Redis keeps them)."""
    return 0 if settings.rate_limits.redis else settings.dpop.replay_cache_size


def _mib(size: int) -> str:
    return f"{max(1, round(size / MiB))} MiB"


def _size(size: int) -> str:
    return f"{size / KiB:.1f} KiB" if size < MiB else _mib(size)
