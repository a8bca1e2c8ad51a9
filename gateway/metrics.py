"""Prometheus metrics of one gateway process, served at `/metrics` on the admin port.

Counted on the request path in plain dicts and lists (a request costs a few dict lookups
and additions), and turned into metric families by prometheus-client when scraped:
  portcullis_gateway_requests_total{route, method, status, decision}
  portcullis_gateway_denials_total{route, decision, reason}      deny and would_deny; every
                                                                   refusal, a refused path too
  portcullis_gateway_request_duration_seconds{route}              histogram, whole exchange
  portcullis_gateway_upstream_duration_seconds{route}             histogram, upstream part
  portcullis_gateway_upstream_errors_total{route, kind}           connect | timeout | broken | busy
  portcullis_gateway_rate_limit_rejections_total{route, policy}
  portcullis_gateway_config_reloads_total{result}                 applied | rejected
Read from the live state at scrape time (no cost per request):
  portcullis_gateway_jwks_fetches_total{issuer}, ..._jwks_fetch_failures_total{issuer}
  portcullis_gateway_introspection_requests_total{issuer, outcome}  active|inactive|error
  portcullis_gateway_introspection_cache_hits_total{issuer}
  portcullis_gateway_token_cache_hits_total, ..._misses_total, ..._token_cache_entries
  portcullis_gateway_rate_limit_backend_errors_total{backend}
  portcullis_gateway_websockets_open
And portcullis_build_info{version}, always 1.

Every label has a bounded set of values: route names come from the config, methods outside
the standard ones are counted as OTHER, statuses are three digits.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from portcullis.buildinfo import BuildInfo

from .exchange import DENY, UNMATCHED, Exchange

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
KNOWN_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"}
)


@dataclass
class IssuerCounts:
    issuer: str
    jwks_fetches: int | None = None
    jwks_failures: int | None = None
    introspection_active: int | None = None
    introspection_inactive: int | None = None
    introspection_errors: int | None = None
    introspection_cache_hits: int | None = None


@dataclass
class StateCounts:
    """What the live state has counted so far, gathered at scrape time."""

    issuers: list[IssuerCounts] = field(default_factory=list)
    token_cache_hits: int = 0
    token_cache_misses: int = 0
    token_cache_entries: int = 0
    rate_limit_backend: str = "memory"
    rate_limit_backend_errors: int = 0
    websockets_open: int = 0


class _StateCollector(Collector):
    def __init__(self, read: Callable[[], StateCounts]) -> None:
        self._read = read

    def describe(self) -> list[Metric]:
        return []  # names are not registered up front: the state may not exist yet

    def collect(self) -> Iterator[Metric]:
        state = self._read()
        prefix = "portcullis_gateway_"
        fetches = CounterMetricFamily(
            prefix + "jwks_fetches", "Key set fetches, by issuer.", labels=["issuer"]
        )
        failures = CounterMetricFamily(
            prefix + "jwks_fetch_failures", "Key set fetches that failed.", labels=["issuer"]
        )
        introspection = CounterMetricFamily(
            prefix + "introspection_requests",
            "Introspection calls, by issuer and outcome (active, inactive, error).",
            labels=["issuer", "outcome"],
        )
        hits = CounterMetricFamily(
            prefix + "introspection_cache_hits",
            "Tokens answered from the introspection cache (active or inactive).",
            labels=["issuer"],
        )
        for counts in state.issuers:
            if counts.jwks_fetches is not None:
                fetches.add_metric([counts.issuer], counts.jwks_fetches)
                failures.add_metric([counts.issuer], counts.jwks_failures or 0)
            if counts.introspection_active is not None:
                for outcome, value in (
                    ("active", counts.introspection_active),
                    ("inactive", counts.introspection_inactive),
                    ("error", counts.introspection_errors),
                ):
                    introspection.add_metric([counts.issuer, outcome], value or 0)
                hits.add_metric([counts.issuer], counts.introspection_cache_hits or 0)
        yield from (fetches, failures, introspection, hits)
        yield CounterMetricFamily(
            prefix + "token_cache_hits",
            "Requests whose JWT was found in the verified-token cache.",
            value=state.token_cache_hits,
        )
        yield CounterMetricFamily(
            prefix + "token_cache_misses",
            "JWTs that had to be verified.",
            value=state.token_cache_misses,
        )
        yield GaugeMetricFamily(
            prefix + "token_cache_entries",
            "Verified JWTs held in the cache.",
            value=state.token_cache_entries,
        )
        backend_errors = CounterMetricFamily(
            prefix + "rate_limit_backend_errors",
            "Rate-limit checks the backend could not answer (on_backend_error applied).",
            labels=["backend"],
        )
        backend_errors.add_metric([state.rate_limit_backend], state.rate_limit_backend_errors)
        yield backend_errors
        yield GaugeMetricFamily(
            prefix + "websockets_open", "WebSocket sessions open.", value=state.websockets_open
        )


_BUCKET_NAMES = (*(repr(float(b)) for b in LATENCY_BUCKETS), "+Inf")


class _Histogram:
    """Counts per bucket and a sum, kept as plain numbers: observing is a bisect and two
    additions (the event loop is the only writer, so no lock is needed)."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(LATENCY_BUCKETS, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        cumulative = 0
        out: list[tuple[str, float]] = []
        for bound, count in zip(_BUCKET_NAMES, self.counts, strict=True):
            cumulative += count
            out.append((bound, cumulative))
        return out


