"""DPoP (RFC 9449) at the gateway: the proof checks are the kernel's (portcullis/dpop.py,
the same as the authorization server's), re-exported here for the request path; what is the
gateway's own is the replay cache a proof is recorded in.

A proof that passed `ProofChecker.check` is recorded by the caller in a `ReplayCache` until
`Proof.replay_until` (§11.1): `MemoryReplayCache` here, the one shared by workers and
replicas in gateway/steps/replay.py. Pure: no I/O here either.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Protocol

from portcullis.dpop import (
    ASYMMETRIC_ALGORITHMS,
    InvalidBinding,
    InvalidProof,
    NonceMaker,
    Proof,
    ProofChecker,
    ProofPolicy,
    UseNonce,
    check_binding,
)

# What the request path uses: the kernel's checks, and the replay caches below.
__all__ = [
    "ASYMMETRIC_ALGORITHMS",
    "REPLAY_ENTRY_BYTES",
    "InvalidBinding",
    "InvalidProof",
    "MemoryReplayCache",
    "NonceMaker",
    "Proof",
    "ProofChecker",
    "ProofPolicy",
    "ReplayCache",
    "ReplayCacheUnavailable",
    "UseNonce",
    "check_binding",
]

# Memory one entry of MemoryReplayCache holds (a 16-byte digest, its deadline, the ordered
# dict's share), measured with tracemalloc over 100,000 entries: about 180 bytes.
REPLAY_ENTRY_BYTES = 200


# ---------------------------------------------------------------------------- replay


class ReplayCacheUnavailable(Exception):
    """The replay cache cannot say whether a proof is new (full, or its server is down): the
    proof is refused, never let through unchecked (503)."""


class ReplayCache(Protocol):
    """Proofs seen, each until it expires: a proof is accepted once (§11.1)."""

    name: str

    def first_use_now(self, key: bytes, until: float, now: float) -> bool | None:
        """Record `key` until `until`; whether it was new. None when the cache cannot tell
        without waiting (then `first_use` asks it)."""
        ...

    async def first_use(self, key: bytes, until: float, now: float) -> bool:
        """Record `key` until `until`; whether it was new. Raises ReplayCacheUnavailable."""
        ...

    def start(self) -> None: ...

    async def close(self) -> None: ...


class MemoryReplayCache:
    """Proofs seen by this process, oldest first, at most `max_entries`: when every entry is
    still alive and another comes, the proof is refused (ReplayCacheUnavailable) rather than
    an entry dropped early, which would let its proof be replayed."""

    name = "memory"

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._seen: OrderedDict[bytes, float] = OrderedDict()
        self.full = 0  # proofs refused because the cache was full
        self._swept = -math.inf  # when a full cache last looked past its oldest entry

    def __len__(self) -> int:
        return len(self._seen)

    def first_use_now(self, key: bytes, until: float, now: float) -> bool:
        seen = self._seen
        # Entries go in as proofs arrive, and each lives about as long as the next: the
        # oldest ones come first and mostly expire first.
        while seen:
            oldest, expires = next(iter(seen.items()))
            if expires > now:
                break
            del seen[oldest]
        previous = seen.get(key)
        if previous is not None and previous > now:
            return False
        if len(seen) >= self.max_entries and now - self._swept >= 1:
            # Not every entry expires in the order it came (an older iat expires sooner):
            # expired ones may wait behind a live one. Looked for when full, once a second
            # at most, so a cache full for good costs no sweep per request.
            self._swept = now
            for expired in [k for k, until in seen.items() if until <= now]:
                del seen[expired]
        if len(seen) >= self.max_entries:
            self.full += 1
            raise ReplayCacheUnavailable("the replay cache is full")
        seen[key] = until
        seen.move_to_end(key)
        return True

    async def first_use(self, key: bytes, until: float, now: float) -> bool:
        return self.first_use_now(key, until, now)

    def start(self) -> None:
        return None

    async def close(self) -> None:
        return None
