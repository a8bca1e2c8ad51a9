"""A line repeated by every failing request is logged at most once per interval, with the
count of those held back since the last one."""

from __future__ import annotations

from datetime import timedelta

from authserver.endpoints.errors import LogPace


def test_a_repeated_line_is_due_once_per_interval_with_the_count_held_back() -> None:
    now = [100.0]
    pace = LogPace(timedelta(seconds=10), lambda: now[0])
    assert pace.due() == 0  # the first at once
    assert [pace.due() for _ in range(5)] == [None] * 5
    now[0] += 9.9
    assert pace.due() is None
    now[0] += 0.1
    assert pace.due() == 6  # due again, telling how many were not logged
    now[0] += 30
    assert pace.due() == 0
