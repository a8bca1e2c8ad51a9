"""Throttles on guessing: how many attempts a key may make, and when it may make the next.

A password or a device user code is guessed by trying, so each attempt is counted under a
few keys (a username at an address, an address, a browser session) and refused beyond a
limit. The store keeps one `Counter` per key; a rule here decides, given the counter and the
time, whether one more attempt goes ahead and what the counter becomes. The store runs the
rules inside the transaction that charges the attempt (`Store.reserve_attempt`), before the
guess is checked: deciding and counting are one step, however many requests race, and a
guess that turns out wrong keeps its charge. A guess that turns out right may be given back
(`released`): it was not a failure.

The attempts of a key form runs: a run begins with the key's first attempt and ends once a
quiet time passes without one. Two kinds of rule:
- `Cap`: at most `limit` attempts in a run that ends after `window` of quiet. Two runs are
  `window` apart, so any `window`-long stretch of time holds at most `limit` attempts. A
  hard bound, for keys only the guesser charges (its own address or session).
- `Backoff`: `free` attempts go ahead at once; each one after them waits, after the previous
  attempt, a delay that doubles from `first_delay` up to `max_delay`; the run ends after
  `idle` of quiet. It bounds the rate without ever refusing for longer than `max_delay`, for
  a key that anyone can charge (a username), so that charging it slows its owner down but
  cannot lock them out.

Pure: standard library only; times are seconds since the epoch, passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# 2**64 seconds is longer than any delay a rule caps at: the exponent stops growing there.
_MAX_DOUBLINGS = 64


@dataclass(frozen=True)
class Counter:
    """What the store keeps for a key."""

    window_start: float  # when the current run of attempts began
    count: int  # attempts charged since then, less those released
    last_attempt: float  # when the latest attempt was charged


@dataclass(frozen=True)
class Admit:
    counter: Counter  # the key's counter with this attempt charged
    expires_at: float  # from then on the counter no longer matters and may be purged


@dataclass(frozen=True)
class Refuse:
    key: str  # the key whose rule refused
    retry_after: float  # seconds: when the caller may try again


class Rule(Protocol):
    @property
    def key(self) -> str: ...

    def admit(self, counter: Counter | None, now: float) -> Admit | Refuse:
        """One more attempt at `now` for a key whose counter is `counter` (None: none yet)."""
        ...


@dataclass(frozen=True)
class Cap:
    key: str
    limit: int
    window: float  # seconds

    def admit(self, counter: Counter | None, now: float) -> Admit | Refuse:
        if counter is None or counter.last_attempt + self.window <= now:
            return Admit(Counter(now, 1, now), now + self.window)
        if counter.count >= self.limit:
            # The whole window, the most the wait can be: the answer tells nothing of when
            # the attempts that filled the run came.
            return Refuse(self.key, self.window)
        charged = Counter(counter.window_start, counter.count + 1, max(counter.last_attempt, now))
        return Admit(charged, charged.last_attempt + self.window)


@dataclass(frozen=True)
class Backoff:
    key: str
    free: int
    first_delay: float  # seconds
    max_delay: float
    idle: float  # at least max_delay, or the count would start again during a delay

    def delay(self, count: int) -> float:
        """The least time between the `count`-th attempt of a run and the next one."""
        if count < self.free:
            return 0.0
        doublings = min(count - self.free, _MAX_DOUBLINGS)
        return float(min(self.max_delay, self.first_delay * 2**doublings))

    def admit(self, counter: Counter | None, now: float) -> Admit | Refuse:
        if counter is None or counter.last_attempt + self.idle <= now:
            return Admit(Counter(now, 1, now), now + self.idle)
        wait = counter.last_attempt + self.delay(counter.count) - now
        if wait > 0:
            return Refuse(self.key, wait)
        charged = Counter(counter.window_start, counter.count + 1, max(counter.last_attempt, now))
        return Admit(charged, charged.last_attempt + self.idle)


def released(counter: Counter, reserved_at: float) -> Counter:
    """The counter with one attempt, charged at `reserved_at`, given back.

    Only while the run that attempt was charged to goes on: once a new run has begun (its
    start is later than the attempt), the attempt is not in it, and taking one off would let
    a guess of the new run through uncounted.
    """
    if counter.count <= 0 or counter.window_start > reserved_at:
        return counter
    return Counter(counter.window_start, counter.count - 1, counter.last_attempt)
