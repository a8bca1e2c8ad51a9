"""What one request went through: the facts the access log and the metrics record.

One `Exchange` per request, filled in as the request moves along the path (route, decision,
principal, upstream time) and read once the answer is sent. Pure: no I/O.
"""

from __future__ import annotations

from .principal import Principal

# Decisions, as counted and logged:
ALLOW = "allow"  # forwarded after every check passed (or the route is public)
DENY = "deny"  # refused by the gateway
WOULD_DENY = "would_deny"  # monitor mode: refused in enforce mode, forwarded here
PREFLIGHT = "preflight"  # a CORS preflight the gateway answered itself

UNMATCHED = "-"  # the route of a request no rule matched

# Where a request came in, as counted and logged:
PROXY = "proxy"  # the public listener: checked, then forwarded upstream
EXT_AUTHZ = "ext_authz"  # the decision listener: checked for a front proxy, which forwards


class Exchange:
    __slots__ = (
        "client",
        "decision",
        "method",
        "mode",
        "path",
        "principal",
        "reason",
        "request_id",
        "route",
        "started",
        "trace_id",
        "trace_restarted",
        "traceparent",
        "upstream_error",
        "upstream_seconds",
    )

    def __init__(
        self, started: float, request_id: str, method: str, path: str, mode: str = PROXY
    ) -> None:
        self.started = started
        self.mode = mode
        self.request_id = request_id
        self.method = method
        self.path = path
        self.route = UNMATCHED
        self.decision = ALLOW
        self.reason: str | None = None
        self.principal: Principal | None = None
        self.client: str | None = None
        self.trace_id: str | None = None
        self.traceparent: str | None = None  # the value sent upstream
        self.trace_restarted = False  # the client's traceparent was absent or invalid
        self.upstream_seconds: float | None = None
        self.upstream_error: str | None = None  # connect | timeout | broken | busy

    def deny(self, reason: str, monitor: bool) -> None:
        """Record a refusal: enforced, or only noted in monitor mode. The first reason
        stays, unless an enforced refusal follows ones monitor mode only noted."""
        if self.reason is None or (not monitor and self.decision == WOULD_DENY):
            self.reason = reason
        self.decision = WOULD_DENY if monitor else DENY
