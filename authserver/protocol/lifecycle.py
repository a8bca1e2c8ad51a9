"""Lifecycles of authorization codes, refresh-token families and device codes, as tables.

Every state change the authorization server makes to these objects is one row here; the
grants look up `(state, event)` and act on the effect, so a rule such as "a replayed code
revokes what it issued" lives in one place rather than in branches scattered over endpoints.
A pair missing from a table is a programming error, not a client error.

Which event a request is (expired, within the grace window, polled too fast) and the times
a change writes (expiries, the slowed-down interval) are decided here too, by the functions
below the tables. A store never decides: it is handed a `Move`, the state the object must
still be in and the state it goes to, and applies it as a compare-and-set.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from enum import Enum, StrEnum


class Effect(Enum):
    ISSUE_TOKENS = "issue_tokens"
    REPEAT_SUCCESSOR = "repeat_successor"  # refresh retry within refresh_grace
    REVOKE_ISSUED = "revoke_issued"  # code replay: revoke every token issued from the code
    REVOKE_FAMILY = "revoke_family"  # refresh reuse or revocation
    RAISE_INTERVAL = "raise_interval"  # device polled too fast: its interval grows by 5 s
    REJECT = "reject"
    NONE = "none"


@dataclass(frozen=True)
class Transition:
    next_state: str
    effect: Effect
    error: str | None = None  # the OAuth error the client gets, when the event is refused


class IllegalTransition(Exception):
    pass


@dataclass(frozen=True)
class Move:
    """A change decided from a state read before: the object must still be in `expected`
    when the store applies it (compare-and-set), and goes to `next`."""

    expected: str
    next: str


@dataclass(frozen=True)
class Decision:
    """What the table says about one event in one state, and the move it makes."""

    state: str
    transition: Transition

    @property
    def effect(self) -> Effect:
        return self.transition.effect

    @property
    def error(self) -> str | None:
        return self.transition.error

    @property
    def move(self) -> Move:
        return Move(self.state, self.transition.next_state)


class Code(StrEnum):
    ISSUED = "issued"
    CONSUMED = "consumed"


class Refresh(StrEnum):
    ACTIVE = "active"
    ROTATED = "rotated"
    REVOKED = "revoked"


class Device(StrEnum):
    PENDING = "pending"
    APPROVED = "approved"
    DENIED = "denied"
    REDEEMED = "redeemed"


# Authorization codes: single use (RFC 6749 §4.1.2; RFC 9700 §4.8 on replay).
CODE: dict[tuple[str, str], Transition] = {
    (Code.ISSUED, "redeem"): Transition(Code.CONSUMED, Effect.ISSUE_TOKENS),
    (Code.CONSUMED, "redeem"): Transition(Code.CONSUMED, Effect.REVOKE_ISSUED, "invalid_grant"),
}

# Refresh tokens: rotation with reuse detection (RFC 9700 §4.14.2). A rotated token shown
# again within the grace window repeats its successor (an idempotent retry); after it, the
# whole family is revoked. An expired token changes nothing: past the family's absolute
# lifetime there is nothing left to protect, and an active token past its idle expiry was
# never replaced.
REFRESH: dict[tuple[str, str], Transition] = {
    (Refresh.ACTIVE, "use"): Transition(Refresh.ROTATED, Effect.ISSUE_TOKENS),
    (Refresh.ACTIVE, "use_expired"): Transition(Refresh.ACTIVE, Effect.REJECT, "invalid_grant"),
    (Refresh.ROTATED, "use_expired"): Transition(Refresh.ROTATED, Effect.REJECT, "invalid_grant"),
    (Refresh.REVOKED, "use_expired"): Transition(Refresh.REVOKED, Effect.REJECT, "invalid_grant"),
    (Refresh.ROTATED, "use_within_grace"): Transition(Refresh.ROTATED, Effect.REPEAT_SUCCESSOR),
    (Refresh.ROTATED, "use"): Transition(Refresh.REVOKED, Effect.REVOKE_FAMILY, "invalid_grant"),
    (Refresh.REVOKED, "use"): Transition(Refresh.REVOKED, Effect.REJECT, "invalid_grant"),
    (Refresh.REVOKED, "use_within_grace"): Transition(
        Refresh.REVOKED, Effect.REJECT, "invalid_grant"
    ),
    (Refresh.ACTIVE, "revoke"): Transition(Refresh.REVOKED, Effect.REVOKE_FAMILY),
    (Refresh.ROTATED, "revoke"): Transition(Refresh.REVOKED, Effect.REVOKE_FAMILY),
    (Refresh.REVOKED, "revoke"): Transition(Refresh.REVOKED, Effect.NONE),
}

# Device codes (RFC 8628 §3.5): pending until the user decides, tokens exactly once.
# `poll_too_fast` is a poll sooner than the code's interval after the previous one. It only
# matters while the code is pending: slow_down is a variant of authorization_pending, and
# once the user has decided, the answer is the decision. A code redeemed twice is treated
# like a replayed authorization code: the tokens issued from it are revoked, since the
# device code may have leaked and the first redeemer may not be the device.
DEVICE: dict[tuple[str, str], Transition] = {
    (Device.PENDING, "poll"): Transition(Device.PENDING, Effect.REJECT, "authorization_pending"),
    (Device.PENDING, "poll_too_fast"): Transition(
        Device.PENDING, Effect.RAISE_INTERVAL, "slow_down"
    ),
    (Device.PENDING, "approve"): Transition(Device.APPROVED, Effect.NONE),
    (Device.PENDING, "deny"): Transition(Device.DENIED, Effect.NONE),
    (Device.APPROVED, "poll"): Transition(Device.REDEEMED, Effect.ISSUE_TOKENS),
    (Device.DENIED, "poll"): Transition(Device.DENIED, Effect.REJECT, "access_denied"),
    (Device.REDEEMED, "poll"): Transition(Device.REDEEMED, Effect.REVOKE_ISSUED, "invalid_grant"),
}


SLOW_DOWN_STEP = timedelta(seconds=5)  # RFC 8628 §3.5
# A poll counts as too fast only when it comes this much sooner than the interval: the
# device waits after it reads an answer, the server measures between arrivals, and the
# two differ by network and scheduling jitter. The interval protects load, not a secret.
POLL_TOLERANCE = timedelta(milliseconds=100)


def device_poll_event(state: str, too_fast: bool) -> str:
    """The event a poll is, given the code's state before it and the time since the last."""
    return "poll_too_fast" if too_fast and (state, "poll_too_fast") in DEVICE else "poll"


