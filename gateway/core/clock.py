"""Where the gateway reads the time: one clock, built once and handed to what needs it.

Two readings, each a `now()` callable a component holds, and the timer background work waits
on:
- `wall`: seconds since the epoch, the scale of token timestamps (`exp`, `nbf`, `iat`), so
  what is compared with them (token expiry, cache lifetimes derived from `exp`) uses it;
- `monotonic`: seconds on a clock no change of the system time moves, for intervals
  (cool-downs, back-off, rate-limit refills, throttled warnings);
- `sleep`: waits `seconds` on the monotonic clock (the key sets' scheduled refreshes).
Tests hand the gateway a clock they move by hand instead of sleeping: its `sleep` ends when
the test has moved the time far enough.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

Now = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Clock:
    wall: Now = time.time
    monotonic: Now = time.monotonic
    sleep: Sleep = asyncio.sleep


SYSTEM_CLOCK = Clock()
