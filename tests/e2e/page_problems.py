"""What the browser tests hold a page to: no script error, and no console error or warning
(a Content-Security-Policy violation is an error). Chromium's informational lines are no
problem of the page's: one says autofocus was skipped when the test had focused a field
first, as Playwright may before the page's autofocus runs."""

from __future__ import annotations

from typing import Any

REPORTED = frozenset({"error", "warning"})


def watch(tab: Any, problems: list[str]) -> None:
    """Append the page's problems to `problems` as they happen."""
    tab.on("console", lambda message: _console(message, problems))
    tab.on("pageerror", lambda error: problems.append(str(error)))


def _console(message: Any, problems: list[str]) -> None:
    if message.type in REPORTED:
        problems.append(message.text)
