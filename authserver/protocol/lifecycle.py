"""Lifecycles of authorization codes, refresh-token families and device codes, as tables.

Every state change the authorization server makes to these objects is one row here; the
grants look up `(state, event)` and act on the effect, so a rule such as "a replayed code
revokes what it issued" lives in one place rather than in branches scattered over endpoints.
A pair missing from a table is a programming error, not a client error.
"""

from __future__ import annotations

from dataclasses import dataclass
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
# whole family is revoked.
REFRESH: dict[tuple[str, str], Transition] = {
    (Refresh.ACTIVE, "use"): Transition(Refresh.ROTATED, Effect.ISSUE_TOKENS),
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


def device_poll_event(state: str, too_fast: bool) -> str:
    """The event a poll is, given the code's state before it and the time since the last."""
    return "poll_too_fast" if too_fast and (state, "poll_too_fast") in DEVICE else "poll"


def step(table: dict[tuple[str, str], Transition], state: str, event: str) -> Transition:
    try:
        return table[(state, event)]
    except KeyError:
        raise IllegalTransition(f"{event!r} is not allowed in state {state!r}") from None
