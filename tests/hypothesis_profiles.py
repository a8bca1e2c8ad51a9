"""Hypothesis profiles: `full`, which `make test` runs, and `quick`, which `make test-fast` runs.

`full` is what Hypothesis runs when nothing is chosen (its `default` profile, or its `ci`
profile on a CI machine), with the budgets the tests declare: 100 examples per property, or
the number a test gives. `quick` is the same with a tenth of the examples. A run chooses with
`--hypothesis-profile NAME`, or with the HYPOTHESIS_PROFILE environment variable; `full`
when it names neither.

A loaded profile sets only the default: an explicit `@settings(max_examples=600)` would run
600 examples under every profile. So a test that wants a budget of its own writes
`@settings(max_examples=examples(600))`: 600 under `full`, and the same share of the loaded
profile's default under any other (60 under `quick`). Test modules are imported after the
profile is loaded (tests/conftest.py imports this module first; pytest loads a
`--hypothesis-profile` before it collects), so `examples` sees the profile of the run.
"""

from __future__ import annotations

import os

from hypothesis import settings

# Hypothesis's own choice, before any profile of ours is loaded.
_UNCHOSEN = settings.get_profile(settings.get_current_profile_name())
# The default number of examples the tests' budgets are written against: `full`'s.
FULL_EXAMPLES = _UNCHOSEN.max_examples

settings.register_profile("full", _UNCHOSEN)
settings.register_profile("quick", _UNCHOSEN, max_examples=FULL_EXAMPLES // 10)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "full"))


def examples(full: int) -> int:
    """A test's number of examples: `full` under the full profile, in proportion under the
    loaded one (never fewer than one)."""
    return max(1, full * settings.default.max_examples // FULL_EXAMPLES)