class Metrics:
    """The request path's counts, in plain dicts, turned into Prometheus text on scrape."""

    def __init__(self, read_state: Callable[[], StateCounts]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests: dict[tuple[str, str, int, str], int] = {}
        self._denials: dict[tuple[str, str, str], int] = {}
        self._durations: dict[str, tuple[_Histogram, _Histogram]] = {}
        self._upstream_errors: dict[tuple[str, str], int] = {}
        self._rate_limited: dict[tuple[str, str], int] = {}
        self._reloads: dict[str, int] = {"applied": 0, "rejected": 0}
        self.registry.register(_RequestCollector(self))
        self.registry.register(_StateCollector(read_state))
        self.registry.register(BuildInfo())

    def observe(self, exchange: Exchange, status: int, finished: float) -> None:
        route = exchange.route
        method = exchange.method
        if method not in KNOWN_METHODS:
            method = "OTHER"
        key = (route, method, status, exchange.decision)
        requests = self._requests
        requests[key] = requests.get(key, 0) + 1
        timing = self._durations.get(route)
        if timing is None:
            timing = self._durations[route] = (_Histogram(), _Histogram())
        timing[0].observe(finished - exchange.started)
        upstream = exchange.upstream_seconds
        if upstream is not None:
            timing[1].observe(upstream)
        if exchange.upstream_error is not None:
            _count(self._upstream_errors, (route, exchange.upstream_error))
        if exchange.reason is not None:
            _count(self._denials, (route, exchange.decision, exchange.reason))

    def unparsable(self, status: int) -> None:
        """A request refused before it could be read (a broken request line, a header too
        large): no route, method or exchange, but a denial all the same."""
        _count(self._requests, (UNMATCHED, "OTHER", status, DENY))
        _count(self._denials, (UNMATCHED, DENY, "unparsable"))

    def rate_limit_rejected(self, route: str, policy: str) -> None:
        _count(self._rate_limited, (route, policy))

    def reloaded(self, applied: bool) -> None:
        _count(self._reloads, "applied" if applied else "rejected")

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _count(table: dict[Any, int], key: Any) -> None:
    table[key] = table.get(key, 0) + 1


class _RequestCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        prefix = "portcullis_gateway_"
        requests = CounterMetricFamily(
            prefix + "requests",
            "Requests answered, by route, method, status and decision "
            "(allow, deny, would_deny, preflight).",
            labels=["route", "method", "status", "decision"],
        )
        for (route, method, status, decision), value in list(m._requests.items()):
            requests.add_metric([route, method, str(status), decision], value)
        yield requests
        denials = CounterMetricFamily(
            prefix + "denials",
            "Refusals (deny) and refusals monitor mode let through (would_deny), by reason.",
            labels=["route", "decision", "reason"],
        )
        for denial, value in list(m._denials.items()):
            denials.add_metric(list(denial), value)
        yield denials
        total = HistogramMetricFamily(
            prefix + "request_duration_seconds",
            "Time from a request's arrival to the end of its answer.",
            labels=["route"],
        )
        upstream = HistogramMetricFamily(
            prefix + "upstream_duration_seconds",
            "Time from sending a request upstream to the end of the upstream's answer.",
            labels=["route"],
        )
        for route, (whole, part) in list(m._durations.items()):
            total.add_metric([route], whole.buckets(), whole.sum)
            if any(part.counts):
                upstream.add_metric([route], part.buckets(), part.sum)
        yield total
        yield upstream
        tables: tuple[tuple[str, str, list[str], dict[tuple[str, str], int]], ...] = (
            (
                "upstream_errors",
                "Upstream exchanges that failed, by kind (connect, timeout, broken, busy).",
                ["route", "kind"],
                m._upstream_errors,
            ),
            (
                "rate_limit_rejections",
                "Requests a rate limit refused (or would have, in monitor mode), by policy.",
                ["route", "policy"],
                m._rate_limited,
            ),
        )
        for name, documentation, names, table in tables:
            family = CounterMetricFamily(prefix + name, documentation, labels=names)
            for key, value in list(table.items()):
                family.add_metric(list(key), value)
            yield family
        reloads = CounterMetricFamily(
            prefix + "config_reloads",
            "Configuration reloads, by result (applied, rejected).",
            labels=["result"],
        )
        for result, value in m._reloads.items():
            reloads.add_metric([result], value)
        yield reloads
