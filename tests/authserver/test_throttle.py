"""The throttle rules (protocol/throttle.py) hold the bounds the README promises, against a
guesser who tries at every moment a rule lets them."""

from __future__ import annotations

import bisect
import functools
from datetime import timedelta

from authserver.app import login_rules
from authserver.endpoints.signin import LoginLimits
from authserver.protocol.throttle import Admit, Backoff, Cap, Counter, Rule
from authserver.settings import LoginThrottle

HOUR = 3600


def admitted_times(rule: Rule, tries: list[float]) -> list[float]:
    """The moments, among `tries`, at which the rule lets an attempt through."""
    counter: Counter | None = None
    admitted = []
    for at in tries:
        decision = rule.admit(counter, at)
        if isinstance(decision, Admit):
            counter = decision.counter
            admitted.append(at)
    return admitted


def most_in_one_hour(rule: Backoff) -> int:
    """The most attempts a backoff admits in one hour, over every way of splitting the hour
    into runs: within a run, trying as early as allowed is best; a pause of `idle` starts a
    new run with its free attempts again."""
    run: list[float] = []
    counter: Counter | None = None
    at = 0.0
    while at <= HOUR:
        decision = rule.admit(counter, at)
        assert isinstance(decision, Admit)
        counter = decision.counter
        run.append(at)
        at += rule.delay(counter.count)

    @functools.cache
    def best(time_left: float) -> int:
        result = 0
        for last in run:  # a run is best ended right after one of its attempts
            if last > time_left:
                break
            in_run = bisect.bisect_right(run, last)
            rest = time_left - last - rule.idle
            result = max(result, in_run + (best(rest) if rest >= 0 else 0))
        return result

    return best(float(HOUR))


def test_one_username_gets_at_most_74_guesses_an_hour_from_all_addresses_by_default() -> None:
    backoff = LoginLimits.of(login_rules(LoginThrottle()), "alice", "192.0.2.1").username
    assert most_in_one_hour(backoff) == 74


def test_a_longer_backoff_max_lowers_the_hourly_bound() -> None:
    throttle = LoginThrottle(backoff_after=10, backoff_max=timedelta(minutes=5))
    backoff = LoginLimits.of(login_rules(throttle), "alice", "192.0.2.1").username
    assert most_in_one_hour(backoff) < 74


def test_a_cap_admits_at_most_its_limit_in_any_window_long_stretch() -> None:
    cap = Cap("login:ip:192.0.2.1", limit=5, window=900.0)
    # Someone trying every half second for three hours.
    admitted = admitted_times(cap, [i / 2 for i in range(3 * HOUR * 2)])
    assert len(admitted) > 5
    for start in admitted:
        stretch = [t for t in admitted if start <= t < start + cap.window]
        assert len(stretch) <= cap.limit
