"""The clock the server's components hold: one `now()` each, passed in at construction, so
that tests move time instead of sleeping."""

from __future__ import annotations

from collections.abc import Callable

Clock = Callable[[], float]  # seconds since the epoch, like time.time
