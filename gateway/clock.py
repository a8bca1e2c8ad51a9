"""Where the gateway reads the time: one clock, built once and handed to what needs it.

Two readings, each a `now()` callable a component holds:
- `wall`: seconds since the epoch, the scale of token timestamps (`exp`, `nbf`, `iat`), so
  what is compared with them (token expiry, cache lifetimes derived from `exp`) uses it;
- `monotonic`: seconds on a clock no change of the system time moves, for intervals
  (cool-downs, back-off, rate-limit refills, throttled warnings).
Tests hand the gateway a clock they move by hand instead of sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

Now = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Clock:
    wall: Now = time.time
    monotonic: Now = time.monotonic


SYSTEM_CLOCK = Clock()