def poll_too_fast(last_poll: float | None, interval: float, now: float) -> bool:
    """Whether a poll at `now` comes sooner than the interval after the previous one."""
    return last_poll is not None and now - last_poll < interval - POLL_TOLERANCE.total_seconds()


def slowed_down(interval: float) -> float:
    """The interval after a slow_down: 5 seconds longer, for good (RFC 8628 §3.5)."""
    return interval + SLOW_DOWN_STEP.total_seconds()


def expired(expires_at: float, now: float) -> bool:
    """Every lifetime ends at its expiry: from `expires_at` on, the object is expired."""
    return expires_at <= now


def refresh_use_event(
    state: str,
    *,
    expires_at: float,
    family_expires_at: float,
    rotated_at: float | None,
    successor_state: str | None,
    now: float,
    grace: float,
) -> str:
    """The event a presented refresh token is, from what is stored about it.

    Within the grace window a rotated token repeats its successor only while the successor
    is still unused (`successor_state` active, or not known): once the client used the
    successor it surely received it, so the old token shown again is a replay, not the
    retry of a response that was lost (RFC 9700 §4.14.2).
    """
    if expired(family_expires_at, now) or (state == Refresh.ACTIVE and expired(expires_at, now)):
        return "use_expired"
    if (
        state == Refresh.ROTATED
        and rotated_at is not None
        # No window at all without a grace: a use that began before the rotation it lost
        # to (another replica's, its clock a little ahead) is a second use, not a retry.
        and grace > 0
        and now < rotated_at + grace
        and successor_state in (None, Refresh.ACTIVE)
    ):
        return "use_within_grace"
    return "use"


def refresh_idle_expiry(now: float, idle: float, family_expires_at: float) -> float:
    """A new refresh token's idle expiry: it slides with each use, never past the family's
    absolute end."""
    return min(now + idle, family_expires_at)


def step(table: dict[tuple[str, str], Transition], state: str, event: str) -> Transition:
    try:
        return table[(state, event)]
    except KeyError:
        raise IllegalTransition(f"{event!r} is not allowed in state {state!r}") from None


def decide(table: dict[tuple[str, str], Transition], state: str, event: str) -> Decision:
    """The table's row for `event` in `state`, with the move it makes from that state."""
    return Decision(state, step(table, state, event))
